"""Mounts the web admin on the gateway at /admin: sqladmin over the database with its own login (admin/auth.py),
the views and actions (admin/views.py), the dashboard (admin/dashboard.py); same-origin checks on every change."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from sqladmin import Admin
from starlette.middleware import Middleware

from loraplex.admin.auth import AdminAuth
from loraplex.admin.dashboard import Dashboard
from loraplex.admin.origin_check import SameOriginOnly
from loraplex.admin.views import MODEL_VIEWS, CheckpointTtl, GetServices, ServicesRef
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory

TEMPLATES = Path(__file__).parent / "templates"


def mount_admin(app: FastAPI, settings: Settings, services: GetServices) -> Admin:
    """`services`: the gateway's Services (built in its lifespan), read when an action or the dashboard runs."""
    sessions = session_factory(make_db_engine(settings.resolved_database_url))
    admin = Admin(
        app,
        session_maker=sessions,
        base_url="/admin",
        title="loraplex admin",
        templates_dir=str(TEMPLATES),
        authentication_backend=AdminAuth(settings, sessions),
        middlewares=[Middleware(SameOriginOnly)],
    )
    wiring = ServicesRef(services)
    Dashboard.wiring = wiring
    admin.add_base_view(Dashboard)
    for view in MODEL_VIEWS:
        view.wiring = wiring
        admin.add_view(view)
    admin.add_base_view(CheckpointTtl)
    return admin

"""Mounts the web admin on the gateway at /admin: sqladmin over the database with its own login (admin/auth.py),
the views and actions (admin/views.py), the dashboard (admin/dashboard.py).

Every state-changing route (each action, the logout, the TTL form, the login) takes POST only, so the origin check
(admin/origin_check.py, which looks at every POST) stands in front of it and a link or an <img> elsewhere changes
nothing (a GET of one is a 405); the pages' buttons submit POST forms (templates/sqladmin/base.html)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from sqladmin import Admin
from starlette.middleware import Middleware
from starlette.routing import Route

from loraplex.admin.auth import AdminAuth
from loraplex.admin.dashboard import Dashboard
from loraplex.admin.formatting import format_count, format_seconds, format_size, format_time
from loraplex.admin.origin_check import SameOriginOnly
from loraplex.admin.request_views import RequestViews
from loraplex.admin.secure_cookies import SecureCookiesOverHttps
from loraplex.admin.views import MODEL_VIEWS, CheckpointTtl, GetServices, ServicesRef
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory

TEMPLATES = Path(__file__).parent / "templates"


def mount_admin(app: FastAPI, settings: Settings, services: GetServices) -> Admin:
    """`services`: the gateway's Services (built in its lifespan), read when an action or the dashboard runs."""
    sessions = session_factory(make_db_engine(settings.resolved_database_url))
    auth = AdminAuth(settings, sessions)
    admin = Admin(
        app,
        session_maker=sessions,
        base_url="/admin",
        title="loraplex admin",
        templates_dir=str(TEMPLATES),
        authentication_backend=auth,
        middlewares=[Middleware(SameOriginOnly), Middleware(SecureCookiesOverHttps, settings=settings)],
    )
    auth.templates = admin.templates
    # What the pages' own templates write values with (the lists use the views' formatters: admin/formatting.py).
    admin.templates.env.globals.update(
        fmt_time=format_time, fmt_size=format_size, fmt_count=format_count, fmt_seconds=format_seconds
    )
    wiring = ServicesRef(services)
    Dashboard.wiring = wiring
    admin.add_base_view(Dashboard)
    RequestViews.wiring = wiring
    admin.add_base_view(RequestViews)
    for view in MODEL_VIEWS:
        view.wiring = wiring
        admin.add_view(view)
    admin.add_base_view(CheckpointTtl)
    _post_only(admin)
    return admin


def _post_only(admin: Admin) -> None:
    """sqladmin routes its actions (`action-<view>-<slug>`) and the logout as GETs; here they take POST only."""
    for route in admin.admin.routes:
        if isinstance(route, Route) and (route.name == "logout" or route.name.startswith("action-")):
            route.methods = {"POST"}

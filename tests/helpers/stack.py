"""Tenants of a running embedded stack (tests/e2e): new tenants in its database, and a ServiceClient for each."""

from __future__ import annotations

from loraplex.client import ServiceClient
from loraplex.launch.embedded import Stack
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import TenantRepository, unit_of_work


def create_tenants(stack: Stack, *names: str) -> dict[str, str]:
    """New tenants in the stack's database; returns name -> API key."""
    with unit_of_work(session_factory(make_db_engine(stack.settings.resolved_database_url))) as session:
        repo = TenantRepository(session)
        return {name: repo.create_tenant(name)[1] for name in names}


def tenant_clients(stack: Stack, *names: str) -> dict[str, ServiceClient]:
    """New tenants and a client for each: name -> ServiceClient."""
    return {name: ServiceClient(stack.base_url, key) for name, key in create_tenants(stack, *names).items()}

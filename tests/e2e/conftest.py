"""One embedded stack (redis child, SQLite, gateway, one CPU pool: 4 slots, max rank 16) shared by the e2e tests of a
session; each test file makes its own tenants, so they never see each other's adapters."""

from __future__ import annotations

import pytest

from loraplex.client import ServiceClient
from loraplex.embedded import Stack
from loraplex.redis_child import free_port
from loraplex.settings import Settings
from loraplex.storage.db import make_engine, session_factory
from loraplex.storage.repositories import TenantRepository, unit_of_work


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("stack")
    with Stack(Settings(home=home, slots=4, max_rank=16), api_port=free_port()) as running:
        yield running


def create_tenants(stack: Stack, *names: str) -> dict[str, str]:
    """New tenants in the stack's database; returns name -> API key."""
    with unit_of_work(session_factory(make_engine(stack.settings.resolved_database_url))) as session:
        repo = TenantRepository(session)
        return {name: repo.create_tenant(name)[1] for name in names}


def tenant_clients(stack: Stack, *names: str) -> dict[str, ServiceClient]:
    """New tenants and a client for each: name -> ServiceClient."""
    return {name: ServiceClient(stack.base_url, key) for name, key in create_tenants(stack, *names).items()}

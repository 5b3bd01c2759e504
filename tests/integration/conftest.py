"""Fixtures for integration tests: real services, started once per session."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import redis
from fastapi.testclient import TestClient

from loraplex.api.app import create_app
from loraplex.api.deps import Services
from loraplex.settings import Settings
from loraplex.storage.db import migrate
from loraplex.storage.repositories import TenantRepository, unit_of_work
from tests.helpers.services.redis import redis_server


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a redis-server started for this test session (db 0; tests keep apart by unique pool names or flush)."""
    with redis_server() as url:
        yield url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client on the session's server. Nothing is flushed (other fixtures may share the server): tests keep apart
    by unique pool names and ids."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@dataclass
class Gateway:
    """The gateway app under FastAPI's TestClient, on real Redis and a fresh SQLite database, with two tenants."""

    client: TestClient
    services: Services
    tenant_ids: dict[str, str]  # name -> tenant id
    keys: dict[str, str]  # name -> API key


@contextmanager
def gateway_app(settings: Settings) -> Iterator[Gateway]:
    """The gateway for `settings` on a freshly migrated database, with tenants alice and bob."""
    migrate(settings.resolved_database_url)
    app = create_app(settings)
    with TestClient(app) as client:
        services = app.state.services
        with unit_of_work(services.sessions) as session:
            repo = TenantRepository(session)
            created = {name: repo.create_tenant(name) for name in ("alice", "bob")}
        yield Gateway(
            client,
            services,
            {name: tenant.id for name, (tenant, _) in created.items()},
            {name: key for name, (_, key) in created.items()},
        )


@pytest.fixture()
def gateway(tmp_path, redis_url: str) -> Iterator[Gateway]:
    with gateway_app(Settings(home=tmp_path, redis_url=redis_url, pool=f"gw-{tmp_path.name}", max_rank=16)) as gw:
        yield gw

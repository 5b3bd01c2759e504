"""Fixtures for integration tests: real services, started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.services.redis import redis_server


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

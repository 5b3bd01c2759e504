"""FastAPI dependencies: the app's shared services, the database session, and the authenticated tenant."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Annotated

import redis
from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import AuthenticationError
from loraplex.queue.producer import Producer
from loraplex.queue.results import ResultStore
from loraplex.settings import Settings
from loraplex.storage.repositories import TenantRepository, unit_of_work


@dataclass
class Services:
    """Everything a route needs, built once in the app's lifespan."""

    settings: Settings
    sessions: sessionmaker[Session]
    redis: redis.Redis
    producer: Producer
    results: ResultStore


def get_services(request: Request) -> Services:
    return request.app.state.services


def get_db(services: Annotated[Services, Depends(get_services)]) -> Iterator[Session]:
    """A read session for the request. Writes go through `write_session` instead: on SQLite it takes the write lock
    up front, so a concurrent writer makes it wait rather than fail."""
    with services.sessions() as session:
        yield session


def write_session(services: Services) -> AbstractContextManager[Session]:
    """One transaction: committed when the block ends, rolled back (nothing half-written) on any error."""
    return unit_of_work(services.sessions)


@dataclass(frozen=True)
class TenantRef:
    id: str
    name: str


def _key_from_headers(x_api_key: str | None, authorization: str | None) -> str:
    if x_api_key:
        return x_api_key.strip()
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    raise AuthenticationError("missing API key: send it in the X-API-Key header")


def get_tenant(
    services: Annotated[Services, Depends(get_services)],
    x_api_key: Annotated[str | None, Header()] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> TenantRef:
    """Authenticate in a short session of its own, so a long-polling route holds no connection."""
    with services.sessions() as session:
        tenant = TenantRepository(session).authenticate(_key_from_headers(x_api_key, authorization))
        return TenantRef(tenant.id, tenant.name)


ServicesDep = Annotated[Services, Depends(get_services)]
DbDep = Annotated[Session, Depends(get_db)]
TenantDep = Annotated[TenantRef, Depends(get_tenant)]

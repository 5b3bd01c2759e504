"""FastAPI dependencies: the app's shared services, the database session, and the authenticated tenant."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.types import Scope

from loraplex.errors import AuthenticationError
from loraplex.service import tenant_auth
from loraplex.service.context import Services, TenantRef

# Services and TenantRef are the service layer's (service/context.py); the dependencies hand them to the routes.
__all__ = [
    "DbDep",
    "Services",
    "ServicesDep",
    "TenantDep",
    "TenantInAnyStateDep",
    "TenantRef",
    "get_db",
    "get_services",
    "get_tenant",
    "get_tenant_in_any_state",
    "key_of_request",
    "key_tenant",
    "tenant_for_key",
]

# ASGI scope keys api/door.py sets before the body is read: the tenant whose key it checked, or that the check could
# not be made (the database away) and is left to `get_tenant`.
AUTHENTICATED_TENANT = "loraplex.tenant"
AUTH_DEFERRED = "loraplex.auth_deferred"


async def get_services(request: Request) -> Services:
    return request.app.state.services  # async: no I/O, so no hop to a worker thread


def get_db(services: Annotated[Services, Depends(get_services)]) -> Iterator[Session]:
    """A read session for the request. Writes go through `write_session` (service/context.py) instead."""
    with services.sessions() as session:
        yield session


# Security schemes (documented in the OpenAPI schema); they read the header directly, cheaper than Header params.
_API_KEY = APIKeyHeader(name="X-API-Key", auto_error=False)
_BEARER = HTTPBearer(auto_error=False)


def _key_from_headers(x_api_key: str | None, bearer: HTTPAuthorizationCredentials | None) -> str:
    if x_api_key and x_api_key.strip():
        return x_api_key.strip()
    if bearer is not None and bearer.credentials.strip():
        return bearer.credentials.strip()
    raise AuthenticationError("missing API key: send it in the X-API-Key header")


async def get_tenant(
    request: Request,
    services: Annotated[Services, Depends(get_services)],
    x_api_key: Annotated[str | None, Security(_API_KEY)] = None,
    authorization: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)] = None,
) -> TenantRef:
    """The key's tenant: the one api/door.py found before the body was read, else from this process's recent checks
    (service/auth_cache.py), else from SQL in a worker thread and a short session of its own (so a long-polling route
    holds no connection). Each call spends one of the tenant's requests (service/rate_limit.py: 429 past its rate)."""
    return await _tenant_of_request(request, services, x_api_key, authorization, tenant_for_key)


async def get_tenant_in_any_state(
    request: Request,
    services: Annotated[Services, Depends(get_services)],
    x_api_key: Annotated[str | None, Security(_API_KEY)] = None,
    authorization: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)] = None,
) -> TenantRef:
    """`get_tenant` for the few routes a suspended tenant may still call because they queue no work and keep what it
    has (the Tinker SDK's telemetry and session heartbeats: refused, the SDK prints tracebacks and lets its session
    expire during the suspension)."""
    return await _tenant_of_request(request, services, x_api_key, authorization, key_tenant)


async def _tenant_of_request(
    request: Request,
    services: Services,
    x_api_key: str | None,
    authorization: HTTPAuthorizationCredentials | None,
    lookup: Callable[[Services, str], Awaitable[TenantRef]],
) -> TenantRef:
    """The tenant api/door.py found, else `lookup` of the headers' key; one of its requests spent (rate limit)."""
    tenant = request.scope.get(AUTHENTICATED_TENANT)
    if not isinstance(tenant, TenantRef):
        tenant = await lookup(services, _key_from_headers(x_api_key, authorization))
    services.rate_limit.take(tenant.id, tenant.name)
    return tenant


async def tenant_for_key(services: Services, key: str) -> TenantRef:
    """The tenant of an API key (AuthenticationError if none), through this process's cache; ForbiddenError (403,
    naming the operator's reason) if the tenant is suspended (service/tenant_rules.py)."""
    tenant = await key_tenant(services, key)
    tenant_auth.check_serves(tenant)
    return tenant


async def key_tenant(services: Services, key: str) -> TenantRef:
    """The tenant of an API key whatever its state (AuthenticationError if none), through this process's cache."""
    tenant = services.auth.get(key)
    if tenant is None:
        tenant = await run_in_threadpool(tenant_auth.authenticate, services, key)
        services.auth.put(key, tenant)
    return tenant


def key_of_request(request: Request) -> str | None:
    """The API key a request carries (X-API-Key, else a bearer token), or None; for handlers outside the routes."""
    return key_from_scope(request.scope)


def key_from_scope(scope: Scope) -> str | None:
    """`key_of_request` from an ASGI scope's raw headers (for middleware, before any Request exists)."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope.get("headers", ()):
        if name in (b"x-api-key", b"authorization"):
            headers.setdefault(name, value)  # the first, as starlette's Headers.get reads it
    key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
    if not key:
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        key = token.strip() if scheme.lower() == "bearer" else ""
    return key or None


ServicesDep = Annotated[Services, Depends(get_services)]
DbDep = Annotated[Session, Depends(get_db)]
TenantDep = Annotated[TenantRef, Depends(get_tenant)]
TenantInAnyStateDep = Annotated[TenantRef, Depends(get_tenant_in_any_state)]

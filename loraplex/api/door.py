"""Authentication at the door: an ASGI middleware that checks the API key of every request to a route that needs one
(any route depending on `get_tenant`) before a byte of its body is read. A missing, malformed or unknown key is a 401
(a suspended tenant's a 403, its chain step's seq_id filled first: api/refused_steps.py; the routes that take a tenant
in any state, `get_tenant_in_any_state`, excepted) answered at once, with
`Connection: close` so the server does not read the rest of the body either: an anonymous client's 30 MB or
malformed body costs the gateway nothing but its headers. The public routes (healthz, metrics, the
admin's pages) and unknown paths pass with no key, under the anonymous body limit (api/admission.py).

The check is the routes' own (api/deps.py: the process's auth cache, else SQL in a worker thread), and the tenant it
found rides in the ASGI scope, so `get_tenant` does not look it up again. When the check itself fails (the database
away) the request goes on, and the route's own dependency answers it as it always did (503)."""

from __future__ import annotations

import logging

from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.api.deps import (
    AUTH_DEFERRED,
    AUTHENTICATED_TENANT,
    get_tenant,
    get_tenant_in_any_state,
    key_from_scope,
    key_tenant,
)
from loraplex.api.errors import typed_error_response
from loraplex.api.refused_steps import fill_refused_step
from loraplex.errors import AuthenticationError, ForbiddenError
from loraplex.service import tenant_auth

log = logging.getLogger("loraplex.api")


def _tenant_rule(dependant: object) -> str | None:
    """"serving": the route needs the key of a tenant that is served; "any": of a tenant in any state; None: no key."""
    rules = set()
    for d in getattr(dependant, "dependencies", ()):
        if d.call is get_tenant:
            rules.add("serving")
        elif d.call is get_tenant_in_any_state:
            rules.add("any")
        elif (inner := _tenant_rule(d)) is not None:
            rules.add(inner)
    return "serving" if "serving" in rules else ("any" if rules else None)


class Door:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._rules: dict[int, str | None] = {}  # id(route) -> its `_tenant_rule`

    def _route_needing_key(self, scope: Scope) -> tuple[APIRoute, str] | None:
        """The route the request matches and its tenant rule, where it needs a key."""
        app = scope.get("app")
        for route in getattr(getattr(app, "router", None), "routes", ()):
            match, _ = route.matches(scope)
            if match is Match.FULL:
                if not isinstance(route, APIRoute):
                    return None  # a mount (the admin) or a docs page: its own rules
                if id(route) not in self._rules:
                    self._rules[id(route)] = _tenant_rule(route.dependant)
                rule = self._rules[id(route)]
                return None if rule is None else (route, rule)
        return None  # no route (404) or another method (405): nothing is read

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self._route_needing_key(scope) if scope["type"] == "http" else None
        if found is None:
            await self.app(scope, receive, send)
            return
        route, rule = found
        key = key_from_scope(scope)
        services = scope["app"].state.services
        try:
            if key is None:
                raise AuthenticationError("missing API key: send it in the X-API-Key header")
            tenant = await key_tenant(services, key)
            try:
                if rule == "serving":
                    tenant_auth.check_serves(tenant)
            except ForbiddenError as refused:  # a suspended tenant: a chain step's seq_id is filled first
                await fill_refused_step(scope, receive, route, services, tenant, refused)
                raise
            scope[AUTHENTICATED_TENANT] = tenant
        except (AuthenticationError, ForbiddenError) as exc:  # no key, a bad one, or a suspended tenant
            response = typed_error_response(exc, scope.get("path", ""))
            response.headers["Connection"] = "close"  # the unread body is not drained for keep-alive
            await response(scope, receive, send)
            return
        except Exception as exc:  # noqa: BLE001 - the database or Redis away: the route's dependency answers it
            log.debug("authentication at the door deferred to the route: %s: %s", type(exc).__name__, exc)
            scope[AUTH_DEFERRED] = True
        await self.app(scope, receive, send)

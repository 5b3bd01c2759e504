"""Authenticating a tenant's API key against SQL (the gateway's auth cache sits in front: api/deps.py), and what the
tenant's state allows (service/tenant_rules.py).

Each check reads the tenant's state and quotas with its key, so an operator's change reaches a gateway process when
its cached entry expires: at most `auth_cache_seconds` (2 s by default) after the change on every replica, at once on
the process that made it (it clears its cache). A key's last use is written here, at most once a minute per key
(KEY_USE_RESOLUTION_S): one UPDATE whose WHERE skips a use recorded within the minute, only when the row read says it
is older, and only on a cache miss; a failed write never fails the request."""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.exc import SQLAlchemyError

from loraplex.protocol import RequestKind
from loraplex.service import tenant_rules
from loraplex.service.context import Services, TenantQuotas, TenantRef, write_session
from loraplex.storage.models import Tenant
from loraplex.storage.repositories import TenantRepository
from loraplex.storage.types import utcnow

log = logging.getLogger("loraplex.api")
KEY_USE_RESOLUTION_S = 60.0


def tenant_ref(tenant: Tenant) -> TenantRef:
    quotas = TenantQuotas(tenant.max_queued_requests, tenant.max_queued_tokens, tenant.max_adapters)
    return TenantRef(tenant.id, tenant.name, tenant.state, tenant.state_reason, quotas)


def authenticate(services: Services, key: str) -> TenantRef:
    """The key's tenant (AuthenticationError if none), its last use recorded when the one on record is a minute old."""
    now = utcnow()
    older_than = now - timedelta(seconds=KEY_USE_RESOLUTION_S)
    with services.sessions() as session:
        tenant, api_key = TenantRepository(session).authenticate_key(key)
        ref, key_id, last_used = tenant_ref(tenant), api_key.id, api_key.last_used_at
    if last_used is None or last_used < older_than:
        try:
            with write_session(services) as session:
                TenantRepository(session).touch_key(key_id, now, older_than)
        except SQLAlchemyError as exc:  # the use is a display; the request goes on
            log.debug("could not record the use of key %s: %s", key_id, exc)
    return ref


def check_serves(tenant: TenantRef) -> None:
    """ForbiddenError (403, naming the reason) when the tenant is suspended."""
    tenant_rules.check_serves(tenant.name, tenant.state, tenant.state_reason)


def check_queues(tenant: TenantRef, kind: RequestKind) -> None:
    """ForbiddenError when the tenant may not queue `kind` now (suspended; draining, for new work)."""
    tenant_rules.check_queues(tenant.name, tenant.state, tenant.state_reason, kind)

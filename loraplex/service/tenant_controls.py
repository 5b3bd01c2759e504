"""An operator's controls over a tenant (the web admin calls these; the rules are service/tenant_rules.py): suspend,
drain and resume it, set its fair-share weight and quotas, issue and revoke its API keys. Each change and its audit
entry (service/audit.py) are one transaction: a change is never unrecorded, a record never without its change.

Afterwards this process's auth cache is cleared, so its next call of the tenant reads the change; the other gateway
processes read it when their cached entry expires, at most `auth_cache_seconds` later (service/tenant_auth.py)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.errors import NotFoundError
from loraplex.service import tenant_rules
from loraplex.service.context import Services, TenantQuotas, write_session
from loraplex.storage.enums import TenantState
from loraplex.storage.models import ApiKey
from loraplex.storage.repositories import AuditRepository, TenantRepository
from loraplex.storage.types import utcnow

TENANT = "tenant"
API_KEY = "api key"


@dataclass(frozen=True)
class TenantLimits:
    weight: float
    quotas: TenantQuotas


def _change_state(services: Services, actor: str, tenant_id: str, target: TenantState, reason: str | None) -> None:
    with write_session(services) as db:
        tenants = TenantRepository(db)
        tenant = tenants.get(tenant_id)
        tenant_rules.check_transition(tenant.name, tenant.state, target)
        tenants.set_state(tenant_id, target, reason, utcnow())
        action = {TenantState.SUSPENDED: "suspend", TenantState.DRAINING: "drain", TenantState.ACTIVE: "resume"}[target]
        AuditRepository(db).record(actor, action, TENANT, tenant_id, tenant.name, reason)
    services.auth.clear()


def suspend_tenant(services: Services, actor: str, tenant_id: str, reason: str) -> None:
    """Every authenticated call of the tenant gets 403 naming `reason`; its queued requests stay and run."""
    _change_state(services, actor, tenant_id, TenantState.SUSPENDED, tenant_rules.parse_reason(reason))


def drain_tenant(services: Services, actor: str, tenant_id: str, reason: str) -> None:
    """The tenant's calls that would queue new work get 403 naming `reason`; its queue empties as it runs."""
    _change_state(services, actor, tenant_id, TenantState.DRAINING, tenant_rules.parse_reason(reason))


def resume_tenant(services: Services, actor: str, tenant_id: str) -> None:
    """Served again (from suspended or draining)."""
    _change_state(services, actor, tenant_id, TenantState.ACTIVE, None)


def set_tenant_limits(services: Services, actor: str, tenant_id: str, limits: TenantLimits) -> None:
    """The tenant's weight and own quotas (service/context.py's TenantQuotas: None for the setting's, 0 for none)."""
    quotas = limits.quotas
    with write_session(services) as db:
        tenants = TenantRepository(db)
        tenants.set_weight(tenant_id, limits.weight)
        tenant = tenants.set_quotas(tenant_id, max_queued_requests=quotas.max_queued_requests,
                                    max_queued_tokens=quotas.max_queued_tokens, max_adapters=quotas.max_adapters)  # fmt: skip
        detail = (f"weight={limits.weight:g} max_queued_requests={_shown(quotas.max_queued_requests)} "
                  f"max_queued_tokens={_shown(quotas.max_queued_tokens)} max_adapters={_shown(quotas.max_adapters)}")  # fmt: skip
        AuditRepository(db).record(actor, "set limits", TENANT, tenant_id, tenant.name, detail)
    services.auth.clear()


def _shown(quota: int | None) -> str:
    return "default" if quota is None else str(quota)


def issue_key(services: Services, actor: str, tenant_id: str, name: str | None) -> str:
    """A new API key for the tenant, returned once (only its hash is stored)."""
    with write_session(services) as db:
        tenants = TenantRepository(db)
        key = tenants.issue_key(tenant_id, name)
        tenant = tenants.get(tenant_id)
        detail = f"prefix {key[:8]}" + (f", named {name.strip()!r}" if name and name.strip() else "")
        AuditRepository(db).record(actor, "issue key", TENANT, tenant_id, tenant.name, detail)
    return key


def revoke_key(services: Services, actor: str, key_id: str) -> None:
    """Clients using the key get 401 from now on (on other gateway processes within `auth_cache_seconds`)."""
    with write_session(services) as db:
        key = db.get(ApiKey, key_id)
        if key is None:
            raise NotFoundError(f"API key {key_id!r} not found")
        TenantRepository(db).revoke_key(key.tenant_id, key_id)
        label = key.prefix + (f" ({key.name})" if key.name else "")
        AuditRepository(db).record(actor, "revoke key", API_KEY, key_id, label, None)
    services.auth.clear()

"""Tenants and their API keys. Not tenant-scoped: this is what the gateway (auth) and operators use."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Collection
from datetime import datetime

from sqlalchemy import delete, or_, select, update
from sqlalchemy.orm import Session

from loraplex.errors import AuthenticationError, ConflictError, InvalidRequestError, NotFoundError
from loraplex.storage.models import Adapter, ApiKey, Tenant, TenantState
from loraplex.storage.repositories._common import add_or_conflict
from loraplex.storage.types import utcnow

# The official tinker SDK refuses keys that do not start with "tml-".
API_KEY_PREFIX = "tml-"
_KEY_RE = re.compile(r"^tml-[A-Za-z0-9_-]{16,128}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    def create_tenant(self, name: str) -> tuple[Tenant, str]:
        """New tenant plus its first API key; the plaintext key is returned once and never stored."""
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise InvalidRequestError("tenant name must be 1-64 characters of A-Z a-z 0-9 _ . -")
        if self.session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
            raise ConflictError(f"tenant {name!r} already exists")
        tenant = Tenant(name=name)
        add_or_conflict(self.session, tenant, f"tenant {name!r} already exists")
        return tenant, self.issue_key(tenant.id)

    def issue_key(self, tenant_id: str, name: str | None = None) -> str:
        """A new key for the tenant, labelled `name` (optional: at most 64 printable characters)."""
        self.get(tenant_id)
        name = (name or "").strip() or None
        if name is not None and (len(name) > 64 or not name.isprintable()):
            raise InvalidRequestError("a key's name must be at most 64 printable characters")
        key = new_api_key()
        self.session.add(ApiKey(tenant_id=tenant_id, key_hash=hash_api_key(key), prefix=key[:8], name=name))
        self.session.flush()
        return key

    def revoke_key(self, tenant_id: str, key_id: str) -> None:
        key = self.session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant_id))
        if key is None:
            raise NotFoundError(f"API key {key_id!r} not found")
        if key.revoked_at is None:
            key.revoked_at = utcnow()
            self.session.flush()

    def revoke_all_keys(self, tenant_id: str) -> int:
        """Revoke every active key of the tenant; returns how many were active."""
        active = [k for k in self.list_keys(tenant_id) if k.revoked_at is None]
        for key in active:
            key.revoked_at = utcnow()
        self.session.flush()
        return len(active)

    def delete(self, tenant_id: str) -> None:
        """Remove the tenant row; the database cascades to its keys, adapters, checkpoints, sessions and usage.
        Operators only (`loraplex tenant delete`), after its adapters were deleted through the queue."""
        self.get(tenant_id)
        self.session.execute(delete(Tenant).where(Tenant.id == tenant_id))
        self.session.flush()

    def list_keys(self, tenant_id: str) -> list[ApiKey]:
        stmt = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at, ApiKey.id)
        return list(self.session.scalars(stmt))

    def authenticate(self, key: str | None) -> Tenant:
        """The tenant owning an active key. Lookup is by hash, so no constant-time compare is needed."""
        return self.authenticate_key(key)[0]

    def authenticate_key(self, key: str | None) -> tuple[Tenant, ApiKey]:
        """`authenticate`, with the key's row (its id and last use)."""
        if not key:
            raise AuthenticationError("missing API key")
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise AuthenticationError("malformed API key")
        row = self.session.execute(
            select(Tenant, ApiKey).join(ApiKey, ApiKey.tenant_id == Tenant.id).where(ApiKey.key_hash == hash_api_key(key))
        ).first()
        if row is None or row.ApiKey.revoked_at is not None:
            raise AuthenticationError("invalid or revoked API key")
        return row.Tenant, row.ApiKey

    def touch_key(self, key_id: str, now: datetime, older_than: datetime) -> bool:
        """Record a use of the key at `now` unless one at or after `older_than` is recorded already (one UPDATE whose
        WHERE decides, so gateways racing on the same key write it once). True if it wrote."""
        stmt = (
            update(ApiKey)
            .where(ApiKey.id == key_id, or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < older_than))
            .values(last_used_at=now)
        )
        return bool(getattr(self.session.execute(stmt), "rowcount", 0))

    def set_state(self, tenant_id: str, state: TenantState, reason: str | None, now: datetime) -> Tenant:
        tenant = self.get(tenant_id)
        tenant.state, tenant.state_reason, tenant.state_changed_at = state, reason, now
        self.session.flush()
        return tenant

    def set_quotas(
        self, tenant_id: str, *, max_queued_requests: int | None, max_queued_tokens: int | None, max_adapters: int | None
    ) -> Tenant:
        """The tenant's own quotas (None: the setting's; 0: none), each a whole number >= 0."""
        for what, value in (("max_queued_requests", max_queued_requests), ("max_queued_tokens", max_queued_tokens),
                            ("max_adapters", max_adapters)):  # fmt: skip
            if value is not None and not (isinstance(value, int) and 0 <= value < 2**62):
                raise InvalidRequestError(f"{what} must be a whole number >= 0 (0: no limit), got {value!r}")
        tenant = self.get(tenant_id)
        tenant.max_queued_requests, tenant.max_queued_tokens = max_queued_requests, max_queued_tokens
        tenant.max_adapters = max_adapters
        self.session.flush()
        return tenant

    def get(self, tenant_id: str) -> Tenant:
        tenant = self.session.get(Tenant, tenant_id)
        if tenant is None:
            raise NotFoundError(f"tenant {tenant_id!r} not found")
        return tenant

    def get_by_name(self, name: str) -> Tenant:
        tenant = self.session.scalar(select(Tenant).where(Tenant.name == name))
        if tenant is None:
            raise NotFoundError(f"tenant {name!r} not found")
        return tenant

    def owner_of_adapter(self, model_id: str) -> Tenant:
        """The tenant an adapter belongs to, for operator tools (the CLI); tenant-facing code never needs this."""
        tenant = self.session.scalar(select(Tenant).join(Adapter, Adapter.tenant_id == Tenant.id).where(
            Adapter.model_id == model_id))  # fmt: skip
        if tenant is None:
            raise NotFoundError(f"adapter {model_id!r} not found")
        return tenant

    def set_weight(self, tenant_id: str, weight: float) -> None:
        """The tenant's fair-share weight (operators only): finite and > 0."""
        if not (0 < weight < float("inf")):
            raise InvalidRequestError(f"tenant weight must be a positive finite number, got {weight!r}")
        self.get(tenant_id).weight = float(weight)
        self.session.flush()

    def weights(self, tenant_ids: Collection[str]) -> dict[str, float]:
        """tenant id -> fair-share weight, for the pool's dispatcher (ids it does not know are left out)."""
        if not tenant_ids:
            return {}
        rows = self.session.execute(select(Tenant.id, Tenant.weight).where(Tenant.id.in_(list(tenant_ids))))
        return {tid: float(w) for tid, w in rows}

    def list(self) -> list[Tenant]:
        return list(self.session.scalars(select(Tenant).order_by(Tenant.name)))

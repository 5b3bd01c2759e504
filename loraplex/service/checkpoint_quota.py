"""Each tenant's checkpoint quotas: how many checkpoints it keeps (`max_checkpoints_per_tenant`) and the bytes they
hold (`max_checkpoint_bytes_per_tenant`), checked when a save is submitted (native, Tinker, pipelines: every save goes
through service/checkpoints._save).

What counts: the tenant's rows in SQL (every adapter's, deleted adapters' too) plus its saves accepted but not yet
recorded, so a burst of saves queued before any completes cannot pass the quota. Those pending saves sit in a Redis
hash (queue/keys.pending_saves: request id -> estimated bytes); one whose request has finished (its state key says
complete or failed, or has expired) is dropped from it before each check, and a save is recorded in SQL before its
state says complete, so a save is never counted in neither place (at worst in both, for a moment). The check and the
reservation are one Lua script, so saves racing on several gateways cannot all take the last unit of room.

Bytes of a pending save are estimated by the adapter's latest checkpoint of that kind (else any kind, else 0): the
bytes quota can be passed by at most one checkpoint's size per adapter saved for the first time while others queue.
Waiting frees nothing, so the 429 carries no Retry-After; deleting checkpoints (or their expiry) frees room."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from sqlalchemy.orm import Session

from loraplex.errors import QuotaExceededError
from loraplex.protocol.checkpoint_paths import CheckpointKind
from loraplex.queue import keys
from loraplex.queue.keys import JobState
from loraplex.queue.results import DEFAULT_TTL_S
from loraplex.service.context import Services, TenantRef
from loraplex.storage.repositories import CheckpointRepository

# A reservation not yet swapped for its request id is dropped after this long (the gateway died between the two).
RESERVATION_TTL_S = 300
FINISHED = frozenset({JobState.COMPLETE.value, JobState.FAILED.value})
RESERVATION_PREFIX = "reserved:"

# KEYS: the pending hash. ARGV: field, value ("<bytes> <unix s>"), stored count, stored bytes, max count, max bytes,
# whether this save adds a checkpoint (1) or overwrites one (0), the estimate of its bytes, the hash's TTL.
_RESERVE = """
local values = redis.call('HVALS', KEYS[1])
local pending, pending_bytes = #values, 0
for _, v in ipairs(values) do pending_bytes = pending_bytes + (tonumber(string.match(v, '^%S+')) or 0) end
local count = tonumber(ARGV[3]) + pending + tonumber(ARGV[7])
if tonumber(ARGV[5]) > 0 and count > tonumber(ARGV[5]) then return {-1, pending, tostring(pending_bytes)} end
local size = tonumber(ARGV[4]) + pending_bytes + tonumber(ARGV[8])
if tonumber(ARGV[6]) > 0 and size > tonumber(ARGV[6]) then return {-2, pending, tostring(pending_bytes)} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[9])
return {1, pending, tostring(pending_bytes)}
"""


@dataclass
class Reservation:
    """Room held for one save until its request id is known (`bind`), then until that request finishes."""

    services: Services
    key: str
    field: str
    estimate: int
    active: bool  # False when the tenant has no checkpoint quota: nothing is tracked

    def bind(self, request_id: str) -> None:
        if not self.active:
            return
        pipe = self.services.redis.pipeline()
        pipe.hdel(self.key, self.field)
        pipe.hset(self.key, request_id, f"{self.estimate} {int(time.time())}")
        pipe.expire(self.key, DEFAULT_TTL_S)
        pipe.execute()

    def cancel(self) -> None:
        if self.active:
            self.services.redis.hdel(self.key, self.field)


def _prune(services: Services, key: str) -> None:
    """Drop the pending saves that have finished (or whose reservation outlived RESERVATION_TTL_S)."""
    pending = {_text(k): _text(v) for k, v in services.redis.hgetall(key).items()}
    if not pending:
        return
    now = time.time()
    ids = [f for f in pending if not f.startswith(RESERVATION_PREFIX)]
    states = services.redis.mget([keys.state_key(i) for i in ids]) if ids else []
    done = [i for i, state in zip(ids, states, strict=True) if state is None or _text(state) in FINISHED]
    done += [f for f, v in pending.items()
             if f.startswith(RESERVATION_PREFIX) and now - float(v.split(" ")[1]) > RESERVATION_TTL_S]  # fmt: skip
    if done:
        services.redis.hdel(key, *done)


def _estimate(checkpoints: CheckpointRepository, model_id: str, kind: CheckpointKind) -> int:
    latest = checkpoints.latest(model_id, (kind,)) or checkpoints.latest(model_id, tuple(CheckpointKind))
    return latest.size_bytes if latest is not None else 0


def reserve_save(
    services: Services, db: Session, tenant: TenantRef, model_id: str, kind: CheckpointKind, *, overwrites: bool
) -> Reservation:
    """Hold room for one save of `model_id` until it is submitted (then `bind` it to its request id, or `cancel`
    it). QuotaExceededError (429, no Retry-After) naming the quota and its setting when there is no room.
    `overwrites`: the save replaces an existing checkpoint (the count does not grow)."""
    settings = services.settings
    max_count, max_bytes = settings.max_checkpoints_per_tenant, settings.max_checkpoint_bytes_per_tenant
    key = keys.pending_saves(tenant.id)
    field = f"{RESERVATION_PREFIX}{uuid.uuid4().hex}"
    checkpoints = CheckpointRepository(db, tenant.id)
    active = bool(max_count or max_bytes)
    estimate = _estimate(checkpoints, model_id, kind) if active else 0
    if active:
        _prune(services, key)
        count, size = checkpoints.usage()
        script = services.redis.register_script(_RESERVE)
        args: list[str | int] = [field, f"{estimate} {int(time.time())}", count, size, max_count, max_bytes, int(not overwrites),
                estimate, DEFAULT_TTL_S]  # fmt: skip
        verdict, pending, pending_bytes = script(keys=[key], args=args)
        if verdict == -1:
            raise QuotaExceededError(
                f"tenant {tenant.name} keeps {count} checkpoints and has {pending} saves queued; its quota is "
                f"{max_count} checkpoints (LORAPLEX_MAX_CHECKPOINTS_PER_TENANT): delete some first"
            )
        if verdict == -2:
            raise QuotaExceededError(
                f"tenant {tenant.name}'s checkpoints hold {size} bytes, and its {pending} queued saves about "
                f"{int(_text(pending_bytes))} more; its quota is {max_bytes} bytes "
                "(LORAPLEX_MAX_CHECKPOINT_BYTES_PER_TENANT): delete some first"
            )
    return Reservation(services, key, field, estimate, active)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

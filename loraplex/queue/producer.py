"""Enqueue requests on a pool's stream, at most once per idempotency key.

Idempotency: training steps are keyed by (model_id, seq_id); create_adapter / delete_adapter (seq_id -1, outside the
seq chain) by (model_id, kind), since an adapter is created and deleted once. One Lua script claims the key with the
new request_id, the request's fingerprint (its kind and the payload's bytes the entry carries, hashed: the payload
is serialized once) and its kind (SET NX semantics), XADDs the entry, marks it queued and writes its owner (the tenant:
who may read its future), atomically, in one round trip: a crash can never leave a claimed key without its entry
(which would make every retry wait on a request that was never queued). If the key is already claimed, nothing is
enqueued: the same request again (same fingerprint: a retry) gets the first request_id, so it is never applied
twice; a different request under the same key is a ConflictError naming both kinds (the caller reused a seq_id).

Each tenant has its own stream on the pool (queue/keys.py), and the same script enforces the tenant's quotas: queued
requests (the stream's length: answered entries are deleted) and queued tokens (a per-tenant count the consumer's ack
takes back; the count is the kind's token function, protocol/kinds.py). A request over a quota is a
QuotaExceededError (429, retry after) and queues nothing. Kinds whose row says quota_exempt skip the quotas (a
rejection must fill its seq_id, and a delete frees what a tenant holds).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import redis as redis_lib

from loraplex.errors import ConflictError, QuotaExceededError
from loraplex.protocol import CONTROL_KINDS, KINDS
from loraplex.queue import keys
from loraplex.queue.envelope import TOKENS_FIELD, Envelope, encode, encode_payload
from loraplex.queue.keys import JobState
from loraplex.queue.redis_text import text
from loraplex.queue.results import DEFAULT_TTL_S

# KEYS: idempotency, stream, state, tenants set, doorbell, queued-tokens hash, the request's owner.
# ARGV: claim ("<request_id> <fingerprint> <kind>"), request_id, ttl_s, state value, tenant_id, tokens,
# max queued requests (0: no limit), max queued tokens (0: no limit), the owner key's ttl_s, then field/value pairs
# for XADD.
_SUBMIT = """
local prev = redis.call('GET', KEYS[1])
if prev then return {0, prev} end
local tokens = tonumber(ARGV[6])
local max_requests = tonumber(ARGV[7])
if max_requests > 0 then
  local queued = redis.call('XLEN', KEYS[2])
  if queued >= max_requests then return {-1, tostring(queued)} end
end
local max_tokens = tonumber(ARGV[8])
if max_tokens > 0 then
  local queued = tonumber(redis.call('HGET', KEYS[6], ARGV[5]) or '0')
  if queued > 0 and queued + tokens > max_tokens then return {-2, tostring(queued)} end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
local fields = {}
for i = 10, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(fields))
if tokens > 0 then redis.call('HINCRBY', KEYS[6], ARGV[5], tokens) end
redis.call('SET', KEYS[3], ARGV[4], 'EX', ARGV[3])
redis.call('SET', KEYS[7], ARGV[5], 'NX', 'EX', ARGV[9])
if redis.call('SADD', KEYS[4], ARGV[5]) == 1 then
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', '64', '*', 'tenant', ARGV[5])
end
return {1, ARGV[1]}
"""

# A tenant's own queue quotas (max queued requests, max queued tokens; 0: none), each None for the producer's.
Limits = tuple[int | None, int | None]

# How long a caller over its queue quota is told to wait before sending the same request again.
QUOTA_RETRY_AFTER_S = 1.0
# How long a request's owner key (keys.request_owner: who may read its future) lives.
OWNER_TTL_S = 7 * 24 * 3600


class Producer:
    def __init__(
        self,
        redis: redis_lib.Redis,
        pool: str,
        idempotency_ttl_s: int = DEFAULT_TTL_S,
        *,
        max_queued_requests: int = 0,
        max_queued_tokens: int = 0,
    ) -> None:
        """max_queued_requests / max_queued_tokens: each tenant's quotas on this pool (0: none)."""
        self.redis = redis
        self.pool = pool
        self.idempotency_ttl_s = idempotency_ttl_s
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self._script = redis.register_script(_SUBMIT)

    def submit(self, env: Envelope, pool: str | None = None, limits: Limits | None = None) -> str:
        """Queue `env` on `pool` (default: the producer's); returns its request_id, or the request_id of the first
        request with the same idempotency key (whichever pool that went to). `limits`: the tenant's own (max queued
        requests, max queued tokens), each None for the producer's."""
        return self.submit_checked(env, pool, limits)[0]

    def submit_checked(self, env: Envelope, pool: str | None = None, limits: Limits | None = None) -> tuple[str, bool]:
        """Like `submit`, plus whether this call enqueued anything (False: a retry of an earlier request)."""
        pool = pool or self.pool
        max_requests, max_tokens = limits or (None, None)
        max_requests = self.max_queued_requests if max_requests is None else max_requests
        max_tokens = self.max_queued_tokens if max_tokens is None else max_tokens
        idem = keys.request_idempotency_key(env.kind, env.model_id, env.seq_id)
        payload = encode_payload(env.payload)  # written once: the fingerprint hashes the bytes the entry carries
        claim = Claim(env.request_id, fingerprint(env, payload), str(env.kind))
        spec = KINDS[env.kind]
        tokens = spec.tokens(env.payload, None)
        exempt = spec.quota_exempt
        argv: list[str | int | bytes] = [claim.encode(), env.request_id, self.idempotency_ttl_s, JobState.QUEUED.value]
        argv += [env.tenant_id, tokens, 0 if exempt else max_requests]
        argv += [0 if exempt else max_tokens, OWNER_TTL_S]
        for name, value in encode(env, payload).items():
            argv += [name, value]
        argv += [TOKENS_FIELD, tokens]
        script_keys = [
            idem,
            keys.request_stream(pool, env.tenant_id),
            keys.state_key(env.request_id),
            keys.pool_tenants(pool),
            keys.pool_doorbell(pool),
            keys.queued_tokens(pool),
            keys.request_owner(env.request_id),
        ]
        created, raw = self._script(keys=script_keys, args=argv)
        if created == 1:
            return env.request_id, True
        if created < 0:
            quota = max_requests if created == -1 else max_tokens
            raise self._over_quota(env, pool, tokens, int(text(raw)), quota, requests=created == -1)
        first = Claim.decode(text(raw))
        if first.fingerprint is not None and first.fingerprint != claim.fingerprint:
            where = f"seq_id {env.seq_id}" if env.kind not in CONTROL_KINDS else str(env.kind)
            raise ConflictError(
                f"adapter {env.model_id}: {where} was already used by a {first.kind} request (request "
                f"{first.request_id}) with a different body; this {env.kind} needs the next unused seq_id"
            )
        return first.request_id, False

    @staticmethod
    def _over_quota(
        env: Envelope, pool: str, tokens: int, queued: int, quota: int, *, requests: bool
    ) -> QuotaExceededError:
        if requests:
            what = f"{queued} requests queued; the quota is {quota}"
        else:
            what = f"{queued} tokens queued, and this request adds {tokens}; the quota is {quota}"
        return QuotaExceededError(
            f"tenant {env.tenant_id} has {what} on pool {pool}: send it again once some are answered",
            retry_after_s=QUOTA_RETRY_AFTER_S,
        )


class Claim(NamedTuple):
    """What an idempotency key holds: the first request's id, its fingerprint and kind (None for keys written before
    fingerprints were: such a claim matches any retry)."""

    request_id: str
    fingerprint: str | None = None
    kind: str | None = None

    def encode(self) -> str:
        return f"{self.request_id} {self.fingerprint} {self.kind}"

    @classmethod
    def decode(cls, raw: str) -> Claim:
        parts = raw.split(" ")
        return cls(parts[0], parts[1], parts[2]) if len(parts) == 3 else cls(raw)


def fingerprint(env: Envelope, payload: bytes | None = None) -> str:
    """A hash of what the request asks for (its kind and its payload's encoded bytes, `payload` when the caller has
    them; not its id or time): equal for a retry."""
    body = encode_payload(env.payload) if payload is None else payload
    return hashlib.sha256(str(env.kind).encode() + b"\0" + body).hexdigest()[:32]

"""Enqueue requests on a pool's stream, at most once per idempotency key.

Idempotency: training steps are keyed by (model_id, seq_id); create_adapter / delete_adapter (seq_id -1, outside the
seq chain) by (model_id, kind), since an adapter is created and deleted once. One Lua script claims the key with the
new request_id, the request's fingerprint (its kind and payload, hashed) and its kind (SET NX semantics), XADDs the
entry and marks it queued, atomically: a crash can never leave a claimed key without its entry (which would make every
retry wait on a request that was never queued). If the key is already claimed, nothing is enqueued: the same request
again (same fingerprint: a retry) gets the first request_id, so it is never applied twice; a different request under
the same key is a ConflictError naming both kinds (the caller reused a seq_id).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import orjson
import redis as redis_lib

from loraplex.errors import ConflictError
from loraplex.protocol import CONTROL_KINDS
from loraplex.queue import keys
from loraplex.queue.envelope import Envelope, encode
from loraplex.queue.keys import JobState
from loraplex.queue.redis_text import text
from loraplex.queue.results import DEFAULT_TTL_S

# KEYS: idempotency, stream, state. ARGV: claim ("<request_id> <fingerprint> <kind>"), request_id, ttl_s, state value,
# then field/value pairs for XADD.
_SUBMIT = """
local prev = redis.call('GET', KEYS[1])
if prev then return {0, prev} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
local fields = {}
for i = 5, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('SET', KEYS[3], ARGV[4], 'EX', ARGV[3])
return {1, ARGV[1]}
"""


class Producer:
    def __init__(self, redis: redis_lib.Redis, pool: str, idempotency_ttl_s: int = DEFAULT_TTL_S) -> None:
        self.redis = redis
        self.pool = pool
        self.stream = keys.request_stream(pool)
        self.idempotency_ttl_s = idempotency_ttl_s
        self._script = redis.register_script(_SUBMIT)

    def submit(self, env: Envelope) -> str:
        """Queue `env`; returns its request_id, or the request_id of the first request with the same idempotency key."""
        return self.submit_checked(env)[0]

    def submit_checked(self, env: Envelope) -> tuple[str, bool]:
        """Like `submit`, plus whether this call enqueued anything (False: a retry of an earlier request)."""
        idem = keys.request_idempotency_key(env.kind, env.model_id, env.seq_id)
        claim = Claim(env.request_id, fingerprint(env), str(env.kind))
        argv: list[str | int] = [claim.encode(), env.request_id, self.idempotency_ttl_s, JobState.QUEUED.value]
        for name, value in encode(env).items():
            argv += [name, value]
        created, raw = self._script(keys=[idem, self.stream, keys.state_key(env.request_id)], args=argv)
        if created:
            return env.request_id, True
        first = Claim.decode(text(raw))
        if first.fingerprint is not None and first.fingerprint != claim.fingerprint:
            where = f"seq_id {env.seq_id}" if env.kind not in CONTROL_KINDS else str(env.kind)
            raise ConflictError(
                f"adapter {env.model_id}: {where} was already used by a {first.kind} request (request "
                f"{first.request_id}) with a different body; this {env.kind} needs the next unused seq_id"
            )
        return first.request_id, False


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


def fingerprint(env: Envelope) -> str:
    """A hash of what the request asks for (kind and payload; not its id or time): equal for a retry."""
    body = orjson.dumps({"kind": str(env.kind), "payload": env.payload}, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(body).hexdigest()[:32]

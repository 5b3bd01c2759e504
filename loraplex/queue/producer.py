"""Enqueue requests on a pool's stream, at most once per idempotency key.

Idempotency: training steps are keyed by (model_id, seq_id); create_adapter / delete_adapter (seq_id -1, outside the
seq chain) by (model_id, kind), since an adapter is created and deleted once. One Lua script claims the key with the
new request_id (SET NX semantics), XADDs the entry and marks it queued, atomically: a crash can never leave a claimed
key without its entry (which would make every retry wait on a request that was never queued). If the key is already
claimed, nothing is enqueued and the first request_id is returned, so a retried request is never applied twice.
"""

from __future__ import annotations

import redis as redis_lib

from loraplex.queue import keys
from loraplex.queue.envelope import Envelope, encode
from loraplex.queue.keys import JobState
from loraplex.queue.redis_text import text
from loraplex.queue.results import DEFAULT_TTL_S

# KEYS: idempotency, stream, state. ARGV: request_id, ttl_s, state value, then field/value pairs for XADD.
_SUBMIT = """
local prev = redis.call('GET', KEYS[1])
if prev then return {0, prev} end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('SET', KEYS[3], ARGV[3], 'EX', ARGV[2])
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
        """Like `submit`, plus whether this call enqueued anything (False: a duplicate of an earlier request)."""
        idem = keys.request_idempotency_key(env.kind, env.model_id, env.seq_id)
        argv: list[str | int] = [env.request_id, self.idempotency_ttl_s, JobState.QUEUED.value]
        for name, value in encode(env).items():
            argv += [name, value]
        created, request_id = self._script(keys=[idem, self.stream, keys.state_key(env.request_id)], args=argv)
        rid = text(request_id)
        return rid, bool(created)

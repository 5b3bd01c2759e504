"""Results and job states in Redis. `put` writes the Outcome, its final JobState and a notify token in one MULTI, so a
waiter that wakes on the token always finds the result.

Fenced (the pool leader's store, `lease=`): `put_many` and `set_states` run as one Lua script that first checks the pool's
lease still holds this writer's fencing token (queue/lease.py), and writes nothing otherwise (LeaseLostError): a
deposed leader that still finishes a plan cannot publish its results. Still one round trip, as the MULTI was.

Waiting: `wait` blocks on the notify list in short slices (always below the client's socket timeout) with a BLMOVE of
the list onto itself, which hands the token over and leaves it there, so any number of waiters, and repeated waits on
the same id, all wake, and a wake-up costs one round trip; it checks the result key first, so a finished request
answers at once. With `wait_redis` (the gateway's: a client over a connection pool of its own)
the waits use that client, so however many long-polls wait, the short calls' connections stay free.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import orjson
import redis as redis_lib

from loraplex.errors import error_class
from loraplex.protocol import Outcome
from loraplex.protocol.results import result_from_wire
from loraplex.queue import keys
from loraplex.queue.keys import JobState
from loraplex.queue.lease import HELD_LUA, PoolLease
from loraplex.queue.redis_text import text

DEFAULT_TTL_S = 24 * 3600
# Longest single BLPOP; redis-py's default socket_timeout is 5 s, and a BLPOP longer than that would raise.
WAIT_SLICE_S = 1.0
_TOKEN = "1"


def outcome_to_json(outcome: Outcome) -> bytes:
    """orjson: a forward_backward result carries a logprob per token (~1.3 ms for 4,096 with the json module, 0.1 ms
    here, in the pool process beside the engine's host-bound thread). NaN or infinity become null, valid JSON. The
    result is stored in its JSON form with its type's name (`result_type`), the error as its registered name."""
    result = outcome.result
    return orjson.dumps(
        {
            "request_id": outcome.request_id,
            "result": None if result is None else result.to_wire(),
            "result_type": None if result is None else result.RESULT_NAME,
            "error_type": outcome.error_name,
            "error": outcome.error,
        }
    )


def outcome_from_json(raw: bytes | str) -> Outcome:
    data = orjson.loads(raw)
    result, error_type = data.get("result"), data.get("error_type")
    return Outcome(
        request_id=data["request_id"],
        result=None
        if result is None
        else result_from_wire(data.get("result_type") or _untyped_result_type(result), result),
        error_type=None if error_type is None else error_class(error_type),
        error=data.get("error"),
    )


# A result stored without its type's name (the version before typed results wrote the same JSON forms without it, and
# they live for the store's time-to-live): its type is the first whose key it holds, in this order (a forward_backward
# result holds metrics too, a load result model_id too); an empty one is a delete's.
_TYPE_BY_KEY = (("loss_fn_outputs", "forward_backward"), ("sequences", "sample"), ("with_optimizer", "load_state"),
                ("step", "save"), ("metrics", "optim_step"), ("model_id", "create_adapter"))  # fmt: skip


def _untyped_result_type(result: dict[str, object]) -> str:
    """The result type's name for a result stored without one (ValueError for a shape no version wrote)."""
    if not result:
        return "delete_adapter"
    name = next((name for key, name in _TYPE_BY_KEY if key in result), None)
    if name is None:
        raise ValueError(f"a stored result without result_type, of unknown keys {sorted(result)}")
    return name


# KEYS[3..]: (result, state, notify) per outcome; ARGV[4] ttl s, ARGV[5..]: (result JSON, state) per outcome.
_FENCED_PUT = (
    HELD_LUA
    + """
if not held() then return 0 end
local ttl = ARGV[4]
for i = 0, (#KEYS - 2) / 3 - 1 do
  local k, a = 3 + 3 * i, 5 + 2 * i
  redis.call('SET', KEYS[k], ARGV[a], 'EX', ttl)
  redis.call('SET', KEYS[k + 1], ARGV[a + 1], 'EX', ttl)
  redis.call('RPUSH', KEYS[k + 2], '1')
  redis.call('EXPIRE', KEYS[k + 2], ttl)
end
return 1
"""
)
# KEYS[3..]: state keys; ARGV[4] ttl s, ARGV[5] the state.
_FENCED_STATES = (
    HELD_LUA
    + """
if not held() then return 0 end
for i = 3, #KEYS do redis.call('SET', KEYS[i], ARGV[5], 'EX', ARGV[4]) end
return 1
"""
)


class ResultStore:
    def __init__(
        self,
        redis: redis_lib.Redis,
        ttl_s: int = DEFAULT_TTL_S,
        lease: PoolLease | None = None,
        wait_redis: redis_lib.Redis | None = None,
    ) -> None:
        """lease: fence every write with this pool lease's token (the pool leader's store; see the module doc);
        wait_redis: the client `wait` uses (default: `redis`)."""
        self.redis = redis
        self.wait_redis = wait_redis if wait_redis is not None else redis
        self.ttl_s = ttl_s
        self.lease = lease
        self._fenced_put = redis.register_script(_FENCED_PUT) if lease is not None else None
        self._fenced_states = redis.register_script(_FENCED_STATES) if lease is not None else None

    def put(self, outcome: Outcome) -> None:
        self.put_many([outcome])

    def put_many(self, outcomes: Iterable[Outcome]) -> None:
        if self.lease is not None:
            self._put_fenced(list(outcomes))
            return
        pipe = self.redis.pipeline(transaction=True)
        for o in outcomes:
            state = JobState.COMPLETE if o.ok else JobState.FAILED
            pipe.set(keys.result_key(o.request_id), outcome_to_json(o), ex=self.ttl_s)
            pipe.set(keys.state_key(o.request_id), state.value, ex=self.ttl_s)
            pipe.rpush(keys.notify_key(o.request_id), _TOKEN)
            pipe.expire(keys.notify_key(o.request_id), self.ttl_s)
        pipe.execute()

    def _put_fenced(self, outcomes: list[Outcome]) -> None:
        assert self.lease is not None and self._fenced_put is not None
        if not outcomes:
            return
        script_keys: list[str] = self.lease.fence_keys()
        args: list[str | int | bytes] = [*self.lease.fence_args(), self.ttl_s]
        for o in outcomes:
            state = JobState.COMPLETE if o.ok else JobState.FAILED
            script_keys += [keys.result_key(o.request_id), keys.state_key(o.request_id), keys.notify_key(o.request_id)]
            args += [outcome_to_json(o), state.value]
        if not int(self._fenced_put(keys=script_keys, args=args)):
            raise self.lease.refused(f"storing {len(outcomes)} results")

    def get(self, request_id: str) -> Outcome | None:
        raw = self.redis.get(keys.result_key(request_id))
        return None if raw is None else outcome_from_json(raw)

    def has_many(self, request_ids: list[str]) -> list[bool]:
        """Whether each request already has a stored result (one round trip)."""
        if not request_ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.exists(keys.result_key(rid))
        return [bool(n) for n in pipe.execute()]

    def wait(self, request_id: str, timeout_s: float, *, known_unstored: bool = False) -> Outcome | None:
        """The outcome, waiting up to `timeout_s` for it; None on timeout. known_unstored: the caller has just read
        that no result is stored (`owner_and_outcome`): the wait starts on the notify list at once."""
        return self.wait_with_others(request_id, timeout_s, [], "", known_unstored=known_unstored)[0]

    def wait_with_others(
        self, request_id: str, timeout_s: float, others: list[str], tenant_id: str, *, known_unstored: bool = False
    ) -> tuple[Outcome | None, list[Outcome]]:
        """`wait`, and the outcomes `finished_of(others, tenant_id)` read with the result in the same round trip."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        result_key, notify = keys.result_key(request_id), keys.notify_key(request_id)
        redis = self.wait_redis
        others_keys = [k for rid in others for k in (keys.request_owner(rid), keys.result_key(rid))]
        raw: bytes | str | None = None
        found: list[bytes | str | None] = [None] * len(others_keys)
        if not known_unstored:
            raw, *found = redis.mget([result_key, *others_keys])
        while raw is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # The notify list moved onto itself (a rotation): the wait wakes on the token and leaves it in place, so
            # every waiter on this id, and every later wait, wakes too, in one round trip. A timeout of 0 means
            # "forever": never pass less than 10 ms.
            slice_s = max(min(remaining, WAIT_SLICE_S), 0.01)
            redis.blmove(notify, notify, slice_s, "RIGHT", "LEFT")  # type: ignore[arg-type]  # Redis takes fractions
            raw, *found = redis.mget([result_key, *others_keys])
        return None if raw is None else outcome_from_json(raw), _owned_outcomes(found, tenant_id)

    def owner_and_outcome(self, request_id: str) -> tuple[str | None, Outcome | None]:
        """The tenant that submitted the request (its owner key, service/submit.py; None: no such request) and its
        stored outcome (None: not finished), in one round trip."""
        owner, raw = self.redis.mget([keys.request_owner(request_id), keys.result_key(request_id)])
        return None if owner is None else text(owner), None if raw is None else outcome_from_json(raw)

    def finished_of(self, request_ids: list[str], tenant_id: str) -> list[Outcome]:
        """The stored outcomes of those of `request_ids` that `tenant_id` submitted and that are finished (one MGET);
        an unknown id, another tenant's or one not finished is left out."""
        if not request_ids:
            return []
        raw = self.redis.mget([k for rid in request_ids for k in (keys.request_owner(rid), keys.result_key(rid))])
        return _owned_outcomes(raw, tenant_id)

    def result_and_state(self, request_id: str) -> tuple[Outcome | None, JobState | None]:
        """The result and the job state read together (one MGET): `put` writes both in one MULTI, so a finished state
        never comes without its result here (reading them one after the other could see the state of a result that
        landed in between, and answer "complete" with nothing)."""
        raw_result, raw_state = self.redis.mget([keys.result_key(request_id), keys.state_key(request_id)])
        outcome = None if raw_result is None else outcome_from_json(raw_result)
        return outcome, None if raw_state is None else JobState(text(raw_state))

    def set_state(self, request_id: str, state: JobState) -> None:
        self.set_states([request_id], state)

    def set_states(self, request_ids: Iterable[str], state: JobState) -> None:
        if self.lease is not None:
            assert self._fenced_states is not None
            state_keys = [keys.state_key(rid) for rid in request_ids]
            if not state_keys:
                return
            args = [*self.lease.fence_args(), self.ttl_s, JobState(state).value]
            if not int(self._fenced_states(keys=self.lease.fence_keys() + state_keys, args=args)):
                raise self.lease.refused(f"setting {len(state_keys)} job states")
            return
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.set(keys.state_key(rid), JobState(state).value, ex=self.ttl_s)
        pipe.execute()

    def state(self, request_id: str) -> JobState | None:
        raw = self.redis.get(keys.state_key(request_id))
        if raw is None:
            return None
        return JobState(text(raw))


def _owned_outcomes(owners_and_results: Sequence[bytes | str | None], tenant_id: str) -> list[Outcome]:
    """From an MGET of (owner key, result key) pairs: the stored outcomes that `tenant_id` owns."""
    pairs = zip(owners_and_results[::2], owners_and_results[1::2], strict=True)
    return [outcome_from_json(result) for owner, result in pairs
            if result is not None and owner is not None and text(owner) == tenant_id]  # fmt: skip

"""Moving an adapter from one pool to another in Redis (the pool side: pool/handoff.py; the order: service/moves.py).

Three small records per pool (queue/keys.py):
- move orders (`loraplex:pool:{pool}:move_orders`, adapter -> target pool): asked by an operator, read by the pool's
  dispatcher, which hands the adapter over between two plans;
- forwarding addresses (`...:moved`, adapter -> target pool): set by the hand-over, so an entry a gateway still queues
  on the old pool (it read the adapter's pool just before the move) is forwarded to the new one;
- adopt orders (`...:adopt`, a set): adapters handed to this pool; it adopts each from its durable snapshot and the
  request log the hand-over gave it, when it first meets one of its requests (or at its next start).

`hand_over` is one script, fenced by the source pool's lease (a deposed holder moves nothing): the adapter's request
log goes from the source's key to the target's, its unanswered entries from the source's tenant stream to the
target's (same request ids and payloads, so their futures resolve when the target answers them; the queued-token
counts follow), the forwarding address and the adopt order are written, the move order is cleared. One entry moves
at most once: it is added to the target only when this call deleted it from the source (as the ack script does), so a
script run twice, or a forward racing the hand-over, never queues a request twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import redis as redis_lib

from loraplex.queue import keys
from loraplex.queue.envelope import TOKENS_FIELD, decode
from loraplex.queue.lease import HELD_LUA, PoolLease
from loraplex.queue.redis_text import text

# Moves one entry of a tenant's stream on one pool to the same tenant's stream on another; 1 if this call moved it.
# Keys are built here from the pools' names (ARGV), as the ack script builds the request-log keys.
_MOVE_ENTRY = (
    """
local function stream_of(pool, tenant) return PREFIX .. 'pool:' .. pool .. ':tenant:' .. tenant .. ':requests' end
local function move_entry(src_pool, dst_pool, tenant, id, group)
  local src, dst = stream_of(src_pool, tenant), stream_of(dst_pool, tenant)
  local entry = redis.call('XRANGE', src, id, id)
  pcall(redis.call, 'XACK', src, group, id)
  if not entry[1] then return 0 end
  if redis.call('XDEL', src, id) == 0 then return 0 end
  local fields = entry[1][2]
  local tokens = 0
  for j = 1, #fields, 2 do
    if fields[j] == '"""
    + TOKENS_FIELD
    + """' then tokens = tonumber(fields[j + 1]) or 0 end
  end
  redis.call('XADD', dst, '*', unpack(fields))
  if tokens > 0 then
    local src_tokens = PREFIX .. 'pool:' .. src_pool .. ':queued_tokens'
    if redis.call('HINCRBY', src_tokens, tenant, -tokens) <= 0 then redis.call('HDEL', src_tokens, tenant) end
    redis.call('HINCRBY', PREFIX .. 'pool:' .. dst_pool .. ':queued_tokens', tenant, tokens)
  end
  if redis.call('SADD', PREFIX .. 'pool:' .. dst_pool .. ':tenants', tenant) == 1 then
    redis.call('XADD', PREFIX .. 'pool:' .. dst_pool .. ':doorbell', 'MAXLEN', '~', '64', '*', 'tenant', tenant)
  end
  return 1
end
"""
).replace("PREFIX", "'" + keys.PREFIX + "'")

# KEYS[1], KEYS[2]: the source pool's lease and token counter (HELD_LUA). ARGV[1..3]: the fence ("" in ARGV[1]: not
# fenced), ARGV[4] source pool, ARGV[5] target pool, ARGV[6] model_id, ARGV[7] tenant, ARGV[8] consumer group,
# ARGV[9..] the adapter's entry ids on the source's tenant stream. Returns the entries moved, or -1 (fence refused).
_HAND_OVER = (
    HELD_LUA
    + _MOVE_ENTRY
    + """
if ARGV[1] ~= '' and not held() then return -1 end
local src, dst, model, tenant, group = ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local P = PREFIX .. 'pool:'
local src_log, dst_log = P .. src .. ':replay:' .. model, P .. dst .. ':replay:' .. model
if redis.call('EXISTS', src_log) == 1 then
  redis.call('ZUNIONSTORE', dst_log, 2, dst_log, src_log, 'AGGREGATE', 'MIN')
  redis.call('DEL', src_log)
end
redis.call('SREM', P .. src .. ':replay_adapters', model)
redis.call('SADD', P .. dst .. ':replay_adapters', model)
redis.call('SREM', P .. src .. ':adopt', model)
redis.call('SADD', P .. dst .. ':adopt', model)
redis.call('HSET', P .. src .. ':moved', model, dst)
redis.call('HDEL', P .. dst .. ':moved', model)
redis.call('HDEL', P .. src .. ':move_orders', model)
local moved = 0
for i = 9, #ARGV do moved = moved + move_entry(src, dst, tenant, ARGV[i], group) end
return moved
"""
).replace("PREFIX", "'" + keys.PREFIX + "'")

# ARGV[1] source pool, ARGV[2] model_id, ARGV[3] tenant, ARGV[4] entry id, ARGV[5] group. Returns the pool the
# adapter moved to (the entry moved there, or was gone already), or false: the adapter has not moved from this pool.
_FORWARD = (
    _MOVE_ENTRY
    + """
local target = redis.call('HGET', PREFIX .. 'pool:' .. ARGV[1] .. ':moved', ARGV[2])
if not target then return false end
move_entry(ARGV[1], target, ARGV[3], ARGV[4], ARGV[5])
return target
"""
).replace("PREFIX", "'" + keys.PREFIX + "'")


def order_move(redis: redis_lib.Redis, source: str, model_id: str, target: str) -> None:
    """Ask `source` to hand `model_id` over to `target` (its dispatcher does it between two plans)."""
    pipe = redis.pipeline()
    pipe.hset(keys.move_orders(source), model_id, target)
    pipe.xadd(keys.pool_doorbell(source), {"move": model_id}, maxlen=64, approximate=True)  # wakes a blocked read
    pipe.execute()


def move_orders(redis: redis_lib.Redis, pool: str) -> dict[str, str]:
    return {text(k): text(v) for k, v in redis.hgetall(keys.move_orders(pool)).items()}


def moved_to(redis: redis_lib.Redis, pool: str, model_id: str) -> str | None:
    """Where the adapter went when it left `pool` (None: it has not left it)."""
    raw = redis.hget(keys.moved_adapters(pool), model_id)
    return text(raw) if raw is not None else None


def moved_away(redis: redis_lib.Redis, pool: str) -> dict[str, str]:
    return {text(k): text(v) for k, v in redis.hgetall(keys.moved_adapters(pool)).items()}


def meet(redis: redis_lib.Redis, pool: str, model_id: str) -> tuple[str | None, bool]:
    """(where it moved from `pool`, or None; whether it was handed to `pool` and waits to be adopted)."""
    pipe = redis.pipeline(transaction=False)
    pipe.hget(keys.moved_adapters(pool), model_id)
    pipe.sismember(keys.adopt_orders(pool), model_id)
    moved, adopt = pipe.execute()
    return (text(moved) if moved is not None else None), bool(adopt)


def adopt_orders(redis: redis_lib.Redis, pool: str) -> list[str]:
    return sorted(text(m) for m in redis.smembers(keys.adopt_orders(pool)))


def adopted(redis: redis_lib.Redis, pool: str, model_ids: Sequence[str]) -> None:
    """The pool adopted these adapters: their adopt orders are done."""
    if model_ids:
        redis.srem(keys.adopt_orders(pool), *model_ids)


def entries_of(redis: redis_lib.Redis, pool: str, tenant_id: str, model_id: str) -> list[str]:
    """The ids of the adapter's entries on the tenant's stream of `pool` (queued or read and not yet acked)."""
    out = []
    rows = cast(list[tuple[bytes, Mapping[Any, Any]]], redis.xrange(keys.request_stream(pool, tenant_id)))
    for sid, fields in rows:
        try:
            env = decode(fields)
        except Exception:  # noqa: BLE001 - an entry that does not decode is the consumer's to drop
            continue
        if env.model_id == model_id:
            out.append(text(sid))
    return out


class Handoffs:
    """The two scripts, registered once per client."""

    def __init__(self, redis: redis_lib.Redis) -> None:
        self.redis = redis
        self._hand_over = redis.register_script(_HAND_OVER)
        self._forward = redis.register_script(_FORWARD)

    def hand_over(
        self, source: str, target: str, tenant_id: str, model_id: str, entry_ids: Sequence[str], lease: PoolLease | None
    ) -> int:
        """Hand the adapter over (see the module doc); returns how many of `entry_ids` moved to the target's stream.
        LeaseLostError (the lease marked lost) when `lease` no longer holds the source pool."""
        fence: list[str | int] = list(lease.fence_args()) if lease is not None else ["", 0, "0"]
        script_keys = (
            lease.fence_keys() if lease is not None else [keys.pool_leader(source), keys.pool_leader_token(source)]
        )
        argv = [*fence, source, target, model_id, tenant_id, keys.CONSUMER_GROUP, *entry_ids]
        moved = int(self._hand_over(keys=script_keys, args=argv))
        if moved < 0:
            assert lease is not None
            raise lease.refused(f"handing adapter {model_id} over to pool {target}")
        return moved

    def forward(self, source: str, tenant_id: str, model_id: str, entry_id: str) -> str | None:
        """Forward one entry of an adapter that left `source` to the pool it went to; that pool's name (the entry is
        there now, or was moved before), or None: the adapter has not left `source`, the entry stays."""
        raw = self._forward(keys=[], args=[source, model_id, tenant_id, entry_id, keys.CONSUMER_GROUP])
        return text(raw) if raw else None

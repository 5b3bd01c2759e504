"""One leader per pool: a lease in Redis with a fencing token.

The lease key (`keys.pool_leader`) holds "<token> <holder>" with a TTL; the token comes from a per-pool counter
(`keys.pool_leader_token`, INCR on every acquisition, never expires), so each acquisition has a larger token than every
earlier one. Every step is one Lua script (atomic on the server):
- `try_acquire`: when no lease is live, INCR the counter (raised above `floor`, the last token the database saw, in
  case Redis lost its data) and SET the lease NX PX ttl;
- `renew`: PEXPIRE, only while the lease still holds our value;
- `release`: DEL, only if ours;
- fenced writes (queue/results.py) run the same "still ours?" check inside their own script before writing.

"Still ours" is: the lease holds our value; or the lease is gone and nobody acquired it since (the counter still holds
our token, or Redis lost the counter along with everything else), in which case the check re-claims it under the same
token. Any acquisition by another process moves the counter, so a deposed holder can never pass the check again.

`keep()` starts a thread that renews every ttl/3. A refused renewal or a refused fenced write marks the lease lost
(`lost`, and the `on_lost` callbacks run once); the holder must stop writing. A Redis that cannot be reached is not a
loss (nobody else can take the lease from that Redis either): the thread keeps trying.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis as redis_lib

from loraplex.errors import LeaseLostError
from loraplex.queue import keys
from loraplex.queue.redis_text import text

log = logging.getLogger(__name__)

# A Lua function for fenced scripts: KEYS[1] lease, KEYS[2] counter; ARGV[1] our value, ARGV[2] ttl ms, ARGV[3] token.
HELD_LUA = """
local function held()
  local cur = redis.call('GET', KEYS[1])
  if cur == ARGV[1] then return true end
  if cur then return false end
  local counter = redis.call('GET', KEYS[2])
  if counter and counter ~= ARGV[3] then return false end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  if not counter then redis.call('SET', KEYS[2], ARGV[3]) end
  return true
end
"""

_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then return {0, cur} end
local token = redis.call('INCR', KEYS[2])
local floor = tonumber(ARGV[3])
if token <= floor then
  token = floor + 1
  redis.call('SET', KEYS[2], string.format('%d', token))
end
local value = string.format('%d', token) .. ' ' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2])
return {token, value}
"""

_RENEW = (
    HELD_LUA
    + """
if not held() then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# How often a waiting holder's "lease refused" is worth a log line, and a Redis outage's warning.
_WARN_EVERY_S = 5.0


def default_holder() -> str:
    """host:pid:random, so two processes (or two runs of one pid) never share a holder name."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True)
class LeaseValue:
    """Who holds a pool's lease now."""

    token: int
    holder: str

    @classmethod
    def parse(cls, raw: bytes | str) -> LeaseValue:
        token, _, holder = text(raw).partition(" ")
        return cls(int(token), holder)


class PoolLease:
    def __init__(self, redis: redis_lib.Redis, pool: str, ttl_s: float, holder: str | None = None) -> None:
        self.redis = redis
        self.pool = pool
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.holder = holder or default_holder()
        self.key = keys.pool_leader(pool)
        self.counter_key = keys.pool_leader_token(pool)
        self.token: int | None = None  # ours, once acquired
        self.value: str | None = None  # "<token> <holder>", once acquired
        self.lost_reason = ""
        self._lost = threading.Event()
        self._released = threading.Event()
        self._on_lost: list[Callable[[str], None]] = []
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    # -- the lease ------------------------------------------------------------------------------------------------
    def try_acquire(self, floor: int = 0) -> bool:
        """Take the lease if nobody holds it; its token is above `floor` (and above every earlier token)."""
        token, value = self._acquire(keys=[self.key, self.counter_key], args=[self.holder, self.ttl_ms, int(floor)])
        if int(token) == 0:
            return False
        self.token, self.value = int(token), text(value)
        self._lost.clear()
        self._released.clear()
        self.lost_reason = ""
        return True

    def current(self) -> LeaseValue | None:
        """The live lease's token and holder (anyone's), or None."""
        raw = self.redis.get(self.key)
        return None if raw is None else LeaseValue.parse(raw)

    def renew(self) -> bool:
        """Extend our lease by the TTL; False when it is no longer ours (then it is marked lost)."""
        if self.value is None:
            return False
        if int(self._renew(keys=self.fence_keys(), args=self.fence_args())):
            return True
        self.mark_lost(f"renewing refused: the lease is {self._describe_current()}")
        return False

    def release(self) -> bool:
        """Give the lease up (only if it is still ours), so a waiting pool process takes over at once."""
        self._released.set()
        if self.value is None:
            return False
        return bool(int(self._release(keys=[self.key], args=[self.value])))

    def break_dead(self, dead: LeaseValue) -> bool:
        """Delete another holder's lease, only if it still holds exactly `dead` (its holder is known to be dead, e.g.
        a killed process of this host): the waiting process then takes over without waiting out the TTL. Safe even
        if that were wrong: the old holder's writes are fenced by its token, which the next acquisition passes."""
        return bool(int(self._release(keys=[self.key], args=[f"{dead.token} {dead.holder}"])))

    # -- fencing --------------------------------------------------------------------------------------------------
    def fence_keys(self) -> list[str]:
        """KEYS[1], KEYS[2] of a script that starts with HELD_LUA."""
        return [self.key, self.counter_key]

    def fence_args(self) -> list[str | int]:
        """ARGV[1..3] of a script that starts with HELD_LUA."""
        if self.value is None or self.token is None:
            raise LeaseLostError(f"pool {self.pool}: this process never held the lease")
        return [self.value, self.ttl_ms, str(self.token)]

    def refused(self, what: str) -> LeaseLostError:
        """A fenced write was refused: mark the lease lost; returns the error to raise."""
        reason = f"{what} refused: the lease is {self._describe_current()}"
        self.mark_lost(reason)
        return LeaseLostError(f"pool {self.pool}: token {self.token} no longer leads it ({reason})")

    # -- loss -----------------------------------------------------------------------------------------------------
    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once, when the lease is found lost."""
        self._on_lost.append(callback)

    def mark_lost(self, reason: str) -> None:
        if self._lost.is_set():
            return
        self.lost_reason = reason
        self._lost.set()
        for callback in self._on_lost:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - every callback runs
                log.exception("a lease-lost callback failed")

    def keep(self) -> threading.Thread:
        """Renew every ttl/3 in a daemon thread, until released or lost."""
        thread = threading.Thread(target=self._keep, name=f"lease-{self.pool}", daemon=True)
        thread.start()
        return thread

    def _keep(self) -> None:
        interval = self.ttl_ms / 3000
        warned = 0.0
        while not self._released.wait(interval) and not self.lost:
            try:
                self.renew()
            except redis_lib.RedisError as exc:  # unreachable: nobody else can take it from this Redis either
                if time.monotonic() - warned >= _WARN_EVERY_S:
                    warned = time.monotonic()
                    log.warning("pool %s: renewing the lease failed (%s); retrying", self.pool, exc)

    def _describe_current(self) -> str:
        try:
            now = self.current()
        except redis_lib.RedisError:
            return "unknown (redis unavailable)"
        return "free" if now is None else f"held by {now.holder} (token {now.token})"

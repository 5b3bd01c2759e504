"""One run per pipeline: the Celery task holds a lease in Redis (queue/keys.pipeline_runner) while it trains, renewed
by a thread every third of its TTL. The broker hands an unacked task out again after its visibility timeout, also
while the first run still lives; that second delivery finds the lease held and comes back later. A run that loses
its lease (it stalled past the TTL and another run took over) stops before its next step. The tenant's claim to run
a pipeline at all (tenant_slots.py) rides on the lease: renewed with it, given back with it."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading

import redis

from loraplex.pipelines.tenant_slots import TenantSlots
from loraplex.queue import keys

_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class RunnerLease:
    def __init__(self, client: redis.Redis, pipeline_id: str, ttl_s: float) -> None:
        self._redis = client
        self._pipeline_id = pipeline_id
        self._key = keys.pipeline_runner(pipeline_id)
        self._slots: TenantSlots | None = None
        # Who holds it, for operators (and tests) reading the key: host:pid:random.
        self._token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def acquire(self) -> bool:
        """Take the lease if nobody holds it, and start renewing it; False when another run holds it."""
        if not self._redis.set(self._key, self._token, nx=True, px=self._ttl_ms):
            return False
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease {self._key}", daemon=True)
        self._thread.start()
        return True

    def hold_slot(self, slots: TenantSlots) -> bool:
        """Take the tenant's claim for this pipeline (after `acquire`); from then on it is renewed and given back
        with the lease. False (nothing held) when the tenant's other pipelines hold every claim."""
        if not slots.take(self._pipeline_id):
            return False
        self._slots = slots
        return True

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._ttl_ms / 3000):
            try:
                if not self._redis.eval(_RENEW, 1, self._key, self._token, self._ttl_ms):
                    self.lost = True
                    return
                if self._slots is not None:
                    self._slots.renew(self._pipeline_id)
            except redis.RedisError:
                continue  # Redis briefly away: the next round tries again (the TTL leaves two more)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):  # else it lapses by itself
            if self._slots is not None:
                self._slots.give_back(self._pipeline_id)
            self._redis.eval(_RELEASE, 1, self._key, self._token)

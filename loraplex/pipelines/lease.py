"""One run per pipeline: the Celery task holds a lease in Redis (queue/keys.pipeline_runner) while it trains, renewed
by a thread every third of its TTL. The broker hands an unacked task out again after its visibility timeout, also
while the first run still lives; that second delivery finds the lease held and comes back later. A run that loses
its lease (it stalled past the TTL and another run took over) stops before its next step."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading

import redis

from loraplex.queue import keys

_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class RunnerLease:
    def __init__(self, client: redis.Redis, pipeline_id: str, ttl_s: float) -> None:
        self._redis = client
        self._key = keys.pipeline_runner(pipeline_id)
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

    def _renew_loop(self) -> None:
        while not self._stop.wait(self._ttl_ms / 3000):
            try:
                if not self._redis.eval(_RENEW, 1, self._key, self._token, self._ttl_ms):
                    self.lost = True
                    return
            except redis.RedisError:
                continue  # Redis briefly away: the next round tries again (the TTL leaves two more)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(redis.RedisError):  # else it lapses by itself
            self._redis.eval(_RELEASE, 1, self._key, self._token)

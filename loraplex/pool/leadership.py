"""One leader per pool, the pool process's side (rank 0, before it loads the model; pool/process.py calls it).

`acquire_leadership` takes the pool's lease in Redis (queue/lease.py). While another pool process holds a live lease it
waits, logging one line at most every few seconds, and takes over when that lease lapses (its holder was killed) or
is released (its holder stopped), or at once when the holder is a process of this host that no longer exists (a
SIGKILLed pool the supervisor is replacing: `holder_is_dead`); with `LORAPLEX_LEADER_WAIT=false` it exits at once with
that line instead. Having
the lease, it writes its fencing token to the pool's SQL row (`PoolRepository.take_leadership`, which also clears the
residency rows of the earlier run), then renews the lease every ttl/3 in a thread.

From then on every write of a plan is fenced by the token: results and job states in Redis (queue/results.py, a Lua
check of the lease), SQL records and checkpoint rows (pool/records.check_leader, the pools row). A refused write or
renewal marks the lease lost; the pool process then stops its dispatcher and exits non-zero.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import redis as redis_lib

from loraplex.queue.lease import PoolLease
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import PoolRepository, ResidencyRepository, unit_of_work

log = logging.getLogger("loraplex.pool")

WAITING_LOG_EVERY_S = 5.0


def waiting_message(pool: str, holder: str, token: int) -> str:
    return f"pool {pool}: another pool process (holder {holder}, token {token}) leads it; waiting for its lease to lapse"


def holder_is_dead(holder: str) -> bool:
    """The holder ("host:pid:random", queue/lease.default_holder) is a process of this host that no longer exists. A
    zombie (dead, not yet reaped) still counts as alive: its parent may not know yet."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def acquire_leadership(settings: Settings, stop: threading.Event) -> PoolLease | None:
    """The pool's lease, held and kept; None when `stop` was set while waiting for it. Exits (SystemExit, non-zero,
    with the message) when another process leads the pool and `settings.leader_wait` is off."""
    redis = redis_lib.Redis.from_url(settings.redis_url)
    lease = PoolLease(redis, settings.pool, ttl_s=settings.leader_lease_seconds)
    db = make_db_engine(settings.resolved_database_url)
    sessions = session_factory(db)
    poll_s = min(1.0, max(0.05, settings.leader_lease_seconds / 10))
    world = int(os.environ.get("WORLD_SIZE", settings.world_size))
    last_log, last_holder = float("-inf"), ""
    try:
        while not stop.is_set():
            try:
                with sessions() as session:  # the token must pass the last leader's, even if Redis lost the counter
                    floor = PoolRepository(session).leader_token(settings.pool) or 0
                if lease.try_acquire(floor):
                    with unit_of_work(sessions) as session:
                        took = PoolRepository(session).take_leadership(
                            settings.pool, lease.token or 0, settings.base_model, world, settings.slots
                        )
                        if took:  # the adapters of an earlier run of this pool are gone, and so are their rows
                            ResidencyRepository(session).clear(settings.pool)
                    if took:
                        break
                    lease.release()  # a newer leader is in SQL (Redis lost its counter): try again above its token
                    continue
                holder = lease.current()
            except (redis_lib.ConnectionError, redis_lib.TimeoutError) as exc:
                if time.monotonic() - last_log >= WAITING_LOG_EVERY_S:
                    last_log = time.monotonic()
                    log.warning("pool %s: redis unavailable (%s) while taking the lease; retrying", settings.pool, exc)
                stop.wait(poll_s)
                continue
            if holder is not None and holder_is_dead(holder.holder) and lease.break_dead(holder):
                log.warning("pool %s: the lease holder %s (token %d) is a dead process of this host; taking over now",
                            settings.pool, holder.holder, holder.token)  # fmt: skip
                continue
            if holder is not None:
                message = waiting_message(settings.pool, holder.holder, holder.token)
                if not settings.leader_wait:
                    raise SystemExit(message.replace("waiting for its lease to lapse", "exiting (LORAPLEX_LEADER_WAIT=false)"))
                if holder.holder != last_holder or time.monotonic() - last_log >= WAITING_LOG_EVERY_S:
                    log.warning("%s", message)
                    last_log, last_holder = time.monotonic(), holder.holder
            stop.wait(poll_s)
        else:
            return None
    finally:
        db.dispose()
    lease.keep()
    log.info("pool %s: leading it (holder %s, fencing token %d, lease %g s)", settings.pool, lease.holder, lease.token,
             settings.leader_lease_seconds)  # fmt: skip
    return lease

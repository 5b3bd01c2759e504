"""The dispatcher's two helper stages, so the pool is never idle for I/O it could do beside the engine:
- `Prefetcher`: a thread that reads and decodes the request stream while a plan runs (a bounded queue: when the pool
  falls behind, reading stops rather than buffering without end);
- `Finisher`: one thread that runs each plan's finish step (dispatch/hooks.FinishStep: the pool's writes its SQL record,
  then stores the results and acks), plan after plan in order, while the next plan runs. Inline (no thread) when the
  loop is driven step by step (`run_once` in tests).

Both ride out a Redis outage: the reader retries with backoff, then reads this consumer's pending entries again (a
read's answer may have been lost with the connection), and recreates a consumer group that a Redis restart lost; a
finisher write (`retry_redis`) waits for Redis up to REDIS_OUTAGE_S; logging about it is rate-limited.
The plan's SQL transaction (pool/finish.py) rides out a database outage the same way (storage/outage.retry_database),
so a result is still stored only after its SQL record.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Any, TypeVar

import redis as redis_lib

from loraplex.errors import LeaseLostError
from loraplex.protocol import RequestKind
from loraplex.queue.consumer import Consumer, Entry
from loraplex.runtime.logutil import Backoff, RateLimitedLog
from loraplex.runtime.retry import retry_while_unreachable

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long a finisher write waits for Redis to come back before giving up (the entries stay in the stream unacked).
REDIS_OUTAGE_S = 600.0


def lost_group(exc: redis_lib.ResponseError) -> bool:
    """Redis answered NOGROUP: the stream's consumer group is gone (a Redis restarted without its data)."""
    return str(exc).startswith("NOGROUP")


def retry_redis(call: Callable[[], object], what: str, warn: RateLimitedLog, outage_s: float = REDIS_OUTAGE_S) -> None:
    """`call()`, retried with backoff while Redis is unreachable, for up to `outage_s` seconds; then it raises."""

    def unreachable(exc: Exception) -> str | None:
        if isinstance(exc, (redis_lib.ConnectionError, redis_lib.TimeoutError)):
            return f"redis unavailable while {what} ({exc}); retrying"
        return None

    retry_while_unreachable(call, unreachable, warn, outage_s, Backoff())


class Prefetcher:
    def __init__(
        self, consumer: Consumer, block_ms: int, count: int, depth: int = 4, others_waiting: threading.Event | None = None
    ) -> None:
        self._consumer = consumer
        self._block_ms = block_ms
        self._count = count
        self._queue: queue.Queue[list[Entry]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # set when entries other than samples were read and not taken yet: a sample slice then ends early
        self.others_waiting = others_waiting if others_waiting is not None else threading.Event()
        self._thread = threading.Thread(target=self._run, name="dispatch-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff, warn = Backoff(), RateLimitedLog(log, every_s=5.0)
        while not self._stop.is_set():
            try:
                entries = self._consumer.read(self._block_ms, self._count)
                backoff.reset()
            except (redis_lib.ConnectionError, redis_lib.TimeoutError) as exc:
                warn.warning("redis unavailable (%s); reading resumes when it is back", exc)
                self._consumer.rescan_pending()  # what a read delivered and lost with the connection comes back
                self._stop.wait(backoff.next())
                continue
            except redis_lib.ResponseError as exc:
                if lost_group(exc):  # Redis came back empty: the stream's group is gone; make it again
                    warn.warning("consumer group missing (redis restarted empty?); recreating it")
                    with suppress(redis_lib.RedisError):
                        self._consumer.ensure_group()
                else:
                    warn.error("reading the request stream failed: %s", exc)
                self._stop.wait(backoff.next())
                continue
            except Exception:  # noqa: BLE001 - keep reading; the loop must not lose its reader
                log.exception("reading the request stream failed")
                self._stop.wait(0.5)
                continue
            while entries and not self._stop.is_set():
                try:
                    self._queue.put(entries, timeout=0.1)
                    if any(env.kind != RequestKind.SAMPLE for _, env in entries):
                        self.others_waiting.set()
                    break
                except queue.Full:
                    continue

    def take(self, wait_s: float | None) -> list[Entry]:
        """Everything read so far; when there is nothing, wait up to `wait_s` (None: don't wait) for the next read."""
        out: list[Entry] = []
        self.others_waiting.clear()  # before taking: entries put from now on set it again
        try:
            if wait_s:
                out += self._queue.get(timeout=wait_s)
            while True:
                out += self._queue.get_nowait()
        except queue.Empty:
            pass
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Finisher:
    def __init__(self, background: bool) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dispatch-finish") if background else None
        self._last: Future[Any] | None = None
        self.warn = RateLimitedLog(log, every_s=5.0)  # this finisher's outage lines (its own: one per dispatcher)

    def submit(self, job: Callable[..., None], *args: Any) -> None:
        if self._pool is None:
            job(*args)
            return
        self._last = self._pool.submit(self._guarded, job, *args)

    def _guarded(self, job: Callable[..., None], *args: Any) -> None:
        try:
            job(*args)
        except LeaseLostError as exc:  # a deposed leader: nothing of this plan was written; the new leader redoes it
            log.error("finishing a plan refused: %s", exc)
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as exc:  # e.g. a RUNNING state lost: harmless
            self.warn.warning("redis unavailable: %s skipped (%s)", getattr(job, "__name__", job), exc)
        except Exception:  # noqa: BLE001 - the stream keeps the entries (not acked): a restart redelivers them
            log.exception("finishing a plan failed (%s)", getattr(job, "__name__", job))

    def drain(self) -> None:
        """Wait until every job submitted so far has run (one worker: the last one finishing means all did)."""
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

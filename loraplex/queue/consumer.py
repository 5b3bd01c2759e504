"""Read a pool's request stream through its consumer group (at-least-once: an entry stays pending until acked).

- `read` first returns this consumer's own pending entries (delivered before a crash, never acked), once, then new
  entries (">"). Pending entries the loop still holds are not re-read, so a live loop never sees one twice.
- `ack` = XACK + XDEL: an answered request leaves the stream entirely.
- `claim_stale` takes over entries another consumer read and left idle longer than `min_idle_ms` (it died): XAUTOCLAIM.
- An entry that fails to decode is acked at once, and its request (if a request_id can be read) gets a failed result,
  so one bad entry never blocks the stream.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, cast

import redis as redis_lib

from loraplex.errors import LoraplexError
from loraplex.protocol import Outcome
from loraplex.queue import keys
from loraplex.queue.envelope import Envelope, decode, request_id_of
from loraplex.queue.redis_text import text
from loraplex.queue.results import ResultStore

log = logging.getLogger(__name__)

Entry = tuple[str, Envelope]


class Consumer:
    def __init__(
        self, redis: redis_lib.Redis, pool: str, consumer_name: str, results: ResultStore | None = None
    ) -> None:
        self.redis = redis
        self.pool = pool
        self.name = consumer_name
        self.stream = keys.request_stream(pool)
        self.group = keys.CONSUMER_GROUP
        self.results = results or ResultStore(redis)
        # Where the pending-backlog scan stands; None once it has been drained.
        self._backlog_cursor: str | None = "0"
        self.ensure_group()

    def ensure_group(self) -> None:
        """Create the group (and the stream) if missing. Id "0": entries queued before any dispatcher started count."""
        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis_lib.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, block_ms: int | None = None, count: int = 100) -> list[Entry]:
        """Up to `count` entries: this consumer's un-acked backlog first (once), then new ones, waiting up to
        `block_ms` for new ones (None: don't wait; never 0, which Redis reads as "forever")."""
        if self._backlog_cursor is not None:
            raw = self._xreadgroup(self._backlog_cursor, count, None)
            if raw:
                self._backlog_cursor = raw[-1][0]
                return self._decode(raw)
            self._backlog_cursor = None
        return self._decode(self._xreadgroup(">", count, block_ms))

    def ack(self, stream_ids: Iterable[str]) -> None:
        ids = list(stream_ids)
        if not ids:
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(self.stream, self.group, *ids)
        pipe.xdel(self.stream, *ids)
        pipe.execute()

    def claim_stale(self, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Take over entries other consumers left pending longer than `min_idle_ms`."""
        raw: list[tuple[str, Mapping[Any, Any]]] = []
        cursor = "0-0"
        while len(raw) < count:
            reply = self.redis.xautoclaim(
                self.stream, self.group, self.name, min_idle_ms, cursor, count=count - len(raw)
            )
            cursor = text(reply[0])
            raw += [(text(sid), fields) for sid, fields in reply[1]]
            if cursor == "0-0":
                break
        return self._decode(raw)

    def pending_count(self) -> int:
        """Entries delivered to any consumer of the group and not yet acked."""
        return int(self.redis.xpending(self.stream, self.group)["pending"])

    def _xreadgroup(self, start: str, count: int, block_ms: int | None) -> list[tuple[str, Mapping[Any, Any]]]:
        if block_ms is not None and block_ms <= 0:
            block_ms = None
        try:
            reply = self.redis.xreadgroup(self.group, self.name, {self.stream: start}, count=count, block=block_ms)
        except redis_lib.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()  # the stream was deleted under us (FLUSHDB, an operator): recreate and read again
            reply = self.redis.xreadgroup(self.group, self.name, {self.stream: start}, count=count, block=block_ms)
        if isinstance(reply, dict):  # RESP3 clients answer {stream: [entries]}
            entries = [
                e for batch in reply.values() for e in (batch[0] if batch and isinstance(batch[0], list) else batch)
            ]
        else:
            entries = [e for _stream, batch in (reply or []) for e in batch]
        return [(text(sid), fields) for sid, fields in cast(list[tuple[bytes | str, Mapping[Any, Any]]], entries)]

    def _decode(self, raw: list[tuple[str, Mapping[Any, Any]]]) -> list[Entry]:
        good: list[Entry] = []
        bad: list[str] = []
        failed: list[Outcome] = []
        for sid, fields in raw:
            if not fields:  # deleted from the stream but still pending (acked half-way): just finish the ack
                bad.append(sid)
                continue
            try:
                good.append((sid, decode(fields)))
            except LoraplexError as exc:
                log.warning("dropping undecodable entry %s on %s: %s", sid, self.stream, exc)
                bad.append(sid)
                request_id = request_id_of(fields)
                if request_id:
                    failed.append(Outcome(request_id=request_id, error_type="InvalidRequestError", error=str(exc)))
        if failed:
            self.results.put_many(failed)  # answer first, then ack: a crash in between re-reads, never loses
        self.ack(bad)
        return good

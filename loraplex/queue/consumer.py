"""Read a pool's request streams (one per tenant) through their consumer group (at-least-once: an entry stays pending
until acked).

- `read` first returns this consumer's own pending entries (delivered before a crash, never acked), once per stream,
  and again after `rescan_pending` (a Redis error: a read whose answer was lost, or entries dropped by a caller whose
  next call failed, are pending to this consumer and no ">" read returns them), then new entries (">") of every
  tenant's stream side by side: at most `count` of each per call, and none of a
  tenant that has `window` entries read and not yet acked (the dispatcher holds enough of its requests). So one
  tenant's deep backlog never stands between another tenant and the dispatcher. A blocked read also watches the pool's
  doorbell stream, so a tenant's first stream wakes it; the size of the pool's tenants set comes back in the same round
  trip, and the set is read again only when the doorbell rang or the size changed.
- `ack` = XACK + XDEL, and the tenant's queued-token count gives back the entry's tokens (one script: exact even when
  an entry is acked twice): an answered request leaves its stream entirely, and (when the dispatcher says so) moves
  to its adapter's durable request log in the same script (queue/replay_log.py).
- `claim_stale` takes over entries another consumer read and left idle longer than `min_idle_ms` (it died): XAUTOCLAIM;
  `keep` refreshes the idle time of entries this consumer still holds, so that rule never takes a running request.
- An entry that fails to decode is acked at once, and its request (if a request_id can be read) gets a failed result,
  so one bad entry never blocks a stream.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, cast

import redis as redis_lib

from loraplex.errors import InvalidRequestError, LoraplexError
from loraplex.protocol import Outcome
from loraplex.queue import keys
from loraplex.queue.envelope import TOKENS_FIELD, Envelope, decode, request_id_of
from loraplex.queue.handoff import Handoffs
from loraplex.queue.redis_text import text
from loraplex.queue.results import ResultStore

log = logging.getLogger(__name__)


class EntryRef(NamedTuple):
    """Where an entry sits: its tenant's stream and its id there (ids are unique per stream only)."""

    stream: str
    id: str


Entry = tuple[EntryRef, Envelope]
RawEntry = tuple[EntryRef, Mapping[Any, Any]]

# KEYS: stream, queued-tokens hash, the pool's replay-adapters set. ARGV: group, tenant_id, the replay-log key prefix,
# then per entry 4 values: id, log action, model_id, seq_id. Per entry: its tokens and envelope (read before it goes),
# XACK, XDEL; the tokens go back only for entries this call deleted. The log action (queue/replay_log.py), done in the
# same script so an answered request is never out of both the stream and the log: "a" / "s" add the envelope to the
# adapter's request log (to apply on replay / only to advance its seq_id), "x" drops the adapter's log (deleted).
_ACK = """
local back = 0
for i = 4, #ARGV, 4 do
  local id, action, model, seq = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local entry = redis.call('XRANGE', KEYS[1], id, id)
  local tokens = 0
  local data = nil
  if entry[1] then
    local fields = entry[1][2]
    for j = 1, #fields, 2 do
      if fields[j] == '""" + TOKENS_FIELD + """' then tokens = tonumber(fields[j + 1]) or 0 end
      if fields[j] == 'data' then data = fields[j + 1] end
    end
  end
  redis.call('XACK', KEYS[1], ARGV[1], id)
  if redis.call('XDEL', KEYS[1], id) == 1 then
    back = back + tokens
    if (action == 'a' or action == 's') and data then
      redis.call('ZADD', ARGV[3] .. model, tonumber(seq), action .. data)
      redis.call('SADD', KEYS[3], model)
    end
  end
  if action == 'x' then
    redis.call('DEL', ARGV[3] .. model)
    redis.call('SREM', KEYS[3], model)
  end
end
if back > 0 then
  if redis.call('HINCRBY', KEYS[2], ARGV[2], -back) <= 0 then redis.call('HDEL', KEYS[2], ARGV[2]) end
end
return back
"""

# What the ack script does with an entry's envelope (see _ACK): nothing, log it (apply on replay / only advance), or
# drop its adapter's log.
LogAction = tuple[str, str, int]  # (action "a" | "s" | "x", model_id, seq_id)


class Consumer:
    def __init__(
        self,
        redis: redis_lib.Redis,
        pool: str,
        consumer_name: str,
        results: ResultStore | None = None,
        *,
        window: int = 1 << 30,
    ) -> None:
        """window: the most entries of one tenant read and not yet acked; its new entries wait in Redis past it."""
        self.redis = redis
        self.pool = pool
        self.name = consumer_name
        self.group = keys.CONSUMER_GROUP
        self.results = results or ResultStore(redis)
        self.window = window
        self._unacked: dict[str, set[str]] = defaultdict(set)  # tenant -> ids read and not acked (read/ack threads)
        self._lock = threading.Lock()
        self._tenants_key = keys.pool_tenants(pool)
        self._doorbell = keys.pool_doorbell(pool)
        self._tokens_key = keys.queued_tokens(pool)
        self._replay_prefix = keys.replay_log_prefix(pool)
        self._replay_set = keys.replay_adapters(pool)
        # tenant -> where the scan of this consumer's pending backlog on its stream stands (None once drained)
        self._backlog: dict[str, str | None] = {}
        self._rescan = False  # set from any thread (rescan_pending), acted on by the reading one
        self._ack_script = redis.register_script(_ACK)
        self._handoffs = Handoffs(redis)
        self._ensure_group(self._doorbell)
        self.refresh()

    def stream_of(self, tenant_id: str) -> str:
        return keys.request_stream(self.pool, tenant_id)

    def refresh(self) -> list[str]:
        """Pick up tenants whose stream appeared since the last call (their group made, their backlog to scan)."""
        tenants = {text(t) for t in self.redis.smembers(self._tenants_key)}
        new = sorted(tenants - self._backlog.keys())
        for tenant in new:
            self._ensure_group(self.stream_of(tenant))
            self._backlog[tenant] = "0"
        return new

    def ensure_group(self) -> None:
        """(Re)create the group on the doorbell and on every tenant stream this consumer knows (Redis came back
        empty: the streams, their groups and the tenants set are gone)."""
        for stream in (self._doorbell, *(self.stream_of(t) for t in self._backlog)):
            self._ensure_group(stream)

    def _ensure_group(self, stream: str) -> None:
        """Create the group (and the stream) if missing. Id "0": entries queued before any dispatcher started count."""
        try:
            self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
        except redis_lib.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def rescan_pending(self) -> None:
        """Scan this consumer's pending entries again on the next `read`: after a Redis error, entries delivered to it
        may never have reached its caller (an answer lost with the connection, or a caller's next call failed before
        it kept them); without this they would wait for the stale-entry claim (`claim_stale`, ~30 s). Entries it still
        holds come back too: the caller drops the ids it holds (the dispatcher does)."""
        self._rescan = True

    def read(self, block_ms: int | None = None, count: int = 100) -> list[Entry]:
        """Up to `count` entries of each tenant: this consumer's un-acked backlog first (once per stream, and again
        after `rescan_pending`), then new ones, waiting up to `block_ms` for some (None: don't wait; never 0, which
        Redis reads as "forever")."""
        if self._rescan:
            self._rescan = False
            self._backlog = dict.fromkeys(self._backlog, "0")
        for tenant, cursor in self._backlog.items():
            if cursor is None:
                continue
            _, raw = self._xreadgroup({self.stream_of(tenant): cursor}, count, None)
            if raw:
                self._backlog[tenant] = raw[-1][0].id
                return self._decode(raw)
            self._backlog[tenant] = None
        with self._lock:
            paused = {t for t, ids in self._unacked.items() if len(ids) >= self.window}
        streams = {self.stream_of(t): ">" for t in self._backlog if t not in paused}
        known = len(self._backlog)
        tenants, raw = self._xreadgroup({**streams, self._doorbell: ">"}, count, block_ms, count_tenants=True)
        rang = [ref for ref, _ in raw if ref.stream == self._doorbell]
        if rang:
            self.redis.xack(self._doorbell, self.group, *[ref.id for ref in rang])
            raw = [e for e in raw if e[0].stream != self._doorbell]
        if (rang or tenants != known) and self.refresh() and not raw:  # a new tenant's stream: read it at once
            return self.read(None, count)
        return self._decode(raw)

    def ack(self, refs: Iterable[EntryRef], log: Mapping[EntryRef, LogAction] | None = None) -> None:
        """Ack and delete entries; `log`: what to do with some of them in the request log (see _ACK)."""
        log = log or {}
        by_stream: dict[str, list[str]] = defaultdict(list)
        for ref in refs:
            action, model_id, seq_id = log.get(ref, ("", "", 0))
            by_stream[ref.stream] += [ref.id, action, model_id, str(seq_id)]
        if not by_stream:
            return
        calls = [([stream, self._tokens_key, self._replay_set], [self.group, self._tenant_of(stream), self._replay_prefix,
                                                                 *args]) for stream, args in by_stream.items()]  # fmt: skip
        if len(calls) == 1:
            self._ack_script(keys=calls[0][0], args=calls[0][1])
        else:
            self._ack_in_one_round_trip(calls)
        with self._lock:
            for stream, args in by_stream.items():
                self._unacked[self._tenant_of(stream)].difference_update(args[::4])

    def _ack_in_one_round_trip(self, calls: list[tuple[list[str], list[Any]]]) -> None:
        """The ack script once per stream, pipelined by its hash: a pipeline of Script calls would first ask SCRIPT
        EXISTS, a round trip of its own, on every ack. Calls that find the script cache empty (a Redis restart) run
        again once it is loaded; running the script twice on an entry is harmless (see _ACK)."""
        while calls:
            pipe = self.redis.pipeline(transaction=False)
            for script_keys, args in calls:
                pipe.evalsha(self._ack_script.sha, len(script_keys), *script_keys, *args)
            answers = pipe.execute(raise_on_error=False)
            for answer in answers:
                if isinstance(answer, Exception) and not isinstance(answer, redis_lib.exceptions.NoScriptError):
                    raise answer
            calls = [c for c, a in zip(calls, answers, strict=True) if isinstance(a, redis_lib.exceptions.NoScriptError)]
            if calls:
                self._ack_script.sha = self.redis.script_load(self._ack_script.script)

    def forward(self, ref: EntryRef, model_id: str) -> str | None:
        """An entry of an adapter that was handed to another pool (queue/handoff.py) goes to that pool's stream;
        returns that pool's name, or None when the adapter has not left this pool (the entry stays)."""
        target = self._handoffs.forward(self.pool, self._tenant_of(ref.stream), model_id, ref.id)
        if target is not None:
            self.forget([ref])
        return target

    def forget(self, refs: Iterable[EntryRef]) -> None:
        """Entries that left this pool's streams another way (a hand-over): no longer read and unacked here."""
        with self._lock:
            for ref in refs:
                self._unacked[self._tenant_of(ref.stream)].discard(ref.id)

    def claim_stale(self, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Take over entries other consumers left pending longer than `min_idle_ms` (up to `count` per stream)."""
        self.refresh()
        raw: list[RawEntry] = []
        for tenant in list(self._backlog):  # a copy: the prefetch thread's refresh may add a tenant meanwhile
            stream = self.stream_of(tenant)
            cursor, taken = "0-0", 0
            while taken < count:
                reply = self.redis.xautoclaim(stream, self.group, self.name, min_idle_ms, cursor, count=count - taken)
                cursor = text(reply[0])
                raw += [(EntryRef(stream, text(sid)), fields) for sid, fields in reply[1]]
                taken += len(reply[1])
                if cursor == "0-0":
                    break
        return self._decode(raw)

    def keep(self, refs: Iterable[EntryRef]) -> None:
        """Entries this consumer still works on: their idle time starts again (XCLAIM JUSTID to itself), so the
        stale-entry rule (`claim_stale`, with any consumer name) does not take them while a plan runs them. A stream
        whose group is gone (Redis restarted empty: NOGROUP) holds nothing to keep, and is passed over."""
        by_stream: dict[str, list[Any]] = defaultdict(list)
        for ref in refs:
            by_stream[ref.stream].append(ref.id)
        if not by_stream:
            return
        pipe = self.redis.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, self.group, self.name, 0, ids, justid=True)
        for answer in pipe.execute(raise_on_error=False):
            if isinstance(answer, redis_lib.ResponseError) and not str(answer).startswith("NOGROUP"):
                raise answer

    def pending_count(self) -> int:
        """Entries delivered to any consumer of the group and not yet acked, over every tenant's stream."""
        self.refresh()
        return sum(int(self.redis.xpending(self.stream_of(t), self.group)["pending"]) for t in list(self._backlog))

    def _tenant_of(self, stream: str) -> str:
        prefix, suffix = keys.request_stream(self.pool, ""), ":requests"
        return stream[len(prefix) - len(suffix) : -len(suffix)]

    def _xreadgroup(
        self, streams: dict[str, str], count: int, block_ms: int | None, *, count_tenants: bool = False
    ) -> tuple[int | None, list[RawEntry]]:
        """(the size of the pool's tenants set when `count_tenants`, else None; the entries XREADGROUP of `streams`
        returns): the size is read in the same round trip, so a tenant that appeared without a doorbell is noticed
        without a read of its own."""
        if block_ms is not None and block_ms <= 0:
            block_ms = None

        def call() -> tuple[int | None, Any]:
            if not count_tenants:
                return None, self.redis.xreadgroup(self.group, self.name, streams, count=count, block=block_ms)  # type: ignore[arg-type]
            pipe = self.redis.pipeline(transaction=False)
            pipe.scard(self._tenants_key)
            pipe.xreadgroup(self.group, self.name, streams, count=count, block=block_ms)  # type: ignore[arg-type]
            tenants, answer = pipe.execute()
            return int(tenants), answer

        try:
            tenants, reply = call()
        except redis_lib.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            for stream in streams:  # a stream was deleted under us (FLUSHDB, an operator): recreate and read again
                self._ensure_group(stream)
            tenants, reply = call()
        return tenants, self._entries(reply)

    @staticmethod
    def _entries(reply: Any) -> list[RawEntry]:
        pairs: list[Any]
        if isinstance(reply, dict):  # RESP3 clients answer {stream: [entries]}
            pairs = [(s, b[0] if b and isinstance(b[0], list) else b) for s, b in reply.items()]
        else:
            pairs = list(reply or [])
        return [
            (EntryRef(text(stream), text(sid)), fields)
            for stream, batch in cast(list[tuple[bytes | str, list[tuple[bytes | str, Mapping[Any, Any]]]]], pairs)
            for sid, fields in batch
        ]

    def _decode(self, raw: list[RawEntry]) -> list[Entry]:
        good: list[Entry] = []
        bad: list[EntryRef] = []
        failed: list[Outcome] = []
        for ref, fields in raw:
            if not fields:  # deleted from the stream but still pending (acked half-way): just finish the ack
                bad.append(ref)
                continue
            try:
                good.append((ref, decode(fields)))
            except LoraplexError as exc:
                log.warning("dropping undecodable entry %s on %s: %s", ref.id, ref.stream, exc)
                bad.append(ref)
                request_id = request_id_of(fields)
                if request_id:
                    failed.append(Outcome.failed(request_id, InvalidRequestError(str(exc))))
        with self._lock:
            for ref, _ in raw:
                self._unacked[self._tenant_of(ref.stream)].add(ref.id)
        if failed:
            self.results.put_many(failed)  # answer first, then ack: a crash in between re-reads, never loses
        self.ack(bad)
        return good

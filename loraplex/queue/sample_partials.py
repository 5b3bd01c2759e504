"""A streaming sample's tokens while the pool samples it: after each slice the pool publishes what every sample of the
request gained since its last entry (pool/sample_partials.py), and the gateway reads the entries as they come
(api/openai/streaming.py). Only requests that asked to stream (`SamplePayload.stream_partials`) are published, so
sampling that does not stream pays nothing.

Wire: a Redis stream `loraplex:partial:{request_id}` (queue/keys.py), entries of one field `d`, JSON:

    {"s": [[sample, start, tokens, logprobs, topk], ...]}   each sample that gained tokens: tokens [start, start + len)
                                                            with their logprobs (and top-k logprobs, or null)
    {"end": 1}                                              the request's outcome is final: its result follows

A delta names its start, so a reader tells a repeat (a pool that restarted publishes from 0 again: equal tokens are
skipped, different ones are a divergence) and a gap (an entry lost to a failed write or a trim: that sample's text
waits for the result), trusting nothing but the stream's order. The result stays the answer; partials are its preview.

Bounded: the deltas add up to the request's tokens (n x max_tokens, within LORAPLEX_MAX_SAMPLE_TOKENS_PER_REQUEST),
one entry per slice at most, MAXLEN caps the entries, every write renews a TTL (PARTIAL_TTL_S: a pool that dies
leaves nothing behind for long), the end entry shortens it to END_TTL_S (a reader still there has read it by then),
and the reader deletes the key once it has the result. A write that fails drops that slice's partials and is logged
(rate-limited); it never fails the sample."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
import redis as redis_lib

from loraplex.queue import keys
from loraplex.queue.redis_text import text
from loraplex.runtime.logutil import RateLimitedLog

log = logging.getLogger(__name__)

PARTIAL_TTL_S = 300
END_TTL_S = 30
MAX_ENTRIES = 8192  # more than the slices of any sample (each slice adds a token to every live row)
FIELD = "d"
END = b'{"end":1}'

TopK = list[list[tuple[int, float]]]


class SoFar(Protocol):
    """One sample as far as it has got (workers' SampledSequence, protocol's SampledSequence)."""

    tokens: list[int]
    logprobs: list[float]
    topk_logprobs: TopK | None


@dataclass(frozen=True)
class SampleDelta:
    sample: int  # the sample's index within its request (0 .. n-1)
    start: int  # the index of its first token in the sample
    tokens: list[int]
    logprobs: list[float]
    topk: TopK | None


@dataclass(frozen=True)
class PartialEntry:
    deltas: list[SampleDelta]
    end: bool = False


# ---- pure: what to publish, and its JSON -----------------------------------------------------------------------------
def sequence_deltas(published: list[int], sequences: Sequence[SoFar]) -> list[SampleDelta]:
    """What each sample gained past `published[i]` tokens (copied: the sampler's lists keep growing); `published`
    is advanced to the sequences' lengths (grown to their count)."""
    published.extend([0] * (len(sequences) - len(published)))
    out = []
    for i, seq in enumerate(sequences):
        start, end = published[i], len(seq.tokens)
        if end > start:
            topk = seq.topk_logprobs
            out.append(SampleDelta(i, start, seq.tokens[start:end], seq.logprobs[start:end],
                                   None if topk is None else topk[start:end]))  # fmt: skip
            published[i] = end
    return out


def encode_deltas(deltas: Sequence[SampleDelta]) -> bytes:
    return orjson.dumps({"s": [[d.sample, d.start, d.tokens, d.logprobs, d.topk] for d in deltas]})


def decode_entry(raw: bytes | str) -> PartialEntry:
    """An entry as written by `encode_deltas` or END; ValueError for any other shape."""
    try:
        data = orjson.loads(raw)
        if data.get("end"):
            return PartialEntry([], end=True)
        deltas = []
        for sample, start, tokens, logprobs, topk in data["s"]:
            if not (isinstance(sample, int) and isinstance(start, int) and sample >= 0 and start >= 0):
                raise ValueError(f"bad sample or start: {sample!r}, {start!r}")
            top = None if topk is None else [[(int(t), float(lp)) for t, lp in row] for row in topk]
            deltas.append(SampleDelta(sample, start, [int(t) for t in tokens], [float(x) for x in logprobs], top))
        return PartialEntry(deltas)
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a malformed partial-sample entry: {exc}") from None


# ---- the pool's side -------------------------------------------------------------------------------------------------
class PartialWriter:
    """Collects a step's partials (`update`, `end`) and writes them in one pipeline (`flush`)."""

    def __init__(self, redis: redis_lib.Redis, ttl_s: int = PARTIAL_TTL_S, max_entries: int = MAX_ENTRIES) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._published: dict[str, list[int]] = {}  # request id -> tokens published per sample
        self._pending: list[tuple[str, bytes]] = []
        self._failed = RateLimitedLog(log, every_s=30.0)

    def update(self, request_id: str, sequences: Sequence[SoFar]) -> None:
        deltas = sequence_deltas(self._published.setdefault(request_id, []), sequences)
        if deltas:
            self._pending.append((request_id, encode_deltas(deltas)))

    def end(self, request_id: str) -> None:
        self._published.pop(request_id, None)
        self._pending.append((request_id, END))

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        try:
            pipe = self.redis.pipeline(transaction=False)
            for request_id, data in pending:
                key = keys.sample_partials(request_id)
                pipe.xadd(key, {FIELD: data}, maxlen=self.max_entries, approximate=True)
                pipe.expire(key, END_TTL_S if data == END else self.ttl_s)
            pipe.execute()
        except redis_lib.RedisError as exc:
            self._failed.warning("streaming samples: %d partial entries not published (%s: %s)", len(pending),
                                 type(exc).__name__, exc)  # fmt: skip

    @property
    def tracked(self) -> int:
        """Requests published and not ended (for tests: an ended one leaves nothing here)."""
        return len(self._published)


# ---- the gateway's side ----------------------------------------------------------------------------------------------
class PartialReader:
    """Reads the entries of several requests' partial streams, blocking up to a slice for the next ones."""

    def __init__(self, redis: redis_lib.Redis) -> None:
        self.redis = redis

    def read(self, after: dict[str, str], block_s: float | None) -> list[tuple[str, str, PartialEntry]]:
        """(request id, entry id, entry) of the entries past `after[request id]` ("0": from the start), waiting up to
        `block_s` (at least 1 ms; keep it below the client's socket timeout; None: not at all) for the first. A
        malformed entry is skipped (logged): the result still answers."""
        if not after:
            return []
        by_key = {keys.sample_partials(rid): rid for rid in after}
        streams: dict[Any, Any] = {key: after[rid] for key, rid in by_key.items()}
        block = None if block_s is None else max(1, int(block_s * 1000))
        found: Any = self.redis.xread(streams, block=block)
        out = []
        for key, entries in found or []:
            rid = by_key[text(key)]
            for entry_id, fields in entries:
                raw = fields.get(FIELD.encode(), fields.get(FIELD))
                try:
                    out.append((rid, text(entry_id), decode_entry(raw)))
                except ValueError as exc:
                    log.warning("request %s: %s", rid, exc)
        return out

    def delete(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            self.redis.delete(*(keys.sample_partials(rid) for rid in request_ids))

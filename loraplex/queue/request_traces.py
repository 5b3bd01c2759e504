"""The request traces: when each answered request passed each stage of its life, kept per adapter in Redis so that a
tenant (its own adapters only: the service checks ownership) or an operator can read a session's or an adapter's
recent requests and export them as a trace (service/request_traces.py).

    loraplex:trace:{model_id}   stream: one entry per answered request of the adapter (field `r`: a TraceRecord's
                                JSON), capped at about `MAX_PER_ADAPTER` entries, expiring `TTL_S` after its last one

The stages, each a wall-clock time in unix seconds: `enqueued` (the gateway's XADD: the stream entry's id, so Redis's
clock), `read` (the dispatcher took it into its buffer), `start` and `end` (the engine ran the plan that answered it:
for a sample run, its first slice's start and its last slice's end; for a request run in parts, its last part),
`done` (its result stored, after the plan's SQL record). The dispatcher writes one pipeline of XADDs per plan, on its
finisher thread, after the results are out (dispatch/loop.py): tracing never delays an answer.

The key is per adapter, not per pool: an adapter moved to another pool keeps one trace."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import orjson
import redis as redis_lib

from loraplex.protocol import Outcome, PlannedRequest
from loraplex.protocol.results import ForwardBackwardResult
from loraplex.queue import keys
from loraplex.queue.redis_text import text

MAX_PER_ADAPTER = 2000  # entries kept per adapter (approximate trimming: Redis keeps a few more)
TTL_S = 7 * 24 * 3600


@dataclass(frozen=True)
class TraceRecord:
    request_id: str
    tenant_id: str
    model_id: str
    seq_id: int
    kind: str
    tokens: int
    ok: bool
    pool: str
    enqueued: float
    read: float
    start: float
    end: float
    done: float
    loss: float | None = None  # a forward_backward's loss:sum
    error: str | None = None  # the error's type name when not ok

    @property
    def queue_wait_s(self) -> float:
        """Seconds from its arrival to the start of the engine work that answered it."""
        return max(0.0, self.start - self.enqueued)

    @property
    def compute_s(self) -> float:
        return max(0.0, self.end - self.start)

    def to_json(self) -> bytes:
        return orjson.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, raw: bytes | str) -> TraceRecord:
        data = orjson.loads(raw)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def entry_time(entry_id: str) -> float:
    """A stream entry id's time ("1733500000123-0" -> unix seconds)."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


def write(redis: redis_lib.Redis, records: Sequence[TraceRecord], max_per_adapter: int = MAX_PER_ADAPTER) -> None:
    """One round trip for a plan's records (each adapter's stream capped and its expiry pushed back)."""
    if not records:
        return
    pipe = redis.pipeline(transaction=False)
    touched: set[str] = set()
    for record in records:
        key = keys.request_trace(record.model_id)
        pipe.xadd(key, {"r": record.to_json()}, maxlen=max_per_adapter, approximate=True)
        touched.add(key)
    for key in touched:
        pipe.expire(key, TTL_S)
    pipe.execute()


def read(redis: redis_lib.Redis, model_ids: Iterable[str], since: float | None = None, limit: int = MAX_PER_ADAPTER
         ) -> list[TraceRecord]:  # fmt: skip
    """The adapters' traced requests answered at or after `since` (unix seconds; None: all kept), oldest first, at most
    `limit` per adapter (the newest)."""
    pipe = redis.pipeline(transaction=False)
    ids = list(dict.fromkeys(model_ids))
    for model_id in ids:
        pipe.xrevrange(keys.request_trace(model_id), "+", "-" if since is None else int(since * 1000), count=limit)
    out: list[TraceRecord] = []
    for entries in pipe.execute() if ids else []:
        for _, fields in reversed(entries):
            raw = fields.get(b"r") or fields.get("r")
            if raw is not None:
                out.append(TraceRecord.from_json(text(raw)))
    out.sort(key=lambda r: (r.done, r.model_id, r.seq_id))
    return out


@dataclass(frozen=True)
class Stages:
    """One request's times before its result (unix seconds); `done` comes when the result is stored."""

    enqueued: float
    read: float
    start: float
    end: float


def records_of(requests: Sequence[PlannedRequest], outcomes: Sequence[Outcome], stages: Sequence[Stages], pool: str,
               done: float) -> list[TraceRecord]:  # fmt: skip
    """The trace records of a plan's answered requests (in plan order, outcomes and stages alike)."""
    out = []
    for request, outcome, s in zip(requests, outcomes, stages, strict=True):
        loss = None
        if isinstance(outcome.result, ForwardBackwardResult):
            value = outcome.result.metrics.get("loss:sum")
            loss = float(value) if isinstance(value, int | float) else None
        out.append(TraceRecord(
            request.request_id, request.tenant_id, request.model_id, request.seq_id, str(request.kind),
            request.num_tokens, outcome.ok, pool, s.enqueued, s.read, s.start, s.end, max(done, s.end), loss,
            None if outcome.ok else (outcome.error_name or "error"),
        ))  # fmt: skip
    return out

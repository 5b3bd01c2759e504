"""A session's or an adapter's numbers from its request traces (the per-session view of the Tinker console): training
utilization, tokens per second, queue wait against compute per request, percentiles. Pure: records in, numbers out.

Training utilization: the share of the wall time from the first training request's arrival to the last one's result
during which the engine was running a plan that held one of them (the union of their engine spans: requests of one
plan overlap and count once). The rest is the time the requests spent queued, waiting for a plan, being recorded, and
the client's own time between requests."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from loraplex.queue.request_traces import TraceRecord

TRAINING_KINDS = frozenset({"forward_backward", "forward", "optim_step"})
TOKEN_KINDS = frozenset({"forward_backward", "forward"})


def exact_percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by nearest rank (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


def union_seconds(spans: Sequence[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for begin, finish in sorted(spans):
        if finish <= end:
            continue
        total += finish - max(begin, end)
        end = finish
    return total


@dataclass(frozen=True)
class RequestRow:
    at: float  # enqueued (unix seconds)
    kind: str
    seq_id: int
    queue_wait_s: float
    compute_s: float
    ok: bool
    loss: float | None


@dataclass
class RequestStats:
    requests: int = 0
    failed: int = 0
    training_tokens: int = 0
    wall_s: float = 0.0
    engine_s: float = 0.0
    utilization: float | None = None  # engine_s / wall_s over the training requests
    tokens_per_s: float | None = None
    queue_wait_p50_s: float | None = None
    queue_wait_p99_s: float | None = None
    compute_p50_s: float | None = None
    compute_p99_s: float | None = None
    in_flight_samples: int = 0  # sample requests accepted and not answered yet
    in_flight_requests: int = 0  # every request accepted and not answered yet
    rows: list[RequestRow] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if k != "rows"}
        out["requests_shown"] = [r.__dict__ for r in self.rows]
        return out


def request_stats(records: Sequence[TraceRecord], in_flight: tuple[int, int] = (0, 0), rows: int = 200) -> RequestStats:
    """in_flight: (requests, sample requests) queued or running now; rows: the newest this many requests listed."""
    stats = RequestStats(requests=len(records), failed=sum(not r.ok for r in records))
    stats.in_flight_requests, stats.in_flight_samples = in_flight
    training = [r for r in records if r.kind in TRAINING_KINDS]
    stats.training_tokens = sum(r.tokens for r in training if r.ok and r.kind in TOKEN_KINDS)
    if training:
        stats.wall_s = max(r.done for r in training) - min(r.enqueued for r in training)
        stats.engine_s = union_seconds([(r.start, r.end) for r in training])
        if stats.wall_s > 0:
            stats.utilization = min(1.0, stats.engine_s / stats.wall_s)
            stats.tokens_per_s = stats.training_tokens / stats.wall_s
    waits = [r.queue_wait_s for r in records]
    computes = [r.compute_s for r in records]
    stats.queue_wait_p50_s, stats.queue_wait_p99_s = exact_percentile(waits, 0.5), exact_percentile(waits, 0.99)
    stats.compute_p50_s, stats.compute_p99_s = exact_percentile(computes, 0.5), exact_percentile(computes, 0.99)
    newest = sorted(records, key=lambda r: r.enqueued)[-rows:]
    stats.rows = [RequestRow(r.enqueued, r.kind, r.seq_id, r.queue_wait_s, r.compute_s, r.ok, r.loss) for r in newest]
    return stats

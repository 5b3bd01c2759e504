"""Request traces (queue/request_traces.TraceRecord) as Chrome / Perfetto trace-event JSON (the "JSON Array/Object
Format" both read: chrome://tracing, ui.perfetto.dev). Pure: records in, a dict out.

Layout: one process per adapter (named "<tenant>/<adapter>"), and in it lanes (threads) so that a lane's requests never
overlap (requests in flight together, e.g. a forward_backward queued behind the optim_step before it, take separate
lanes). Each request is one complete event ("ph": "X") named "<kind> #<seq_id>" (create and delete: "<kind>"), spanning enqueue to result, with its
four stages nested inside it, in order and back to back: `queue` (enqueued -> read by the dispatcher), `plan` (read ->
the engine starts: waiting for a plan that takes it, planning, coalescing), `engine` (the plan's engine work), `result`
(recorded in SQL and the result stored). Times are microseconds from the first enqueue of the export."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loraplex.queue.request_traces import TraceRecord

STAGES = ("queue", "plan", "engine", "result")


def stage_bounds(r: TraceRecord) -> list[tuple[str, float, float]]:
    """The four stages' (name, start, end) in unix seconds, made monotonic (clocks of two hosts may disagree by a little:
    a stage never starts before the one before it ended)."""
    points = [r.enqueued, r.read, r.start, r.end, r.done]
    for i in range(1, len(points)):
        points[i] = max(points[i], points[i - 1])
    return [(name, points[i], points[i + 1]) for i, name in enumerate(STAGES)]


def _lanes(records: Sequence[TraceRecord]) -> list[int]:
    """A lane per record (in the given order) such that a lane's records do not overlap: greedy, lowest free lane."""
    order = sorted(range(len(records)), key=lambda i: (records[i].enqueued, records[i].seq_id))
    lane_free: list[float] = []
    out = [0] * len(records)
    for i in order:
        bounds = stage_bounds(records[i])
        begin, end = bounds[0][1], bounds[-1][2]
        lane = next((k for k, free in enumerate(lane_free) if free <= begin), len(lane_free))
        if lane == len(lane_free):
            lane_free.append(end)
        else:
            lane_free[lane] = end
        out[i] = lane
    return out


def to_trace_events(records: Sequence[TraceRecord], names: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The export: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}. names: model_id -> the label
    of its process (default: the model id)."""
    names = names or {}
    if not records:
        return {"traceEvents": [], "displayTimeUnit": "ms", "otherData": {"requests": 0}}
    origin = min(stage_bounds(r)[0][1] for r in records)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 1)

    adapters = sorted({r.model_id for r in records})
    pid_of = {m: i + 1 for i, m in enumerate(adapters)}
    by_adapter: dict[str, list[TraceRecord]] = {}
    for r in records:
        by_adapter.setdefault(r.model_id, []).append(r)
    events: list[dict[str, Any]] = []
    for model_id, rows in by_adapter.items():
        pid = pid_of[model_id]
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": names.get(model_id, model_id)}})  # fmt: skip
        lanes = _lanes(rows)
        for lane in sorted(set(lanes)):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane + 1,
                           "args": {"name": f"requests {lane + 1}"}})  # fmt: skip
        for r, lane in zip(rows, lanes, strict=True):
            bounds = stage_bounds(r)
            args: dict[str, Any] = {"request_id": r.request_id, "seq_id": r.seq_id, "kind": r.kind, "tokens": r.tokens,
                                    "ok": r.ok, "pool": r.pool, "queue_wait_ms": round(r.queue_wait_s * 1e3, 3),
                                    "compute_ms": round(r.compute_s * 1e3, 3)}  # fmt: skip
            if r.loss is not None:
                args["loss:sum"] = r.loss
            if r.error:
                args["error"] = r.error
            name = r.kind if r.seq_id < 0 else f"{r.kind} #{r.seq_id}"  # create/delete: outside the seq_id chain
            events.append({"ph": "X", "name": name, "cat": "request", "pid": pid, "tid": lane + 1,
                           "ts": us(bounds[0][1]), "dur": round(us(bounds[-1][2]) - us(bounds[0][1]), 1),
                           "args": args})  # fmt: skip
            for name, begin, end in bounds:
                events.append({"ph": "X", "name": name, "cat": "stage", "pid": pid, "tid": lane + 1, "ts": us(begin),
                               "dur": round(us(end) - us(begin), 1)})  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"requests": len(records), "origin_unix_s": origin, "stages": list(STAGES)}}  # fmt: skip

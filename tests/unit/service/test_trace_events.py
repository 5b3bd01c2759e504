"""Request traces as Chrome/Perfetto trace-event JSON and a session's numbers, pure: one span per request with its
four stages nested inside it in order, overlapping requests on separate lanes, stage times kept monotonic; utilization
as the union of engine spans over the wall time; exact percentiles."""

from __future__ import annotations

import json

import pytest

from loraplex.queue.request_traces import TraceRecord
from loraplex.service.request_stats import exact_percentile, request_stats, union_seconds
from loraplex.service.trace_events import STAGES, to_trace_events


def _rec(seq: int, enq: float, read: float, start: float, end: float, done: float, kind: str = "forward_backward",
         model: str = "m1", ok: bool = True) -> TraceRecord:  # fmt: skip
    return TraceRecord(f"r{seq}", "t1", model, seq, kind, 100, ok, "pool", enq, read, start, end, done,
                       2.0 if kind == "forward_backward" else None, None if ok else "EngineError")  # fmt: skip


def test_each_request_is_a_span_with_its_four_stages_nested_in_order() -> None:
    records = [_rec(1, 10.0, 10.1, 10.2, 10.5, 10.6), _rec(2, 10.05, 10.1, 10.6, 10.9, 11.0, "optim_step"),
               _rec(1, 10.0, 10.0, 10.3, 10.4, 10.45, model="m2"), _rec(3, 12.0, 11.99, 12.1, 12.2, 12.3)]  # fmt: skip
    out = json.loads(json.dumps(to_trace_events(records, {"m1": "alice/m1"})))  # JSON-clean
    events = out["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"alice/m1", "m2"}
    spans = [e for e in events if e["ph"] == "X" and e["cat"] == "request"]
    assert len(spans) == 4 and {s["name"] for s in spans} >= {"forward_backward #1", "optim_step #2"}
    for span in spans:
        stages = [e for e in events if e["ph"] == "X" and e["cat"] == "stage" and e["pid"] == span["pid"]
                  and e["tid"] == span["tid"] and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]  # fmt: skip
        stages = [e for e in stages if e["ts"] + e["dur"] <= span["ts"] + span["dur"] + 0.2][:4]
        assert [e["name"] for e in stages] == list(STAGES)
        for a, b in zip(stages, stages[1:], strict=False):
            assert a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=0.2)  # back to back
        assert all(e["dur"] >= 0 for e in stages)
    first = next(s for s in spans if s["name"] == "forward_backward #1" and s["pid"] == 1)
    second = next(s for s in spans if s["name"] == "optim_step #2")
    assert first["tid"] != second["tid"]  # in flight together: separate lanes
    third = next(s for s in spans if s["name"] == "forward_backward #3")
    assert third["tid"] == 1  # the first lane is free again by then
    assert first["args"]["compute_ms"] == pytest.approx(300) and first["args"]["loss:sum"] == 2.0
    assert min(e["ts"] for e in events if e["ph"] == "X") == 0
    assert to_trace_events([])["traceEvents"] == []


def test_utilization_tokens_per_second_and_percentiles() -> None:
    records = [_rec(1, 0.0, 0.0, 1.0, 2.0, 2.0), _rec(2, 0.0, 0.0, 1.5, 2.0, 2.0),  # one plan: counted once
               _rec(3, 2.0, 2.0, 3.0, 4.0, 4.0, ok=False)]  # fmt: skip
    stats = request_stats(records, in_flight=(3, 1))
    assert stats.engine_s == pytest.approx(2.0) and stats.wall_s == pytest.approx(4.0)
    assert stats.utilization == pytest.approx(0.5) and stats.tokens_per_s == pytest.approx(200 / 4)
    assert stats.failed == 1 and stats.in_flight_samples == 1 and stats.in_flight_requests == 3
    assert stats.queue_wait_p50_s == pytest.approx(1.0) and stats.queue_wait_p99_s == pytest.approx(1.5)
    assert len(stats.as_dict()["requests_shown"]) == 3
    assert union_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert exact_percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and exact_percentile([], 0.5) is None

"""The pool's metrics (pool/metrics.py) from hand-made plans and outcomes: what a plan holds (steps per kind,
mixed vs single forward_backward steps, adapters, rows and tokens per step), tokens and requests per tenant, sampled
tokens, parts, the time split, swaps as deltas of the store's totals, tiers and queue depths."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.errors import InvalidRequestError
from loraplex.pool.metrics import PoolMetrics
from loraplex.protocol import BatchPlan, Outcome, Step, StepKind
from loraplex.protocol.results import OptimStepResult, SampledSequence, SampleResult
from tests.helpers.policy import FB, FWD, OPT, SAMPLE, req


@dataclass(frozen=True)
class _Timing:
    kind: StepKind
    swap_s: float
    run_s: float


def _values(metrics: PoolMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, parsed back: (sample name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(values, name: str, **labels: str) -> float:
    return values.get((name, tuple(sorted({"pool": "p", **labels}.items()))), 0.0)


def _ok(r, result=None) -> Outcome:
    return Outcome(r.request_id, result=result or OptimStepResult())


def test_a_plan_is_counted_by_what_it_holds() -> None:
    timings = [_Timing(StepKind.FORWARD_BACKWARD, 0.25, 1.0), _Timing(StepKind.OPTIM_STEP, 0.0, 0.5)]
    swaps = {"cpu_to_gpu": (2, 0.2), "gpu_to_cpu": (1, 0.1)}
    metrics = PoolMetrics("p", slots=4, step_times=lambda: timings, swaps=lambda: swaps,
                          tiers=lambda: {"gpu": 3, "cpu": 1, "disk": 0})  # fmt: skip
    a1, b1 = req("a", 1, FB, tokens=10, tenant="ta", datums=2), req("b", 1, FWD, tokens=7, tenant="tb")
    bad = req("c", 1, FB, tokens=5, tenant="tb")
    lone = req("d", 1, FB, tokens=3, tenant="ta")
    opt = req("a", 2, OPT, tenant="ta")
    sample = req("s", 1, SAMPLE, tenant="tb")
    plan = BatchPlan((Step(StepKind.FORWARD_BACKWARD, (a1, b1, bad)), Step(StepKind.FORWARD_BACKWARD, (lone,)),
                      Step(StepKind.OPTIM_STEP, (opt,)), Step(StepKind.SAMPLE, (sample,))))  # fmt: skip
    outcomes = [_ok(a1), _ok(b1), Outcome.failed(bad.request_id, InvalidRequestError("x")), _ok(lone),
                _ok(opt), _ok(sample, SampleResult((SampledSequence([1, 2, 3], [], "stop"), SampledSequence([4], [], "length"))))]  # fmt: skip
    metrics.executed(plan, outcomes, busy_s=2.0)
    v = _values(metrics)

    assert _get(v, "loraplex_pool_plans_total") == 1
    assert _get(v, "loraplex_pool_steps_total", kind="forward_backward") == 2
    assert _get(v, "loraplex_pool_steps_total", kind="optim_step") == 1
    assert _get(v, "loraplex_pool_fb_steps_total", layout="mixed") == 1
    assert _get(v, "loraplex_pool_fb_steps_total", layout="single") == 1
    assert _get(v, "loraplex_pool_fb_step_adapters_sum") == 3 + 1
    assert _get(v, "loraplex_pool_fb_step_rows_sum") == (2 + 1 + 1) + 1
    assert _get(v, "loraplex_pool_fb_step_tokens_sum") == (20 + 7 + 5) + 3
    # Tokens count requests that ran without error, per tenant and kind; the failed one counts as a request only.
    assert _get(v, "loraplex_pool_tokens_total", tenant="ta", kind="forward_backward") == 20 + 3
    assert _get(v, "loraplex_pool_tokens_total", tenant="tb", kind="forward") == 7
    assert _get(v, "loraplex_pool_tokens_total", tenant="tb", kind="forward_backward") == 0
    assert _get(v, "loraplex_pool_requests_total", tenant="tb", kind="forward_backward", result="error") == 1
    assert _get(v, "loraplex_pool_requests_total", tenant="ta", kind="forward_backward", result="ok") == 2
    assert _get(v, "loraplex_pool_sampled_tokens_total", tenant="tb") == 4
    # The executor's split; what it does not account for is execute_other.
    assert _get(v, "loraplex_pool_seconds_total", phase="swap") == 0.25
    assert _get(v, "loraplex_pool_seconds_total", phase="forward_backward") == 1.0
    assert _get(v, "loraplex_pool_seconds_total", phase="optim_step") == 0.5
    assert _get(v, "loraplex_pool_seconds_total", phase="execute_other") == pytest.approx(0.25)
    assert _get(v, "loraplex_pool_step_seconds_count", kind="forward_backward") == 1
    assert _get(v, "loraplex_pool_swaps_total", move="cpu_to_gpu") == 2
    assert _get(v, "loraplex_pool_swap_seconds_total", move="gpu_to_cpu") == 0.1
    assert _get(v, "loraplex_pool_adapters", tier="gpu") == 3
    assert _get(v, "loraplex_pool_slots") == 4

    # Swaps are the store's cumulative totals: the next plan adds only what changed.
    swaps = {"cpu_to_gpu": (5, 0.5), "gpu_to_cpu": (1, 0.1)}
    timings = []
    metrics.executed(BatchPlan((Step(StepKind.OPTIM_STEP, (opt,)),)), [_ok(opt)], busy_s=0.1)
    metrics.timed({"read": 0.5, "record": 0.125, "plan": 0.0})
    v = _values(metrics)
    assert _get(v, "loraplex_pool_swaps_total", move="cpu_to_gpu") == 5
    assert _get(v, "loraplex_pool_swaps_total", move="gpu_to_cpu") == 1
    assert _get(v, "loraplex_pool_seconds_total", phase="read") == 0.5
    assert _get(v, "loraplex_pool_seconds_total", phase="record") == 0.125


def test_a_request_in_parts_counts_its_tokens_per_part_and_the_request_once() -> None:
    metrics = PoolMetrics("p")
    whole = req("a", 1, FB, tokens=4, tenant="ta", datums=3)
    first, last = replace(whole, part=(0, 2)), replace(whole, part=(2, 3))
    for part in (first, last):
        metrics.executed(BatchPlan((Step(StepKind.FORWARD_BACKWARD, (part,)),)), [_ok(part)], busy_s=0.0)
    v = _values(metrics)
    assert _get(v, "loraplex_pool_tokens_total", tenant="ta", kind="forward_backward") == 12
    assert _get(v, "loraplex_pool_requests_total", tenant="ta", kind="forward_backward", result="ok") == 1
    assert _get(v, "loraplex_pool_fb_step_rows_sum") == 3


def test_queue_depths_are_gauges_and_a_drained_tenant_reads_zero() -> None:
    metrics = PoolMetrics("p")
    metrics.queue_depths({"ta": (3, 120), "tb": (1, 8)})
    v = _values(metrics)
    assert _get(v, "loraplex_pool_queued_requests", tenant="ta") == 3
    assert _get(v, "loraplex_pool_queued_tokens", tenant="ta") == 120
    metrics.queue_depths({"tb": (2, 16)})
    v = _values(metrics)
    assert _get(v, "loraplex_pool_queued_requests", tenant="ta") == 0
    assert _get(v, "loraplex_pool_queued_requests", tenant="tb") == 2


def test_graph_captures_count_and_a_slow_plan_is_logged_with_its_split(caplog: pytest.LogCaptureFixture) -> None:
    captures = [2]  # the engine's running total; captures before the metrics existed are not counted
    timings = [_Timing(StepKind.FORWARD_BACKWARD, 0.125, 1.5)]
    collected = [10.0]  # the process's garbage-collection seconds so far (gcutil.GcClock)
    allocator = {"device_alloc": 100, "device_free": 7, "alloc_retry": 0}  # workers/engine/allocator_events.py's totals
    metrics = PoolMetrics("p", step_times=lambda: timings, graph_captures=lambda: captures[0],
                          graph_memory=lambda: 3 << 30, gc_seconds=lambda: collected[0],
                          allocator_events=lambda: allocator, slow_plan_s=1.0)  # fmt: skip
    a, b = req("a", 1, FB, tokens=512, tenant="ta"), req("b", 1, FB, tokens=256, tenant="tb")
    plan = BatchPlan((Step(StepKind.FORWARD_BACKWARD, (a, b)),))
    captures[0], collected[0] = 4, 10.25
    allocator.update(device_alloc=103, device_free=9, alloc_retry=1)
    with caplog.at_level("INFO", logger="loraplex.pool.metrics"):
        metrics.executed(plan, [_ok(a), _ok(b)], busy_s=2.0)
    assert _get(_values(metrics), "loraplex_pool_graph_captures_total") == 2
    assert _get(_values(metrics), "loraplex_pool_gc_seconds_total") == 0.25
    assert _get(_values(metrics), "loraplex_pool_graph_memory_bytes") == 3 << 30
    (line,) = [r.getMessage() for r in caplog.records]
    assert "slow plan, 2000 ms executing" in line and "swap 125, forward_backward 1500, execute_other 375" in line
    assert "(adapters, tokens) [(2, 768)]" in line and "2 CUDA graphs captured in it" in line
    assert "garbage collector 250 ms since the last plan" in line
    assert "CUDA allocator since the last plan: 3 device_alloc, 2 device_free, 1 alloc_retry" in line
    for event, n in (("device_alloc", 3), ("device_free", 2), ("alloc_retry", 1)):
        assert _get(_values(metrics), "loraplex_pool_cuda_allocator_events_total", event=event) == n

    caplog.clear()  # under the threshold: counted, not logged; a total that did not move adds nothing
    timings = [_Timing(StepKind.FORWARD_BACKWARD, 0.0, 0.5)]
    with caplog.at_level("INFO", logger="loraplex.pool.metrics"):
        metrics.executed(plan, [_ok(a), _ok(b)], busy_s=0.5)
    assert not caplog.records and _get(_values(metrics), "loraplex_pool_graph_captures_total") == 2
    quiet = PoolMetrics("p", step_times=lambda: timings, slow_plan_s=0.0)  # 0: never logged
    with caplog.at_level("INFO", logger="loraplex.pool.metrics"):
        quiet.executed(plan, [_ok(a), _ok(b)], busy_s=60.0)
    assert not caplog.records


def test_a_slow_finish_is_logged_with_its_record_and_publish_seconds(caplog: pytest.LogCaptureFixture) -> None:
    metrics = PoolMetrics("p", slow_plan_s=1.0)
    with caplog.at_level("INFO", logger="loraplex.pool.metrics"):
        metrics.timed({"record": 0.2, "publish": 0.1})  # under the threshold: counted only
        metrics.timed({"read": 5.0, "coalesce": 2.0})  # the loop's waits are no finish
        metrics.timed({"record": 1.25, "publish": 0.05})
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == "pool p: slow finish, record 1250 ms, publish 50 ms (a plan's results wait for both)"
    assert _get(_values(metrics), "loraplex_pool_seconds_total", phase="record") == pytest.approx(1.45)

"""The pool's metrics fed from a real engine, adapter store and executor the way pool/process.py wires them: with one
slot, two adapters training in turn swap at every step, and the swap counters, tiers and per-step seconds follow
what the store and the executor measured."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from loraplex.models import load_base_model
from loraplex.pool.process import pool_metrics
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.settings import Settings
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.state.adapter_store import AdapterStore


def _fb(model_id: str, seq: int) -> PlannedRequest:
    toks = [(seq * 31 + j * 3) % 500 + 1 for j in range(9)]
    datum = {"model_input": toks[:-1], "loss_fn_inputs": {"target_tokens": toks[1:], "weights": [1.0] * 8}}
    return PlannedRequest(f"{model_id}-{seq}", "tenant-1", model_id, seq, RequestKind.FORWARD_BACKWARD,
                          {"data": [datum], "loss_fn": "cross_entropy"})  # fmt: skip


def test_swaps_tiers_and_step_seconds_follow_the_store_and_the_executor(tiny_dir: Path, tmp_path: Path) -> None:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    engine = build_engine(model, EngineConfig(num_slots=1, max_rank=4))
    store = AdapterStore(engine, 1 << 30, tmp_path / "spill")
    executor = PlanExecutor(engine, store)
    metrics = pool_metrics(Settings(home=tmp_path, pool="p", slots=1), executor, store)
    creates = tuple(
        PlannedRequest(f"c-{m}", "tenant-1", m, 0, RequestKind.CREATE_ADAPTER, {"rank": 2, "alpha": 4.0, "seed": i})
        for i, m in enumerate("ab")
    )
    plans = [BatchPlan((Step(StepKind.CREATE, creates),))]
    plans += [BatchPlan((Step(StepKind.FORWARD_BACKWARD, (_fb(m, seq),)),)) for seq in (1, 2) for m in "ab"]
    for plan in plans:
        outcomes = executor.execute(plan)
        assert all(o.ok for o in outcomes), outcomes
        metrics.executed(plan, outcomes, busy_s=0.0)

    samples = {
        (s.name, s.labels.get("move") or s.labels.get("tier") or s.labels.get("kind") or s.labels.get("phase")): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    stats = store.stats
    assert stats.in_host == 4 and stats.out_host == 5  # b's creation evicts a; then each step swaps
    assert samples[("loraplex_pool_swaps_total", "cpu_to_gpu")] == stats.in_host
    assert samples[("loraplex_pool_swaps_total", "gpu_to_cpu")] == stats.out_host
    assert samples[("loraplex_pool_swap_seconds_total", "cpu_to_gpu")] == stats.in_host_s
    assert samples[("loraplex_pool_swaps_total", "disk_to_gpu")] == 0
    assert samples[("loraplex_pool_adapters", "gpu")] == 1 and samples[("loraplex_pool_adapters", "cpu")] == 1
    assert samples[("loraplex_pool_step_seconds_count", "forward_backward")] == 4
    assert samples[("loraplex_pool_step_seconds_count", "create")] == 1
    assert samples[("loraplex_pool_seconds_total", "swap")] > 0
    assert samples[("loraplex_pool_tokens_total", "forward_backward")] == 4 * 8

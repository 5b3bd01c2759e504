"""The adapter store on a pool of two CPU ranks (gloo): each rank has its own store and spill folder, runs the same
plans, makes the same swaps (with a barrier after them), and ends with the same state as one process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.models import resolve
from loraplex.protocol import BatchPlan, PlannedRequest, RequestKind, Step, StepKind
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.ranks.distributed import RankGroup
from loraplex.workers.ranks.rank_loop import EngineSpec, LeaderExecutor, build_rank_engine, follow, spawn_ranks
from loraplex.workers.state.adapter_store import AdapterStoreSpec
from tests.helpers.distributed import TinyLoader

pytestmark = [pytest.mark.timeout(180)]

IDS = ("a", "b", "c")
DATA = [{"model_input": [3, 14, 15, 92, 65], "loss_fn_inputs": {"target_tokens": [14, 15, 92, 65, 35]}}]


def _req(rid: str, model_id: str, kind: RequestKind, **payload: Any) -> PlannedRequest:
    return PlannedRequest(request_id=rid, tenant_id="t", model_id=model_id, seq_id=0, kind=kind, payload=payload)


def plans() -> list[BatchPlan]:
    out = [BatchPlan((Step(StepKind.CREATE, tuple(_req(f"c{m}", m, RequestKind.CREATE_ADAPTER, rank=4, seed=i)
                                                      for i, m in enumerate(IDS))),))]  # fmt: skip
    for step in range(3):
        for m in (IDS, IDS[::-1])[step % 2]:  # two slots, three adapters: every step swaps
            fb = Step(StepKind.FORWARD_BACKWARD, (_req(f"f{step}{m}", m, RequestKind.FORWARD_BACKWARD, data=DATA),))
            out.append(BatchPlan((fb,)))
        opt = tuple(_req(f"o{step}{m}", m, RequestKind.OPTIM_STEP, adam_params={"learning_rate": 1e-2}) for m in IDS)
        out.append(BatchPlan((Step(StepKind.OPTIM_STEP, opt),)))  # three adapters in one step: run in two parts
    return out


def _scenario(group: RankGroup, spec: EngineSpec, stores: AdapterStoreSpec, out_dir: str) -> None:
    engine = build_rank_engine(spec, group)
    store = stores.build(engine, group.rank)
    executor = PlanExecutor(engine, store)
    report: dict[str, Any] = {}
    if group.is_leader:
        leader = LeaderExecutor(executor, group)
        report["outcomes"] = [leader.execute(plan) for plan in plans()]
        leader.close()
    else:
        follow(executor, group)
    report["tiers"] = {m: store.tier_of(m) for m in IDS}
    report["rows"] = {m: store.peek(m).rows for m in IDS}
    report["files"] = sorted(p.name for p in store.spill_dir.iterdir())
    torch.save(report, Path(out_dir) / f"rank{group.rank}.pt")


def test_two_ranks_swap_alike_and_match_one_process(tmp_path: Path) -> None:
    tiny = resolve("tiny", tmp_path / "model-cache")
    spec = EngineSpec(TinyLoader(str(tiny)), "cpu", EngineConfig(num_slots=2, max_rank=4))
    stores = AdapterStoreSpec(0, str(tmp_path / "spill"))  # budget 0: every eviction goes to disk
    started = time.monotonic()
    context, _ = spawn_ranks(_scenario, (spec, stores, str(tmp_path)), world_size=2, ranks=range(2), device="cpu")
    try:
        while not context.join(timeout=1.0):
            assert time.monotonic() - started < 150, "the ranks did not finish"
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert all(o.ok for outcomes in rank0["outcomes"] for o in outcomes)
    assert rank0["tiers"] == rank1["tiers"] and sorted(rank0["tiers"].values()) == ["disk", "gpu", "gpu"]
    assert rank0["files"] == rank1["files"] and len(rank0["files"]) == 1
    assert (tmp_path / "spill" / "rank0").is_dir() and (tmp_path / "spill" / "rank1").is_dir()

    engine = build_rank_engine(spec, None)  # the reference: one process, no group
    store = stores.build(engine, 9)
    executor = PlanExecutor(engine, store)
    ref = [executor.execute(plan) for plan in plans()]
    for m in IDS:
        assert torch.equal(rank0["rows"][m], rank1["rows"][m])
        torch.testing.assert_close(rank0["rows"][m], store.peek(m).rows, rtol=1e-5, atol=1e-6)
    assert [[o.ok for o in p] for p in ref] == [[o.ok for o in p] for p in rank0["outcomes"]]

"""The FSDP2 scenario of tests/integration/test_distributed.py, shared with tests/gpu/test_distributed_cuda.py and the
other multi-rank tests: a picklable tiny-model loader, the plans (5 mixed steps of 3 adapters, then edge cases), the
spawned ranks' scenario and its world-size-1 reference, and the comparison of two runs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.models import load_base_model
from loraplex.protocol import BatchPlan, Outcome, PlannedRequest, RequestKind, Step, StepKind
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.ranks.distributed import RankGroup, is_sharded
from loraplex.workers.ranks.rank_loop import EngineSpec, LeaderExecutor, build_rank_engine, follow, spawn_ranks

ADAPTERS = [("a", 2, 4.0, 1), ("b", 4, 16.0, 2), ("c", 8, 8.0, 3)]  # model_id, rank, alpha, seed
ENGINE_CONFIG = EngineConfig(num_slots=4, max_rank=8, microbatch_tokens=96)  # several microbatches per rank
ADAM = {"learning_rate": 1e-2, "weight_decay": 0.01, "grad_clip_norm": 5.0}
VOCAB = 512  # the tiny preset's
# Datum lengths per step for (a, b, forward-only c, c): odd sequence counts, uneven token splits, and unequal
# microbatch counts per rank (the rank with fewer runs dummy microbatches, with a backward when the other trains).
LENGTHS = [
    ([7, 31, 5], [60, 9], [12], [3, 44, 2]),
    ([40, 2], [3], [30], [5, 70]),
    ([5, 5, 5, 5, 5], [90], [8, 8], [64]),
    ([33], [2, 17, 4], [50, 1], [9]),
    ([70, 3, 3], [6, 6], [2], [11, 12, 13]),
]


@dataclass(frozen=True)
class TinyLoader:
    """Picklable model loader for the spawned ranks."""

    folder: str
    dtype: str = "float32"

    def __call__(self, device: torch.device) -> torch.nn.Module:
        return load_base_model(self.folder, Path(self.folder).parent, getattr(torch, self.dtype), device)[0]


def _req(rid: str, model_id: str, kind: RequestKind, **payload: Any) -> PlannedRequest:
    return PlannedRequest(request_id=rid, tenant_id="t", model_id=model_id, seq_id=0, kind=kind, payload=payload)


def _data(seed: int, lengths: list[int], rl: bool = False) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n + 1,), generator=g).tolist()
        inputs: dict[str, Any] = {"target_tokens": ids[1:]}
        if rl:
            inputs |= {"logprobs": [-6.0] * n, "advantages": torch.randn(n, generator=g).tolist()}
        out.append({"model_input": ids[:-1], "loss_fn_inputs": inputs})
    return out


def _fb(rid: str, model_id: str, data: list[dict[str, Any]], loss_fn: str = "cross_entropy") -> PlannedRequest:
    return _req(rid, model_id, RequestKind.FORWARD_BACKWARD, data=data, loss_fn=loss_fn)


def _optim(tag: str, model_ids: str = "abc") -> Step:
    return Step(
        StepKind.OPTIM_STEP, tuple(_req(f"{tag}-o{m}", m, RequestKind.OPTIM_STEP, adam_params=ADAM) for m in model_ids)
    )


def make_plans() -> list[BatchPlan]:
    create = Step(
        StepKind.CREATE,
        tuple(_req(f"create-{m}", m, RequestKind.CREATE_ADAPTER, rank=r, alpha=al, seed=s) for m, r, al, s in ADAPTERS),
    )
    plans = [BatchPlan((create,))]
    for step, (la, lb, lf, lc) in enumerate(LENGTHS):
        k = 100 * step
        fb = Step(
            StepKind.FORWARD_BACKWARD,
            (
                _fb(f"s{step}-a", "a", _data(k + 1, la)),
                _fb(f"s{step}-b", "b", _data(k + 2, lb), "ppo" if step % 2 else "cross_entropy"),
                _req(f"s{step}-fwd", "c", RequestKind.FORWARD, data=_data(k + 3, lf), loss_fn="cross_entropy"),
                _fb(f"s{step}-c", "c", _data(k + 4, lc, rl=True), "importance_sampling"),
            ),
        )
        plans.append(BatchPlan((fb, _optim(f"s{step}"))))
    # (d) one sequence for two ranks, then a forward-only plan (no backward anywhere)
    plans.append(BatchPlan((Step(StepKind.FORWARD_BACKWARD, (_fb("d-a", "a", _data(7, [11])),)), _optim("d", "a"))))
    plans.append(BatchPlan((Step(StepKind.FORWARD_BACKWARD, (_req("d-fwd", "b", RequestKind.FORWARD, data=_data(8, [4, 20]), loss_fn="cross_entropy"),)),)))  # fmt: skip
    # (e) a token out of the vocabulary fails its request alone; the next plan still runs in step
    bad = [{"model_input": [1, 2, 10**6], "loss_fn_inputs": {"target_tokens": [2, 3, 4]}}]
    plans.append(
        BatchPlan(
            (
                Step(StepKind.FORWARD_BACKWARD, (_fb("e-a", "a", _data(9, [6, 13])), _fb("e-bad", "b", bad), _fb("e-c", "c", _data(10, [17])))),
                _optim("e", "ac"),
            )
        )
    )  # fmt: skip
    plans.append(
        BatchPlan((Step(StepKind.FORWARD_BACKWARD, (_fb("f-b", "b", _data(11, [25, 8, 3])),)), _optim("f", "b")))
    )
    return plans


def _state(engine: Engine) -> dict[str, Any]:
    """What each rank reports: adapter weights, raw banks and Adam state, and how parameters are held."""
    banks = {
        name: (b.lora_A.detach().cpu().clone(), b.lora_B.detach().cpu().clone()) for name, b in engine.banks.items()
    }
    lora_ids = {id(p) for pair in ((b.lora_A, b.lora_B) for b in engine.banks.values()) for p in pair}
    base = {
        name: (is_sharded(p), tuple(p.shape), tuple(p.to_local().shape) if is_sharded(p) else None)
        for name, p in engine.model.named_parameters()
        if id(p) not in lora_ids
    }
    lora = {
        name: (type(p).__name__, is_sharded(p), tuple(p.shape))
        for name, p in engine.model.named_parameters()
        if id(p) in lora_ids
    }
    return {
        "weights": {m: engine.adapter_weights(m) for m, *_ in ADAPTERS},
        "banks": banks,
        "adam": [t.cpu().clone() for t in (*engine.optimizer.exp_avg, *engine.optimizer.exp_avg_sq)],
        "steps": list(engine.optimizer.steps),
        "base": base,
        "lora": lora,
    }


def _scenario(group: RankGroup, spec: EngineSpec, plans: list[BatchPlan], out_dir: str) -> None:
    """Each spawned rank: rank 0 leads the plans through LeaderExecutor, rank 1 follows; both report their state."""
    engine = build_rank_engine(spec, group)
    report: dict[str, Any] = {}
    if group.is_leader:
        leader = LeaderExecutor(PlanExecutor(engine), group)
        report["outcomes"] = [leader.execute(plan) for plan in plans]
        leader.close()
    else:
        report["followed"] = follow(PlanExecutor(engine), group)
    report["state"] = _state(engine)
    torch.save(report, Path(out_dir) / f"rank{group.rank}.pt")


def run_ranks(world: int, device: str, spec: EngineSpec, plans: list[BatchPlan], out: Path) -> list[dict[str, Any]]:
    """Spawn `world` ranks running _scenario; their reports, in rank order."""
    started = time.monotonic()
    context, _ = spawn_ranks(_scenario, (spec, plans, str(out)), world_size=world, ranks=range(world), device=device)
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() - started > 120:
                raise TimeoutError(f"the {world} ranks did not finish in 120 s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def run_one_process(spec: EngineSpec, plans: list[BatchPlan]) -> dict[str, Any]:
    """The reference: the same plans on one engine without any process group."""
    engine = build_rank_engine(spec, None)
    executor = PlanExecutor(engine)
    return {"outcomes": [executor.execute(plan) for plan in plans], "state": _state(engine)}


def assert_outcomes_close(got: list[Outcome], want: list[Outcome]) -> None:
    assert [o.request_id for o in got] == [o.request_id for o in want]
    for g, w in zip(got, want, strict=True):
        assert (g.error_type, g.ok) == (w.error_type, w.ok), (g, w)
        if not w.ok or w.result is None:
            continue
        assert g.result is not None and type(g.result) is type(w.result), (g, w)
        gw, ww = g.result.to_wire(), w.result.to_wire()
        assert set(gw) == set(ww)
        for key, value in ww.get("metrics", {}).items():
            assert gw["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), (g.request_id, key)
        for dg, dw in zip(gw.get("loss_fn_outputs", []), ww.get("loss_fn_outputs", []), strict=True):
            torch.testing.assert_close(torch.tensor(dg["logprobs"]), torch.tensor(dw["logprobs"]), atol=1e-5, rtol=0)


def assert_same_run(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Every outcome and the adapters' final weights agree (fp32, 1e-5)."""
    for got_plan, want_plan in zip(got["outcomes"], want["outcomes"], strict=True):
        assert_outcomes_close(got_plan, want_plan)
    moved = 0.0
    for model_id, *_ in ADAPTERS:
        for name, (a1, b1) in want["state"]["weights"][model_id].items():
            a2, b2 = got["state"]["weights"][model_id][name]
            torch.testing.assert_close(a2, a1, atol=1e-5, rtol=0)
            torch.testing.assert_close(b2, b1, atol=1e-5, rtol=0)
            moved = max(moved, float(b1.abs().max()))
    assert moved > 1e-2  # the adapters really trained (B starts at zero)
    assert got["state"]["steps"] == want["state"]["steps"]

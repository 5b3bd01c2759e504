"""Checkpoints restore on any world size, through the real rank loop (2 gloo ranks on CPU: rank 0 leads the plans
through LeaderExecutor, rank 1 follows) and the executor's CHECKPOINT and CREATE-from-checkpoint steps, with the
payloads the gateway produces.

(a) 1 -> 2: world size 1 trains "a" 3 steps and saves its state; world size 2 creates "b" from that checkpoint and
    trains 3 more steps, which match world size 1 continuing "a" (losses, logprobs and weights within 1e-5: the 2-rank
    reduction order differs, so bits may too).
(b) 2 -> 1: world size 2 trains "c" 3 steps, saves (the folder is written once, by the leader) and continues 3 steps;
    world size 1 creates "d" from that checkpoint and the same 3 steps match.

One spawn of two ranks serves both directions: the world-size-1 runs happen in the test process, before and after it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.models import resolve
from loraplex.protocol import BatchPlan, Outcome, PlannedRequest, RequestKind, Step, StepKind
from loraplex.settings import DEFAULT_TARGET_MODULES
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.ranks.distributed import RankGroup
from loraplex.workers.ranks.rank_loop import EngineSpec, LeaderExecutor, build_rank_engine, follow, spawn_ranks
from loraplex.workers.state.checkpoint import MANIFEST_FILE, OPTIMIZER_FILE, WEIGHTS_FILE, read_checkpoint
from tests.helpers.distributed import TinyLoader

pytestmark = [pytest.mark.timeout(180)]

ENGINE_CONFIG = EngineConfig(num_slots=4, max_rank=8, microbatch_tokens=96)  # several microbatches per rank
RANK, ALPHA, SEED = 4, 8.0, 11
ADAM = {"learning_rate": 1e-2, "weight_decay": 0.01, "grad_clip_norm": 5.0}
VOCAB = 512  # the tiny preset's
# Datum lengths of the 6 steps (3 before the save, 3 after): odd counts, uneven splits across the 2 ranks.
LENGTHS = [[7, 31, 5], [40, 2, 9], [5, 5, 5, 5, 5], [33, 3], [70, 3, 3], [2, 17, 4]]
BEFORE, AFTER = range(3), range(3, 6)


def _req(rid: str, model_id: str, kind: RequestKind, **payload: Any) -> PlannedRequest:
    return PlannedRequest(request_id=rid, tenant_id="t", model_id=model_id, seq_id=0, kind=kind, payload=payload)


def _data(step: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for n in LENGTHS[step]:
        ids = torch.randint(0, VOCAB, (n + 1,), generator=g).tolist()
        out.append({"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:]}})
    return out


def _create(model_id: str, from_directory: Path | None = None) -> BatchPlan:
    """The CREATE payload of routes/adapters.py (with from_checkpoint, rank/alpha/seed are the source adapter's)."""
    payload: dict[str, Any] = {
        "base_model": "tiny",
        "rank": RANK,
        "alpha": ALPHA,
        "seed": SEED,
        "target_modules": list(DEFAULT_TARGET_MODULES),
    }
    if from_directory is not None:
        payload["from_checkpoint"] = {
            "path": "tinker://src/weights/saved",
            "directory": str(from_directory),
            "with_optimizer": True,
        }
    return BatchPlan((Step(StepKind.CREATE, (_req(f"create-{model_id}", model_id, RequestKind.CREATE_ADAPTER, **payload),)),))  # fmt: skip


def _save(model_id: str, directory: Path) -> Step:
    """A save_state CHECKPOINT step with the payload of routes/checkpoints.py."""
    payload = {
        "name": "saved",
        "path": f"tinker://{model_id}/weights/saved",
        "directory": str(directory),
        "blob_uri": directory.as_uri(),
        "ttl_seconds": None,
        "base_model": "tiny",
        "overwrite": False,
    }
    return Step(StepKind.CHECKPOINT, (_req(f"save-{model_id}", model_id, RequestKind.SAVE_STATE, **payload),))


def _train(model_id: str, steps: range, save_to: Path | None = None) -> list[BatchPlan]:
    """One plan per step (forward_backward, optim_step); a save, when asked, right after the last optim step."""
    plans = []
    for k in steps:
        fb = Step(StepKind.FORWARD_BACKWARD, (_req(f"fb{k}-{model_id}", model_id, RequestKind.FORWARD_BACKWARD, data=_data(k), loss_fn="cross_entropy"),))  # fmt: skip
        opt = Step(StepKind.OPTIM_STEP, (_req(f"o{k}-{model_id}", model_id, RequestKind.OPTIM_STEP, adam_params=ADAM),))  # fmt: skip
        last = save_to is not None and k == steps[-1]
        plans.append(BatchPlan((fb, opt, _save(model_id, save_to)) if last else (fb, opt)))  # type: ignore[arg-type]
    return plans


def _report(engine: Any, model_ids: tuple[str, ...]) -> dict[str, Any]:
    return {
        "weights": {m: engine.adapter_weights(m) for m in model_ids},
        "steps": {m: int(engine.optimizer.steps[engine.adapter(m).slot]) for m in model_ids},
    }


def _scenario(group: RankGroup, spec: EngineSpec, plans: list[BatchPlan], out_dir: str) -> None:
    """Each spawned rank: rank 0 leads, rank 1 follows; both count the checkpoint writes they made."""
    from loraplex.workers.state import checkpoint

    writes: list[str] = []
    write = checkpoint.write_checkpoint

    def counted(state: Any, directory: Path) -> Any:
        writes.append(str(directory))
        return write(state, directory)

    checkpoint.write_checkpoint = counted  # the executor imports it from the module at each save
    engine = build_rank_engine(spec, group)
    report: dict[str, Any] = {"writes": writes}
    if group.is_leader:
        leader = LeaderExecutor(PlanExecutor(engine), group)
        report["outcomes"] = [o for plan in plans for o in leader.execute(plan)]
        leader.close()
    else:
        report["followed"] = follow(PlanExecutor(engine), group)
    report |= _report(engine, ("b", "c"))
    torch.save(report, Path(out_dir) / f"rank{group.rank}.pt")


def _run_two_ranks(spec: EngineSpec, plans: list[BatchPlan], out: Path) -> list[dict[str, Any]]:
    """Spawn 2 ranks running _scenario (as test_distributed.run_ranks does); their reports, in rank order."""
    started = time.monotonic()
    context, _ = spawn_ranks(_scenario, (spec, plans, str(out)), world_size=2, ranks=range(2), device="cpu")
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() - started > 120:
                raise TimeoutError("the 2 ranks did not finish in 120 s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _run_here(executor: PlanExecutor, plans: list[BatchPlan]) -> list[Outcome]:
    return [o for plan in plans for o in executor.execute(plan)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("ckpt-dist")
    spec = EngineSpec(TinyLoader(str(resolve("tiny", tmp_path_factory.getbasetemp() / "model-cache"))), "cpu", ENGINE_CONFIG)  # fmt: skip
    saved_on_1, saved_on_2 = base / "blobs" / "a-saved-on-1", base / "blobs" / "c-saved-on-2"

    one = build_rank_engine(spec, None)  # world size 1: no process group at all
    ex_one = PlanExecutor(one)
    before_a = _run_here(ex_one, [_create("a"), *_train("a", BEFORE, save_to=saved_on_1)])
    after_a = _run_here(ex_one, _train("a", AFTER))

    two_plans = [
        _create("b", saved_on_1), *_train("b", AFTER),  # (a) continue a's checkpoint on 2 ranks
        _create("c"), *_train("c", BEFORE, save_to=saved_on_2), *_train("c", AFTER),  # (b) save on 2 ranks
    ]  # fmt: skip
    ranks_out = base / "ranks"
    ranks_out.mkdir()
    two = _run_two_ranks(spec, two_plans, ranks_out)

    after_d = _run_here(ex_one, [_create("d", saved_on_2), *_train("d", AFTER)])  # (b) load on 1 rank
    return {
        "saved_on_1": saved_on_1,
        "saved_on_2": saved_on_2,
        "one": {"outcomes": before_a + after_a + after_d, **_report(one, ("a", "d"))},
        "two": two,
        "plans_on_two": len(two_plans),
    }


def _by_id(outcomes: list[Outcome]) -> dict[str, Outcome]:
    return {o.request_id: o for o in outcomes}


def _assert_same_training(got: dict[str, Outcome], got_id: str, want: dict[str, Outcome], want_id: str) -> None:
    """The AFTER steps of adapter got_id match those of want_id: loss, per-token logprobs, grad norms."""
    for k in AFTER:
        g, w = got[f"fb{k}-{got_id}"], want[f"fb{k}-{want_id}"]
        assert g.ok and w.ok, (g, w)
        for key, value in w.result.to_wire()["metrics"].items():  # type: ignore[union-attr]
            assert g.result.to_wire()["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), (k, key)  # type: ignore[union-attr]
        for dg, dw in zip(g.result.to_wire()["loss_fn_outputs"], w.result.to_wire()["loss_fn_outputs"], strict=True):  # type: ignore[union-attr]
            torch.testing.assert_close(torch.tensor(dg["logprobs"]), torch.tensor(dw["logprobs"]), atol=1e-5, rtol=0)
        og, ow = got[f"o{k}-{got_id}"], want[f"o{k}-{want_id}"]
        assert og.ok and ow.ok, (og, ow)
        for key, value in ow.result.to_wire()["metrics"].items():  # type: ignore[union-attr]
            assert og.result.to_wire()["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), (k, key)  # type: ignore[union-attr]


def _assert_same_weights(got: dict[str, tuple[torch.Tensor, torch.Tensor]], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    moved = 0.0
    for name, (a1, b1) in want.items():
        a2, b2 = got[name]
        torch.testing.assert_close(a2, a1, atol=1e-5, rtol=0)
        torch.testing.assert_close(b2, b1, atol=1e-5, rtol=0)
        moved = max(moved, float(b1.abs().max()))
    assert moved > 1e-2  # really trained (B starts at zero)


def test_saved_on_one_rank_continues_on_two(runs: dict[str, Any]) -> None:
    leader, follower = runs["two"]
    assert follower["followed"] == runs["plans_on_two"]
    one, two = _by_id(runs["one"]["outcomes"]), _by_id(leader["outcomes"])
    assert one["save-a"].ok and one["save-a"].result.to_wire()["step"] == 3  # type: ignore[union-attr]
    assert two["create-b"].ok, two["create-b"]
    _assert_same_training(two, "b", one, "a")
    _assert_same_weights(leader["weights"]["b"], runs["one"]["weights"]["a"])
    assert leader["steps"]["b"] == runs["one"]["steps"]["a"] == 6
    for name, (a, b) in leader["weights"]["b"].items():  # the ranks hold the same adapter, bit for bit
        fa, fb = follower["weights"]["b"][name]
        assert torch.equal(a, fa) and torch.equal(b, fb), name


def test_saved_on_two_ranks_continues_on_one(runs: dict[str, Any]) -> None:
    leader, follower = runs["two"]
    directory: Path = runs["saved_on_2"]
    # written once, by the leader; the follower wrote nothing
    assert leader["writes"] == [str(directory)] and follower["writes"] == []
    assert sorted(p.name for p in directory.parent.iterdir()) == sorted([directory.name, runs["saved_on_1"].name])
    assert sorted(p.name for p in directory.iterdir()) == sorted([MANIFEST_FILE, WEIGHTS_FILE, OPTIMIZER_FILE])
    two = _by_id(leader["outcomes"])
    saved = two["save-c"]
    assert saved.ok and saved.result.to_wire()["step"] == 3 and saved.result.to_wire()["size_bytes"] > 0, saved  # type: ignore[union-attr]

    # What 2 ranks saved is what 1 rank saved after the same 3 steps from the same seed (up to reduction order).
    on_two, on_one = read_checkpoint(directory), read_checkpoint(runs["saved_on_1"])
    for name, (a, b) in on_one.weights.items():
        torch.testing.assert_close(on_two.weights[name][0], a, atol=1e-5, rtol=0)
        torch.testing.assert_close(on_two.weights[name][1], b, atol=1e-5, rtol=0)
    assert on_two.step == on_one.step == 3 and on_two.optimizer is not None

    one = _by_id(runs["one"]["outcomes"])
    assert one["create-d"].ok, one["create-d"]
    _assert_same_training(one, "d", two, "c")
    _assert_same_weights(runs["one"]["weights"]["d"], leader["weights"]["c"])
    assert runs["one"]["steps"]["d"] == leader["steps"]["c"] == 6

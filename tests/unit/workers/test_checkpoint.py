"""Checkpoints through the engine: save_state after training, load into a new adapter (another slot of another engine)
or over an existing one, and training continues bit-identically to the uninterrupted run; weights-only loads restart
Adam; signatures that do not fit the pool are refused with the engine untouched."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.state.checkpoint import OPTIMIZER_FILE, CheckpointState, read_checkpoint, write_checkpoint
from loraplex.workers.state.checkpoint_state import load_into_engine, state_from_engine
from tests.helpers.datums import datums

ADAM = {"learning_rate": 1e-2, "beta2": 0.99, "weight_decay": 0.01, "grad_clip_norm": 5.0}
RANK, ALPHA, SEED = 4, 8.0, 7


def new_engine(tiny_dir: Path, **kwargs: Any) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    return build_engine(model, EngineConfig(**{"num_slots": 3, "max_rank": 8, **kwargs}))


def make_data(seed: int, lengths: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        ids = torch.randint(0, 512, (n + 1,), generator=g).tolist()
        data.append({"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:], "weights": [1.0] * n}})
    return data


DATA = make_data(3, [6, 11, 9])


def train(engine: Engine, model_id: str, steps: int, adam: dict[str, float] = ADAM) -> list[float]:
    losses = []
    for _ in range(steps):
        out = engine.forward_backward([engine.prepare(model_id, datums(DATA), "cross_entropy", None, False)])[0]
        losses.append(out["metrics"]["loss:sum"])
        (res,) = engine.optim_step([(model_id, adam)])
        assert "metrics" in res, res
    return losses


def full_state(engine: Engine, model_id: str) -> CheckpointState:
    return state_from_engine(engine, model_id, base_model="tiny", with_optimizer=True)


def assert_same_state(got: CheckpointState, want: CheckpointState, *, optimizer: bool = True) -> None:
    assert (got.rank, got.alpha) == (want.rank, want.alpha)
    if optimizer:
        assert got.step == want.step
    for name in want.modules:
        for x, y in zip(got.weights[name], want.weights[name], strict=True):
            assert torch.equal(x, y), name
        if optimizer:
            assert got.optimizer is not None and want.optimizer is not None
            for x, y in zip(got.optimizer[name], want.optimizer[name], strict=True):
                assert torch.equal(x, y), name


def engine_fingerprint(engine: Engine) -> tuple:
    opt = engine.optimizer
    return (
        engine.adapters,
        engine.free_slots,
        list(opt.steps),
        *(t.clone() for t in (opt.data, opt.grad, opt.exp_avg_flat, opt.exp_avg_sq_flat)),
    )


def assert_unchanged(engine: Engine, before: tuple) -> None:
    after = engine_fingerprint(engine)
    assert after[:3] == before[:3]
    for x, y in zip(after[3:], before[3:], strict=True):
        assert torch.equal(x, y)


@pytest.fixture(scope="module")
def run(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run: 3 steps, save_state (to disk), 3 more steps; what the restored runs must reproduce."""
    engine = new_engine(tiny_dir)
    engine.create_adapter("neighbour", 2, 4.0, seed=11)  # our adapter sits in slot 1
    engine.create_adapter("a", RANK, ALPHA, seed=SEED)
    train(engine, "a", 3)
    directory = tmp_path_factory.mktemp("ckpt") / "step3"
    saved = full_state(engine, "a")
    write_checkpoint(saved, directory)
    losses = train(engine, "a", 3)
    return {"dir": directory, "saved": saved, "losses": losses, "final": full_state(engine, "a")}


def test_saved_state_has_moments_and_step(run: dict[str, Any]) -> None:
    saved: CheckpointState = run["saved"]
    assert saved.step == 3 and saved.kind == "state" and saved.optimizer is not None
    assert all(m.abs().sum() > 0 and v.abs().sum() > 0 for m, v, _, _ in saved.optimizer.values())
    assert all(b.abs().sum() > 0 for _, b in saved.weights.values())  # B moved off zero
    assert (directory := run["dir"] / OPTIMIZER_FILE).is_file(), directory
    assert_same_state(read_checkpoint(run["dir"]), saved)


def test_load_into_new_adapter_of_another_engine_continues_bit_identically(tiny_dir: Path, run: dict) -> None:
    engine = new_engine(tiny_dir, num_slots=4)
    for i in range(2):  # another slot than the original's (slot 1)
        engine.create_adapter(f"other{i}", 3, 3.0, seed=i)
    record = load_into_engine(engine, read_checkpoint(run["dir"]), "b", with_optimizer=True, existing=False)
    assert record.slot == 2 and (record.rank, record.alpha, record.seed) == (RANK, ALPHA, SEED)
    assert engine.optimizer.steps[record.slot] == 3
    assert train(engine, "b", 3) == run["losses"]  # exact float equality
    assert_same_state(full_state(engine, "b"), run["final"])


def test_load_into_pool_with_larger_r_max_continues_bit_identically(tiny_dir: Path, run: dict) -> None:
    """Zero padding up to a larger r_max changes nothing (without clipping the norm reduction is not involved)."""
    adam = {k: v for k, v in ADAM.items() if k != "grad_clip_norm"}
    reference = new_engine(tiny_dir)
    load_into_engine(reference, read_checkpoint(run["dir"]), "a", with_optimizer=True, existing=False)
    wide = new_engine(tiny_dir, max_rank=16, num_slots=2)
    load_into_engine(wide, read_checkpoint(run["dir"]), "a", with_optimizer=True, existing=False)
    assert train(wide, "a", 3, adam) == train(reference, "a", 3, adam)
    assert_same_state(full_state(wide, "a"), full_state(reference, "a"))


def test_load_over_existing_adapter_continues_bit_identically(tiny_dir: Path, run: dict) -> None:
    engine = new_engine(tiny_dir)
    engine.create_adapter("x", 2, 2.0, seed=5)  # another rank, alpha and seed than the checkpoint's
    engine.create_adapter("bystander", 3, 6.0, seed=9)
    train(engine, "x", 2)
    train(engine, "bystander", 1)
    engine.forward_backward(
        [engine.prepare("x", datums(DATA), "cross_entropy", None, False)]
    )  # unconsumed gradients on x
    bystander = full_state(engine, "bystander")
    slot = engine.adapter("x").slot

    record = load_into_engine(engine, read_checkpoint(run["dir"]), "x", with_optimizer=True, existing=True)
    assert record.slot == slot and (record.rank, record.alpha, record.seed) == (RANK, ALPHA, SEED)
    assert engine.adapter("x") == record
    assert all(ga.abs().sum() == 0 and gb.abs().sum() == 0 for ga, gb in engine.adapter_grads("x").values())
    assert engine.optimizer.steps[slot] == 3
    assert train(engine, "x", 3) == run["losses"]
    assert_same_state(full_state(engine, "x"), run["final"])
    assert_same_state(full_state(engine, "bystander"), bystander)  # the other slot untouched


def test_load_without_optimizer_restarts_adam_from_the_weights(tiny_dir: Path, run: dict) -> None:
    state = read_checkpoint(run["dir"])
    engine = new_engine(tiny_dir)
    record = load_into_engine(engine, state, "w", with_optimizer=False, existing=False)
    assert engine.optimizer.steps[record.slot] == 0
    assert engine.optimizer.exp_avg_flat[record.slot].abs().sum() == 0
    assert engine.optimizer.exp_avg_sq_flat[record.slot].abs().sum() == 0
    assert_same_state(state_from_engine(engine, "w", base_model="tiny", with_optimizer=False), state, optimizer=False)
    # Reference: a fresh adapter given those weights, fresh AdamW.
    engine.create_adapter("fresh", RANK, ALPHA, seed=123)
    engine.load_adapter_weights("fresh", {n: (a.t(), b.t()) for n, (a, b) in state.weights.items()})
    losses = train(engine, "w", 3)
    assert losses == train(engine, "fresh", 3)
    assert_same_state(full_state(engine, "w"), full_state(engine, "fresh"))
    # ...which differs from continuing with the saved moments.
    assert losses[0] == run["losses"][0]  # same weights: same first loss
    assert losses[1:] != run["losses"][1:]
    final = full_state(engine, "w")
    assert any(not torch.equal(final.weights[n][1], run["final"].weights[n][1]) for n in state.modules)


def test_existing_load_of_weights_only_clears_moments_and_step(tiny_dir: Path, run: dict) -> None:
    engine = new_engine(tiny_dir)
    engine.create_adapter("x", RANK, ALPHA, seed=1)
    train(engine, "x", 2)
    record = load_into_engine(engine, read_checkpoint(run["dir"]), "x", with_optimizer=False, existing=True)
    assert engine.optimizer.steps[record.slot] == 0
    assert engine.optimizer.exp_avg_flat[record.slot].abs().sum() == 0


def test_rank_above_pool_max_is_refused_engine_unchanged(tiny_dir: Path, run: dict) -> None:
    engine = new_engine(tiny_dir, max_rank=2)
    engine.create_adapter("x", 2, 2.0, seed=1)
    train(engine, "x", 1)
    before = engine_fingerprint(engine)
    state = read_checkpoint(run["dir"])
    with pytest.raises(InvalidRequestError, match="rank 4 exceeds this pool's max rank 2"):
        load_into_engine(engine, state, "new", with_optimizer=True, existing=False)
    with pytest.raises(InvalidRequestError, match="max rank"):
        load_into_engine(engine, state, "x", with_optimizer=True, existing=True)
    assert_unchanged(engine, before)


def test_other_target_modules_are_refused_engine_unchanged(tiny_dir: Path, run: dict) -> None:
    engine = new_engine(tiny_dir, target_modules=("q_proj", "v_proj"))
    before = engine_fingerprint(engine)
    with pytest.raises(InvalidRequestError, match="target modules") as info:
        load_into_engine(engine, read_checkpoint(run["dir"]), "new", with_optimizer=True, existing=False)
    assert "k_proj" in str(info.value)  # names what differs
    assert_unchanged(engine, before)


def test_other_modules_or_shapes_are_refused(tiny_dir: Path, run: dict) -> None:
    state = read_checkpoint(run["dir"])
    engine = new_engine(tiny_dir)
    before = engine_fingerprint(engine)
    # Same target set, but only layer 0 (a checkpoint of a shallower model).
    kept = tuple(m for m in state.modules if ".layers.0." in m)
    assert state.optimizer is not None
    shallow = dataclasses.replace(
        state,
        modules=kept,
        weights={m: state.weights[m] for m in kept},
        optimizer={m: state.optimizer[m] for m in kept},
    )
    with pytest.raises(InvalidRequestError, match="modules do not match"):
        load_into_engine(engine, shallow, "new", with_optimizer=True, existing=False)
    # Same names, another width (a different base model).
    name = state.modules[0]
    a, b = state.weights[name]
    wider = dataclasses.replace(
        state,
        weights={**state.weights, name: (torch.zeros(a.shape[0], a.shape[1] + 8), b)},
        optimizer={**state.optimizer, name: (torch.zeros(a.shape[0], a.shape[1] + 8),) * 2 + state.optimizer[name][2:]},
    )
    with pytest.raises(InvalidRequestError, match=name.replace(".", r"\.")):
        load_into_engine(engine, wider, "new", with_optimizer=True, existing=False)
    assert_unchanged(engine, before)


def test_unknown_or_taken_adapter_ids(tiny_dir: Path, run: dict) -> None:
    engine = new_engine(tiny_dir)
    engine.create_adapter("x", 2, 2.0, seed=1)
    before = engine_fingerprint(engine)
    state = read_checkpoint(run["dir"])
    with pytest.raises(NotFoundError):
        load_into_engine(engine, state, "missing", with_optimizer=True, existing=True)
    with pytest.raises(ConflictError):
        load_into_engine(engine, state, "x", with_optimizer=True, existing=False)
    assert_unchanged(engine, before)


def test_sampler_checkpoint_is_weights_only(tiny_dir: Path, run: dict, tmp_path: Path) -> None:
    engine = new_engine(tiny_dir)
    load_into_engine(engine, read_checkpoint(run["dir"]), "a", with_optimizer=True, existing=False)
    sampler = state_from_engine(engine, "a", base_model="tiny", with_optimizer=False)
    assert sampler.kind == "sampler" and sampler.optimizer is None and sampler.step == 3
    files = write_checkpoint(sampler, tmp_path / "s")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["adapter_model.safetensors", "checkpoint.json"]
    assert set(files.files) == {"adapter_model.safetensors", "checkpoint.json"}
    back = read_checkpoint(tmp_path / "s")
    assert back.kind == "sampler" and back.optimizer is None
    assert_same_state(back, run["saved"], optimizer=False)
    with pytest.raises(InvalidRequestError, match="no optimizer state"):
        load_into_engine(engine, back, "b", with_optimizer=True, existing=False)
    assert "b" not in engine.adapters
    load_into_engine(engine, back, "b", with_optimizer=False, existing=False)
    with pytest.raises(InvalidRequestError, match="weights only"):
        state_from_engine(engine, "a", base_model="tiny", with_optimizer=True, kind="sampler")

"""Mixed-adapter batches: same results as each adapter alone, isolation, bit-identical twins, microbatching,
forward-only rows, batched-vs-alone logprobs, and create-after-delete starting from the seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.errors import NotFoundError
from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from tests.helpers.datums import datums, with_datums
from tests.helpers.lora import make_data

ADAPTERS = [("a", 2, 4.0, 1), ("b", 4, 16.0, 2), ("c", 8, 8.0, 3)]  # model_id, rank, alpha, seed


def make_engine(tiny_dir: Path, **kw) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    return build_engine(model, EngineConfig(**{"num_slots": 4, "max_rank": 8, **kw}))


def with_adapters(engine: Engine, adapters=ADAPTERS) -> Engine:
    """Create the adapters and give B seeded non-zero values, so each adapter really changes the outputs."""
    for model_id, rank, alpha, seed in adapters:
        engine.create_adapter(model_id, rank, alpha, seed)
        g = torch.Generator().manual_seed(seed + 1000)
        weights = {
            n: (a, 0.05 * torch.randn(b.shape, generator=g)) for n, (a, b) in engine.adapter_weights(model_id).items()
        }
        engine.load_adapter_weights(model_id, weights)
    return engine


DATA = {"a": make_data(10, [5, 9]), "b": make_data(11, [13, 2, 7]), "c": make_data(12, [6])}


def assert_results_close(x: dict, y: dict, atol: float = 1e-5) -> None:
    assert x["metrics"]["loss:sum"] == pytest.approx(y["metrics"]["loss:sum"], abs=10 * atol)
    for dx, dy in zip(x["loss_fn_outputs"], y["loss_fn_outputs"], strict=True):
        torch.testing.assert_close(torch.tensor(dx["logprobs"]), torch.tensor(dy["logprobs"]), atol=atol, rtol=0)


def assert_grads_close(e1: Engine, e2: Engine, model_id: str, atol: float = 1e-5) -> None:
    g1, g2 = e1.adapter_grads(model_id), e2.adapter_grads(model_id)
    for name in g1:
        for t1, t2 in zip(g1[name], g2[name], strict=True):
            torch.testing.assert_close(t1, t2, atol=atol, rtol=1e-5)


def test_mixed_batch_equals_each_adapter_alone(tiny_dir: Path) -> None:
    mixed, alone = with_adapters(make_engine(tiny_dir)), with_adapters(make_engine(tiny_dir))
    # Interleaved on purpose: the engine lays rows out adapter-contiguous itself.
    items = [("b", DATA["b"][:1], "cross_entropy", None, False), ("a", DATA["a"], "cross_entropy", None, False)]
    items += [("c", DATA["c"], "cross_entropy", None, False), ("b", DATA["b"][1:], "cross_entropy", None, False)]
    got = mixed.forward_backward([mixed.prepare(*with_datums(it)) for it in items])
    for item, res in zip(items, got, strict=True):
        assert_results_close(res, alone.forward_backward([alone.prepare(*with_datums(item))])[0])
    for model_id, *_ in ADAPTERS:
        assert_grads_close(mixed, alone, model_id)
        assert any(g.abs().sum() > 0 for pair in mixed.adapter_grads(model_id).values() for g in pair)


def test_an_adapter_is_untouched_while_others_train(tiny_dir: Path) -> None:
    engine = with_adapters(make_engine(tiny_dir))
    before = engine.forward_backward([engine.prepare("a", datums(DATA["a"]), "cross_entropy", None, True)])[0]
    weights_before = engine.adapter_weights("a")
    for _ in range(3):
        engine.forward_backward(
            [
                engine.prepare("b", datums(DATA["b"]), "cross_entropy", None, False),
                engine.prepare("c", datums(DATA["c"]), "cross_entropy", None, False),
            ]
        )
        assert all(r.get("metrics") for r in engine.optim_step([("b", None), ("c", {"learning_rate": 1e-2})]))
    after = engine.forward_backward([engine.prepare("a", datums(DATA["a"]), "cross_entropy", None, True)])[0]
    assert after == before  # bit-identical
    for name, (a, b) in engine.adapter_weights("a").items():
        assert torch.equal(a, weights_before[name][0]) and torch.equal(b, weights_before[name][1])
    assert all(torch.count_nonzero(g) == 0 for pair in engine.adapter_grads("a").values() for g in pair)
    assert engine.optimizer.steps[engine.adapter("a").slot] == 0


def test_twins_with_identical_data_stay_bit_identical(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    twins = [("t1", 4, 8.0, 5), ("other", 8, 8.0, 6), ("t2", 4, 8.0, 5)]
    with_adapters(engine, [(m, r, a, 5 if m != "other" else s) for m, r, a, s in twins])
    data = make_data(20, [7, 4])
    for step in range(3):
        items = [("t1", data, "cross_entropy", None, False), ("other", DATA["b"], "cross_entropy", None, False)]
        items.append(("t2", data, "cross_entropy", None, False))
        out = engine.forward_backward([engine.prepare(*with_datums(it)) for it in items])
        assert out[0] == out[2]
        res = engine.optim_step([("t2", {"learning_rate": 1e-2}), ("other", None), ("t1", {"learning_rate": 1e-2})])
        assert res[0] == res[2]
        if step == 1:  # also interleaved across calls: each twin alone in its own batch
            out1 = engine.forward_backward([engine.prepare("t1", datums(data), "cross_entropy", None, False)])
            out2 = engine.forward_backward([engine.prepare("t2", datums(data), "cross_entropy", None, False)])
            assert out1 == out2
            engine.optim_step([("t1", {"learning_rate": 1e-2})])
            engine.optim_step([("t2", {"learning_rate": 1e-2})])
    w1, w2 = engine.adapter_weights("t1"), engine.adapter_weights("t2")
    assert all(torch.equal(w1[n][i], w2[n][i]) for n in w1 for i in (0, 1))


def test_microbatching_equals_one_big_batch(tiny_dir: Path) -> None:
    small, big = with_adapters(make_engine(tiny_dir, microbatch_tokens=12)), with_adapters(make_engine(tiny_dir))
    items = [(m, DATA[m], "cross_entropy", None, False) for m in ("a", "b", "c")]
    from loraplex.workers.engine.batching import layout, split_microbatches

    # Lengths 5, 9 | 13, 2, 7 | 6 packed at 12 tokens: [5] [9] [13] (longer than the cap: alone) [2, 7] [6].
    assert len(split_microbatches(layout([small.prepare(*with_datums(it)) for it in items]), 12)) >= 4
    for got, expected in zip(
        small.forward_backward([small.prepare(*with_datums(it)) for it in items]),
        big.forward_backward([big.prepare(*with_datums(it)) for it in items]),
        strict=True,
    ):
        assert_results_close(got, expected)
    for model_id, *_ in ADAPTERS:
        assert_grads_close(small, big, model_id)


def test_forward_only_rows_give_no_gradient(tiny_dir: Path) -> None:
    engine, reference = with_adapters(make_engine(tiny_dir)), with_adapters(make_engine(tiny_dir))
    out = engine.forward_backward(
        [
            engine.prepare("a", datums(DATA["a"]), "cross_entropy", None, True),
            engine.prepare("b", datums(DATA["b"]), "cross_entropy", None, False),
        ]
    )
    assert all(torch.count_nonzero(g) == 0 for pair in engine.adapter_grads("a").values() for g in pair)
    ref = reference.forward_backward([reference.prepare("b", datums(DATA["b"]), "cross_entropy", None, False)])
    assert_results_close(out[1], ref[0])
    assert_grads_close(engine, reference, "b")
    # The same adapter forward-only and training in one batch: only the training rows count.
    engine2, reference2 = with_adapters(make_engine(tiny_dir)), with_adapters(make_engine(tiny_dir))
    engine2.forward_backward(
        [
            engine2.prepare("c", datums(DATA["c"]), "cross_entropy", None, False),
            engine2.prepare("c", datums(DATA["a"]), "cross_entropy", None, True),
        ]
    )
    reference2.forward_backward([reference2.prepare("c", datums(DATA["c"]), "cross_entropy", None, False)])
    assert_grads_close(engine2, reference2, "c")


def test_datum_logprobs_do_not_depend_on_batch_mates(tiny_dir: Path) -> None:
    engine = with_adapters(make_engine(tiny_dir))
    data = make_data(30, [3, 17, 1, 9])
    batched = engine.forward_backward([engine.prepare("b", datums(data), "cross_entropy", None, True)])[0]
    for d, got in zip(data, batched["loss_fn_outputs"], strict=True):
        out = engine.forward_backward([engine.prepare("b", datums([d]), "cross_entropy", None, True)])
        alone = out[0]["loss_fn_outputs"][0]
        assert len(got["logprobs"]) == len(d["model_input"])
        torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(alone["logprobs"]), atol=1e-5, rtol=0)


def test_create_after_delete_starts_from_the_seed(tiny_dir: Path) -> None:
    used, fresh = make_engine(tiny_dir, num_slots=1), make_engine(tiny_dir, num_slots=1)
    used.create_adapter("old", 8, 8.0, seed=1)
    for _ in range(2):
        used.forward_backward([used.prepare("old", datums(DATA["b"]), "cross_entropy", None, False)])
        used.optim_step([("old", {"learning_rate": 1e-2})])
    # Leave unconsumed gradients behind.
    used.forward_backward([used.prepare("old", datums(DATA["b"]), "cross_entropy", None, False)])
    used.delete_adapter("old")
    with pytest.raises(NotFoundError):
        used.adapter_weights("old")
    used.create_adapter("new", 4, 8.0, seed=7)
    fresh.create_adapter("new", 4, 8.0, seed=7)
    assert used.adapter("new").slot == fresh.adapter("new").slot == 0
    for engine in (used, fresh):
        assert all(torch.count_nonzero(g) == 0 for pair in engine.adapter_grads("new").values() for g in pair)
        for bank in engine.banks.values():  # the slot's padding was wiped too
            assert torch.count_nonzero(bank.lora_A[0, :, 4:]) == 0 and torch.count_nonzero(bank.lora_B[0]) == 0
    for _ in range(2):  # identical training: Adam state and step count were reset as well
        r_used = used.forward_backward([used.prepare("new", datums(DATA["c"]), "cross_entropy", None, False)])
        r_fresh = fresh.forward_backward([fresh.prepare("new", datums(DATA["c"]), "cross_entropy", None, False)])
        assert r_used == r_fresh
        assert used.optim_step([("new", {"learning_rate": 1e-2})]) == fresh.optim_step(
            [("new", {"learning_rate": 1e-2})]
        )
    w_used, w_fresh = used.adapter_weights("new"), fresh.adapter_weights("new")
    assert all(torch.equal(w_used[n][i], w_fresh[n][i]) for n in w_used for i in (0, 1))


def test_seeded_init_is_independent_of_slot_and_matches_kaiming_bound(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    engine.create_adapter("x", 4, 8.0, seed=42)
    engine.create_adapter("y", 4, 8.0, seed=42)
    wx, wy = engine.adapter_weights("x"), engine.adapter_weights("y")
    assert engine.adapter("x").slot != engine.adapter("y").slot
    for name, (a, b) in wx.items():
        assert torch.equal(a, wy[name][0]) and torch.count_nonzero(b) == 0
        bound = a.shape[0] ** -0.5
        assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound


ALL_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")


def rl_data(engine: Engine, model_id: str, lengths: list[int], seed: int) -> list[dict]:
    """Datums with prompt tokens (A = 0, q = 0) and sampled tokens whose sampler logprobs sit near the adapter's own
    (ratios around 1, some clipped), read by a forward-only call (no gradient)."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        ids = torch.randint(0, 512, (n + 1,), generator=g).tolist()
        probe = {"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:]}}
        out = engine.forward_backward([engine.prepare(model_id, datums([probe]), "cross_entropy", None, True)])[0]
        lp = torch.tensor(out["loss_fn_outputs"][0]["logprobs"])
        prompt = n // 3
        q = [0.0] * prompt + (lp[prompt:] + 0.3 * torch.randn(n - prompt, generator=g)).tolist()
        adv = [0.0] * prompt + (torch.randn(n - prompt, generator=g)).tolist()
        inputs = {"target_tokens": ids[1:], "logprobs": q, "advantages": adv}
        data.append({"model_input": ids[:-1], "loss_fn_inputs": inputs})
    return data


def test_one_batch_of_all_seven_losses_equals_each_loss_alone(tiny_dir: Path) -> None:
    """Every loss in ONE mixed batch over four adapters (some adapters with several losses, interleaved), against each
    request run alone on a twin engine: per request loss:sum, metrics and logprobs; per adapter the accumulated
    gradients (the alone engine accumulates the same requests' gradients one call at a time)."""
    adapters = [*ADAPTERS, ("d", 6, 3.0, 4)]
    mixed = with_adapters(make_engine(tiny_dir), adapters)
    alone = with_adapters(make_engine(tiny_dir), adapters)
    owners = ["a", "b", "c", "d", "a", "b", "c"]  # loss i trains adapter owners[i]
    items = []
    for i, (name, model_id) in enumerate(zip(ALL_LOSSES, owners, strict=True)):
        data = rl_data(alone, model_id, [5 + i, 9, 3 + 2 * i], seed=100 + i)
        if name == "gspo":
            data[0]["loss_fn_inputs"]["sequence_ratio_mask"] = [0.0] * 3 + [1.0] * (len(data[0]["model_input"]) - 3)
        config = {"beta": 0.3, "kl_coeff": 0.2, "clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
        items.append((model_id, data, name, config if name != "cross_entropy" else None, False))
    items.append(("b", rl_data(alone, "b", [4], seed=7), "gspo", None, True))  # forward-only rows mixed in too
    together = mixed.forward_backward([mixed.prepare(*with_datums(it)) for it in items])
    for item, got in zip(items, together, strict=True):
        expected = alone.forward_backward([alone.prepare(*with_datums(item))])[0]
        assert got["metrics"].keys() == expected["metrics"].keys(), item[2]
        assert got["metrics"] == pytest.approx(expected["metrics"], rel=1e-5, abs=1e-5), item[2]
        assert_results_close(got, expected)
        if item[2] != "cross_entropy":
            assert len(got["metrics"]) > 1, item[2]  # the loss's own metrics, not just loss:sum
    for model_id, *_ in adapters:
        assert_grads_close(mixed, alone, model_id)
        assert any(g.abs().sum() > 0 for pair in mixed.adapter_grads(model_id).values() for g in pair)

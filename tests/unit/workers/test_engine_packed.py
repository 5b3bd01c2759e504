"""The packed engine (default: one [1, N] row of real tokens per microbatch, packed attention) against the padded one
(EngineConfig(packed=False): [B, T_max] rows padded on the right), on ragged random batches of several adapters with mixed
losses and forward-only rows, in fp32 on the CPU: losses, logprobs, metrics, LoRA gradients and the weights after
optimizer steps agree to fp32 rounding. `-s` prints the largest differences measured."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from loraplex.protocol.payloads import DatumPayload
from loraplex.workers.engine.batching import layout, split_microbatches
from loraplex.workers.engine.engine import Engine
from loraplex.workers.lora import lora_delta_reference
from tests.helpers.calls import CallCount
from tests.helpers.lora import ADAPTERS, make_engine

# Every comparison: |packed - padded| <= TOL x scale, the scale being 1 for logprobs and weights, the largest |value| of
# the tensor for a gradient (norm-wise relative), and max(1, |loss|, tokens) for a request's loss sum over its tokens.
TOL = 1e-5
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "gspo")


def ragged_items(rng: random.Random, cap: int) -> list[tuple[str, list[DatumPayload], str, None, bool]]:
    """1-2 requests per adapter, interleaved, of 1-4 datums of 1-60 tokens (now and then one longer than the cap),
    random losses, one request in five forward-only."""
    items = []
    for model_id, *_ in ADAPTERS:
        for _ in range(rng.randint(1, 2)):
            lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.2:
                lengths[0] = cap + rng.randint(1, 30)
            loss = rng.choice(LOSSES)
            items.append((model_id, random_datums(rng, lengths, loss), loss, None, rng.random() < 0.2))
    rng.shuffle(items)
    return items


def random_datums(rng: random.Random, lengths: list[int], loss: str) -> list[DatumPayload]:
    out = []
    for n in lengths:
        ids = [rng.randrange(512) for _ in range(n + 1)]
        inputs: dict[str, list] = {"target_tokens": ids[1:]}
        if loss == "cross_entropy":
            inputs["weights"] = [rng.choice([0.0, 1.0, 0.5]) for _ in range(n)]
        else:
            inputs["logprobs"] = [-rng.uniform(3.0, 9.0) for _ in range(n)]
            inputs["advantages"] = [rng.uniform(-1.0, 1.0) for _ in range(n)]
        out.append(DatumPayload(model_input=ids[:-1], loss_fn_inputs=inputs))
    return out


class Diffs:
    """The largest |packed - padded| / scale seen, per quantity (scale as TOL's comment says)."""

    def __init__(self) -> None:
        self.max: dict[str, float] = {}

    def check(self, name: str, a: Any, b: Any, scale: float = 1.0) -> None:
        ta, tb = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        err = float((ta - tb).abs().max()) / scale if ta.numel() else 0.0
        self.max[name] = max(self.max.get(name, 0.0), err)
        assert err <= TOL, f"{name}: max |packed - padded| / scale = {err:.3g} (scale {scale:.3g})"


def compare_results(diffs: Diffs, items: list[tuple], packed: list[dict], padded: list[dict]) -> None:
    for item, x, y in zip(items, packed, padded, strict=True):
        assert x["metrics"].keys() == y["metrics"].keys()
        tokens = sum(len(d.model_input) for d in item[1])
        for key, value in x["metrics"].items():
            scale = max(1.0, abs(value), tokens) if key == "loss:sum" else max(1.0, abs(value))
            diffs.check("loss:sum" if key == "loss:sum" else "metrics", value, y["metrics"][key], scale)
        for dx, dy in zip(x["loss_fn_outputs"], y["loss_fn_outputs"], strict=True):
            diffs.check("logprobs", dx["logprobs"], dy["logprobs"])


def compare_state(diffs: Diffs, packed: Engine, padded: Engine, what: str) -> None:
    for model_id, *_ in ADAPTERS:
        got, want = (
            e.adapter_grads(model_id) if what == "grads" else e.adapter_weights(model_id) for e in (packed, padded)
        )
        for name in want:
            for t1, t2 in zip(got[name], want[name], strict=True):
                scale = max(float(t2.abs().max()), 1e-12) if what == "grads" else 1.0
                diffs.check(what, t1, t2, scale)


@pytest.mark.parametrize(
    ("seed", "cap", "unfused"),
    [(0, 64, False), (1, 96, False), (2, 48, True), (3, 4096, False)],
    ids=["cap64", "cap96", "cap48-reference-op", "one-microbatch"],
)
def test_packed_engine_equals_padded_engine(tiny_dir: Path, seed: int, cap: int, unfused: bool) -> None:
    kw: dict[str, Any] = {"lora_op": lora_delta_reference} if unfused else {}
    packed = make_engine(tiny_dir, 8, cap, **kw)
    padded = make_engine(tiny_dir, 8, cap, packed=False, **kw)
    assert packed.packed and not padded.packed
    rng = random.Random(seed)
    diffs = Diffs()
    adam = {"learning_rate": 2e-3, "weight_decay": 0.01}
    for _ in range(2):
        items = ragged_items(rng, cap)
        prepared = [packed.prepare(*it) for it in items]
        if cap < 4096:  # packing cuts fewer (or as many) microbatches than padding
            seqs = layout(prepared)
            assert len(split_microbatches(seqs, cap)) <= len(split_microbatches(seqs, cap, packed=False))
        got = packed.forward_backward(prepared)
        compare_results(diffs, items, got, padded.forward_backward([padded.prepare(*it) for it in items]))
        compare_state(diffs, packed, padded, "grads")
        steps = [(m, adam) for m, *_ in ADAPTERS]
        for x, y in zip(packed.optim_step(steps), padded.optim_step(steps), strict=True):
            assert isinstance(x, dict) and isinstance(y, dict)
            norm = y["metrics"]["grad_norm:mean"]
            diffs.check("grad_norm", x["metrics"]["grad_norm:mean"], norm, max(1.0, norm))
        compare_state(diffs, packed, padded, "weights")
    print(
        f"seed {seed} cap {cap}: max |packed - padded| / scale: "
        + ", ".join(f"{k} {v:.2g}" for k, v in diffs.max.items())
    )


def test_the_layout_can_be_flipped_between_calls(tiny_dir: Path) -> None:
    """One engine, the same request packed and then padded: the same outputs (to fp32 rounding)."""
    engine = make_engine(tiny_dir, 8, 40)
    rng = random.Random(7)
    items = ragged_items(rng, 40)
    first = engine.forward_backward([engine.prepare(m, d, loss, c, True) for m, d, loss, c, _ in items])
    engine.packed = False
    second = engine.forward_backward([engine.prepare(m, d, loss, c, True) for m, d, loss, c, _ in items])
    compare_results(Diffs(), items, first, second)


def test_an_eager_microbatch_of_one_length_takes_the_dense_attention_from_its_second_time_on(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shape (S sequences of length L) seen once keeps flash varlen (the dense kernel builds a plan per new shape);
    seen again it runs the dense path, with the same logprobs; ragged microbatches never do."""
    from loraplex.workers.kernels import packed_attention as pa

    dense = CallCount(monkeypatch, pa, "uniform_attention")
    engine = make_engine(tiny_dir, 8, 4096)
    layers = engine.model.config.num_hidden_layers
    rng = random.Random(5)
    three_of_12, ragged, two_of_20 = (random_datums(rng, n, "cross_entropy") for n in ([12] * 3, [9, 12], [20] * 2))

    def logprobs(datums: list[DatumPayload]) -> list[list[float]]:
        result = engine.forward_backward([engine.prepare("a", datums, "cross_entropy", None, False)])[0]
        return [out["logprobs"] for out in result["loss_fn_outputs"]]

    first = logprobs(three_of_12)
    assert dense.calls == 0
    torch.testing.assert_close(logprobs(three_of_12), first, rtol=0, atol=1e-5)
    assert dense.calls == layers
    logprobs(ragged)
    logprobs(two_of_20)
    assert dense.calls == layers

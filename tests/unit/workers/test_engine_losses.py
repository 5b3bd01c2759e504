"""Tinker loss semantics and the chunked LM head."""

from __future__ import annotations

from typing import get_args

import pytest
import torch

from loraplex.errors import InvalidRequestError
from loraplex.models import load_base_model, resolve
from loraplex.protocol.losses import LOSS_NAMES
from loraplex.service.schemas import ForwardBackwardRequest
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.lm_head import target_logprobs
from loraplex.workers.engine.losses import LOSSES, segments_of
from tests.helpers.datums import datums, with_datums


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    folder = resolve("tiny", tmp_path_factory.getbasetemp() / "model-cache")
    model, _ = load_base_model(str(folder), folder.parent)
    e = build_engine(model, EngineConfig(num_slots=2, max_rank=8, loss_chunk_tokens=5))  # several chunks per microbatch
    e.create_adapter("a", 8, 16.0, seed=0)
    return e


def test_chunked_head_equals_full_log_softmax_with_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g)
    targets = torch.randint(0, 40, (23,), generator=g)
    full = (hidden @ weight.T).log_softmax(-1).gather(1, targets[:, None])[:, 0]
    (grad_full,) = torch.autograd.grad((full * torch.arange(23.0)).sum(), hidden)
    chunked = target_logprobs(hidden, weight, targets, chunk_tokens=4)
    (grad_chunked,) = torch.autograd.grad((chunked * torch.arange(23.0)).sum(), hidden)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_chunked, grad_full, atol=1e-5, rtol=1e-5)
    assert chunked.dtype == torch.float32


def test_cross_entropy_is_a_weighted_sum_over_datums(engine: Engine) -> None:
    data = [
        {"model_input": [5, 6, 7, 8], "loss_fn_inputs": {"target_tokens": [6, 7, 8, 9], "weights": [0, 0, 1, 0.5]}},
        {
            "model_input": [10, 11, 12, 13, 14, 15, 16],
            "loss_fn_inputs": {"target_tokens": [11, 12, 13, 14, 15, 16, 17], "weights": [1] * 7},
        },
    ]
    out = engine.forward_backward([engine.prepare("a", datums(data), "cross_entropy", None, True)])[0]
    expected = 0.0
    for d, o in zip(data, out["loss_fn_outputs"], strict=True):
        assert len(o["logprobs"]) == len(d["model_input"]) and all(lp < 0 for lp in o["logprobs"])
        expected -= sum(w * lp for w, lp in zip(d["loss_fn_inputs"]["weights"], o["logprobs"], strict=True))
    assert out["metrics"]["loss:sum"] == pytest.approx(expected, rel=1e-5)  # a sum, not a mean


def test_policy_gradient_losses_follow_tinker_formulas(engine: Engine) -> None:
    n = 9
    g = torch.Generator().manual_seed(3)
    base = {"model_input": list(range(20, 20 + n)), "loss_fn_inputs": {"target_tokens": list(range(21, 21 + n))}}
    forward = engine.forward_backward([engine.prepare("a", datums([base]), "cross_entropy", None, True)])
    lp = torch.tensor(forward[0]["loss_fn_outputs"][0]["logprobs"])
    sampling = lp + 0.3 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    inputs = {**base["loss_fn_inputs"], "logprobs": sampling.tolist(), "advantages": adv.tolist()}
    ratio = torch.exp(lp - sampling)
    expected = {  # Tinker's defaults: ppo clips to [0.8, 1.2], cispo to [0, 4] (one-sided), dro has beta = 1
        "importance_sampling": -(ratio * adv).sum(),
        "ppo": -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum(),
        "cispo": -(ratio.clamp(0.0, 4.0) * lp * adv).sum(),
        "dro": -(lp * adv - 0.5 * (lp - sampling) ** 2).sum(),
    }
    for name, value in expected.items():
        out = engine.forward_backward(
            [
                engine.prepare(
                    "a", datums([{"model_input": base["model_input"], "loss_fn_inputs": inputs}]), name, None, True
                )
            ]
        )[0]
        assert out["metrics"]["loss:sum"] == pytest.approx(value.item(), rel=1e-4, abs=1e-5), name
        assert out["loss_fn_outputs"][0]["logprobs"] == lp.tolist()
    tight = engine.forward_backward(
        [
            engine.prepare(
                "a",
                datums([{"model_input": base["model_input"], "loss_fn_inputs": inputs}]),
                "ppo",
                {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05},
                True,
            )
        ]
    )[0]
    expected_tight = -torch.minimum(ratio * adv, ratio.clamp(0.95, 1.05) * adv).sum()
    assert tight["metrics"]["loss:sum"] == pytest.approx(expected_tight.item(), rel=1e-4, abs=1e-5)


def test_the_protocol_lists_exactly_the_engines_losses() -> None:
    """The gateway accepts the names protocol/losses.py lists; the engine implements exactly those."""
    assert tuple(LOSSES) == LOSS_NAMES
    assert all(spec.name == name for name, spec in LOSSES.items())
    assert get_args(ForwardBackwardRequest.model_fields["loss_fn"].annotation) == LOSS_NAMES


def test_mixed_losses_share_one_batch(engine: Engine) -> None:
    ce = [{"model_input": [1, 2, 3], "loss_fn_inputs": {"target_tokens": [2, 3, 4], "weights": [1, 1, 1]}}]
    is_ = [
        {
            "model_input": [7, 8],
            "loss_fn_inputs": {"target_tokens": [8, 9], "logprobs": [-5.0, -5.0], "advantages": [1.0, -1.0]},
        }
    ]
    together = engine.forward_backward(
        [
            engine.prepare("a", datums(ce), "cross_entropy", None, True),
            engine.prepare("a", datums(is_), "importance_sampling", None, True),
        ]
    )
    apart = [
        engine.forward_backward([engine.prepare("a", datums(d), fn, None, True)])[0]
        for d, fn in ((ce, "cross_entropy"), (is_, "importance_sampling"))
    ]
    for t, a in zip(together, apart, strict=True):
        assert t["metrics"]["loss:sum"] == pytest.approx(a["metrics"]["loss:sum"], abs=1e-5)


RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")


def rl_datum(engine: Engine, n: int, seed: int, **extra: list[float]) -> tuple[dict, torch.Tensor]:
    """An RL datum whose sampling logprobs sit near the model's own (ratios around 1, some outside [0.8, 1.2])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (n + 1,), generator=g).tolist()
    probe = {"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:]}}
    forward = engine.forward_backward([engine.prepare("a", datums([probe]), "cross_entropy", None, True)])
    lp = torch.tensor(forward[0]["loss_fn_outputs"][0]["logprobs"])
    sampling = (lp + 0.3 * torch.randn(n, generator=g)).tolist()
    adv = torch.randn(n, generator=g).tolist()
    inputs = {"target_tokens": ids[1:], "logprobs": sampling, "advantages": adv, **extra}
    return {"model_input": ids[:-1], "loss_fn_inputs": inputs}, lp


def test_config_and_per_token_clip_thresholds(engine: Engine) -> None:
    low, high = [0.9, 0.5, 0.95, 0.7, 0.85, 0.99, 0.8], [1.1, 1.5, 1.05, 1.3, 1.15, 1.01, 1.2]
    d_tok, lp_tok = rl_datum(engine, 7, 1, clip_low_threshold=low, clip_high_threshold=high)
    d_one, lp_one = rl_datum(engine, 5, 2, clip_low_threshold=[0.97])  # one value for the datum; high from the config
    d_cfg, lp_cfg = rl_datum(engine, 6, 3)  # thresholds from the config alone
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.02, "beta": 123.0}  # beta: not ppo's, ignored

    def ppo(d: dict, lp: torch.Tensor, lo: torch.Tensor | float, hi: torch.Tensor | float) -> torch.Tensor:
        q, a = torch.tensor(d["loss_fn_inputs"]["logprobs"]), torch.tensor(d["loss_fn_inputs"]["advantages"])
        r = torch.exp(lp - q)
        return -torch.minimum(r * a, torch.clamp(r, lo, hi) * a).sum()

    out = engine.forward_backward([engine.prepare("a", datums([d_tok, d_one, d_cfg]), "ppo", config, True)])[0]
    expected = ppo(d_tok, lp_tok, torch.tensor(low), torch.tensor(high)) + ppo(d_one, lp_one, 0.97, 1.02)
    expected += ppo(d_cfg, lp_cfg, 0.9, 1.02)
    assert out["metrics"]["loss:sum"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-5)

    for name, cfg, formula in [
        ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, lambda lp, q, a: -(torch.exp(lp - q).clamp(0.9, 1.1) * lp * a)),
        ("dro", {"beta": 0.05}, lambda lp, q, a: -(lp * a - 0.025 * (lp - q) ** 2)),
    ]:  # fmt: skip
        q, a = (torch.tensor(d_cfg["loss_fn_inputs"][k]) for k in ("logprobs", "advantages"))
        got = engine.forward_backward([engine.prepare("a", datums([d_cfg]), name, cfg, True)])[0]["metrics"]["loss:sum"]
        assert got == pytest.approx(formula(lp_cfg, q, a).sum().item(), rel=1e-5, abs=1e-5), name


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro"])
def test_token_gradients_follow_the_formulas(name: str) -> None:
    """d loss / d lp per token, written out by hand: the stop-gradient of cispo and ppo's zero-gradient region included."""
    g = torch.Generator().manual_seed(7)
    n = 64
    lp = (-3 * torch.rand(n, generator=g)).requires_grad_(True)
    q = lp.detach() + 0.4 * torch.randn(n, generator=g)
    a = torch.randn(n, generator=g)
    lo, hi = torch.full((n,), 0.8), torch.full((n,), 1.25)
    spec = LOSSES[name]
    inputs = {"logprobs": q, "advantages": a, "clip_low_threshold": lo, "clip_high_threshold": hi}
    (grad,) = torch.autograd.grad(spec.fn(lp, inputs, {"beta": 0.3}, segments_of([n])).sum(), lp)
    r = torch.exp(lp.detach() - q)
    if name == "importance_sampling":
        expected = -r * a
    elif name == "ppo":  # the unclipped term is the min (gradient -r*A) unless the clipped constant is smaller
        expected = torch.where(r.clamp(lo, hi) * a < r * a, torch.zeros(n), -r * a)
    elif name == "cispo":
        expected = -r.clamp(lo, hi) * a
    else:
        expected = -(a - 0.3 * (lp.detach() - q))
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)
    if name == "ppo":
        assert 0 < int((grad == 0).sum()) < n  # both regions exercised


def test_metrics_are_name_reduction_keyed_and_finite(engine: Engine) -> None:
    d, lp = rl_datum(engine, 12, 5)
    inputs = d["loss_fn_inputs"]
    inputs["advantages"][:3] = [0.0, 0.0, 0.0]  # "prompt" tokens: not counted in the ratio metrics
    active = torch.tensor(inputs["advantages"]) != 0
    ratio = torch.exp(lp - torch.tensor(inputs["logprobs"]))
    adv = torch.tensor(inputs["advantages"])
    ce = {"model_input": d["model_input"], "loss_fn_inputs": {"target_tokens": inputs["target_tokens"]}}
    outs = engine.forward_backward(
        [engine.prepare("a", datums([ce]), "cross_entropy", None, True)]
        + [engine.prepare("a", datums([d]), name, None, True) for name in RL_LOSSES]
    )
    for out in outs:
        assert "loss:sum" in out["metrics"]
        for key, value in out["metrics"].items():
            metric, reduction = key.split(":")
            assert metric and reduction in {"sum", "mean", "min", "max"} and isinstance(value, float), key
            assert value == value and abs(value) < float("inf"), key
    by_loss = dict(zip(["cross_entropy", *RL_LOSSES], (o["metrics"] for o in outs), strict=True))
    assert set(by_loss["cross_entropy"]) == {"loss:sum"}
    assert by_loss["dro"]["importance_ratio:mean"] == pytest.approx(ratio[active].mean().item(), rel=1e-5)
    assert by_loss["importance_sampling"]["importance_ratio:max"] == pytest.approx(ratio[active].max().item(), rel=1e-5)
    ppo_clipped = (ratio.clamp(0.8, 1.2) * adv < ratio * adv) & active
    assert by_loss["ppo"]["clip_fraction:mean"] == pytest.approx(ppo_clipped.sum().item() / active.sum().item())
    assert 0 < by_loss["ppo"]["clip_fraction:mean"] < 1
    cispo_out = ((ratio < 0.0) | (ratio > 4.0)) & active
    assert by_loss["cispo"]["clip_fraction:mean"] == pytest.approx(cispo_out.sum().item() / active.sum().item())
    # No active token at all: the ratio metrics are left out rather than NaN.
    inputs["advantages"] = [0.0] * 12
    quiet = engine.forward_backward([engine.prepare("a", datums([d]), "ppo", None, True)])[0]["metrics"]
    assert quiet == {"loss:sum": quiet["loss:sum"], "clip_fraction:mean": 0.0}


def test_forward_only_rl_rows_return_logprobs_and_leave_no_gradient(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = resolve("tiny", tmp_path_factory.getbasetemp() / "model-cache")
    model, _ = load_base_model(str(folder), folder.parent)
    e = build_engine(model, EngineConfig(num_slots=2, max_rank=8, loss_chunk_tokens=5))
    e.create_adapter("a", 8, 16.0, seed=0)
    d, lp = rl_datum(e, 9, 11)
    for name in RL_LOSSES:
        out = e.forward_backward([e.prepare("a", datums([d]), name, None, True)])[0]
        assert out["loss_fn_outputs"][0]["logprobs"] == lp.tolist()
    assert all(torch.count_nonzero(t) == 0 for pair in e.adapter_grads("a").values() for t in pair)
    e.forward_backward([e.prepare("a", datums([d]), "dro", None, False)])
    assert any(torch.count_nonzero(t) > 0 for pair in e.adapter_grads("a").values() for t in pair)


def bad(n: int = 3, **inputs: object) -> dict:
    return {"model_input": list(range(1, n + 1)), "loss_fn_inputs": {"target_tokens": list(range(2, n + 2)), **inputs}}


RL_OK = {"logprobs": [-1.0, -2.0, -0.5], "advantages": [1.0, -1.0, 0.5]}


@pytest.mark.parametrize(
    ("datum", "loss_fn", "config", "match"),
    [
        (bad(advantages=[1.0, 1.0, 1.0]), "dro", None, "logprobs is required by loss_fn 'dro'"),
        (bad(logprobs=[-1.0, -1.0, -1.0]), "cispo", None, "advantages is required by loss_fn 'cispo'"),
        (bad(**{**RL_OK, "advantages": [1.0, 2.0]}), "ppo", None, r"data\[0\]\.advantages: length 2"),
        (bad(**{**RL_OK, "logprobs": [-1.0, float("-inf"), -1.0]}), "importance_sampling", None, "NaN or infinity"),
        (bad(**{**RL_OK, "advantages": [float("nan"), 0.0, 0.0]}), "dro", None, "NaN or infinity"),
        (bad(**RL_OK, clip_low_threshold=[0.8, 0.9]), "ppo", None, r"clip_low_threshold: length 2 .* one value"),
        (bad(**RL_OK, clip_high_threshold=[1.2, 0.5, 1.2]), "ppo", None, "clip_low_threshold must be <="),
        (bad(**RL_OK, clip_high_threshold=[1.2, float("inf"), 1.2]), "cispo", None, "NaN or infinity"),
        (bad(**RL_OK), "ppo", {"clip_low_threshold": 1.3}, "clip_low_threshold must be <="),
        (bad(**RL_OK), "cispo", {"clip_high_threshold": float("nan")}, "must be finite"),
        (bad(**RL_OK), "ppo", {"clip_low_threshold": "tight"}, "must be a number"),
        (bad(**RL_OK), "dro", {"beta": -0.1}, "beta'] must be >= 0"),
        (bad(**RL_OK), "dro", {"beta": True}, "must be a number"),
        (bad(**RL_OK), "grpo", None, "unknown loss_fn 'grpo'"),
        (
            bad(advantages=[1.0, 1.0, 1.0]),
            "stable_reinforce",
            None,
            "logprobs is required by loss_fn 'stable_reinforce'",
        ),
        (bad(logprobs=[-1.0, -1.0, -1.0]), "gspo", None, "advantages is required by loss_fn 'gspo'"),
        (bad(**RL_OK, sequence_ratio_mask=[0.0, 0.0, 0.0]), "gspo", None, "sequence_ratio_mask marks no token"),
        (bad(**RL_OK, sequence_ratio_mask=[1.0, 1.0]), "gspo", None, r"sequence_ratio_mask: length 2"),
        (bad(**RL_OK, sequence_ratio_mask=[1.0, float("nan"), 1.0]), "gspo", None, "NaN or infinity"),
        (bad(**RL_OK), "gspo", {"clip_low_threshold": 1.5}, "clip_low_threshold must be <="),
        (bad(**RL_OK), "stable_reinforce", {"kl_coeff": -0.01}, "kl_coeff'] must be >= 0"),
    ],
)
def test_bad_loss_inputs_are_refused(
    engine: Engine, datum: dict, loss_fn: str, config: dict | None, match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        engine.forward_backward([engine.prepare("a", datums([datum]), loss_fn, config, False)])
    assert all(torch.count_nonzero(t) == 0 for pair in engine.adapter_grads("a").values() for t in pair)


def test_all_losses_share_one_batch(engine: Engine) -> None:
    d1, _ = rl_datum(engine, 6, 21)
    d2, _ = rl_datum(engine, 11, 22, clip_high_threshold=[1.1])
    ce = {"model_input": d1["model_input"], "loss_fn_inputs": {"target_tokens": d1["loss_fn_inputs"]["target_tokens"]}}
    items = [("a", [ce], "cross_entropy", None, True)]
    items += [("a", [d1, d2], name, {"beta": 0.2}, True) for name in RL_LOSSES]
    together = engine.forward_backward([engine.prepare(*with_datums(it)) for it in items])
    for item, got in zip(items, together, strict=True):
        alone = engine.forward_backward([engine.prepare(*with_datums(item))])[0]
        assert got["metrics"] == pytest.approx(alone["metrics"], rel=1e-5, abs=1e-6), item[2]
        for x, y in zip(got["loss_fn_outputs"], alone["loss_fn_outputs"], strict=True):
            torch.testing.assert_close(torch.tensor(x["logprobs"]), torch.tensor(y["logprobs"]), atol=1e-5, rtol=0)


# ---- gspo and stable_reinforce against plain-torch references ------------------------------------------------------
def gspo_reference(lps: list[torch.Tensor], datums: list[dict], lo: float, hi: float) -> torch.Tensor:
    """GSPO-token (Tinker docs /tinker/losses/gspo), one datum at a time: the sequence log-ratio is the mean of
    sg(lp) - q over the tokens sequence_ratio_mask marks (default: A != 0); each token carries exp of it times
    p / sg(p); then PPO's min / clip per token, summed."""
    total = torch.zeros(())
    for lp, d in zip(lps, datums, strict=True):
        inp = d["loss_fn_inputs"]
        q, a = torch.tensor(inp["logprobs"]), torch.tensor(inp["advantages"])
        mask = torch.tensor(inp["sequence_ratio_mask"]) != 0 if "sequence_ratio_mask" in inp else a != 0
        log_s = (lp.detach() - q)[mask].mean() if bool(mask.any()) else torch.zeros(())
        s_t = torch.exp(log_s) * torch.exp(lp - lp.detach())
        for t in range(lp.numel()):
            total = total - torch.minimum(s_t[t] * a[t], s_t[t].clamp(lo, hi) * a[t])
    return total


def stable_reinforce_reference(lps: list[torch.Tensor], datums: list[dict], kl_coeff: float) -> torch.Tensor:
    """Our stand-in (losses.py docstring): -sg(p/q) * lp * A per token, plus kl_coeff * (r - 1 - log r) where A != 0."""
    total = torch.zeros(())
    for lp, d in zip(lps, datums, strict=True):
        q = torch.tensor(d["loss_fn_inputs"]["logprobs"])
        a = torch.tensor(d["loss_fn_inputs"]["advantages"])
        for t in range(lp.numel()):
            r = torch.exp(lp[t] - q[t])
            total = total - r.detach() * lp[t] * a[t]
            if a[t] != 0:
                total = total + kl_coeff * (r - 1 - torch.log(r))
    return total


def sequence_level_data(engine: Engine) -> list[dict]:
    """Datums of different lengths with prompt tokens (A = 0, q = 0 as the cookbook pads them) and sampled tokens; one
    datum's sampler sits far from the model so its whole sequence clips, one carries an explicit sequence_ratio_mask."""
    data = []
    for i, (prompt, sampled, shift) in enumerate([(3, 6, 0.0), (2, 9, 0.6), (4, 5, -0.5), (1, 7, 0.05)]):
        d, lp = rl_datum(engine, prompt + sampled, 40 + i)
        inp = d["loss_fn_inputs"]
        g = torch.Generator().manual_seed(80 + i)
        q = lp[prompt:] + shift + 0.2 * torch.randn(sampled, generator=g)
        inp["logprobs"] = [0.0] * prompt + q.tolist()
        inp["advantages"] = [0.0] * prompt + [float(torch.randn(1, generator=g)) * 2] * sampled
        if i == 3:  # a mask narrower than the sampled tokens: only the last four count for the ratio
            inp["sequence_ratio_mask"] = [0.0] * (prompt + sampled - 4) + [1.0] * 4
        data.append(d)
    return data


def engine_grads(engine: Engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = engine.adapter_grads("a")
    engine.optimizer.grad.zero_()  # the fixture engine's accumulated gradients: cleared for the next call
    return out


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("gspo", None),
        ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
        ("stable_reinforce", None),
        ("stable_reinforce", {"kl_coeff": 0.3}),
    ],
)
def test_sequence_losses_equal_a_per_datum_reference_with_gradients(
    engine: Engine, name: str, config: dict | None
) -> None:
    data = sequence_level_data(engine)
    engine_grads(engine)
    out = engine.forward_backward([engine.prepare("a", datums(data), name, config, False)])[0]
    got_grads = engine_grads(engine)
    lps = [torch.tensor(o["logprobs"], requires_grad=True) for o in out["loss_fn_outputs"]]
    if name == "gspo":
        cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, **(config or {})}
        expected = gspo_reference(lps, data, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    else:
        expected = stable_reinforce_reference(lps, data, (config or {}).get("kl_coeff", 0.0))
    assert out["metrics"]["loss:sum"] == pytest.approx(expected.item(), rel=1e-5, abs=1e-5)
    for key, value in out["metrics"].items():
        assert key.split(":")[1] in {"sum", "mean", "min", "max"} and value == value and abs(value) < float("inf")
    # The engine's adapter gradient is sum_t dL/dlp_t * dlp_t/dtheta: the same as cross_entropy with weights -dL/dlp.
    token_grads = torch.autograd.grad(expected, lps)
    assert any(bool((g == 0).any()) for g in token_grads) and any(bool((g != 0).any()) for g in token_grads)
    as_ce = [
        {"model_input": d["model_input"], "loss_fn_inputs": {"target_tokens": d["loss_fn_inputs"]["target_tokens"],
                                                              "weights": (-g).tolist()}}
        for d, g in zip(data, token_grads, strict=True)
    ]  # fmt: skip
    engine.forward_backward([engine.prepare("a", datums(as_ce), "cross_entropy", None, False)])
    want_grads = engine_grads(engine)
    for module, (ga, gb) in got_grads.items():
        torch.testing.assert_close(ga, want_grads[module][0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(gb, want_grads[module][1], atol=2e-5, rtol=1e-4)
    assert any(bool(gb.abs().sum() > 0) for _, gb in got_grads.values())


def test_gspo_clips_whole_sequences_and_reports_sequence_ratios() -> None:
    """A sequence whose geometric-mean ratio is outside [lo, hi] on the advantage's side has zero gradient on every
    token, even tokens whose own ratio is inside; a sequence inside keeps every token's gradient, -s * A."""
    lp = torch.tensor([-1.0, -2.0, -0.5, -1.5, -1.0, -3.0], requires_grad=True)
    q = torch.tensor([-1.0, -2.0, -1.0, -1.5, -1.1, -2.9])  # datum 0: mean log-ratio 0.5 / 3 -> s = 1.18
    a = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])  # datum 1: log-ratios 0, 0.1, -0.1 -> s = 1
    seg = segments_of([3, 3])
    inputs = {"logprobs": q, "advantages": a, "sequence_ratio_mask": torch.ones(6)}
    inputs |= {"clip_low_threshold": torch.full((6,), 0.9), "clip_high_threshold": torch.full((6,), 1.1)}
    (grad,) = torch.autograd.grad(LOSSES["gspo"].fn(lp, inputs, {}, seg).sum(), lp)
    s0 = float(torch.exp(torch.tensor(0.5 / 3)))
    assert s0 > 1.1
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0]))
    metrics = LOSSES["gspo"].metrics(lp.detach(), inputs, {}, seg)  # type: ignore[misc]
    assert metrics["sequence_ratio:max"] == pytest.approx(s0, rel=1e-6)
    assert metrics["sequence_ratio:min"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["clip_fraction:mean"] == pytest.approx(0.5)


def test_gspo_without_a_mask_takes_the_tokens_with_advantages(engine: Engine) -> None:
    data = sequence_level_data(engine)[:3]
    explicit = [
        {**d, "loss_fn_inputs": {**d["loss_fn_inputs"],
                                 "sequence_ratio_mask": [float(x != 0) for x in d["loss_fn_inputs"]["advantages"]]}}
        for d in data
    ]  # fmt: skip
    got = engine.forward_backward([engine.prepare("a", datums(data), "gspo", None, True)])[0]
    want = engine.forward_backward([engine.prepare("a", datums(explicit), "gspo", None, True)])[0]
    assert got == want

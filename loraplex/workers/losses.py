"""Tinker loss functions on per-token target logprobs and their metrics (lm_head.py produces the logprobs).

Every loss here is a token-wise **sum** (Tinker semantics): a datum's loss is the sum of its per-token losses and a step's
loss is the sum over datums (never a mean). Each loss maps (target logprobs [N], float inputs [N] each, config) -> per-token
loss [N]; rows of different losses share one forward pass and are scored separately (`engine._run_microbatch`).

Notation: lp = log p_theta(target) from this forward pass (`lm_head.target_logprobs`), q = the sampler's logprobs
(`loss_fn_inputs["logprobs"]`), A = `advantages`, w = `weights`, ratio = exp(lp - q), sg = stop-gradient (detach),
clip(x, lo, hi) = x.clamp(lo, hi) with lo = `clip_low_threshold`, hi = `clip_high_threshold` (absolute ratio bounds, not
epsilons).

    cross_entropy        loss = -sum(w * lp)                                   inputs: target_tokens, weights (default 1)
    importance_sampling  loss = -sum(ratio * A)                                inputs: target_tokens, logprobs, advantages
    ppo                  loss = -sum(min(ratio * A, clip(ratio, lo, hi) * A))  config: lo = 0.8, hi = 1.2
    cispo                loss = -sum(sg(clip(ratio, lo, hi)) * lp * A)         config: lo = 0.0, hi = 4.0 (one-sided)
    dro                  loss = -sum(lp * A - beta / 2 * (lp - q)^2)           config: beta = 1.0

Sources (formulas re-derived here from the text; no code copied):
- Tinker docs, "Loss functions" (https://tinker-docs.thinkingmachines.ai/losses, the same text as tinker-cookbook
  `docs/losses.mdx`) and the per-loss pages `/tinker/losses/{ppo,cispo,dro}`: all five formulas above, token-wise sums,
  `loss:sum` as the one documented diagnostic, `loss_fn_config` keys `clip_low_threshold` / `clip_high_threshold` (ppo, cispo)
  and `beta` (dro). PPO: "epsilon_low and epsilon_high ... 0.2", i.e. thresholds 0.8 / 1.2. CISPO: "CISPO defaults to
  disabling the lower bound and only capping the upper side (clip_low_threshold=0.0, clip_high_threshold=4.0)" (also in
  tinker-cookbook `tutorials/202_loss_functions.py`). DRO: Richemond et al. 2024 / Kimi k1.5; the docs show
  `loss_fn_config={"beta": 0.05}` but state no default: we use beta = 1.0 (what published reference implementations of
  the Tinker losses use); clients that care pass it.
- Tinker SDK `tinker/types/datum.py` (`_KEY_TO_TYPE`): `clip_low_threshold` and `clip_high_threshold` are also accepted as
  float32 `loss_fn_inputs` of a datum. We take them per token ([N], or one value for the whole datum) and let them override
  `loss_fn_config` for that datum's tokens.
- SkyRL `skyrl/tinker/loss_fns.py` (JAX): the same cross_entropy / importance_sampling / ppo / cispo token formulas, with
  clip thresholds carried per example; it has no dro.

Metrics (all `name:reduction`, reductions from {sum, mean, min, max}); the engine always emits `loss:sum`, and
`LossSpec.metrics` adds, over the item's *active* tokens (advantage != 0: prompt tokens carry A = 0 in Tinker RL data):
    importance_sampling, ppo, cispo, dro   importance_ratio:mean, importance_ratio:min, importance_ratio:max
    ppo                                    clip_fraction:mean  tokens where the clipped term wins the min (zero gradient)
    cispo                                  clip_fraction:mean  tokens whose ratio lies outside [lo, hi]
A metric over an empty set of active tokens is left out (clip_fraction is then 0.0), so every value is finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from loraplex.errors import InvalidRequestError

CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")

TokenLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]
LossMetrics = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], dict[str, float]]


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: TokenLoss
    required: tuple[str, ...]  # float loss_fn_inputs that must be present (besides target_tokens)
    defaults: Mapping[str, float] = field(default_factory=dict)  # float inputs filled with a constant when absent
    config_defaults: Mapping[str, float] = field(default_factory=dict)  # loss_fn_config keys and their defaults
    # config keys a datum may also give in loss_fn_inputs ([N] or [1]); always present in the prepared inputs, filled
    # from the resolved config where the datum has none.
    per_token_config: tuple[str, ...] = ()
    metrics: LossMetrics | None = None  # extra metrics beyond loss:sum, from the item's logprobs and inputs

    def item_metrics(
        self,
        logprobs: Sequence[Sequence[float]],
        inputs: Sequence[Mapping[str, torch.Tensor]],
        config: Mapping[str, float],
    ) -> dict[str, float]:
        """This loss's extra metrics for one request: `logprobs` and `inputs` per datum, as the engine returns / holds them."""
        if self.metrics is None or not logprobs:
            return {}
        lp = torch.tensor([v for d in logprobs for v in d], dtype=torch.float32)
        cat = {k: torch.cat([d[k].detach().float().cpu() for d in inputs]) for k in inputs[0]}
        return self.metrics(lp, cat, config)


# ---- losses ----------------------------------------------------------------------------------------------------------
def _ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])  # p_theta / q, with q the sampler's logprobs


def _clip(ratio: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.clamp(ratio, inputs["clip_low_threshold"], inputs["clip_high_threshold"])


def _cross_entropy(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float]) -> torch.Tensor:
    return -(inputs["weights"] * lp)


def _importance_sampling(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float]) -> torch.Tensor:
    return -(_ratio(lp, inputs) * inputs["advantages"])


def _ppo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = _ratio(lp, inputs), inputs["advantages"]
    return -torch.minimum(ratio * adv, _clip(ratio, inputs) * adv)


def _cispo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float]) -> torch.Tensor:
    return -(_clip(_ratio(lp, inputs), inputs).detach() * lp * inputs["advantages"])


def _dro(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    return -(lp * inputs["advantages"] - 0.5 * cfg["beta"] * (lp - inputs["logprobs"]).square())


# ---- metrics ---------------------------------------------------------------------------------------------------------
def _ratio_metrics(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float]) -> dict[str, float]:
    active = inputs["advantages"] != 0
    if not bool(active.any()):
        return {}
    ratio = _ratio(lp, inputs)[active]
    return {
        "importance_ratio:mean": ratio.mean().item(),
        "importance_ratio:min": ratio.min().item(),
        "importance_ratio:max": ratio.max().item(),
    }


def _fraction(mask: torch.Tensor, active: torch.Tensor) -> float:
    n = int(active.sum())
    return float((mask & active).sum()) / n if n else 0.0


def _ppo_metrics(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> dict[str, float]:
    ratio, adv = _ratio(lp, inputs), inputs["advantages"]
    clipped = _clip(ratio, inputs) * adv < ratio * adv  # the min picks the clipped term: this token's gradient is zero
    return {**_ratio_metrics(lp, inputs, cfg), "clip_fraction:mean": _fraction(clipped, adv != 0)}


def _cispo_metrics(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> dict[str, float]:
    ratio = _ratio(lp, inputs)
    outside = (ratio < inputs["clip_low_threshold"]) | (ratio > inputs["clip_high_threshold"])
    return {**_ratio_metrics(lp, inputs, cfg), "clip_fraction:mean": _fraction(outside, inputs["advantages"] != 0)}


_RL = ("logprobs", "advantages")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec("cross_entropy", _cross_entropy, required=(), defaults={"weights": 1.0}),
    "importance_sampling": LossSpec("importance_sampling", _importance_sampling, required=_RL, metrics=_ratio_metrics),
    "ppo": LossSpec(
        "ppo",
        _ppo,
        required=_RL,
        config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        per_token_config=CLIP_KEYS,
        metrics=_ppo_metrics,
    ),
    "cispo": LossSpec(
        "cispo",
        _cispo,
        required=_RL,
        config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        per_token_config=CLIP_KEYS,
        metrics=_cispo_metrics,
    ),
    "dro": LossSpec("dro", _dro, required=_RL, config_defaults={"beta": 1.0}, metrics=_ratio_metrics),
}


def get_loss(name: str) -> LossSpec:
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        raise InvalidRequestError(f"unknown loss_fn {name!r}; supported: {sorted(LOSSES)}") from None


def check_clip_thresholds(low: torch.Tensor | float, high: torch.Tensor | float, where: str) -> None:
    """Both finite (checked by the caller) and low <= high everywhere; raises InvalidRequestError otherwise."""
    if not bool(torch.as_tensor(low).le(torch.as_tensor(high)).all()):
        raise InvalidRequestError(f"{where}: clip_low_threshold must be <= clip_high_threshold")


def resolve_loss_config(spec: LossSpec, config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss's config values (defaults filled in, validated); keys the loss does not use are ignored, as Tinker does."""
    resolved = dict(spec.config_defaults)
    for key, value in (config or {}).items():
        if key in resolved:
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise InvalidRequestError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
            try:
                number = float(value)
            except ValueError:
                raise InvalidRequestError(f"loss_fn_config[{key!r}] must be a number, got {value!r}") from None
            if not math.isfinite(number):
                raise InvalidRequestError(f"loss_fn_config[{key!r}] must be finite, got {value!r}")
            resolved[key] = number
    if "clip_low_threshold" in resolved:
        check_clip_thresholds(resolved["clip_low_threshold"], resolved["clip_high_threshold"], "loss_fn_config")
    if resolved.get("beta", 0.0) < 0:
        raise InvalidRequestError(f"loss_fn_config['beta'] must be >= 0, got {resolved['beta']}")
    return resolved

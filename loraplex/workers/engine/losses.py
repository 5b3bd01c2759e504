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
    gspo                 loss = -sum(min(s_t * A, clip(s_t, lo, hi) * A))      config: lo = 0.8, hi = 1.2
                         s_t = exp(log_s + lp - sg(lp)), log_s = mean over M of sg(lp) - q (one value per datum)
                         M = tokens with sequence_ratio_mask != 0 (default: tokens with A != 0); input sequence_ratio_mask
    stable_reinforce     loss = -sum(sg(ratio) * lp * A) + kl_coeff * sum over A != 0 of (ratio - 1 - log(ratio))
                         config: kl_coeff = 0.0; inputs: target_tokens, logprobs, advantages (see below: a stand-in)

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
- GSPO: Tinker docs `/tinker/losses/gspo` (Zheng et al. 2025, arXiv 2507.18071), the token-level variant GSPO-token:
  "The sequence ratio, over the tokens M that sequence_ratio_mask marks, is s = exp(1/|M| sum_{t in M} log p/q)"; "Each
  token's ratio takes s's value and its own gradient: s_t = sg[s] * p_theta(x_t) / sg[p_theta(x_t)]"; the objective is
  PPO's min/clip on s_t with clip thresholds. The stored page we could read stops before it states defaults, so the
  thresholds default to PPO's 0.8 / 1.2 (loss_fn_config or per-token inputs override them, as for ppo; the paper itself
  uses epsilons 3e-4 / 4e-4, which a client passes as 0.9997 / 1.0004). `sequence_ratio_mask` is a float32 input in
  the SDK (`tinker/types/datum.py` _KEY_TO_TYPE), set by tinker-cookbook `recipes/rl_loop.py` to 1 on the sampled tokens;
  when a datum has none we take M = its tokens with A != 0 (the sampled tokens in Tinker RL data: the cookbook gives
  prompt tokens A = 0 and q = 0, which must stay out of the mean). A mask that marks no token gives log_s = 0 (s = 1);
  that is refused when the datum has a non-zero advantage (the sequence ratio would be undefined). The mean is per
  datum: the engine passes each token's datum index (`segments`), and a datum is never split across microbatches.
- stable_reinforce: Tinker docs `/tinker/losses/stable-reinforce` (alpha) call it "a REINFORCE variant that stays stable
  even when the sampling policy differs from the policy being trained"; it trains on stability information that
  Tinker's *sampler* records per sampled sequence (`record_stability_info=True`, SDK `types/sample_request.py`), named
  from the training datum through provenance spans (`Datum.with_provenance`: `SampledProvenanceSpan(sequence_id=...)`,
  SDK `types/datum.py`, `types/provenance_spans.py`; tinker-cookbook `recipes/rl_loop.py` builds them). Its config key
  `kl_coeff` comes from the SDK (`types/forward_backward_input.py`: "StableReinforce kl_coeff"; the proto's example is
  `{"kl_coeff": 0.01}`). The objective itself is not in the text we could read. NOT SUPPORTED here: the sampler-recorded
  stability information and provenance spans (we have no sampler yet, and our datums carry no spans). What we compute
  is a stand-in from the per-token inputs the datum does carry (target_tokens; logprobs = q, the sampler's; advantages):
  REINFORCE with a stop-gradient importance weight (gradient -ratio * A per token, every token keeps its gradient) plus
  kl_coeff times the k3 estimator of KL(q || p_theta) on the sampled tokens (A != 0; the prompt tokens' q = 0 padding
  would make it meaningless there). kl_coeff defaults to 0.0 (no default is documented). It is NOT numerically Tinker's
  stable_reinforce; revisit it when sampling lands. logprobs and advantages missing: InvalidRequestError, as for the
  other RL losses.
- SkyRL `skyrl/tinker/loss_fns.py` (JAX): the same cross_entropy / importance_sampling / ppo / cispo token formulas, with
  clip thresholds carried per example; it has no dro.

Metrics (all `name:reduction`, reductions from {sum, mean, min, max}); the engine always emits `loss:sum`, and
`LossSpec.metrics` adds, over the item's *active* tokens (advantage != 0: prompt tokens carry A = 0 in Tinker RL data):
    importance_sampling, ppo, cispo, dro   importance_ratio:mean, importance_ratio:min, importance_ratio:max
    ppo                                    clip_fraction:mean  tokens where the clipped term wins the min (zero gradient)
    cispo                                  clip_fraction:mean  tokens whose ratio lies outside [lo, hi]
    gspo                                   clip_fraction:mean  as ppo, on s_t;  sequence_ratio:mean/min/max  s per datum
                                           (over the datums whose M is not empty)
    stable_reinforce                       kl:mean  the k3 term's mean over the active tokens
A metric over an empty set of active tokens is left out (clip_fraction is then 0.0), so every value is finite.

Every loss function takes `segments`: int64 [N], the index (0, 1, ...) of the datum each token belongs to, for losses
with a per-datum quantity (gspo's sequence ratio); the token-wise losses ignore it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from loraplex.errors import InvalidRequestError
from loraplex.workers.lora.routing import to_device

CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")

# (target logprobs [N], float inputs [N] each, config, segments [N] int64: each token's datum index) -> loss [N]
TokenLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float], torch.Tensor], torch.Tensor]
LossMetrics = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float], torch.Tensor], dict[str, float]]
DerivedInput = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]  # an absent input, from the datum's other inputs
DatumCheck = Callable[[Mapping[str, torch.Tensor], str], None]  # raises InvalidRequestError naming `where`


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
    # float inputs a datum may give ([N]); when absent, computed from its other inputs (after defaults and config).
    derived: Mapping[str, DerivedInput] = field(default_factory=dict)
    check: DatumCheck | None = None  # a datum's prepared inputs, checked together (e.g. gspo's mask vs its advantages)

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
        return self.metrics(lp, cat, config, segments_of([len(d) for d in logprobs]))


def segments_of(lengths: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """int64 [sum(lengths)]: token i's datum index, for datums of these lengths laid end to end."""
    counts = torch.tensor(list(lengths), dtype=torch.int64)
    return to_device(torch.repeat_interleave(torch.arange(len(counts)), counts), torch.device(device or "cpu"))


# ---- losses ----------------------------------------------------------------------------------------------------------
def _ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])  # p_theta / q, with q the sampler's logprobs


def _clip(ratio: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.clamp(ratio, inputs["clip_low_threshold"], inputs["clip_high_threshold"])


def _cross_entropy(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float], _seg: torch.Tensor
) -> torch.Tensor:
    return -(inputs["weights"] * lp)


def _importance_sampling(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float], _seg: torch.Tensor
) -> torch.Tensor:
    return -(_ratio(lp, inputs) * inputs["advantages"])


def _ppo(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float], _seg: torch.Tensor
) -> torch.Tensor:
    ratio, adv = _ratio(lp, inputs), inputs["advantages"]
    return -torch.minimum(ratio * adv, _clip(ratio, inputs) * adv)


def _cispo(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float], _seg: torch.Tensor
) -> torch.Tensor:
    return -(_clip(_ratio(lp, inputs), inputs).detach() * lp * inputs["advantages"])


def _dro(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float], _seg: torch.Tensor
) -> torch.Tensor:
    return -(lp * inputs["advantages"] - 0.5 * cfg["beta"] * (lp - inputs["logprobs"]).square())


def _sequence_log_ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], seg: torch.Tensor) -> torch.Tensor:
    """gspo's log s per token: the mean of sg(lp) - q over its datum's masked tokens (0 where the mask is empty)."""
    in_ratio = (inputs["sequence_ratio_mask"] != 0).to(lp.dtype)
    # Sized by tokens (>= datums), not by seg.max(): no device sync.
    total = torch.zeros_like(lp, requires_grad=False).index_add_(0, seg, in_ratio * (lp.detach() - inputs["logprobs"]))
    count = torch.zeros_like(lp, requires_grad=False).index_add_(0, seg, in_ratio)
    return torch.where(count > 0, total / count.clamp(min=1), 0.0)[seg]


def _gspo_ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], seg: torch.Tensor) -> torch.Tensor:
    """s_t = sg(s) * p / sg(p): the sequence ratio's value with the token's own gradient."""
    return torch.exp(_sequence_log_ratio(lp, inputs, seg) + lp - lp.detach())


def _gspo(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float], seg: torch.Tensor
) -> torch.Tensor:
    ratio, adv = _gspo_ratio(lp, inputs, seg), inputs["advantages"]
    return -torch.minimum(ratio * adv, _clip(ratio, inputs) * adv)


def _k3(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """ratio - 1 - log(ratio): the k3 estimator of KL(q || p_theta) at tokens sampled from q (>= 0, 0 at ratio 1)."""
    log_ratio = lp - inputs["logprobs"]
    return torch.exp(log_ratio) - 1 - log_ratio


def _stable_reinforce(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float], _seg: torch.Tensor
) -> torch.Tensor:
    adv = inputs["advantages"]
    reinforce = -(_ratio(lp, inputs).detach() * lp * adv)
    return reinforce + cfg["kl_coeff"] * torch.where(adv != 0, _k3(lp, inputs), 0.0)


# ---- metrics ---------------------------------------------------------------------------------------------------------
def _ratio_metrics(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float], seg: torch.Tensor
) -> dict[str, float]:
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


def _ppo_metrics(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float], seg: torch.Tensor
) -> dict[str, float]:
    ratio, adv = _ratio(lp, inputs), inputs["advantages"]
    clipped = _clip(ratio, inputs) * adv < ratio * adv  # the min picks the clipped term: this token's gradient is zero
    return {**_ratio_metrics(lp, inputs, cfg, seg), "clip_fraction:mean": _fraction(clipped, adv != 0)}


def _cispo_metrics(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float], seg: torch.Tensor
) -> dict[str, float]:
    ratio = _ratio(lp, inputs)
    outside = (ratio < inputs["clip_low_threshold"]) | (ratio > inputs["clip_high_threshold"])
    return {**_ratio_metrics(lp, inputs, cfg, seg), "clip_fraction:mean": _fraction(outside, inputs["advantages"] != 0)}


def _gspo_metrics(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float], seg: torch.Tensor
) -> dict[str, float]:
    ratio, adv = _gspo_ratio(lp, inputs, seg), inputs["advantages"]
    clipped = _clip(ratio, inputs) * adv < ratio * adv
    out = {**_ratio_metrics(lp, inputs, cfg, seg), "clip_fraction:mean": _fraction(clipped, adv != 0)}
    in_ratio = inputs["sequence_ratio_mask"] != 0
    with_mask = torch.unique(seg[in_ratio])  # the datums whose sequence ratio is defined
    if with_mask.numel():
        first = torch.searchsorted(seg, with_mask)  # seg is sorted: a datum's first token
        s = ratio.detach()[first]
        out.update({"sequence_ratio:mean": s.mean().item(), "sequence_ratio:min": s.min().item(),
                    "sequence_ratio:max": s.max().item()})  # fmt: skip
    return out


def _stable_reinforce_metrics(
    lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float], seg: torch.Tensor
) -> dict[str, float]:
    active = inputs["advantages"] != 0
    out = _ratio_metrics(lp, inputs, cfg, seg)
    if bool(active.any()):
        out["kl:mean"] = _k3(lp, inputs)[active].mean().item()
    return out


def _default_ratio_mask(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return (inputs["advantages"] != 0).to(torch.float32)


def _check_ratio_mask(inputs: Mapping[str, torch.Tensor], where: str) -> None:
    if not bool((inputs["sequence_ratio_mask"] != 0).any()) and bool((inputs["advantages"] != 0).any()):
        raise InvalidRequestError(
            f"{where}.sequence_ratio_mask marks no token but the datum has non-zero advantages: gspo's sequence "
            "ratio is undefined (mark the sampled tokens)"
        )


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
    "gspo": LossSpec(
        "gspo",
        _gspo,
        required=_RL,
        config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        per_token_config=CLIP_KEYS,
        metrics=_gspo_metrics,
        derived={"sequence_ratio_mask": _default_ratio_mask},
        check=_check_ratio_mask,
    ),
    "stable_reinforce": LossSpec(
        "stable_reinforce",
        _stable_reinforce,
        required=_RL,
        config_defaults={"kl_coeff": 0.0},
        metrics=_stable_reinforce_metrics,
    ),
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
    for key in ("beta", "kl_coeff"):
        if resolved.get(key, 0.0) < 0:
            raise InvalidRequestError(f"loss_fn_config[{key!r}] must be >= 0, got {resolved[key]}")
    return resolved

"""Tinker loss functions on per-token target logprobs, and the memory-lean LM head that produces those logprobs.

Every loss here is a token-wise sum (Tinker semantics): a datum's loss is the sum of its per-token losses and a step's loss
is the sum over datums (never a mean). Each loss maps (target logprobs [N], float inputs [N] each, config) -> per-token
loss [N]; rows of different losses share one forward pass and are scored separately.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from loraplex.errors import InvalidRequestError

LOSS_CHUNK_TOKENS = 1024

TokenLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: TokenLoss
    required: tuple[str, ...]  # float loss_fn_inputs that must be present (besides target_tokens)
    defaults: Mapping[str, float] = field(default_factory=dict)  # float inputs filled with a constant when absent
    config_defaults: Mapping[str, float] = field(default_factory=dict)  # loss_fn_config keys and their defaults


def _cross_entropy(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float]) -> torch.Tensor:
    # loss = -sum(weights * logprobs[target])
    return -(inputs["weights"] * lp)


def _ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])  # p_theta / q, with q the sampler's logprobs


def _importance_sampling(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], _: Mapping[str, float]) -> torch.Tensor:
    # loss = -sum(exp(logprobs - sampling_logprobs) * advantages)
    return -(_ratio(lp, inputs) * inputs["advantages"])


def _ppo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    # loss = -sum(min(ratio * adv, clamp(ratio, low, high) * adv))
    ratio, adv = _ratio(lp, inputs), inputs["advantages"]
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(ratio * adv, clipped * adv)


def _cispo(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor], cfg: Mapping[str, float]) -> torch.Tensor:
    # loss = -sum(stopgrad(clamp(ratio, low, high)) * logprobs * adv)
    clipped = _ratio(lp, inputs).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    return -(clipped * lp * inputs["advantages"])


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec("cross_entropy", _cross_entropy, required=(), defaults={"weights": 1.0}),
    "importance_sampling": LossSpec("importance_sampling", _importance_sampling, required=("logprobs", "advantages")),
    "ppo": LossSpec("ppo", _ppo, required=("logprobs", "advantages"), config_defaults=_CLIP),
    "cispo": LossSpec("cispo", _cispo, required=("logprobs", "advantages"), config_defaults=_CLIP),
}


def get_loss(name: str) -> LossSpec:
    try:
        return LOSSES[name]
    except KeyError:
        raise InvalidRequestError(f"unknown loss_fn {name!r}; supported: {sorted(LOSSES)}") from None


def resolve_loss_config(spec: LossSpec, config: Mapping[str, object] | None) -> dict[str, float]:
    """The loss's config values (defaults filled in); keys the loss does not use are ignored, as Tinker does."""
    resolved = dict(spec.config_defaults)
    for key, value in (config or {}).items():
        if key in resolved:
            try:
                resolved[key] = float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise InvalidRequestError(f"loss_fn_config[{key!r}] must be a number, got {value!r}") from None
    return resolved


def _target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return logits.gather(1, targets.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)


def target_logprobs(
    hidden: torch.Tensor, head_weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = LOSS_CHUNK_TOKENS
) -> torch.Tensor:
    """log_softmax(hidden @ W^T)[i, targets[i]] in fp32, one chunk of rows at a time.

    hidden: [N, H] (final-norm output), head_weight: [V, H], targets: [N] -> [N] fp32. Each chunk runs under activation
    checkpointing, so at most one chunk's [chunk, V] fp32 logits is alive in forward and in backward."""
    pieces = []
    grad = torch.is_grad_enabled() and hidden.requires_grad
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if grad:
            pieces.append(checkpoint(_target_logprobs, h, head_weight, t, use_reentrant=False))
        else:
            pieces.append(_target_logprobs(h, head_weight, t))
    if not pieces:
        return hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(pieces)

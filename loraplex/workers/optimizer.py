"""Batched AdamW over slot banks: one vectorised update for every selected slot, each with its own hyperparameters.

Per slot it equals `torch.optim.AdamW` (decoupled weight decay) run on that adapter alone, preceded by
`torch.nn.utils.clip_grad_norm_` over the adapter's LoRA tensors when grad_clip_norm > 0. Only the real-rank part of a slot
changes; the zero padding stays exactly zero (even with eps = 0). Stepped slots get their gradients cleared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from loraplex.errors import InvalidRequestError


@dataclass(frozen=True)
class AdamParams:
    """Tinker's AdamParams and defaults."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 = no clipping

    @classmethod
    def from_dict(cls, values: Mapping[str, object] | None) -> AdamParams:
        """From a request's adam_params; unknown keys are ignored, bad values are an InvalidRequestError."""
        kwargs: dict[str, float] = {}
        for name in cls.__dataclass_fields__:
            if values and values.get(name) is not None:
                try:
                    kwargs[name] = float(values[name])  # type: ignore[arg-type]
                except (TypeError, ValueError):
                    raise InvalidRequestError(f"adam_params.{name} must be a number, got {values[name]!r}") from None
        params = cls(**kwargs)
        params.validate()
        return params

    def validate(self) -> None:
        checks = {
            "learning_rate": self.learning_rate >= 0,
            "beta1": 0 <= self.beta1 < 1,
            "beta2": 0 <= self.beta2 < 1,
            "eps": self.eps >= 0,
            "weight_decay": self.weight_decay >= 0,
            "grad_clip_norm": self.grad_clip_norm >= 0,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if not ok or not math.isfinite(value):
                raise InvalidRequestError(f"adam_params.{name} out of range: {value}")


@dataclass(frozen=True)
class SlotStepResult:
    grad_norm: float  # the adapter's global grad norm before clipping
    stepped: bool  # False: non-finite norm, the step was skipped (gradients still cleared)
    step: int  # the adapter's step count after this call


class SlotAdamW:
    """AdamW state for slot banks. `params[i]` is a bank [S, ...] whose dim `rank_dims[i]` is the rank dimension."""

    def __init__(self, params: Sequence[torch.nn.Parameter], rank_dims: Sequence[int], num_slots: int) -> None:
        if len(params) != len(rank_dims):
            raise ValueError("one rank dimension per parameter")
        self.params = list(params)
        self.rank_dims = list(rank_dims)
        self.exp_avg = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.steps = [0] * num_slots  # host ints: bias corrections are computed in Python doubles, like torch

    def reset_slots(self, slots: Sequence[int]) -> None:
        """Forget the slots' Adam state (a new or deleted adapter never inherits it)."""
        if not slots:
            return
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.params[0].device)
        for m, v in zip(self.exp_avg, self.exp_avg_sq, strict=True):
            m.index_fill_(0, idx, 0.0)
            v.index_fill_(0, idx, 0.0)
        for s in slots:
            self.steps[s] = 0

    def grad_norms(self, idx: torch.Tensor) -> torch.Tensor:
        """Per selected slot: the norm of the per-tensor grad norms (what clip_grad_norm_ computes). [n] fp32."""
        per_tensor = [
            torch.linalg.vector_norm(p.grad.index_select(0, idx).float(), dim=tuple(range(1, p.dim())))
            for p in self.params
            if p.grad is not None
        ]
        if not per_tensor:
            return torch.zeros(idx.numel(), device=idx.device)
        return torch.linalg.vector_norm(torch.stack(per_tensor, dim=1), dim=1)

    @torch.no_grad()
    def step(self, slots: Sequence[int], hparams: Sequence[AdamParams], ranks: Sequence[int]) -> list[SlotStepResult]:
        """One AdamW step for each of `slots` (distinct), then clear their gradients."""
        if len(set(slots)) != len(slots):
            raise ValueError("each slot may appear once per step")
        if not slots:
            return []
        device = self.params[0].device
        idx_all = torch.tensor(list(slots), dtype=torch.int64, device=device)
        norms = self.grad_norms(idx_all).tolist()  # one sync: the host decides which slots step
        ok = [i for i, n in enumerate(norms) if math.isfinite(n)]
        if ok:
            self._update(
                [slots[i] for i in ok], [hparams[i] for i in ok], [ranks[i] for i in ok], [norms[i] for i in ok]
            )
        for p in self.params:
            if p.grad is not None:
                p.grad.index_fill_(0, idx_all, 0.0)
        ok_set = set(ok)
        return [SlotStepResult(norms[i], i in ok_set, self.steps[s]) for i, s in enumerate(slots)]

    def _update(self, slots: list[int], hps: list[AdamParams], ranks: list[int], norms: list[float]) -> None:
        device = self.params[0].device
        idx = torch.tensor(slots, dtype=torch.int64, device=device)
        for s in slots:
            self.steps[s] += 1
        steps = [self.steps[s] for s in slots]

        def col(values: list[float]) -> torch.Tensor:  # per-slot scalar, broadcast over a bank's trailing dims
            return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1, 1)

        # clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1; multiplied in even when it is 1.
        clip = col(
            [
                min(h.grad_clip_norm / (n + 1e-6), 1.0) if h.grad_clip_norm > 0 else 1.0
                for h, n in zip(hps, norms, strict=True)
            ]
        )
        clip_on = any(h.grad_clip_norm > 0 for h in hps)
        decay = col([1.0 - h.learning_rate * h.weight_decay for h in hps])
        one_minus_b1 = col([1.0 - h.beta1 for h in hps])
        beta2 = col([h.beta2 for h in hps])
        one_minus_b2 = col([1.0 - h.beta2 for h in hps])
        step_size = col([h.learning_rate / (1.0 - h.beta1**t) for h, t in zip(hps, steps, strict=True)])
        bc2_sqrt = col([(1.0 - h.beta2**t) ** 0.5 for h, t in zip(hps, steps, strict=True)])
        eps = col([h.eps for h in hps])
        rank_t = torch.tensor(ranks, dtype=torch.int64, device=device)

        for p, m_bank, v_bank, rank_dim in zip(self.params, self.exp_avg, self.exp_avg_sq, self.rank_dims, strict=True):
            if p.grad is None:
                continue
            g = p.grad.index_select(0, idx).float()
            if clip_on:
                g = g * clip
            w, m, v = p.index_select(0, idx).float(), m_bank.index_select(0, idx), v_bank.index_select(0, idx)
            w_new = w * decay
            m.lerp_(g, one_minus_b1)
            v.mul_(beta2).add_(one_minus_b2 * g * g)
            denom = (v.sqrt() / bc2_sqrt).add_(eps)
            w_new = w_new - step_size * (m / denom)
            # Only the real-rank part moves: padding stays exactly zero whatever eps is.
            shape = [1] * p.dim()
            shape[rank_dim] = p.shape[rank_dim]
            positions = torch.arange(p.shape[rank_dim], device=device).view(shape)
            real = positions < rank_t.view([-1] + [1] * (p.dim() - 1))
            w_new = torch.where(real, w_new, w)
            p.index_copy_(0, idx, w_new.to(p.dtype))
            m_bank.index_copy_(0, idx, torch.where(real, m, 0.0))
            v_bank.index_copy_(0, idx, torch.where(real, v, 0.0))

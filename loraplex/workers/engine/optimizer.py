"""Batched AdamW over slot banks: one vectorised update for every selected slot, each with its own hyperparameters.

Per slot it equals `torch.optim.AdamW` (decoupled weight decay) run on that adapter alone, preceded by
`torch.nn.utils.clip_grad_norm_` over the adapter's LoRA tensors when grad_clip_norm > 0. Only the real-rank part of a slot
changes; the zero padding stays exactly zero, and so do the banks an adapter does not train (a
target-module subset: `step(..., params=)`). Stepped slots get their gradients cleared.

The hyperparameters' names, defaults and bounds are protocol/adam.py's (eps > 0 there: with eps = 0 a LoRA A's
first, exactly zero gradient gives 0 / 0).

Two ways, the same maths: slots with eps > 0 go through torch's own fused AdamW kernel (`torch._fused_adamw_`, what
`torch.optim.AdamW(fused=True)` runs: one pass over each slot's four rows), their gradients first clipped and zeroed
outside the slot's real part (the weights and moments there are zero, so with eps > 0 they stay zero); any other slot
takes `_update_masked`, the vectorised plain-torch update that writes only the real part (the reference the fused
path is tested against; it keeps the padding at zero even for an eps = 0 a direct caller may construct). The fused path reads the slots' rows
in place instead of ~20 gathered, masked passes (RESULTS.md, 2026-12-02: the masked passes took 7.7 ms per 4B-model adapter step).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from loraplex.errors import InvalidRequestError
from loraplex.protocol.adam import ADAM_DEFAULTS, adam_problems

# The banks are strided views into one flat buffer, so autograd warns that their gradients are not laid out like a
# dense tensor; it still accumulates into them in place, which is all we need (checked by the optimizer tests).
warnings.filterwarnings("ignore", message="grad and param do not obey the gradient layout contract")


@dataclass(frozen=True)
class AdamParams:
    """Tinker's AdamParams; names, defaults and bounds are the protocol's (loraplex/protocol/adam.py)."""

    learning_rate: float = ADAM_DEFAULTS["learning_rate"]
    beta1: float = ADAM_DEFAULTS["beta1"]
    beta2: float = ADAM_DEFAULTS["beta2"]
    eps: float = ADAM_DEFAULTS["eps"]
    weight_decay: float = ADAM_DEFAULTS["weight_decay"]
    grad_clip_norm: float = ADAM_DEFAULTS["grad_clip_norm"]  # 0 = no clipping

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
        problems = adam_problems(dataclasses.asdict(self))
        if problems:
            raise InvalidRequestError(f"adam_params.{problems[0]}")


@dataclass(frozen=True)
class SlotStepResult:
    grad_norm: float  # the adapter's global grad norm before clipping
    stepped: bool  # False: non-finite norm, the step was skipped (gradients still cleared)
    step: int  # the adapter's step count after this call


class SlotAdamW:
    """AdamW state for slot banks. `params[i]` is a bank [S, ...] whose dim `rank_dims[i]` is the rank dimension.

    All banks live in ONE flat fp32 buffer [S, P] (P = every bank's per-slot size), and so do their gradients and Adam
    moments: each bank Parameter's `.data` and `.grad` become views into it (the Parameter objects stay the same, so
    modules, FSDP's ignored params and tests keep their references). A step is then a dozen kernels on [slots, P]
    columns instead of a dozen per bank (hundreds of banks in a real model: host-bound otherwise)."""

    COLUMN_CHUNK = 1 << 24  # columns per update chunk: bounds the [slots, chunk] temporaries (64 MiB per slot in fp32)

    def __init__(self, params: Sequence[torch.nn.Parameter], rank_dims: Sequence[int], num_slots: int) -> None:
        if len(params) != len(rank_dims):
            raise ValueError("one rank dimension per parameter")
        if not params:
            raise ValueError("no parameters")
        if any(p.dtype != torch.float32 or p.shape[0] != num_slots for p in params):
            raise ValueError(f"banks must be fp32 masters with {num_slots} slots in dim 0")
        self.params = list(params)
        self.rank_dims = list(rank_dims)
        device = self.params[0].device
        sizes = [p[0].numel() for p in self.params]
        self.segments = [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]
        width = sum(sizes)
        self.data = torch.zeros(num_slots, width, device=device)
        self.grad = torch.zeros_like(self.data)
        self.exp_avg_flat = torch.zeros_like(self.data)
        self.exp_avg_sq_flat = torch.zeros_like(self.data)
        self._views = [(self._view(self.data, p, seg), self._view(self.grad, p, seg)) for p, seg in zip(
            self.params, self.segments, strict=True)]  # fmt: skip
        self.adopt_views()
        self.exp_avg = [
            self._view(self.exp_avg_flat, p, seg) for p, seg in zip(self.params, self.segments, strict=True)
        ]
        self.exp_avg_sq = [
            self._view(self.exp_avg_sq_flat, p, seg) for p, seg in zip(self.params, self.segments, strict=True)
        ]
        self.steps = [0] * num_slots  # host ints: bias corrections are computed in Python doubles, like torch
        self._rank_masks: dict[tuple[int, frozenset[int] | None], torch.Tensor] = {}
        self._outside: dict[tuple[int, frozenset[int] | None], torch.Tensor | None] = {}
        # torch's fused AdamW for slots with eps > 0 (see the module doc); False: the masked update for every slot
        self.fused = True

    @torch.no_grad()
    def adopt_views(self) -> None:
        """Make every bank's `.data` and `.grad` the flat buffers' views again, copying in whatever replaced them (code
        that assigns `p.grad = ...` or moves a module). Cheap when nothing changed: a pointer comparison per bank."""
        for p, (data_view, grad_view) in zip(self.params, self._views, strict=True):
            if p.data_ptr() != data_view.data_ptr():  # p.data would make a tensor object per bank, every step
                data_view.copy_(p.data)
                p.data = data_view
            if p.grad is None or p.grad.data_ptr() != grad_view.data_ptr():
                if p.grad is None:
                    grad_view.zero_()
                else:
                    grad_view.copy_(p.grad)
                p.grad = grad_view  # backward accumulates into it in place

    @staticmethod
    def _view(flat: torch.Tensor, p: torch.Tensor, segment: tuple[int, int]) -> torch.Tensor:
        start, size = segment
        return flat[:, start : start + size].view(p.shape)

    def _rank_mask(self, rank: int, params: frozenset[int] | None = None) -> torch.Tensor:
        """[P] bool: True where a rank-`rank` adapter has real weights (the rest is zero padding), within the params
        (indices into self.params) it trains; None: all of them."""
        mask = self._rank_masks.get((rank, params))
        if mask is None:
            pieces = []
            for i, (p, dim) in enumerate(zip(self.params, self.rank_dims, strict=True)):
                shape = [1] * (p.dim() - 1)
                shape[dim - 1] = p.shape[dim]
                positions = torch.arange(p.shape[dim], device=self.data.device).view(shape)
                trained = params is None or i in params
                pieces.append((positions < (rank if trained else 0)).expand(p.shape[1:]).reshape(-1))
            mask = self._rank_masks[(rank, params)] = torch.cat(pieces)
        return mask

    def reset_slots(self, slots: Sequence[int]) -> None:
        """Forget the slots' Adam state (a new or deleted adapter never inherits it)."""
        if not slots:
            return
        self.adopt_views()
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.data.device)
        self.exp_avg_flat.index_fill_(0, idx, 0.0)
        self.exp_avg_sq_flat.index_fill_(0, idx, 0.0)
        for s in slots:
            self.steps[s] = 0

    def grad_norms(self, slots: Sequence[int]) -> torch.Tensor:
        """Per slot: the L2 norm of all its bank gradients together (what clip_grad_norm_ computes). [n]. Each read
        in place from its row of the flat gradient: gathering the rows first would copy them (an MoE slot's row is
        843 M fp32 values, 3.4 GB)."""
        self.adopt_views()
        return torch.stack([torch.linalg.vector_norm(self.grad[s]) for s in slots])

    @torch.no_grad()
    def step(
        self,
        slots: Sequence[int],
        hparams: Sequence[AdamParams],
        ranks: Sequence[int],
        params: Sequence[frozenset[int] | None] | None = None,
    ) -> list[SlotStepResult]:
        """One AdamW step for each of `slots` (distinct), then clear their gradients. params: per slot, the indices
        into self.params it trains (None: all); the others keep their values (zero) whatever eps or weight decay."""
        if len(set(slots)) != len(slots):
            raise ValueError("each slot may appear once per step")
        if not slots:
            return []
        norms = self.grad_norms(slots).tolist()  # one sync: the host decides which slots step
        ok = [i for i, n in enumerate(norms) if math.isfinite(n)]
        trained = list(params) if params is not None else [None] * len(slots)
        if ok:
            for s in (slots[i] for i in ok):
                self.steps[s] += 1
            fused = [i for i in ok if hparams[i].eps > 0] if self.fused else []
            masked = [i for i in ok if i not in set(fused)]
            for pick, update in ((fused, self._update_fused), (masked, self._update_masked)):
                if pick:
                    update(
                        [slots[i] for i in pick],
                        [hparams[i] for i in pick],
                        [ranks[i] for i in pick],
                        [norms[i] for i in pick],
                        [trained[i] for i in pick],
                    )
        for s in slots:
            self.grad[s].zero_()
        ok_set = set(ok)
        return [SlotStepResult(norms[i], i in ok_set, self.steps[s]) for i, s in enumerate(slots)]

    @staticmethod
    def _clip_coef(h: AdamParams, norm: float) -> float:
        """clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1; multiplied in even when it is 1."""
        return min(h.grad_clip_norm / (norm + 1e-6), 1.0) if h.grad_clip_norm > 0 else 1.0

    def _update_fused(
        self,
        slots: list[int],
        hps: list[AdamParams],
        ranks: list[int],
        norms: list[float],
        params: list[frozenset[int] | None],
    ) -> None:
        """torch's fused AdamW over the slots' rows, one call per distinct set of hyperparameters (eps > 0 only)."""
        device = self.data.device
        for i, s in enumerate(slots):
            g = self.grad[s]
            if hps[i].grad_clip_norm > 0:
                g.mul_(self._clip_coef(hps[i], norms[i]))
            outside = self._outside_mask(ranks[i], params[i])
            if outside is not None:
                g.masked_fill_(outside, 0.0)
        groups: dict[AdamParams, list[int]] = {}
        for i, h in enumerate(hps):
            groups.setdefault(h, []).append(i)
        for h, members in groups.items():
            rows = [slots[i] for i in members]
            # 0-dim step counts on the device (the kernel's bias corrections read them); already incremented
            steps = list(torch.tensor([float(self.steps[s]) for s in rows], device=device).unbind())
            torch._fused_adamw_(
                [self.data[s] for s in rows],
                [self.grad[s] for s in rows],
                [self.exp_avg_flat[s] for s in rows],
                [self.exp_avg_sq_flat[s] for s in rows],
                [],
                steps,
                lr=h.learning_rate,
                beta1=h.beta1,
                beta2=h.beta2,
                weight_decay=h.weight_decay,
                eps=h.eps,
                amsgrad=False,
                maximize=False,
            )

    def _outside_mask(self, rank: int, params: frozenset[int] | None) -> torch.Tensor | None:
        """[P] bool: True outside the slot's real part (None when it has none: full rank, every bank trained)."""
        key = (rank, params)
        if key not in self._outside:
            outside = ~self._rank_mask(rank, params)
            self._outside[key] = outside if bool(outside.any()) else None
        return self._outside[key]

    def _update_masked(
        self,
        slots: list[int],
        hps: list[AdamParams],
        ranks: list[int],
        norms: list[float],
        params: list[frozenset[int] | None],
    ) -> None:
        device = self.data.device
        idx = torch.tensor(slots, dtype=torch.int64, device=device)
        steps = [self.steps[s] for s in slots]

        def col(values: list[float]) -> torch.Tensor:  # per-slot scalar, broadcast over the columns
            return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1)

        clip_on = any(h.grad_clip_norm > 0 for h in hps)
        clip = col([self._clip_coef(h, n) for h, n in zip(hps, norms, strict=True)])
        decay = col([1.0 - h.learning_rate * h.weight_decay for h in hps])
        one_minus_b1 = col([1.0 - h.beta1 for h in hps])
        beta2 = col([h.beta2 for h in hps])
        one_minus_b2 = col([1.0 - h.beta2 for h in hps])
        step_size = col([h.learning_rate / (1.0 - h.beta1**t) for h, t in zip(hps, steps, strict=True)])
        bc2_sqrt = col([(1.0 - h.beta2**t) ** 0.5 for h, t in zip(hps, steps, strict=True)])
        eps = col([h.eps for h in hps])
        # [n, P]: only the real-rank part of the trained banks moves
        masks = torch.stack([self._rank_mask(r, t) for r, t in zip(ranks, params, strict=True)])

        width = self.data.shape[1]
        for lo in range(0, width, self.COLUMN_CHUNK):
            cols = slice(lo, min(lo + self.COLUMN_CHUNK, width))
            g = self.grad[:, cols].index_select(0, idx)
            if clip_on:
                g = g * clip
            w = self.data[:, cols].index_select(0, idx)
            m = self.exp_avg_flat[:, cols].index_select(0, idx)
            v = self.exp_avg_sq_flat[:, cols].index_select(0, idx)
            w_new = w * decay
            m.lerp_(g, one_minus_b1)
            v.mul_(beta2).add_(one_minus_b2 * g * g)
            denom = (v.sqrt() / bc2_sqrt).add_(eps)
            w_new = w_new - step_size * (m / denom)
            real = masks[:, cols]
            # Padding stays exactly zero whatever eps is: weights and moments keep their (zero) values there.
            self.data[:, cols].index_copy_(0, idx, torch.where(real, w_new, w))
            self.exp_avg_flat[:, cols].index_copy_(0, idx, torch.where(real, m, 0.0))
            self.exp_avg_sq_flat[:, cols].index_copy_(0, idx, torch.where(real, v, 0.0))

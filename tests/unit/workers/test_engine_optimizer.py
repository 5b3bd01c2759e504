"""Batched AdamW over slots == torch.optim.AdamW (+ clip_grad_norm_) run on each adapter alone."""

from __future__ import annotations

import pytest
import torch

from loraplex.errors import InvalidRequestError
from loraplex.workers.engine.optimizer import AdamParams, SlotAdamW

SLOTS, R_MAX = 6, 8
SHAPES = [(10, 12), (7, 5)]  # (in, out) of two wrapped modules
HPARAMS = {
    0: AdamParams(),  # Tinker defaults
    2: AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1),
    3: AdamParams(learning_rate=3e-3, weight_decay=0.01, grad_clip_norm=0.05),  # clipping active
    4: AdamParams(learning_rate=5e-2, beta1=0.0, beta2=0.5, eps=0.0, grad_clip_norm=1e6),  # clip on, never binding
    5: AdamParams(learning_rate=1e-3, weight_decay=1.0),
}
RANKS = {0: 8, 2: 3, 3: 5, 4: 1, 5: 8}


def make_banks() -> tuple[list[torch.nn.Parameter], list[int]]:
    g = torch.Generator().manual_seed(0)
    params, dims = [], []
    for k, n in SHAPES:
        a = torch.zeros(SLOTS, k, R_MAX)
        b = torch.zeros(SLOTS, R_MAX, n)
        for s, r in RANKS.items():
            a[s, :, :r] = torch.randn(k, r, generator=g)
            b[s, :r] = torch.randn(r, n, generator=g)
        params += [torch.nn.Parameter(a), torch.nn.Parameter(b)]
        dims += [2, 1]
    return params, dims


def real(p: torch.Tensor, dim: int, slot: int, rank: int) -> torch.Tensor:
    return p[slot, :, :rank] if dim == 2 else p[slot, :rank]


def test_matches_torch_adamw_per_slot() -> None:
    params, dims = make_banks()
    opt = SlotAdamW(params, dims, SLOTS)
    refs = {
        s: [real(p, d, s, r).detach().clone().requires_grad_(True) for p, d in zip(params, dims, strict=True)]
        for s, r in RANKS.items()
    }
    torch_opts = {
        s: torch.optim.AdamW(
            refs[s], lr=h.learning_rate, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay
        )
        for s, h in HPARAMS.items()
    }
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        for p in params:
            p.grad = torch.zeros_like(p)
        for s, r in RANKS.items():
            for p, d, ref in zip(params, dims, refs[s], strict=True):
                grad = torch.randn(ref.shape, generator=g) * (step + 1)
                real(p.grad, d, s, r).copy_(grad)
                ref.grad = grad.clone()
        slots = list(HPARAMS)
        results = opt.step(slots, [HPARAMS[s] for s in slots], [RANKS[s] for s in slots])
        for s, res in zip(slots, results, strict=True):
            clip = HPARAMS[s].grad_clip_norm
            norm = (
                torch.nn.utils.clip_grad_norm_(refs[s], clip)
                if clip > 0
                else torch.nn.utils.get_total_norm([r.grad for r in refs[s]])
            )
            assert res.stepped and res.step == step + 1
            assert res.grad_norm == pytest.approx(norm.item(), rel=1e-5)
            torch_opts[s].step()
        for s, r in RANKS.items():
            for p, d, ref in zip(params, dims, refs[s], strict=True):
                if s in HPARAMS:
                    assert (real(p, d, s, r) - ref).abs().max().item() <= 1e-6
        for p in params:
            assert torch.count_nonzero(p.grad[slots]) == 0  # stepped slots are cleared
    for s, r in RANKS.items():  # padding never moves (slot 4 has eps=0 and rank 1)
        for p, d in zip(params, dims, strict=True):
            pad = p[s, :, r:] if d == 2 else p[s, r:]
            assert torch.count_nonzero(pad) == 0


def test_fused_kernel_path_equals_the_masked_reference_update() -> None:
    """torch's fused AdamW (slots with eps > 0) against `_update_masked` (SlotAdamW.fused False) on random gradients
    with noise in the padding and in a bank the adapter does not train: the same weights and moments to fp32 rounding,
    and exact zeros outside each slot's real part."""
    params, dims = make_banks()
    twins, _ = make_banks()
    opts = [SlotAdamW(params, dims, SLOTS), SlotAdamW(twins, dims, SLOTS)]
    opts[1].fused = False
    subset = {0: frozenset({0, 1}), 2: None, 3: frozenset({2, 3}), 5: None}  # slot 0 trains module 0, slot 3 module 1
    for s, only in subset.items():
        if only is not None:  # the untrained module's banks are zero, as Engine.create_adapter leaves them
            for i, p in enumerate(params):
                if i not in only:
                    with torch.no_grad():
                        p[s].zero_()
                        twins[i][s].zero_()
    g = torch.Generator().manual_seed(5)
    slots = list(subset)
    for _ in range(3):
        for p, q in zip(params, twins, strict=True):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        for opt in opts:
            opt.step(slots, [HPARAMS[s] for s in slots], [RANKS[s] for s in slots], [subset[s] for s in slots])
    fused, masked = opts
    for name in ("data", "exp_avg_flat", "exp_avg_sq_flat"):
        got, want = getattr(fused, name), getattr(masked, name)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        for s in slots:
            outside = ~fused._rank_mask(RANKS[s], subset[s])
            assert torch.count_nonzero(got[s][outside]) == 0, (name, s)


def test_unselected_slots_are_untouched() -> None:
    params, dims = make_banks()
    before = [p.detach().clone() for p in params]
    opt = SlotAdamW(params, dims, SLOTS)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step([2], [AdamParams(learning_rate=0.1)], [RANKS[2]])
    for p, b in zip(params, before, strict=True):
        mask = torch.ones(SLOTS, dtype=torch.bool)
        mask[2] = False
        assert torch.equal(p[mask], b[mask]) and torch.equal(p.grad[mask], torch.ones_like(p.grad[mask]))
        assert not torch.equal(p[2], b[2])
    assert opt.steps == [0, 0, 1, 0, 0, 0]


def test_non_finite_gradient_skips_only_that_slot() -> None:
    params, dims = make_banks()
    before = [p.detach().clone() for p in params]
    opt = SlotAdamW(params, dims, SLOTS)
    for p in params:
        p.grad = torch.zeros_like(p)
        p.grad[:, 0, 0] = 0.5
    params[1].grad[3, 0, 0] = float("nan")
    results = opt.step([2, 3, 5], [AdamParams(learning_rate=1e-2)] * 3, [RANKS[2], RANKS[3], RANKS[5]])
    assert [r.stepped for r in results] == [True, False, True]
    assert results[1].step == 0 and results[0].step == 1
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p[3], b[3]) and not torch.equal(p[2], b[2])
        assert torch.count_nonzero(p.grad[[2, 3, 5]]) == 0  # cleared, the skipped slot too
    assert all(torch.count_nonzero(m[3]) == 0 for m in opt.exp_avg)


def test_reset_slots_forgets_state() -> None:
    params, dims = make_banks()
    opt = SlotAdamW(params, dims, SLOTS)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step([0, 2], [AdamParams()] * 2, [RANKS[0], RANKS[2]])
    opt.reset_slots([2])
    assert opt.steps[0] == 1 and opt.steps[2] == 0
    assert all(torch.count_nonzero(m[2]) == 0 and torch.count_nonzero(m[0]) > 0 for m in opt.exp_avg)


def test_adam_params_defaults_and_validation() -> None:
    assert AdamParams.from_dict(None) == AdamParams(1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)
    assert AdamParams.from_dict({"learning_rate": "0.5", "type": "adam", "beta1": None}).learning_rate == 0.5
    for bad in [
        {"learning_rate": -1},
        {"beta1": 1.0},
        {"beta2": -0.1},
        {"eps": -1},
        {"eps": 0.0},  # AdamW divides 0 by 0 on a LoRA A's first (zero) gradient
        {"grad_clip_norm": float("nan")},
        {"weight_decay": "x"},
    ]:
        with pytest.raises(InvalidRequestError):
            AdamParams.from_dict(bad)

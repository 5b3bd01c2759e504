"""The LoRA op tests' builders and oracles: random slot banks, one op's outputs and gradients, the grouped-op cases,
the bf16 rounding bound against the fp32 reference, the fused path on a flat bank buffer, and an engine of four
adapters with mixed ranks (shared by tests/unit/workers/test_lora_grouped.py, test_lora_fused.py and the GPU tests)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from loraplex.models import load_base_model
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.lora import (
    BankLayout,
    MicrobatchBanks,
    Routing,
    lora_delta_fused,
    lora_delta_grouped,
    lora_delta_reference,
    lora_siblings_fused,
)
from loraplex.workers.lora.siblings import siblings_fusable
from loraplex.workers.lora.slot_bank import LoraOp

SLOTS = 8


def make_banks(
    slot_ranks: dict[int, int], n_in: int, n_out: int, r_max: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random A [S, in, r_max] and B [S, r_max, out] with each used slot's padding (beyond its rank) zero, as the engine
    keeps it; unused slots hold random values, which must never leak into the result or receive gradient."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(SLOTS, n_in, r_max, generator=g, dtype=dtype) / n_in**0.5
    b = torch.randn(SLOTS, r_max, n_out, generator=g, dtype=dtype)
    for slot, rank in slot_ranks.items():
        a[slot, :, rank:] = 0
        b[slot, rank:] = 0
    return a, b


def run_op(
    op: LoraOp,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    routing: Routing,
    grad: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(delta, x.grad, A-bank grad, B-bank grad); grad None means y.sum().backward() (a zero-stride incoming gradient)."""
    x, a, b = (t.detach().clone().requires_grad_() for t in (x, a, b))
    y = op(x, a, b, routing)
    if grad is None:
        y.sum().backward()
    else:
        y.backward(grad)
    return y.detach(), x.grad, a.grad, b.grad


# (slots, ranks, scales, group rows) per case: uneven sizes, empty groups (first, middle, last), a 1-row group at the end.
CASES = {
    1: ([5], [7], [0.5], [23]),
    2: ([3, 0], [2, 8], [4.0, 0.25], [17, 1]),
    3: ([6, 1, 4], [8, 3, 5], [1.0, 2.0, 0.75], [5, 0, 30]),
    4: ([0, 7, 2, 5], [1, 8, 6, 4], [16.0, 1.0, 0.5, 2.0], [0, 12, 9, 1]),
    5: ([4, 2, 6, 1, 3], [8, 2, 7, 3, 1], [0.125, 3.0, 1.5, 1.0, 8.0], [11, 3, 0, 19, 2]),
    6: ([1, 3, 5, 7, 0, 2], [4, 8, 2, 6, 5, 3], [1.0, 0.5, 2.0, 4.0, 0.25, 1.5], [6, 14, 1, 0, 9, 0]),
}


BF16_UNIT_ROUNDOFF = 2.0**-8  # half of bf16's machine epsilon 2^-7
FP32_UNIT_ROUNDOFF = 2.0**-24


def check_against_fp32_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    routing: Routing,
    grad: torch.Tensor,
    dtype: torch.dtype,
    run: Callable[..., tuple[torch.Tensor, ...]] | None = None,
) -> dict[str, float]:
    """Run the grouped op in `dtype` (x and the incoming gradient rounded to it; banks stay fp32 masters, cast after the
    gather) and the fp32 reference on the same fp32 inputs, then bound every result elementwise:

        |grouped - reference| <= (8 u + 2 K u32) * M

    u = 2^-8 is bf16's unit roundoff. Each result passes through 6 roundings to bf16 (the three operands it is built from,
    the rank-sized intermediate, the in-place scale, the output); 8 leaves a margin of 2. Accumulation is fp32 inside the
    GEMMs: 2 K u32 with K = in + out + rows + r_max, a generous inner length of the chained products (u32 = 2^-24).
    M is the same quantity computed with |x|, |A|, |B|, |grad| by the fp32 reference (scales are positive): the sum of
    the magnitudes that the rounding errors are relative to. M = 0 (padding, empty groups, unused slots) demands an exact 0.
    Returns max(error / bound) per result (<= 1 passes). `run(x, a, b, routing, grad)` runs the path under test (default:
    `run_op` with the grouped op) and returns (delta, x.grad, A-bank grad, B-bank grad)."""
    run = run or (lambda *args: run_op(lora_delta_grouped, *args))
    got = run(x.to(dtype), a, b, routing, grad.to(dtype))
    want = run_op(lora_delta_reference, x, a, b, routing, grad)
    magnitude = run_op(lora_delta_reference, x.abs(), a.abs(), b.abs(), routing, grad.abs())
    inner = x.shape[1] + b.shape[2] + x.shape[0] + a.shape[2]
    coef = 8 * BF16_UNIT_ROUNDOFF + 2 * inner * FP32_UNIT_ROUNDOFF
    ratios = {}
    for name, g, w, m in zip(("delta", "x.grad", "A grad", "B grad"), got, want, magnitude, strict=True):
        assert g.dtype == (dtype if name in ("delta", "x.grad") else torch.float32), name
        err, bound = (g.float() - w).abs(), coef * m
        assert torch.all(err <= bound), f"{name}: max error/bound {(err / bound).nan_to_num(float('inf')).max():.3g}"
        ratios[name] = float((err / bound.clamp_min(1e-30)).max())
    return ratios


ADAPTERS = [("a", 2, 4.0, 1), ("b", 8, 16.0, 2), ("c", 3, 3.0, 3), ("d", 5, 10.0, 4)]  # model_id, rank, alpha, seed


def make_engine(tiny_dir: Path, max_rank: int, microbatch_tokens: int, **kw: object) -> Engine:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    config = EngineConfig(num_slots=6, max_rank=max_rank, microbatch_tokens=microbatch_tokens, **kw)  # type: ignore[arg-type]
    engine = build_engine(model, config)
    engine.create_adapter("placeholder", 1, 1.0, seed=0)  # so the adapters' slots are not 0..3
    for model_id, rank, alpha, seed in ADAPTERS:
        engine.create_adapter(model_id, min(rank, max_rank), alpha, seed)
        g = torch.Generator().manual_seed(seed + 1000)  # non-zero B: every adapter changes the outputs from step 1
        engine.load_adapter_weights(
            model_id,
            {
                n: (a, 0.05 * torch.randn(b.shape, generator=g))
                for n, (a, b) in engine.adapter_weights(model_id).items()
            },
        )
    return engine


def make_data(seed: int, lengths: list[int]) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, 512, (n + 1,), generator=g).tolist()
        out.append({"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:], "weights": [1.0] * n}})
    return out


def run_fused(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    routing: Routing,
    grad: torch.Tensor | None,
    *,
    grouped: bool = True,
    lead: int = 8,
    x_grad: bool = True,
    single: bool = True,
    base_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The fused path on banks a [S, in, r], b [S, r, out] laid out in a flat [S, P] buffer as the optimizer does (after
    `lead` columns of another layer, then `lead` more): gather, forward, backward, fold. single: as MicrobatchBanks'
    (False: a CUDA graph's device-side rank and scale). base_weight: the base matmul fused in (then the first result is
    the layer's output). Returns what `run_op` returns:
    (delta, x.grad, A-bank grad, B-bank grad), the bank grads as [S, ...] (zero for slots outside the routing)."""
    slots, n_in, r = a.shape
    n_out = b.shape[2]
    a_start, b_start = lead, lead + n_in * r
    flat = torch.randn(slots, b_start + r * n_out + lead, device=a.device)  # other layers' columns: random, unread
    flat[:, a_start:b_start] = a.reshape(slots, -1)
    flat[:, b_start : b_start + r * n_out] = b.reshape(slots, -1)
    layout = BankLayout(a_start, b_start, n_in, n_out, r)
    banks = MicrobatchBanks.gather(flat, routing, x.dtype, trainable=True, grouped=grouped)
    banks.single = single
    x = x.detach().clone().requires_grad_(x_grad)
    y = lora_delta_fused(x, layout, banks, routing, base_weight=base_weight)
    assert y.requires_grad  # even when x does not: the trigger
    if grad is None:
        y.sum().backward()
    else:
        y.backward(grad)
    assert banks.grads is not None
    full = torch.zeros_like(flat).index_add_(0, routing.slot_ids, banks.grads)
    assert torch.count_nonzero(full[:, :a_start]) == 0 and torch.count_nonzero(full[:, b_start + r * n_out :]) == 0
    grad_a = full[:, a_start:b_start].reshape(a.shape)
    grad_b = full[:, b_start : b_start + r * n_out].reshape(b.shape)
    return y.detach(), x.grad, grad_a, grad_b


def flat_sibling_banks(
    banks: list[tuple[torch.Tensor, torch.Tensor]], lead: int = 8
) -> tuple[torch.Tensor, list[BankLayout]]:
    """The siblings' banks in one flat [S, P] buffer as the optimizer lays them out (A then B per layer, after 8
    columns of another layer; `lead` 3: every view off grouped_mm's 16-byte alignment, so it reads copies)."""
    slots = banks[0][0].shape[0]
    parts, layouts, col = [torch.randn(slots, lead, device=banks[0][0].device)], [], lead
    for a, b in banks:
        n_in, r, n_out = a.shape[1], a.shape[2], b.shape[2]
        layouts.append(BankLayout(col, col + n_in * r, n_in, n_out, r))
        parts += [a.reshape(slots, -1), b.reshape(slots, -1)]
        col += n_in * r + r * n_out
    return torch.cat(parts, dim=1), layouts


def run_siblings(
    flat: torch.Tensor,
    layouts: list[BankLayout],
    routing: Routing,
    x: torch.Tensor,
    grads: list[torch.Tensor | None],
    *,
    together: bool,
    single: bool = True,
    x_grad: bool = True,
    bases: list[torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """(outputs, x.grad, the folded [S, P] bank gradient) of the siblings run as one node or each alone."""
    banks = MicrobatchBanks.gather(flat, routing, dtype, trainable=True, grouped=True)
    banks.single = single
    x = x.detach().to(dtype).clone().requires_grad_(x_grad)
    if together:
        assert siblings_fusable(x, layouts, banks, routing)
        outs = list(lora_siblings_fused(x, layouts, banks, routing, bases))
    else:
        outs = [
            lora_delta_fused(x, lay, banks, routing, base_weight=None if bases is None else bases[i])
            for i, lay in enumerate(layouts)
        ]
    loss = sum((o.sum() if g is None else (o * g.to(dtype)).sum()) for o, g in zip(outs, grads, strict=True))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    assert banks.grads is not None
    folded = torch.zeros_like(flat).index_add_(0, routing.slot_ids, banks.grads)
    return [o.detach() for o in outs], x.grad, folded

"""Device time of one LoRA layer's forward + backward against its frozen base matmul alone, per Qwen3-4B projection
shape: where the LoRA overhead over the frozen base comes from (DESIGN.md's LoRA step / frozen-base step target).

    python3 benchmarks/bench_lora_layer.py --rows 4096 --rank 32

Per shape (in, out) and variant, x [rows, in] requires grad (a layer in the middle of the model), the base weight is
frozen, and the time is the sum of the CUDA kernels' device time per forward + backward (torch.profiler, averaged over
the iterations), so host launch overhead is not in it (the engine replays the body as CUDA graphs). Variants:
  base        y = x @ W^T, dx only
  addmm       one adapter, the LoRA node then torch.addmm(delta, x, W^T) (the engine before the base matmul was fused
              into the node: a copy of delta, and autograd adds the two dx)
  single      one adapter, the engine's path: the base matmul fused into the LoRA node (lora/fused.py)
  graph1      the same as a CUDA graph runs it (MicrobatchBanks(single=False): r_max, the scale on the device)
  grouped4    four adapters' groups through grouped_mm, the base fused in
The sum line multiplies each shape by its count per model (36 layers: q, k, v, o, gate, up, down).

Then the blocks of layers that read one input (q/k/v 2560 -> 4096, 1024, 1024; gate/up 2560 -> 9728 x 2), per block:
  base        the block's frozen base matmuls, dx summed
  alone       each layer's own LoRA node, base fused in (autograd sums the layers' dx)
  siblings    the block as one node (lora/siblings.py: one A product, one dA, one dx)
  alone4 / siblings4   the same with four adapters' groups through grouped_mm
  base_stacked  the block's frozen base weights stacked into one GEMM (forward and dx)
  widened       a candidate: one adapter's block with the LoRA expand inside the stacked base GEMM (`_WidenedBlock`)
with the sum of both blocks over 36 layers: what sharing the A side saves per model step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.workers.lora.fused import BankLayout, MicrobatchBanks, lora_delta_fused  # noqa: E402
from loraplex.workers.lora.routing import Routing  # noqa: E402
from loraplex.workers.lora.siblings import lora_siblings_fused  # noqa: E402

# Qwen3-4B: hidden 2560, 32 query heads and 8 kv heads of 128, intermediate 9728; per layer q, k, v, o, gate, up, down.
SHAPES = {"q": (2560, 4096), "k,v": (2560, 1024), "o": (4096, 2560), "gate,up": (2560, 9728), "down": (9728, 2560)}
PER_LAYER = {"q": 1, "k,v": 2, "o": 1, "gate,up": 2, "down": 1}


def device_us(fn, iters: int) -> tuple[float, str]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events)
    table = events.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70)
    return total / iters, table


def layer_case(n_in: int, n_out: int, rows: int, rank: int, variant: str, gen: torch.Generator):
    dev, dt = torch.device("cuda"), torch.bfloat16
    w = (torch.randn(n_out, n_in, generator=gen) * 0.02).to(dev, dt)
    x = torch.randn(rows, n_in, generator=gen).to(dev, dt).requires_grad_()
    gy = torch.randn(rows, n_out, generator=gen).to(dev, dt)
    if variant == "base":

        def base() -> None:
            x.grad = None  # the layer's dx goes on to the norm's backward: no accumulation into x.grad
            (x @ w.t()).backward(gy)

        return base
    groups = 4 if variant.startswith("grouped") else 1
    layout = BankLayout(a_start=0, b_start=n_in * rank, in_features=n_in, out_features=n_out, max_rank=rank)
    flat = torch.randn(8, n_in * rank + rank * n_out, generator=gen).to(dev) * 0.02
    per = rows // groups
    routing = Routing.build(slots=list(range(groups)), ranks=[rank] * groups, scales=[2.0] * groups,
                            group_rows=[per] * (groups - 1) + [rows - per * (groups - 1)], device=dev)  # fmt: skip

    def step() -> None:
        x.grad = None
        banks = MicrobatchBanks.gather(flat, routing, dt, trainable=True, grouped=True)
        banks.single = variant != "graph1"
        if variant == "addmm":
            torch.addmm(lora_delta_fused(x, layout, banks, routing), x, w.t()).backward(gy)
        else:
            lora_delta_fused(x, layout, banks, routing, base_weight=w).backward(gy)

    return step


BLOCKS = {"q/k/v": (2560, (4096, 1024, 1024)), "gate/up": (2560, (9728, 9728))}


class _WidenedBlock(torch.autograd.Function):
    """A candidate, measured here before the engine takes it: one adapter's sibling block with the LoRA expand in the
    base GEMM. The block's base weights stacked as W [sum out, in] inside a wider buffer W_wide [sum out, in + k r]
    whose extra columns hold the siblings' B^T block-diagonally (zero elsewhere), and x beside its scaled shrink,
    x_wide = [x | (x @ A_cat) * c], so that

        forward   out = x_wide @ W_wide^T                    one GEMM: every sibling's base output plus its delta
        backward  [dx_base | dh] = gy @ W_wide                one GEMM: the base dx and every sibling's dh
                  dA_cat = x^T @ (dh * c),  dB = diagonal blocks of (hs^T @ gy),  dx = dx_base + (dh * c) @ A_cat^T

    Its outputs are one [N, sum out] tensor (the siblings' are column views of it): the case gives the backward one
    [N, sum out] gradient, as a model whose consumers read views of one output would (q/k/v's attention, gate/up's
    activation)."""

    @staticmethod
    def forward(ctx, x, a_cat, bs, w_wide, row_scales, ga_cat, gbs):  # type: ignore[no-untyped-def]
        n_in = x.shape[1]
        kr = a_cat.shape[1]
        col = 0
        for i, b in enumerate(bs):  # the siblings' B^T into the extra columns (the rest stays zero), per microbatch
            r = b.shape[0]
            w_wide[col : col + b.shape[1], n_in + i * r : n_in + (i + 1) * r].copy_(b.t())
            col += b.shape[1]
        x_wide = torch.empty(x.shape[0], n_in + kr, dtype=x.dtype, device=x.device)
        x_wide[:, :n_in].copy_(x)
        hs = x @ a_cat
        hs.mul_(row_scales)
        x_wide[:, n_in:].copy_(hs)
        ctx.save_for_backward(x, hs, a_cat, w_wide, row_scales)
        ctx.grads = (ga_cat, gbs)
        return x_wide @ w_wide.t()

    @staticmethod
    def backward(ctx, gy):  # type: ignore[no-untyped-def]
        x, hs, a_cat, w_wide, row_scales = ctx.saved_tensors
        ga_cat, gbs = ctx.grads
        n_in = x.shape[1]
        g = gy @ w_wide  # [N, in + k r]
        dh = g[:, n_in:].mul_(row_scales)
        ga_cat.add_(x.t() @ dh)
        db = hs.t() @ gy  # [k r, sum out]: the diagonal blocks are the siblings' dB
        col = 0
        for i, gb in enumerate(gbs):
            r = gb.shape[0]
            gb.add_(db[i * r : (i + 1) * r, col : col + gb.shape[1]])
            col += gb.shape[1]
        dx = g[:, :n_in].addmm_(dh, a_cat.t())
        return dx, None, None, None, None, None, None


def widened_error(device: str = "cuda", dtype: torch.dtype = torch.float32) -> float:
    """The largest difference between `_WidenedBlock` and plain torch autograd (outputs, dx, dA, dB) on a small block
    of three siblings: the candidate must compute the same thing before its time counts."""
    gen = torch.Generator().manual_seed(1)
    n_in, outs, rank, rows = 48, (40, 16, 16), 4, 24
    ws = [torch.randn(n, n_in, generator=gen, dtype=torch.float64).to(device, dtype) for n in outs]
    a_cat = torch.randn(n_in, 3 * rank, generator=gen, dtype=torch.float64).to(device, dtype)
    bs = [torch.randn(rank, n, generator=gen, dtype=torch.float64).to(device, dtype) for n in outs]
    x0 = torch.randn(rows, n_in, generator=gen, dtype=torch.float64).to(device, dtype)
    gy = torch.randn(rows, sum(outs), generator=gen, dtype=torch.float64).to(device, dtype)
    scale = 0.5
    # plain torch: per sibling, x @ W_i^T + ((x @ A_i) * c) @ B_i
    x = x0.clone().requires_grad_()
    a_ref = a_cat.clone().requires_grad_()
    b_ref = [b.clone().requires_grad_() for b in bs]
    ref = torch.cat([x @ w.t() + ((x @ a_ref[:, i * rank : (i + 1) * rank]) * scale) @ b_ref[i]
                     for i, w in enumerate(ws)], dim=1)  # fmt: skip
    ref.backward(gy)
    w_wide = torch.zeros(sum(outs), n_in + 3 * rank, dtype=dtype, device=device)
    w_wide[:, :n_in].copy_(torch.cat(ws))
    ga_cat = torch.zeros(n_in, 3 * rank, dtype=dtype, device=device)
    gbs = [torch.zeros(rank, n, dtype=dtype, device=device) for n in outs]
    xw = x0.clone().requires_grad_()
    out = _WidenedBlock.apply(xw, a_cat, bs, w_wide, torch.full((rows, 1), scale, device=device, dtype=dtype),
                              ga_cat, gbs)  # fmt: skip
    out.backward(gy)
    pairs = [(out, ref), (xw.grad, x.grad), (ga_cat, a_ref.grad), *zip(gbs, [b.grad for b in b_ref], strict=True)]
    return max(float((a.detach().double() - b.detach().double()).abs().max()) for a, b in pairs)


def block_case(n_in: int, outs: tuple[int, ...], rows: int, rank: int, variant: str, gen: torch.Generator):
    """One block of sibling layers on one x (see the module doc's second list)."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    ws = [(torch.randn(n, n_in, generator=gen) * 0.02).to(dev, dt) for n in outs]
    x = torch.randn(rows, n_in, generator=gen).to(dev, dt).requires_grad_()
    gys = [torch.randn(rows, n, generator=gen).to(dev, dt) for n in outs]
    layouts, col = [], 0
    for n in outs:
        layouts.append(BankLayout(col, col + n_in * rank, n_in, n, rank))
        col += n_in * rank + rank * n
    flat = torch.randn(8, col, generator=gen).to(dev) * 0.02
    groups = 4 if variant.endswith("4") else 1
    per = rows // groups
    routing = Routing.build(slots=list(range(groups)), ranks=[rank] * groups, scales=[2.0] * groups,
                            group_rows=[per] * (groups - 1) + [rows - per * (groups - 1)], device=dev)  # fmt: skip

    w_stacked = torch.cat(ws)
    gy_stacked = torch.cat(gys, dim=1)
    if variant == "widened":
        k = len(outs)
        w_wide = torch.zeros(sum(outs), n_in + k * rank, dtype=dt, device=dev)
        w_wide[:, :n_in].copy_(w_stacked)
        a_cat = (torch.randn(n_in, k * rank, generator=gen) * 0.02).to(dev, dt)
        bs = [(torch.randn(rank, n, generator=gen) * 0.02).to(dev, dt) for n in outs]
        scales = torch.full((rows, 1), 2.0, device=dev)

    def step() -> None:
        x.grad = None
        if variant == "base":
            torch.autograd.backward([x @ w.t() for w in ws], gys)
            return
        if variant == "base_stacked":  # the block's base weights as one GEMM (what the engine does not do yet)
            (x @ w_stacked.t()).backward(gy_stacked)
            return
        if variant == "widened":
            ga_cat = torch.zeros(n_in, k * rank, device=dev)
            gbs = [torch.zeros(rank, n, device=dev) for n in outs]
            _WidenedBlock.apply(x, a_cat, bs, w_wide, scales, ga_cat, gbs).backward(gy_stacked)
            return
        banks = MicrobatchBanks.gather(flat, routing, dt, trainable=True, grouped=True)
        if variant.startswith("siblings"):
            outputs = list(lora_siblings_fused(x, layouts, banks, routing, ws))
        else:
            outputs = [
                lora_delta_fused(x, lay, banks, routing, base_weight=w) for lay, w in zip(layouts, ws, strict=True)
            ]
        torch.autograd.backward(outputs, gys)

    return step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--variants", default="base,addmm,single,graph1,grouped4")
    p.add_argument("--block-variants", default="base,alone,siblings,alone4,siblings4")
    p.add_argument("--tables", default=None, help="write each case's top kernels to this file")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    variants = args.variants.split(",")
    totals = dict.fromkeys(variants, 0.0)
    tables = []
    for name, (n_in, n_out) in SHAPES.items():
        line = []
        for v in variants:
            us, table = device_us(layer_case(n_in, n_out, args.rows, args.rank, v, gen), args.iters)
            totals[v] += us * PER_LAYER[name] * 36
            line.append(f"{v} {us:,.0f} us")
            tables.append(f"== {name} {n_in}x{n_out} {v}: {us:,.0f} us\n{table}")
        print(f"{name:8s} {n_in}x{n_out}: " + ", ".join(line), flush=True)
    base = totals.get("base")
    print("per model step (x36 layers): " + ", ".join(
        f"{v} {t / 1e3:.1f} ms" + (f" (+{(t - base) / 1e3:.1f} over base)" if base and v != "base" else "")
        for v, t in totals.items()))  # fmt: skip
    block_variants = args.block_variants.split(",")
    if "widened" in block_variants:
        print(f"widened block against plain torch: max |difference| {widened_error():.2e} (fp32)", flush=True)
    block_totals = dict.fromkeys(block_variants, 0.0)
    for name, (n_in, outs) in BLOCKS.items():
        line = []
        for v in block_variants:
            us, table = device_us(block_case(n_in, outs, args.rows, args.rank, v, gen), args.iters)
            block_totals[v] += us * 36
            line.append(f"{v} {us:,.0f} us")
            tables.append(f"== block {name} {v}: {us:,.0f} us\n{table}")
        print(f"block {name:8s}: " + ", ".join(line), flush=True)
    print("blocks per model step (x36 layers): " + ", ".join(f"{v} {t / 1e3:.1f} ms" for v, t in block_totals.items()))
    if args.tables:
        Path(args.tables).write_text("\n".join(tables))


if __name__ == "__main__":
    main()

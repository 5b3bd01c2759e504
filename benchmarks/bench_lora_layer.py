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

    def step() -> None:
        x.grad = None
        if variant == "base":
            torch.autograd.backward([x @ w.t() for w in ws], gys)
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

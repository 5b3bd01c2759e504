"""Micro-benchmark of the LoRA delta ops (forward + backward of one layer): reference loop vs grouped_mm.

    python -m benchmarks.lora_microbench                      # CPU fp32, the shapes behind select_lora_op's choice
    python -m benchmarks.lora_microbench --device cuda --dtype bfloat16 --dims 2560x9728 --rank 32 --rows 4096

Each case: T rows split evenly into G adapter groups (the last group takes the remainder), every group a different slot
of an S = max(G, 8) slot bank, rank r, x and both banks requiring grad (a layer in the middle of the model). The time is
the minimum wall time of forward + backward over the iterations (incoming gradient random), after warm-up: the minimum,
not the median, because the CPU machines are shared and a busy neighbour only ever adds time. CUDA times are synchronised.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from loraplex.workers.lora.grouped import lora_delta_grouped
from loraplex.workers.lora.reference import lora_delta_reference
from loraplex.workers.lora.routing import Routing
from loraplex.workers.lora.slot_bank import LoraOp

OPS: dict[str, LoraOp] = {"reference": lora_delta_reference, "grouped": lora_delta_grouped}


def time_op(
    op: LoraOp,
    *,
    rows: int,
    n_in: int,
    n_out: int,
    rank: int,
    groups: int,
    device: torch.device,
    dtype: torch.dtype,
    iters: int = 10,
    warmup: int = 3,
) -> float:
    """Minimum milliseconds of one forward + backward of `op` on random inputs."""
    gen = torch.Generator().manual_seed(0)
    slots = max(groups, 8)
    a_bank = (torch.randn(slots, n_in, rank, generator=gen) / n_in**0.5).to(device).requires_grad_()
    b_bank = (torch.randn(slots, rank, n_out, generator=gen) / rank**0.5).to(device).requires_grad_()
    x = torch.randn(rows, n_in, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(rows, n_out, generator=gen).to(device, dtype)
    per = rows // groups
    routing = Routing.build(
        slots=list(range(groups)),
        ranks=[rank] * groups,
        scales=[2.0] * groups,
        group_rows=[per] * (groups - 1) + [rows - per * (groups - 1)],
        device=device,
    )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + iters):
        x.grad = a_bank.grad = b_bank.grad = None
        sync()
        t0 = time.perf_counter()
        op(x, a_bank, b_bank, routing).backward(grad)
        sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def run(
    device: torch.device,
    dtype: torch.dtype,
    dims: Sequence[tuple[int, int]],
    rows: int,
    rank: int,
    group_counts: Sequence[int],
    iters: int,
) -> list[tuple[int, int, int, dict[str, float]]]:
    results = []
    for n_in, n_out in dims:
        for groups in group_counts:
            ms = {
                name: time_op(
                    op,
                    rows=rows,
                    n_in=n_in,
                    n_out=n_out,
                    rank=rank,
                    groups=groups,
                    device=device,
                    dtype=dtype,
                    iters=iters,
                )
                for name, op in OPS.items()
            }
            results.append((n_in, n_out, groups, ms))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--dims", default="256x256,1024x1024", help="comma-separated INxOUT")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--groups", default="1,4,8")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    dims = [(int(d.split("x")[0]), int(d.split("x")[1])) for d in args.dims.split(",")]
    print(f"device={device} dtype={dtype} rows={args.rows} rank={args.rank} threads={torch.get_num_threads()}")
    print(f"{'in x out':>12} {'G':>3} {'reference ms':>13} {'grouped ms':>11} {'ref/grouped':>12}")
    for n_in, n_out, groups, ms in run(
        device,
        dtype,
        dims,
        args.rows,
        args.rank,
        [int(g) for g in args.groups.split(",")],
        args.iters,
    ):
        ratio = ms["reference"] / ms["grouped"]
        print(f"{f'{n_in}x{n_out}':>12} {groups:>3} {ms['reference']:>13.3f} {ms['grouped']:>11.3f} {ratio:>12.2f}")


if __name__ == "__main__":
    main()

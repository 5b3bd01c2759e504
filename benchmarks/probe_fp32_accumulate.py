"""The LoRA backward's dA / dB accumulation, two ways, per Qwen3-4B projection shape (CUDA): what the engine does now
(`grad.add_(h.t() @ dy)`: a bf16 product, then a type-promoting add into the fp32 gradient view) against cuBLAS
accumulating into the fp32 view itself (`torch.addmm(grad, h.t(), dy, out_dtype=torch.float32, out=grad)`: one GEMM
with beta = 1 and an fp32 C, no bf16 rounding of the product). Prints each shape's device time both ways (CUDA events
over a CUDA graph of `--repeat` calls, so launches are not in it), their error against the fp64 product, and whether
the out_dtype form captures into a graph at all.

    python3 benchmarks/probe_fp32_accumulate.py [--rows 4096] [--rank 32]"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

# Qwen3-4B: (in, out) of q, k / v, o, gate / up, down, and how many of each a layer has
SHAPES = {"q": (2560, 4096, 1), "k,v": (2560, 1024, 2), "o": (4096, 2560, 1), "gate,up": (2560, 9728, 2),
          "down": (9728, 2560, 1)}  # fmt: skip


def graphed_us(fn: Callable[[], None], repeat: int) -> float:
    """Device time of one call of fn, from a CUDA graph of `repeat` calls replayed 5 times."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * repeat)


def accumulations(
    x: torch.Tensor, h: torch.Tensor, dy: torch.Tensor, dh: torch.Tensor, ga: torch.Tensor, gb: torch.Tensor
) -> tuple[Callable[[], None], Callable[[], None]]:
    """dA += x^T dh and dB += h^T dy into the fp32 ga / gb: the engine's way, and cuBLAS's fp32 accumulation."""

    def now() -> None:
        gb.add_(h.t() @ dy)
        ga.add_(x.t() @ dh)

    def fused() -> None:
        torch.addmm(gb, h.t(), dy, out_dtype=torch.float32, out=gb)
        torch.addmm(ga, x.t(), dh, out_dtype=torch.float32, out=ga)

    return now, fused


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    total = {"add": 0.0, "out_dtype": 0.0}
    for name, (n_in, n_out, per_layer) in SHAPES.items():
        x, h, dy, dh, ga, gb = (
            torch.randn(args.rows, n_in, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(args.rows, args.rank, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(args.rows, n_out, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(args.rows, args.rank, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.zeros(n_in, args.rank, device="cuda"),
            torch.zeros(args.rank, n_out, device="cuda"),
        )
        now, fused = accumulations(x, h, dy, dh, ga, gb)
        exact_b = h.double().t() @ dy.double()
        exact_a = x.double().t() @ dh.double()
        errors = {}
        for label, fn in (("add", now), ("out_dtype", fused)):
            ga.zero_()
            gb.zero_()
            try:
                fn()
            except RuntimeError as exc:  # the out_dtype form is CUDA-only and newer than some torch builds
                print(f"{name}: {label} failed: {exc}")
                return
            errors[label] = max((gb.double() - exact_b).abs().max().item(), (ga.double() - exact_a).abs().max().item())
        try:
            times = {label: graphed_us(fn, args.repeat) for label, fn in (("add", now), ("out_dtype", fused))}
        except RuntimeError as exc:  # a form that runs eagerly but not inside a capture is no use to the graphs
            print(f"{name}: capture failed: {exc}")
            return
        for label in total:
            total[label] += times[label] * per_layer
        print(f"{name:8} {n_in}x{n_out}: add {times['add']:6.1f} us (max error {errors['add']:.2e}), out_dtype "
              f"{times['out_dtype']:6.1f} us (max error {errors['out_dtype']:.2e})")  # fmt: skip
    print(
        f"per model step (x36 layers): add {total['add'] * 36 / 1e3:.2f} ms, "
        f"out_dtype {total['out_dtype'] * 36 / 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()

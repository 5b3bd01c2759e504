"""Where a step's time goes: torch.profiler over our engine's lone 1x512 step and an 8x512 step on a Qwen3-shaped
model (prints the top host and device ops).

    python3 benchmarks/profile_engine.py --model qwen3-4b-shape --rank 32"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import TARGETS, datums, frozen_base_step, sync, timed  # noqa: E402
from loraplex.models import build_preset_model  # noqa: E402
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b-shape")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--rows", default="1,8", help="sequences per profiled step")
    p.add_argument("--slots", type=int, default=8, help="engine slots (an MoE's expert banks are large: see bench_engine)")
    p.add_argument("--out", default=None, help="folder for the tables")
    p.add_argument("--unfused", action="store_true", help="the per-layer LoRA op path (EngineConfig(fused_lora=False))")
    p.add_argument("--elementwise", action="store_true", help="the Triton norms and activation (EngineConfig(fused_elementwise=True))")
    p.add_argument("--graphs", action="store_true", help="the body as CUDA graphs (EngineConfig(cuda_graphs=True))")
    p.add_argument("--frozen", action="store_true",
                   help="also the frozen base (activation gradients only) with the engine's kernels, 8x512 padded")
    p.add_argument("--kernels", type=int, default=15, help="rows of the device-time table")
    p.add_argument("--sources", action="store_true",
                   help="also where the copies, sums, adds and cats of the last row count's step are called from")
    args = p.parse_args()
    model = build_preset_model(args.model, dtype=torch.bfloat16, device="cuda")
    if args.frozen:
        profile_frozen(model, args)
    config = EngineConfig(num_slots=args.slots, max_rank=args.rank, target_modules=TARGETS, microbatch_tokens=4096,
                          fused_lora=not args.unfused, fused_elementwise=args.elementwise, cuda_graphs=args.graphs)  # fmt: skip
    engine = build_engine(model, config, "cuda")
    engine.create_adapter("a", rank=args.rank, alpha=2 * args.rank, seed=0)
    adam = {"learning_rate": 1e-5}
    for n in (int(r) for r in args.rows.split(",")):
        data = datums(engine.vocab_size, n, 512, torch.Generator().manual_seed(n))

        def step(data: list = data) -> tuple[float, float]:
            t0 = time.perf_counter()
            engine.forward_backward([engine.prepare("a", data, "cross_entropy", None, False)])
            sync()
            t1 = time.perf_counter()
            engine.optim_step([("a", adam)])
            sync()
            return t1 - t0, time.perf_counter() - t1

        for _ in range(3):
            step()
        times = [step() for _ in range(5)]
        print(f"{n}x512: fwd_bwd {[round(a * 1e3, 1) for a, _ in times]} ms, optim {[round(b * 1e3, 1) for _, b in times]} ms")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        table_gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.kernels, max_name_column_width=90)
        print(table_cpu[-6000:])
        print(table_gpu[-12000:])
        print(categories(prof))
        if args.out:
            Path(args.out, f"profile_{n}x512.txt").write_text(table_cpu + "\n" + table_gpu)
    if args.sources:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
            step()
        print(sources(prof))


def sources(prof: profile, ops: tuple[str, ...] = ("aten::copy_", "aten::sum", "aten::add_", "aten::cat", "aten::mul",
                                                   "aten::add", "aten::fill_", "aten::zero_")) -> str:  # fmt: skip
    """The device time of each op in `ops` by the Python lines that called it (their shapes too): who copies."""
    lines = []
    for ev in prof.key_averages(group_by_input_shape=True, group_by_stack_n=8):
        if ev.key not in ops or ev.device_time_total <= 0:
            continue
        stack = [f for f in ev.stack if "loraplex" in f or "transformers" in f or "torch/nn" in f][:4]
        lines.append((ev.device_time_total, f"{ev.device_time_total / 1e3:7.2f} ms {ev.count:4d}x {ev.key} "
                      f"{ev.input_shapes}\n          " + "\n          ".join(stack)))  # fmt: skip
    lines.sort(key=lambda t: -t[0])
    return "who calls the copies, sums, adds (device ms, top 25):\n" + "\n".join(text for _, text in lines[:25])


def categories(prof: profile) -> str:
    """Device time per kind of kernel (ms), summed over the profiled step: where the non-matmul time goes."""
    # attention first: flash's kernel names carry cutlass template names
    kinds = (("attention", ("flash", "fmha", "cudnn")), ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "splitk", "cublas")),
             ("triton", ("triton", "_rms", "_silu", "_rope", "_fused")), ("copy", ("copy", "memcpy", "memset", "cat", "fill")),
             ("reduce", ("reduce",)), ("elementwise", ("elementwise", "vectorized")))  # fmt: skip
    sums: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        if t <= 0 or ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.key.lower()
        kind = next((k for k, keys in kinds if any(w in name for w in keys)), "other")
        sums[kind] = sums.get(kind, 0.0) + t / 1e3
    total = sum(sums.values())
    return "device ms by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(sums.items(), key=lambda kv: -kv[1])) + f"; total {total:.1f}"


def profile_frozen(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """The frozen base's 8x512 forward + backward with the engine's kernels (bench_engine's frozen_base_fused)."""
    from loraplex.workers.kernels import fused_elementwise

    model.requires_grad_(False)
    fused_elementwise.install(model)  # as bench_engine's frozen_base_fused: the Triton norms, RoPE and activation
    step = frozen_base_step(model, 8, 512, "cuda", fused=True, fused_head=True)
    times = timed(step, 5, 3)
    print(f"frozen base 8x512: {sum(times) / len(times) * 1e3:.1f} ms per step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.kernels, max_name_column_width=90)[-12000:])
    print("frozen base", categories(prof))


if __name__ == "__main__":
    main()

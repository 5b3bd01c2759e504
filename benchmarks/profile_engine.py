"""Where a step's time goes: torch.profiler over our engine's lone 1x512 step and an 8x512 step on a Qwen3-shaped
model (prints the top host and device ops).

    python3 benchmarks/profile_engine.py --model qwen3-4b-shape --rank 32"""

from __future__ import annotations

import argparse
import math
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
    p.add_argument("--gaps", action="store_true",
                   help="also where the device idles in each profiled step: busy against wall, the longest gaps and "
                        "the host code that launched the kernel after each (with Python stacks)")
    p.add_argument("--gemms", action="store_true",
                   help="also each matmul shape's device time in the last row count's step, with the bytes it moves "
                        "and the bandwidth that makes (the skinny LoRA products are bound by memory)")
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
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.gaps) as prof:
            step()
        if args.gaps:
            try:
                print(f"{n}x512 step: {idle_gaps(prof)}")
            except Exception as exc:  # a profiler detail must not cost the rest of the call
                print(f"{n}x512 step: gaps failed: {exc!r}")
        table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        table_gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.kernels, max_name_column_width=90)
        print(table_cpu[-6000:])
        print(table_gpu[-12000:])
        print(categories(prof))
        if args.out:
            Path(args.out, f"profile_{n}x512.txt").write_text(table_cpu + "\n" + table_gpu)
    if args.gemms:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            step()
        print(gemm_shapes(prof))
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


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::_grouped_mm", "aten::bmm", "aten::baddbmm")


def gemm_shapes(prof: profile, rows: int = 40) -> str:
    """Device time of each matmul op by its input shapes (all operands and the output read or written once, bf16:
    2 bytes an element; addmm's bias operand counted as read), the bytes that moves and the bandwidth it makes."""
    lines = []
    total = 0.0
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key not in GEMM_OPS or ev.device_time_total <= 0:
            continue
        shapes = [s for s in ev.input_shapes if isinstance(s, list) and len(s) >= 2]
        elements = sum(math.prod(s) for s in shapes)
        if len(shapes) >= 2:  # the output: [rows of the first product operand, columns of the second]
            a, b = shapes[-2], shapes[-1]
            elements += math.prod(a[:-1]) * b[-1]
        per_call_us = ev.device_time_total / ev.count
        gbps = elements * 2 / (per_call_us * 1e-6) / 1e9 if per_call_us > 0 else 0.0
        total += ev.device_time_total
        text = f"{ev.device_time_total / 1e3:7.2f} ms {ev.count:4d}x {per_call_us:7.1f} us {gbps:6.0f} GB/s {ev.key}"
        lines.append((ev.device_time_total, f"{text} {shapes}"))
    lines.sort(key=lambda t: -t[0])
    return (f"matmuls by shape: {total / 1e3:.1f} ms of device time, the {rows} longest:\n"
            + "\n".join(text for _, text in lines[:rows]))


def idle_gaps(prof: profile, longest: int = 15, floor_us: float = 50.0) -> str:
    """Where the device waits on the host: the union of kernel intervals against the span from the profile's first
    host event to its last kernel, and the longest gaps between kernels, each named by the host op (and its Python
    lines) that launched the kernel after it. A CUDA graph's kernels are launched by cudaGraphLaunch. Read from the
    profiler's raw (kineto) events: they link each kernel to its launch by correlation id."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    assert prof.profiler is not None and prof.profiler.kineto_results is not None, "profile it first"
    events = list(prof.profiler.kineto_results.events())
    kernels = sorted((e for e in events if e.device_type() == cuda), key=lambda e: e.start_ns())
    if not kernels:
        return "no device kernels profiled"
    # a kernel's linked correlation id is the host op's that launched it (the launch call itself is linked alike);
    # the host events around that op on its thread (ops, and Python frames with with_stack) say where it ran
    host = [e for e in events if e.device_type() == cpu]
    launches = {e.correlation_id(): e for e in host if e.correlation_id() and not e.linked_correlation_id()}
    start = min(e.start_ns() for e in events if e.device_type() == cpu)
    busy, gaps, edge = 0, [], start
    for k in kernels:
        if k.start_ns() > edge + floor_us * 1e3:
            gaps.append((k.start_ns() - edge, edge, k))
        if k.end_ns() > edge:
            busy += k.end_ns() - max(edge, k.start_ns())
            edge = k.end_ns()
    span = edge - start
    lines = [f"device busy {busy / 1e6:.1f} ms of {span / 1e6:.1f} ms ({busy / span:.0%}); {len(gaps)} gaps over "
             f"{floor_us:.0f} us sum {sum(g for g, _, _ in gaps) / 1e6:.1f} ms; the longest:"]  # fmt: skip
    for length, at, k in sorted(gaps, key=lambda g: -g[0])[:longest]:
        launch = launches.get(k.linked_correlation_id())
        around = [o for o in host if launch is not None and o is not launch and o.start_ns() <= launch.start_ns()
                  and launch.end_ns() <= o.end_ns() and o.start_thread_id() == launch.start_thread_id()]  # fmt: skip
        around.sort(key=lambda o: o.end_ns() - o.start_ns())  # innermost first
        ours = [o.name() for o in around if "loraplex" in o.name() or "benchmarks" in o.name()][:3]
        names = " < ".join([o.name() for o in around if "(" not in o.name()][:3] + ours)
        lines.append(f"  {length / 1e6:7.2f} ms at +{(at - start) / 1e6:7.1f} ms before {k.name()[:40]} <- "
                     f"{launch.name() if launch is not None else '?'} in {names}")
    return "\n".join(lines)


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
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.gaps) as prof:
        step()
        sync()
    if args.gaps:
        print(f"frozen base 8x512 step: {idle_gaps(prof)}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.kernels, max_name_column_width=90)[-12000:])
    print("frozen base", categories(prof))


if __name__ == "__main__":
    main()

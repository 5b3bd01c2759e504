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

from benchmarks.bench_engine import TARGETS, datums, sync  # noqa: E402
from loraplex.models import build_preset_model  # noqa: E402
from loraplex.workers.engine import Engine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b-shape")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--rows", default="1,8", help="sequences per profiled step")
    p.add_argument("--slots", type=int, default=8, help="engine slots (an MoE's expert banks are large: see bench_engine)")
    p.add_argument("--out", default=None, help="folder for the tables")
    p.add_argument("--unfused", action="store_true", help="the per-layer LoRA op path (Engine(fused_lora=False))")
    p.add_argument("--elementwise", action="store_true", help="the Triton norms and activation (Engine(fused_elementwise=True))")
    p.add_argument("--graphs", action="store_true", help="the body as CUDA graphs (Engine(cuda_graphs=True))")
    args = p.parse_args()
    model = build_preset_model(args.model, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, num_slots=args.slots, max_rank=args.rank, target_modules=TARGETS, device="cuda", microbatch_tokens=4096,
                    fused_lora=not args.unfused, fused_elementwise=args.elementwise, cuda_graphs=args.graphs)  # fmt: skip
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
        table_gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60)
        print(table_cpu[-6000:])
        print(table_gpu[-4000:])
        if args.out:
            Path(args.out, f"profile_{n}x512.txt").write_text(table_cpu + "\n" + table_gpu)


if __name__ == "__main__":
    main()

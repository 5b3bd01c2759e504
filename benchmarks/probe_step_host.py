"""Where the host spends a graphed training step (CUDA): one adapter's 8 x 512 step on the Qwen3-4B shape, the body
as CUDA graphs. Prints the step's wall time against the time from `forward_backward`'s entry to the first graph
replay (the device idles while the host prepares the microbatch) and from the backward's end to the return (the
logprobs read back), then cProfile's view of the same steps: the engine's own functions by time per step, so the host
work that the device waits for has names. With `--threads 1` the intra-op pool is one thread (CPU-side small ops).

    python3 benchmarks/probe_step_host.py [--rows 8] [--steps 5] [--threads 0]"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from math import nan
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import TARGETS, datums, sync  # noqa: E402
from loraplex.models import build_preset_model  # noqa: E402
from loraplex.workers.engine import body_graphs  # noqa: E402
from loraplex.workers.engine.build import build_engine  # noqa: E402
from loraplex.workers.engine.config import EngineConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b-shape")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_preset_model(args.model, dtype=torch.bfloat16, device="cuda")
    config = EngineConfig(num_slots=8, max_rank=args.rank, target_modules=TARGETS, microbatch_tokens=4096,
                          fused_elementwise=True, cuda_graphs=True)  # fmt: skip
    engine = build_engine(model, config, "cuda")
    engine.create_adapter("a", rank=args.rank, alpha=2 * args.rank, seed=0)
    data = datums(engine.vocab_size, args.rows, 512, torch.Generator().manual_seed(1))
    prepared = [engine.prepare("a", data, "cross_entropy", None, False)]
    marks: dict[str, float] = {}
    run, backward = body_graphs.BodyGraph.run, body_graphs._Replay.backward

    profiler = cProfile.Profile()
    profiling = [False]

    def timed_run(self: body_graphs.BodyGraph) -> torch.Tensor:
        if "replay" not in marks:
            marks["replay"] = time.perf_counter()
            if profiling[0]:
                profiler.disable()
        return run(self)

    def timed_backward(ctx: object, *grads: torch.Tensor) -> object:
        out = backward(ctx, *grads)
        marks["backward_queued"] = time.perf_counter()
        return out

    body_graphs.BodyGraph.run = timed_run  # type: ignore[method-assign]
    body_graphs._Replay.backward = staticmethod(timed_backward)  # type: ignore[method-assign]

    def step() -> tuple[float, float, float]:
        marks.clear()
        t0 = time.perf_counter()
        if profiling[0]:
            profiler.enable()
        engine.forward_backward(prepared)
        t1 = time.perf_counter()
        sync()
        engine.optim_step([("a", {"learning_rate": 1e-5})])
        sync()
        return t1 - t0, marks.get("replay", nan) - t0, t1 - marks.get("backward_queued", nan)

    for _ in range(4):
        step()
    rows = [step() for _ in range(args.steps)]
    ms = [[round(v * 1e3, 1) for v in r] for r in zip(*rows, strict=True)]
    print(f"threads {torch.get_num_threads()}: forward_backward {ms[0]} ms; entry -> first replay {ms[1]} ms; "
          f"backward queued -> return {ms[2]} ms")  # fmt: skip
    profiling[0] = True
    for _ in range(args.steps):
        step()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats("loraplex", 40)
    print(f"cProfile over {args.steps} steps' entry -> first replay (times are totals: divide by {args.steps})")
    print(text.getvalue()[-16000:])


if __name__ == "__main__":
    main()

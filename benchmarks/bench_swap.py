"""Swap cost of one adapter between the tiers: GPU slot -> pinned host memory -> disk and back, for a
Qwen3-4B-shaped rank-32 adapter (its whole training state: weights, unconsumed gradients, both Adam moments), next to
the bandwidth floor measured in the same run (a raw copy of the same number of bytes).

    python3 benchmarks/bench_swap.py --model qwen3-4b-shape --rank 32 --out swap.json"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import TARGETS, build_model, sync  # noqa: E402
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.state.adapter_store import AdapterStore  # noqa: E402
from loraplex.workers.state.slot_images import restore_image, take_image  # noqa: E402


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-4b-shape")
    p.add_argument("--cache", default=".loraplex/models")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--spill", default=None, help="folder for the disk tier (default: a temp folder)")
    p.add_argument("--out")
    args = p.parse_args()
    model = build_model(args)
    engine = build_engine(model, EngineConfig(num_slots=2, max_rank=args.rank, target_modules=TARGETS), args.device)
    engine.create_adapter("a", rank=args.rank, alpha=2 * args.rank, seed=0)
    snap = take_image(engine, "a")
    nbytes = snap.nbytes
    results: dict[str, float | str | int] = {"model": args.model, "rank": args.rank, "bytes": nbytes}

    # GPU slot <-> pinned host, through the engine's slot-image path (copies, plus slot bookkeeping).
    buf = torch.empty_like(snap.rows, pin_memory=engine.device.type == "cuda")

    def out_and_in() -> None:
        s = take_image(engine, "a", out=buf)
        engine.delete_adapter("a")
        restore_image(engine, s)

    results["image_out_ms"] = median_ms(lambda: take_image(engine, "a", out=buf), args.reps)
    results["image_out_in_ms"] = median_ms(out_and_in, args.reps)
    # The floor: a raw copy of the same bytes device <-> pinned host.
    dev = torch.empty_like(snap.rows, device=engine.device)
    results["floor_d2h_ms"] = median_ms(lambda: buf.copy_(dev, non_blocking=True), args.reps)
    results["floor_h2d_ms"] = median_ms(lambda: dev.copy_(buf, non_blocking=True), args.reps)

    # Through the store: host tier, then disk (budget 0 forces every eviction to disk).
    engine.delete_adapter("a")
    with tempfile.TemporaryDirectory(dir=args.spill) as spill:
        for name, budget in (("host", 1 << 40), ("disk", 0)):
            store = AdapterStore(engine, host_budget_bytes=budget, spill_dir=Path(spill) / name)
            for i, m in enumerate(("a", "b", "c")):  # 2 slots: creating c evicts a
                store.create(m, rank=args.rank, alpha=2 * args.rank, seed=i)

            def swap(store: AdapterStore = store) -> None:  # c out, a in; then the other way
                store.ensure_resident(["a", "b"])
                store.ensure_resident(["c", "b"])

            results[f"store_{name}_two_swaps_ms"] = median_ms(swap, args.reps)
            for m in ("a", "b", "c"):
                store.delete(m)
        # Disk floor: write + fsync + read back the same bytes with plain file I/O.
        raw = buf.numpy().tobytes()
        path = Path(spill) / "floor.bin"

        def disk_floor() -> None:
            with open(path, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            path.read_bytes()

        results["floor_disk_write_fsync_read_ms"] = median_ms(disk_floor, max(2, args.reps // 2))
    gb = nbytes / 1e9
    for key in list(results):
        if key.endswith("_ms") and isinstance(results[key], float):
            results[key.replace("_ms", "_GBps")] = round(gb / (results[key] / 1e3), 2)
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

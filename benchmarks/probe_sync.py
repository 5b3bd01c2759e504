"""The sync step of an RL iteration through the whole service: how long `save_weights_and_get_sampling_client` (the
official Tinker SDK, unchanged) takes to answer, against an embedded stack of its own, and how soon the first sample
from the new sampler answers after it.

    python benchmarks/probe_sync.py [--model tiny|qwen3-0.6b-shape] [--rank 32] [--repeats 5] [--dtype float32]

Printed: each sync's seconds, their median, and the seconds of one sample right after each (unless --no-sample). On the CPU `qwen3-0.6b-shape` at rank 32 holds
~88 MB of LoRA weights (the Qwen3-4B shape at rank 32 holds ~130 MB on the GPU)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import tinker
from tinker import types

from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import TenantRepository, unit_of_work


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-sample", action="store_true", help="time the sync only")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="probe-sync-"))
    print(f"stack home (logs): {home}", flush=True)
    settings = Settings(home=home, base_model=args.model, max_rank=args.rank, slots=2, dtype=args.dtype)
    with Stack(settings, api_port=free_port()) as stack:
        with unit_of_work(session_factory(make_db_engine(settings.resolved_database_url))) as session:
            _, key = TenantRepository(session).create_tenant("probe")
        client = tinker.ServiceClient(base_url=stack.base_url, api_key=key)
        training = client.create_lora_training_client(base_model=args.model, rank=args.rank, seed=1).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(3, 19))),
                            loss_fn_inputs={"target_tokens": list(range(4, 20)), "weights": [1.0] * 16})  # fmt: skip
        seconds = []
        sample_s = 0.0
        for i in range(args.repeats):
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            start = time.perf_counter()
            sampler = training.save_weights_and_get_sampling_client().result()
            seconds.append(time.perf_counter() - start)
            if args.no_sample:
                print(f"sync {i}: {seconds[-1] * 1000:.1f} ms", flush=True)
                continue
            start = time.perf_counter()
            sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1,
                           types.SamplingParams(max_tokens=4, seed=i)).result()  # fmt: skip
            sample_s = time.perf_counter() - start
            print(f"sync {i}: {seconds[-1] * 1000:.1f} ms; then one sample of 4 tokens: {sample_s * 1000:.1f} ms",
                  flush=True)  # fmt: skip
        print(f"{args.model} rank {args.rank}: save_weights_and_get_sampling_client median "
              f"{statistics.median(seconds) * 1000:.1f} ms over {len(seconds)} (min {min(seconds) * 1000:.1f})")  # fmt: skip


if __name__ == "__main__":
    main()

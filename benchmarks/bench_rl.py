"""RL-iteration benchmark: a GRPO-style iteration through the whole service, as a user of our Python client runs it,
for N tenants at once. The stack is the embedded one (`loraplex serve --embedded`: redis-server child, SQLite, the
gateway under uvicorn, the pool process with the native sampler), driven over HTTP.

    python3 benchmarks/bench_rl.py --tenants 1,4                  # GPU: Qwen3-4B shape, rank 32, 16 x 16 x 256
    python3 benchmarks/bench_rl.py --tenants 1,2 --iterations 2   # CPU: the tiny model, small sizes, seconds
    bash benchmarks/gpu_run.sh rl --tenants 1,4                   # on the GPU machine (the stack's logs collected)

One iteration, per tenant (each in its own thread with its own ServiceClient and adapter; the tenants start each
iteration together):
  sync    save_weights_and_get_sampling_client (a frozen sampler copy of the adapter, and a sampler over it);
  sample  P prompts of L tokens, each one request of S samples x T new tokens (temperature 1, seeded, no stop), all
          sent at once, then every result awaited;
  train   forward_backward(importance_sampling) over the P x S sequences (prompt + sample; the sampled logprobs as
          the loss's `logprobs`, group-normalised advantages of a reward computed from them), then optim_step.
Reported per tenant and iteration (the timed ones, after --warmup): the iteration's wall and its sync / sample /
train split, new tokens/s of the sample phase, training tokens/s; per tenant count, the medians and the tenants'
total new tokens/s over the sample phases' union. The pool's sizing line (rows and KV blocks of the native sampler,
pool/process.sampler_budget) is copied from its log into the results."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.client import Datum, ServiceClient  # noqa: E402
from loraplex.launch.embedded import Stack  # noqa: E402
from loraplex.runtime.netutil import free_port  # noqa: E402
from loraplex.settings import Settings  # noqa: E402
from loraplex.storage.db import make_db_engine, session_factory  # noqa: E402
from loraplex.storage.repositories import TenantRepository, unit_of_work  # noqa: E402

ADAM = {"learning_rate": 1e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
# The tiny model's vocabulary (a byte-level BPE of 512) and the Qwen3 shapes' (their token ids 0..151,935).
VOCAB = {"tiny": 512}
QWEN_VOCAB = 151_936


def rl_datums(prompt: list[int], sequences: list[dict[str, Any]]) -> list[Datum]:
    """One importance_sampling datum per sample of a group: input prompt + sample[:-1], targets the next tokens,
    `logprobs` the sampler's (0 over the prompt), `advantages` the sample's reward less the group's mean (0 over the
    prompt). The reward is the sample's mean logprob: what a real reward is does not change the step's cost."""
    rewards = [statistics.fmean(s["logprobs"]) if s["logprobs"] else 0.0 for s in sequences]
    mean = statistics.fmean(rewards)
    out = []
    for s, reward in zip(sequences, rewards, strict=True):
        tokens = prompt + list(s["tokens"])
        n, p = len(tokens) - 1, len(prompt) - 1
        out.append(Datum(model_input=tokens[:-1], loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * p + [float(x) for x in s["logprobs"]],
            "advantages": [0.0] * p + [reward - mean] * (n - p),
        }))  # fmt: skip
    return out


class Tenant:
    """One tenant's client, adapter and prompts; `iteration()` runs one RL iteration and returns its figures."""

    def __init__(self, base_url: str, key: str, index: int, args: argparse.Namespace, vocab: int) -> None:
        self.client = ServiceClient(base_url, key, timeout=1800)
        self.trainer = self.client.create_lora_training_client(rank=args.rank, seed=index)
        rng = random.Random(1000 + index)
        self.prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        self.args = args
        self.index = index
        self.done = 0

    def iteration(self) -> dict[str, float]:
        a = self.args
        t0 = time.perf_counter()
        sampler = self.trainer.save_weights_and_get_sampling_client()
        t1 = time.perf_counter()
        futures = [sampler.sample(p, num_samples=a.samples, max_tokens=a.new_tokens, temperature=1.0,
                                  seed=7919 * self.done + i, stop=[]) for i, p in enumerate(self.prompts)]  # fmt: skip
        groups = [f.result() for f in futures]
        t2 = time.perf_counter()
        data = [d for p, g in zip(self.prompts, groups, strict=True) for d in rl_datums(p, g["sequences"])]
        fb = self.trainer.forward_backward(data, loss_fn="importance_sampling")
        opt = self.trainer.optim_step(ADAM)
        fb.result()
        opt.result()
        t3 = time.perf_counter()
        self.done += 1
        new_tokens = sum(len(s["tokens"]) for g in groups for s in g["sequences"])
        train_tokens = sum(len(d.model_input) for d in data)
        return {"wall_s": t3 - t0, "sync_s": t1 - t0, "sample_s": t2 - t1, "train_s": t3 - t2,
                "sample_start": t1, "sample_end": t2, "new_tokens": new_tokens, "train_tokens": train_tokens,
                "new_tok_s": new_tokens / (t2 - t1), "train_tok_s": train_tokens / (t3 - t2)}  # fmt: skip

    def close(self) -> None:
        try:
            self.trainer.delete()
        finally:
            self.client.close()


def run_config(stack: Stack, keys: list[str], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """`len(keys)` tenants at once: --warmup iterations, then --iterations timed ones, started together each time."""
    n = len(keys)
    tenants = [Tenant(stack.base_url, key, i, args, vocab) for i, key in enumerate(keys)]
    barrier = threading.Barrier(n)
    figures: list[list[dict[str, float]]] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            for it in range(args.warmup + args.iterations):
                barrier.wait(timeout=3600)
                got = tenants[i].iteration()
                if it >= args.warmup:
                    figures[i].append(got)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=loop, args=(i,), name=f"tenant{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for t in tenants:
        t.close()
    if errors:
        raise RuntimeError(f"a tenant failed: {errors[0]!r}") from errors[0]
    per_tenant = []
    for i, rows in enumerate(figures):
        per_tenant.append({"tenant": i, **{k: statistics.median(r[k] for r in rows)
                                           for k in ("wall_s", "sync_s", "sample_s", "train_s", "new_tok_s",
                                                     "train_tok_s")}})  # fmt: skip
    # the tenants' sampling together: every new token over the union of each timed iteration's sample phases
    together = []
    for it in range(args.iterations):
        rows = [figures[i][it] for i in range(n)]
        span = max(r["sample_end"] for r in rows) - min(r["sample_start"] for r in rows)
        together.append(sum(r["new_tokens"] for r in rows) / span)
    return {"tenants": n, "per_tenant": per_tenant, "iterations": figures,
            "iteration_wall_s": statistics.median(max(figures[i][it]["wall_s"] for i in range(n))
                                                  for it in range(args.iterations)),
            "new_tok_s_all": statistics.median(together)}  # fmt: skip


def sizing_lines(stack: Stack) -> list[str]:
    """The pool log's lines saying how its native sampler was sized (rows, KV blocks, bytes)."""
    path = stack.log_dir / "pool.log"
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text(errors="replace").splitlines() if "native sampler" in line]


def main() -> None:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-4b-shape" if cuda else "tiny")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--rank", type=int, default=32 if cuda else 8)
    p.add_argument("--tenants", default="1,4")
    p.add_argument("--prompts", type=int, default=16 if cuda else 4, help="P: prompts per tenant and iteration")
    p.add_argument("--samples", type=int, default=16 if cuda else 4, help="S: samples per prompt")
    p.add_argument("--new-tokens", type=int, default=256 if cuda else 16, help="T: new tokens per sample")
    p.add_argument("--prompt-len", type=int, default=128 if cuda else 16)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--home", help="the stack's LORAPLEX_HOME (default: a temp folder)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a Settings field for the stack, e.g. --set sampler_max_rows=64 (repeatable)")  # fmt: skip
    args = p.parse_args()

    counts = [int(t) for t in args.tenants.split(",")]
    home = Path(args.home or tempfile.mkdtemp(prefix="bench-rl-"))
    overrides = dict(kv.split("=", 1) for kv in args.set)
    settings = Settings(home=home, base_model=args.model, device=args.device, slots=max(8, 2 * max(counts)),
                        max_rank=args.rank, **overrides)  # fmt: skip
    vocab = VOCAB.get(args.model, QWEN_VOCAB)
    results: dict[str, Any] = {
        "env": {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                "model": args.model, "dtype": settings.resolved_dtype, "rank": args.rank, "prompts": args.prompts,
                "samples": args.samples, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
                "iterations": args.iterations, "warmup": args.warmup, "date": time.strftime("%Y-%m-%d"),
                "settings": overrides},
    }  # fmt: skip
    t0 = time.perf_counter()
    with Stack(settings, api_port=free_port()) as stack:
        results["stack_start_s"] = time.perf_counter() - t0
        print(f"stack up in {results['stack_start_s']:.1f} s; logs in {stack.log_dir}", flush=True)
        results["sampler_sizing"] = sizing_lines(stack)
        for line in results["sampler_sizing"]:
            print(line, flush=True)
        sessions = session_factory(make_db_engine(settings.resolved_database_url))
        with unit_of_work(sessions) as session:
            repo = TenantRepository(session)
            keys = [repo.create_tenant(f"rl{i}-{uuid.uuid4().hex[:6]}")[1] for i in range(max(counts))]
        for n in counts:
            results[f"tenants/{n}"] = got = run_config(stack, keys[:n], args, vocab)
            print(f"{n} tenant(s): iteration {got['iteration_wall_s']:.2f} s, {got['new_tok_s_all']:,.0f} new tok/s "
                  "in all", flush=True)  # fmt: skip
    report(results, counts, args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def report(results: dict[str, Any], counts: list[int], args: argparse.Namespace) -> None:
    e = results["env"]
    print(f"\nRL iteration through the service: {e['model']} ({e['dtype']}, rank {e['rank']}) on {e['device']}; "
          f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, {args.prompt_len}-token "
          f"prompts; medians of {args.iterations} iterations after {args.warmup} warm-up")  # fmt: skip
    print(f"{'tenants':>7} {'tenant':>6} {'iteration s':>11} {'sync s':>7} {'sample s':>9} {'train s':>8} "
          f"{'new tok/s':>10} {'train tok/s':>11}")  # fmt: skip
    for n in counts:
        got = results[f"tenants/{n}"]
        for t in got["per_tenant"]:
            print(f"{n:>7} {t['tenant']:>6} {t['wall_s']:>11.2f} {t['sync_s']:>7.2f} {t['sample_s']:>9.2f} "
                  f"{t['train_s']:>8.2f} {t['new_tok_s']:>10,.0f} {t['train_tok_s']:>11,.0f}")  # fmt: skip
        print(f"{n:>7} {'all':>6} {got['iteration_wall_s']:>11.2f} {'':>7} {'':>9} {'':>8} {got['new_tok_s_all']:>10,.0f}")


if __name__ == "__main__":
    main()

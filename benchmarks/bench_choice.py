"""Choosing the next tokens of one decode step (workers/sampling/choice.py), beside the full-sort choice it replaced:

    python3 benchmarks/bench_choice.py --rows 256 --vocab 151936            # CUDA when there is one, else the CPU

Random fp32 logits [rows, vocab] (the Qwen3-4B vocabulary by default). Cases: plain rows (temperature 1, no top-k or
top-p: the RL default), a quarter of the rows at top_p 0.9, every row at top_k 50, greedy. Each case times the whole
step as the sampler runs it: the draws, the choice and the one host copy of tokens and logprobs (median of
`--repeats`). `before`: every sampled row through a full stable sort, its uniform from its own CPU generator, tokens
and logprobs copied apart (the previous algorithm, restated here as the comparison)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.workers.sampling.choice import choose_tokens, stream_key  # noqa: E402


def before(
    logits: torch.Tensor, temps: list[float], ks: list[int], ps: list[float], gens: list[torch.Generator]
) -> None:
    uniforms = [float(torch.rand((), generator=g, dtype=torch.float64)) for g in gens]
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, t in enumerate(temps) if t > 0]
    if sampled:
        device, vocab = logits.device, logits.shape[-1]
        idx = torch.tensor(sampled, device=device)
        t = torch.tensor([temps[i] for i in sampled], device=device)
        k = torch.tensor([vocab if ks[i] < 0 else min(ks[i], vocab) for i in sampled], device=device)
        p = torch.tensor([ps[i] for i in sampled], device=device)
        u = torch.tensor([uniforms[i] for i in sampled], dtype=torch.float32, device=device)
        sorted_logits, order = (logits.index_select(0, idx) / t[:, None]).sort(dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        keep = torch.arange(vocab, device=device)[None, :] < k[:, None]
        kept = torch.where(keep, probs, torch.zeros_like(probs))
        renorm = kept / kept.sum(dim=-1, keepdim=True)
        keep &= (renorm.cumsum(dim=-1) - renorm) < p[:, None]
        cdf = torch.where(keep, probs, torch.zeros_like(probs)).cumsum(dim=-1)
        pos = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)
        pos = torch.minimum(pos, (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0))
        tokens = tokens.index_copy(0, idx, order.gather(1, pos).squeeze(1))
    picked = logprobs.gather(1, tokens.view(-1, 1)).view(-1)
    tokens.cpu().tolist(), picked.cpu().tolist()


def new_step(
    logits: torch.Tensor, temps: list[float], ks: list[int], ps: list[float], streams: list[int]
) -> Callable[[], None]:
    """One step as the sampler runs it: each call is the rows' next token (t + 1)."""
    rows, step = len(temps), [0]

    def run() -> None:
        step[0] += 1
        choose_tokens(logits, temps, ks, ps, streams=streams, steps=[step[0]] * rows).to_host()

    return run


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    times = []
    fn()
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-before", action="store_true", help="time the new choice only")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = args.rows
    logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(0)).mul_(3).to(device)
    streams = [stream_key(7, i) for i in range(rows)]
    cases = {
        "plain": ([1.0] * rows, [-1] * rows, [1.0] * rows),
        "quarter_top_p_0.9": ([1.0] * rows, [-1] * rows, [0.9 if i % 4 == 0 else 1.0 for i in range(rows)]),
        "top_k_50": ([1.0] * rows, [50] * rows, [1.0] * rows),
        "greedy": ([0.0] * rows, [-1] * rows, [1.0] * rows),
    }
    out: dict[str, dict[str, float]] = {}
    for name, (temps, ks, ps) in cases.items():
        out[name] = {"new_ms": timed(new_step(logits, temps, ks, ps, streams), args.repeats, device)}
        if not args.skip_before:
            gens = [torch.Generator().manual_seed(i) for i in range(rows)]
            out[name]["before_ms"] = timed(partial(before, logits, temps, ks, ps, gens), args.repeats, device)
        print(name, out[name], flush=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    print(json.dumps({"device": device_name, "rows": rows, "vocab": args.vocab, "ms": out}))


if __name__ == "__main__":
    main()

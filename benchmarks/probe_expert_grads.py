"""One Qwen3-30B-A3B-shaped MoE layer's expert LoRA, forward + backward (workers/lora/experts.py), with the banks'
gradients taken two ways, alternating rounds, median wall time each:
  autograd   index_select and cast under autograd: index_select's backward builds a bank-sized gradient [S, E, in, r]
             per bank tensor, which AccumulateGrad then adds into .grad (autograd on a plain read of the masters)
  bankstack  `_BankStack` (the microbatch's trigger as input): the stack's gradient index_add_ed into .grad, the
             microbatch's slots only (what the engine runs now, eager and in CUDA graphs)

    python3 benchmarks/probe_expert_grads.py [--tokens 512] [--slots 4] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.workers.lora.experts import ExpertBanks, experts_grouped  # noqa: E402
from loraplex.workers.lora.routing import Routing  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K, RANK = 128, 2048, 768, 8, 16  # Qwen3-30B-A3B's MoE block, rank 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.02).to(dev, dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.02).to(dev, dtype)
    masters = []
    for n_in, n_out in ((HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)):
        for shape in ((args.slots, EXPERTS, n_in, RANK), (args.slots, EXPERTS, RANK, n_out)):
            t = (torch.randn(shape, generator=gen) * 0.01).to(dev).requires_grad_()
            t.grad = torch.zeros_like(t)  # the optimizer's flat gradient view, as in the engine
            masters.append(t)
    banks = ExpertBanks(*masters)
    x = torch.randn(args.tokens, HIDDEN, generator=gen).to(dev, dtype).requires_grad_()
    weights, idx = torch.topk(torch.randn(args.tokens, EXPERTS, generator=gen).softmax(-1), TOP_K)
    weights, idx = (weights / weights.sum(-1, keepdim=True)).to(dev, dtype), idx.to(dev)
    routing = Routing.build([1], [RANK], [2.0], [args.tokens], dev)
    dy = torch.randn(args.tokens, HIDDEN, generator=gen).to(dev, dtype)

    def step(trigger: torch.Tensor | None) -> float:
        t0 = time.perf_counter()
        out = experts_grouped(x, idx, weights, gate_up, down, banks, routing, F.silu, trigger=trigger)
        torch.autograd.backward(out, dy)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    ways = {"autograd": None, "bankstack": torch.zeros((), device=dev, requires_grad=True)}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, trigger in ways.items():
            step(trigger)  # warm-up
            times[name] += [step(trigger) for _ in range(args.iters)]
    for name, ts in times.items():
        print(f"{name:10s} {args.tokens} tokens, {args.slots} slots, {dev.type}: median {statistics.median(ts) * 1e3:.1f} ms "
              f"over {len(ts)} (min {min(ts) * 1e3:.1f})")  # fmt: skip


if __name__ == "__main__":
    main()

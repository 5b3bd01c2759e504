"""The GPU tests' builders: random datums of the tiny vocabulary, a forward_backward's logprobs flattened, one LoRA
layer's inputs on CUDA (banks built as the CPU tests build them), and Qwen3-4B's projection shapes."""

from __future__ import annotations

from typing import Any

import torch

from loraplex.workers.lora import Routing
from tests.helpers.lora import make_banks

CUDA = torch.device("cuda")


FOUR_ADAPTERS = [("a", 4, 8.0, 1), ("b", 16, 16.0, 2), ("c", 8, 4.0, 3), ("d", 2, 2.0, 4)]  # id, rank, alpha, seed


def add_four_adapters(engine: Any) -> Any:
    """The GPU engine tests' adapters a-d (ranks 2-16, different scales), each B drawn at random (a fresh adapter's B
    is zero, which would hide its A path); returns the engine."""
    for model_id, rank, alpha, seed in FOUR_ADAPTERS:
        engine.create_adapter(model_id, rank, alpha, seed)
        g = torch.Generator().manual_seed(seed + 1000)
        weights = engine.adapter_weights(model_id)
        engine.load_adapter_weights(
            model_id, {n: (a, 0.05 * torch.randn(b.shape, generator=g)) for n, (a, b) in weights.items()}
        )
    return engine


def random_data(g: torch.Generator, n: int, length: int) -> list[dict]:
    """`n` datums of `length` random tiny-vocabulary tokens, next-token targets, unit weights."""
    out = []
    for _ in range(n):
        ids = torch.randint(0, 512, (length + 1,), generator=g).tolist()
        out.append({"model_input": ids[:-1], "loss_fn_inputs": {"target_tokens": ids[1:], "weights": [1.0] * length}})
    return out


def flat_logprobs(results: list[dict]) -> torch.Tensor:
    """Every per-token logprob of a forward_backward's results, in order."""
    return torch.tensor([lp for res in results for d in res["loss_fn_outputs"] for lp in d["logprobs"]])


def cuda_case(
    n_in: int,
    n_out: int,
    r_max: int,
    slots: list[int],
    ranks: list[int],
    scales: list[float],
    rows: list[int],
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Routing, torch.Tensor]:
    a, b = make_banks(dict(zip(slots, ranks, strict=True)), n_in, n_out, r_max, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, grad = torch.randn(sum(rows), n_in, generator=g), torch.randn(sum(rows), n_out, generator=g)
    routing = Routing.build(slots, ranks, scales, rows, device=CUDA)
    return x.to(CUDA), a.to(CUDA), b.to(CUDA), routing, grad.to(CUDA)


# Qwen3-4B: hidden 2560, intermediate 9728, q out 32*128 = 4096, k/v out 8*128 = 1024; rank 32; 8 x 512-token rows.
QWEN3_4B = {
    "q_proj": (2560, 4096),
    "k_proj/v_proj": (2560, 1024),
    "o_proj": (4096, 2560),
    "gate_proj/up_proj": (2560, 9728),
    "down_proj": (9728, 2560),
}

"""GPU tests run on the GPU machine (`pytest -m gpu tests/gpu`); without CUDA every gpu-marked test is skipped."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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

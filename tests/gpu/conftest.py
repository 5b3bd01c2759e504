"""GPU tests run on the GPU machine (`pytest -m gpu tests/gpu`); without CUDA every gpu-marked test is skipped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def exact_fp32_matmul() -> Iterator[None]:
    """The fp32 oracle must be fp32: no TF32 (it would round the reference's operands to 10 mantissa bits)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)

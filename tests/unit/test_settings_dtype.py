"""The `dtype` setting: auto follows the device, torch's spellings are accepted, anything else is refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loraplex.settings import Settings


@pytest.mark.parametrize(
    ("device", "dtype", "resolved"),
    [("cpu", "auto", "fp32"), ("cuda", "auto", "bf16"), ("cuda:1", "auto", "bf16"), ("cuda", "fp32", "fp32"),
     ("cpu", "bfloat16", "bf16"), ("cpu", "FP16", "fp16"), ("cpu", "float32", "fp32")],
)  # fmt: skip
def test_resolved_dtype(device: str, dtype: str, resolved: str) -> None:
    assert Settings(device=device, dtype=dtype).resolved_dtype == resolved


def test_dtype_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_DTYPE", "bf16")
    assert Settings().resolved_dtype == "bf16"


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValidationError, match="dtype"):
        Settings(dtype="int8")

"""Fixtures every test layer shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.models import resolve

# The shared helpers (and the test bodies in tests/helpers/storage_cases.py) get pytest's assertion messages too; this
# must run before anything imports them.
pytest.register_assert_rewrite("tests.helpers")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset's folder (random-init Qwen3 + byte-level BPE), built once per test session."""
    return resolve("tiny", tmp_path_factory.getbasetemp() / "model-cache")


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny-moe` preset (Qwen3-MoE, 4 experts, 2 per token) saved once per session."""
    return resolve("tiny-moe", tmp_path_factory.getbasetemp() / "model-cache")

"""Fixtures every test layer shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.models import resolve

# The shared helpers (and the test bodies in tests/helpers/storage_cases.py) get pytest's assertion messages too; this
# must run before anything imports them.
pytest.register_assert_rewrite("tests.helpers")

TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = ("unit", "integration", "e2e", "security", "gpu")


@pytest.hookimpl(tryfirst=True)  # before tests/gpu/conftest.py's hook, which skips gpu-marked tests without CUDA
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test is marked by its folder (`-m integration`, `-m "not e2e"`), so no module sets its own."""
    for item in items:
        folder = Path(str(item.path)).resolve().relative_to(TESTS).parts[0]
        if folder in FOLDER_MARKERS:
            item.add_marker(folder)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset's folder (random-init Qwen3 + byte-level BPE), built once per test session."""
    return resolve("tiny", tmp_path_factory.getbasetemp() / "model-cache")


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny-moe` preset (Qwen3-MoE, 4 experts, 2 per token) saved once per session."""
    return resolve("tiny-moe", tmp_path_factory.getbasetemp() / "model-cache")

"""Fixtures every test layer shares."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loraplex.models import resolve
from loraplex.runtime.utf8 import utf8_safe

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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A report's captured output and failure text written with any lone surrogate escaped: the fuzz tests send such
    strings, the stack logs them, and pytest-xdist's workers must encode every report as UTF-8 to hand it over."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    report.sections = [(name, utf8_safe(text)) for name, text in report.sections]
    if report.longrepr is not None:
        text = str(report.longrepr)
        safe = utf8_safe(text)
        if safe != text:
            report.longrepr = safe

"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker


@pytest.fixture
def factory(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """A migrated SQLite database in the test's folder: its session factory. (Imported here: the GPU image collects
    tests/gpu/test_distributed_cuda.py without SQLAlchemy.)"""
    from loraplex.storage.db import make_db_engine, migrate, session_factory

    url = f"sqlite:///{tmp_path / 'loraplex.db'}"
    migrate(url)
    engine = make_db_engine(url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture(scope="module")
def tiny_sampler_engine(tiny_dir: Path) -> tuple[Any, Any]:
    """The sampler tests' engine on the tiny model: five adapters whose B is far from zero (each changes the model's
    tokens; tests/helpers/sampling.py), and the model's tokenizer."""
    from tests.helpers.sampling import ADAPTERS, engine_with_adapters

    return engine_with_adapters(tiny_dir, ADAPTERS, num_slots=6, max_rank=16, seed=7)

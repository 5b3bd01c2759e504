"""Fixtures of the security suite: one stack per test module with default settings (a module that needs
other limits starts its own with harness.running_stack), and the Victim tenant on it."""

from __future__ import annotations

import pytest

from tests.security.harness import Victim, running_stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("security")) as running:
        yield running


@pytest.fixture(scope="module")
def victim(stack):
    v = Victim(stack)
    yield v
    v.close()

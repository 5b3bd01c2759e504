"""One embedded stack (redis child, SQLite, gateway, one CPU pool: 4 slots, max rank 16) shared by the e2e tests of a
session; each test file makes its own tenants (tests/helpers/stack.py), so they never see each other's adapters."""

from __future__ import annotations

import pytest

from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("stack")
    # The pool serves its metrics on a port of its own (tests/e2e/test_metrics.py scrapes it), publishing them to
    # Redis twice a second for the gateway's /metrics/pools (opened: tests/e2e/test_metrics.py scrapes it tokenless).
    settings = Settings(home=home, slots=4, max_rank=16, pool_metrics_port=free_port(), pool_metrics_publish_seconds=0.5,
                        metrics_open=True)
    with Stack(settings, api_port=free_port()) as running:
        yield running

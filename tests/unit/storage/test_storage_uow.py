"""unit_of_work: commit on success, full rollback on error, and several processes writing one SQLite file."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from loraplex.storage.db import make_db_engine, migrate, session_factory, unit_of_work
from loraplex.storage.repositories import AdapterRepository, TenantRepository, UsageRepository

# The tests shared with PostgreSQL (tests/integration/test_storage_postgres.py), run here on SQLite.
from tests.helpers.storage_cases import (  # noqa: F401 - collected here, on this module's `factory`
    test_error_rolls_back_everything,
    test_failed_repository_call_rolls_back_earlier_writes,
    test_success_commits_and_rows_stay_readable,
)


def _hammer(url: str, tenant_id: str, worker: int, steps: int) -> None:
    # Read-then-write transactions from several processes: the pattern that fails with SQLITE_BUSY under a deferred BEGIN.
    engine = make_db_engine(url)
    factory = session_factory(engine)
    for step in range(steps):
        with unit_of_work(factory) as s:
            AdapterRepository(s, tenant_id).get("shared")
            AdapterRepository(s, tenant_id).record_applied("shared", worker * steps + step)
            UsageRepository(s, tenant_id).record("shared", "forward_backward", 1, 0.01)
    engine.dispose()


def test_several_processes_write_one_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    migrate(url)
    engine = make_db_engine(url)
    factory = session_factory(engine)
    with unit_of_work(factory) as s:
        tenant_id = TenantRepository(s).create_tenant("acme")[0].id
        AdapterRepository(s, tenant_id).create("shared", "tiny", 8, 16.0, ["q_proj"], seed=0)
    workers, steps = 4, 25
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(url, tenant_id, w, steps)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * workers
    with factory() as s:
        assert UsageRepository(s, tenant_id).totals().records == workers * steps
        assert AdapterRepository(s, tenant_id).get("shared").applied_seq_id == workers * steps - 1
    engine.dispose()

"""The worker pool launched with world size 2 on CPU: `python -m loraplex.pool.process` is rank 0 (dispatcher + leader)
and spawns rank 1 itself; a tenant trains through the real gateway, queue and dispatcher, the pool reports world size 2,
and on SIGTERM every rank process exits."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import PoolRepository, TenantRepository, unit_of_work
from tests.helpers.processes import rank_processes

pytestmark = [pytest.mark.timeout(120)]


def _alive(pid: int) -> bool:
    try:
        return b"Z" not in (Path("/proc") / str(pid) / "stat").read_bytes().split(b") ")[1][:1]
    except OSError:
        return False


def _data() -> list[Datum]:
    # 5 sequences of different lengths: both ranks get rows, unevenly.
    return [Datum.for_next_token([(7 * i + j) % 200 + 10 for j in range(6 + 5 * i)]) for i in range(5)]


def test_pool_with_two_ranks_trains_and_stops_cleanly(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_WORLD_SIZE", "2")  # the stack's children inherit the environment
    settings = Settings(home=tmp_path, slots=2, max_rank=8, world_size=2)
    stack = Stack(settings, api_port=free_port()).start()
    try:
        pool = next(p for p in stack.children if "loraplex.pool.process" in p.args)
        ranks = rank_processes(pool.pid)
        assert len(ranks) == 1, ranks  # rank 1; rank 0 is the pool process itself
        with unit_of_work(session_factory(make_db_engine(settings.resolved_database_url))) as session:
            key = TenantRepository(session).create_tenant("t")[1]
        trainer = ServiceClient(stack.base_url, key).create_lora_training_client(rank=4, seed=3)
        losses = []
        for _ in range(6):
            fb = trainer.forward_backward(_data())
            trainer.optim_step(AdamParams(learning_rate=2e-2)).result()
            result = fb.result()
            assert [len(o["logprobs"]) for o in result["loss_fn_outputs"]] == [5, 10, 15, 20, 25]
            losses.append(result["metrics"]["loss:sum"])
        assert losses[-1] < 0.7 * losses[0], losses
        with session_factory(make_db_engine(settings.resolved_database_url))() as session:
            assert [p.world_size for p in PoolRepository(session).list() if p.name == settings.pool] == [2]
    finally:
        stack.stop()
    deadline = time.monotonic() + 20
    while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [r for r in ranks if _alive(r)]
    assert pool.returncode == 0

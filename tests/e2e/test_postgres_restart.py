"""PostgreSQL crashed and restarted under load: an embedded stack of its own (real redis-server,
real pool and gateway processes, the tiny model in fp32 on the CPU) on a real PostgreSQL 15 cluster that this module
owns (its own data folder and port, tests/helpers/services/postgres.py), while tenants train through the client.

The server is stopped with `pg_ctl stop -m immediate` (every backend killed, no shutdown checkpoint: a crash) and
started again on the same data folder and port, three times:
1. the pool paused (SIGSTOP) until the trainers' next requests are accepted and queued, the database crashed, the
   pool resumed: it runs them while the database is away, so their plans' SQL records (applied seq_ids, usage) meet
   a dead server; a fourth tenant starts training meanwhile (its create_adapter meets a gateway without its
   database: 503 + Retry-After, retried by the client until the database is back);
2. the same with two saves of another tenant queued (their checkpoint rows meet the dead server);
3. at a random moment under load (transactions cut mid-flight).

The service rides through: no client sees an error, and neither the pool nor the gateway restarts. The pool waits
for the database before it stores a plan's results (storage/outage.retry_database), so a result is never visible
before its SQL record (DESIGN, Durability). Before that fix a save run while the database was away failed with
"checkpoint saved but not recorded", and a plan whose record failed was answered anyway with its record lost (usage
rows missing; an adapter whose last plans met the outage kept a stale applied_seq_id for good).

After it every accepted request completed exactly once: every forward_backward's loss and each tenant's final weights
and Adam moments are bit-identical to a fault-free engine run (slots=1, as tests/e2e/test_recovery.py explains),
SQL's applied_seq_id is exact, each forward_backward's usage is recorded once, the saves' checkpoint rows exist, and
nothing is left running (the stack's children, redis-server, every PostgreSQL server started).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis
from sqlalchemy import func, select

from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.enums import AdapterStatus
from loraplex.storage.models import Adapter, Usage
from loraplex.storage.repositories.pools import PoolRepository
from tests.helpers.processes import running
from tests.helpers.recovery import Plan, Trained, assert_same_state, reference, saved_state, train
from tests.helpers.services.postgres import PostgresServer, postgres_server
from tests.helpers.stack import tenant_clients

OUTAGE_S = 2.5  # seconds the database stays down each time


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server
        last = server.postmaster_pid()
    assert last is None or not running(last)  # the server is stopped too


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresServer) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("pg-restart")
    settings = Settings(home=home, database_url=postgres.create_database("loraplex"), slots=1, max_rank=16,
                        pool_heartbeat_seconds=0.5, leader_lease_seconds=2.0, snapshot_every_steps=3,
                        snapshot_every_seconds=0, restart_backoff_seconds=0.2)  # fmt: skip
    running = Stack(settings, api_port=free_port()).start()
    pids = [p.pid for p in running.children]
    if running.redis is not None and running.redis._proc is not None:
        pids.append(running.redis._proc.pid)
    try:
        yield running
    finally:
        running.stop()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # nothing left running (every child reaped too)


def _progress(out: list[Trained]) -> int:
    return sum(o.done for o in out)


def _wait(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _queued(client: redis.Redis) -> int:
    """Entries in the pool's request streams: accepted by the gateway and not answered yet."""
    return sum(client.xlen(k) for k in client.scan_iter(match="loraplex:pool:*:requests"))


def _crash(postgres: PostgresServer) -> None:
    pid = postgres.postmaster_pid()
    assert pid is not None and running(pid)
    postgres.crash()
    assert not running(pid)  # crash() waits for the postmaster to exit


def test_postgres_crashed_three_times_under_load_loses_and_repeats_nothing(
    stack: Stack, postgres: PostgresServer
) -> None:
    plans = [Plan(t, rank=(4, 8, 16, 8)[t], seed=71 + t, steps=(12, 12, 12, 6)[t]) for t in range(4)]
    names = ["pg-a", "pg-b", "pg-c", "pg-late"]
    clients = tenant_clients(stack, *names, "pg-saver")
    out = [Trained() for _ in plans]
    threads = [threading.Thread(target=train, args=(clients[n], p, o, "final"), daemon=True)
               for n, p, o in zip(names, plans, out, strict=True)]  # fmt: skip
    saver = clients["pg-saver"].create_lora_training_client(rank=4, alpha=8.0, seed=5)
    pool, api = stack.child("pool"), stack.child("api")
    pool_pid, api_pid = pool.pid, api.pid
    assert pool_pid is not None
    rng = random.Random(4)
    streams = redis.Redis.from_url(stack.settings.redis_url)
    saves: list = []

    def crash_with_the_pool_paused(queue: Callable[[], int]) -> None:
        """Pause the pool, let `queue()` add requests (it returns how many entries the streams should then hold),
        crash the database under them, resume the pool: it runs them while the database is away."""
        os.kill(pool_pid, signal.SIGSTOP)
        try:
            want = queue()
            _wait(lambda: _queued(streams) >= want)
            _crash(postgres)
        finally:
            os.kill(pool_pid, signal.SIGCONT)

    try:
        for t in threads[:3]:
            t.start()
        _wait(lambda: _progress(out) >= 8)

        # 1. The trainers' next requests run while the database is away (their plans' records must wait), and a
        # new tenant arrives (its create_adapter meets a gateway without its database).
        crash_with_the_pool_paused(lambda: 3)  # each trainer's next request
        threads[3].start()
        time.sleep(OUTAGE_S)
        postgres.start()

        # 2. The same with two saves of another tenant queued (their checkpoint rows must wait).
        _wait(lambda: _progress(out) >= 24)
        # ...once the late tenant has trained: the dispatcher reads a new adapter's applied seq_id from SQL when it
        # first meets it, and a create met during this outage would hold the saves behind that read (the flake).
        _wait(lambda: out[3].done >= 1)

        def two_saves() -> int:
            saves.extend([saver.save_state("queued"), saver.save_weights_for_sampler("queued-sampler")])
            return 2  # accepted: in the stream once the calls return

        crash_with_the_pool_paused(two_saves)
        time.sleep(OUTAGE_S)
        postgres.start()

        # 3. A crash at a random moment under load.
        mark = _progress(out) + rng.randrange(6, 12)
        _wait(lambda: _progress(out) >= mark)
        time.sleep(rng.uniform(0.0, 0.2))
        _crash(postgres)
        time.sleep(OUTAGE_S)
        postgres.start()

        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
        results = [f.result(timeout=60) for f in saves]  # before the fix: RequestFailedError, "not recorded"
        kept = {(c["kind"], c["name"]) for c in saver.list_checkpoints()}
    finally:
        streams.close()
        for c in clients.values():
            c.close()

    for o in out:
        assert o.errors == [], o.errors  # no client saw an error: each 503 was retried
    assert all(r["path"] for r in results) and kept == {("state", "queued"), ("sampler", "queued-sampler")}
    # The pool and the gateway rode through: neither died nor was restarted.
    assert (pool.pid, pool.restarts, api.pid, api.restarts) == (pool_pid, 0, api_pid, 0)
    assert httpx.get(f"{stack.base_url}/v1/healthz", timeout=5).status_code == 200
    api_log, pool_log = ((stack.log_dir / f"{n}.log").read_text() for n in ("api", "pool"))
    assert "the database unavailable" in api_log and "answering 503 (POST /v1/adapters)" in api_log
    assert "Traceback" not in api_log and "Traceback" not in pool_log
    # The pool waited for the database: plans' records, the saves' rows among them (one transaction per plan).
    database_lines = "\n".join(line for line in pool_log.splitlines() if "database" in line or "checkpoint" in line)
    assert "database available again: recording a plan" in pool_log, database_lines

    want_states, want_losses = reference(stack, plans)
    with session_factory(make_db_engine(stack.settings.resolved_database_url))() as session:
        for p, o in zip(plans, out, strict=True):
            assert o.losses == want_losses[p.tenant]  # each forward_backward saw exactly the reference's state
            assert_same_state(saved_state(stack, o.model_id, "final"), want_states[p.tenant])
            # create, then 2 per step, then the save: each applied once, and recorded
            assert PoolRepository(session).applied_seq_id(o.model_id) == 2 * p.steps + 1
            assert session.scalar(select(Adapter.status).where(Adapter.model_id == o.model_id)) == AdapterStatus.READY
            usage = select(func.count(), func.sum(Usage.tokens)).where(
                Usage.model_id == o.model_id, Usage.kind == "forward_backward"
            )
            sent = sum(len(d["model_input"]) for k in range(p.steps) for d in p.batch(k))
            assert tuple(session.execute(usage).one()) == (p.steps, sent)  # each step's usage recorded once
        assert PoolRepository(session).applied_seq_id(saver.model_id) == 2  # the two saves


def test_a_pool_restarted_while_the_database_is_down_waits_for_it(stack: Stack, postgres: PostgresServer) -> None:
    """The pool SIGKILLed while PostgreSQL is down: its successor cannot migrate yet, and waits (pool/process.preflight)
    instead of exiting into the supervisor's growing backoff; once the database is back it serves a new tenant."""
    from loraplex.client import Datum

    pool = stack.child("pool")
    restarts = pool.restarts
    _crash(postgres)
    try:
        old = pool.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        _wait(lambda: pool.pid not in (None, old))
        new = pool.pid
        time.sleep(3.0)  # the supervisor's backoff is 0.2 s here: an exiting successor would be replaced by now
        assert pool.pid == new and new is not None and running(new) and pool.restarts == restarts + 1
    finally:
        postgres.start()
    stack.wait_pool_ready(120)
    client = tenant_clients(stack, "pg-restarted-pool")["pg-restarted-pool"]
    try:
        trainer = client.create_lora_training_client(rank=4, seed=5)
        assert trainer.forward_backward([Datum.for_next_token([5, 6, 7, 8, 9])]).result(timeout=120)["metrics"]
    finally:
        client.close()
    assert pool.pid == new
    log = (stack.log_dir / "pool.log").read_text()
    assert "database unavailable while migrating the database before the pool starts" in log

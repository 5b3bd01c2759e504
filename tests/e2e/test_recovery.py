"""Crash recovery end to end: an embedded stack of its own (real redis-server with its append-only file,
SQLite, real pool and gateway processes, the tiny model in fp32 on the CPU) under load from three tenants, each
training its own adapter through the client one request at a time, while the test kills parts of the stack.

After every fault each accepted request completed exactly once: every future resolved (none failed), every
forward_backward's loss equals the uninterrupted reference's at that step (the state before each request was exact),
the adapter's Adam step count and SQL applied_seq_id are exact, and the final weights and both Adam moments (read back
from a save_state checkpoint) are bit-identical to a run without faults on a local engine.

Why `slots=1`: a plan then holds one adapter's step at a time, as the reference runs it. The CPU matmuls are not
batch-invariant (one adapter's rows batched with another's come out ~1e-6 apart), so with mixed plans two
*uninterrupted* runs of this workload already differ in the last bits, depending on how requests happened to meet;
one slot pins the batch composition and makes bit-identity a meaningful check of recovery.
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

from loraplex.launch.embedded import Stack
from loraplex.queue import keys
from loraplex.runtime.netutil import free_port
from loraplex.runtime.redis_child import RedisChild
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import SnapshotRepository
from loraplex.storage.repositories.pools import PoolRepository
from tests.helpers.pipelined import check_applied_once
from tests.helpers.processes import rank_processes, running
from tests.helpers.recovery import (
    Plan,
    Trained,
    assert_close_state,
    assert_same_state,
    reference,
    saved_state,
    train,
    wait_restarted,
)
from tests.helpers.stack import tenant_clients


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("recovery")
    settings = Settings(home=home, slots=1, max_rank=16, pool_heartbeat_seconds=0.5, leader_lease_seconds=2.0,
                        snapshot_every_steps=3, snapshot_every_seconds=0, restart_backoff_seconds=0.2)  # fmt: skip
    running = Stack(settings, api_port=free_port()).start()
    pids: set[int] = set()
    running.seen_pids = pids  # type: ignore[attr-defined]
    try:
        yield running
    finally:
        pids.update(p.pid for p in running.children)
        redis_pid = running.redis._proc.pid if running.redis is not None and running.redis._proc else None
        running.stop()
        for pid in pids | ({redis_pid} if redis_pid else set()):
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # nothing left running (every child reaped too)


def _run_with_faults(stack: Stack, names: list[str], plans: list[Plan], fault) -> list[Trained]:
    clients = tenant_clients(stack, *names)
    out = [Trained() for _ in plans]
    threads = [threading.Thread(target=train, args=(clients[n], p, o, "final"), daemon=True)
               for n, p, o in zip(names, plans, out, strict=True)]  # fmt: skip
    for t in threads:
        t.start()
    try:
        fault(out)
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads)
    finally:
        for c in clients.values():
            c.close()
    return out


_check = check_applied_once


def _check_close(stack: Stack, plans: list[Plan], out: list[Trained]) -> None:
    """As _check, to fp32 rounding (plans that mixed adapters or split rows across ranks): losses and states within
    1e-4, Adam steps and seq_ids exact."""
    for o in out:
        assert o.errors == [], o.errors
    want_states, want_losses = reference(stack, plans)
    sessions = session_factory(make_db_engine(stack.settings.resolved_database_url))
    for p, o in zip(plans, out, strict=True):
        assert o.losses == pytest.approx(want_losses[p.tenant], rel=1e-4)
        assert_close_state(saved_state(stack, o.model_id, "final"), want_states[p.tenant])
        with sessions() as session:
            assert PoolRepository(session).applied_seq_id(o.model_id) == 2 * p.steps + 1


def _pool_killer(stack: Stack, marks: tuple[int, ...], rng: random.Random) -> Callable[[list[Trained]], None]:
    """A fault for _run_with_faults: SIGKILL the pool once each mark of answered requests is passed (plus a random
    moment up to 0.1 s), each time waiting for the stack to restart it."""

    def kill_pool(out: list[Trained]) -> None:
        for mark in marks:
            while _progress(out) < mark:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.1))
            pid = stack.child("pool").pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait_restarted(stack, pid)

    return kill_pool


TIMELINE, GATEWAYS = keys.timeline().encode(), keys.gateways().encode()


def _everything(url: str) -> dict[bytes, int]:
    """Every loraplex key and its size (stream length, string length, set/zset/list/hash size)."""
    client = redis.Redis.from_url(url)
    sizes = {"stream": client.xlen, "string": client.strlen, "set": client.scard, "zset": client.zcard,
             "list": client.llen, "hash": client.hlen}  # fmt: skip
    out = {}
    for key in client.scan_iter(match="loraplex:*"):
        kind = client.type(key).decode()
        if key.endswith((b":leader", b":registration", b":metrics", b":stats")) or key in (TIMELINE, GATEWAYS):
            # the lease, the pool's registration and published metrics (TTLs), statistics, and the dashboard's history
            # and gateway reports (a running gateway adds to them every 2 s): they move alone
            continue
        out[key] = int(sizes[kind](key))
    client.close()
    return out


def _progress(out: list[Trained]) -> int:
    return sum(o.done for o in out)


def test_the_pool_sigkilled_five_times_under_load_loses_and_repeats_nothing(stack: Stack) -> None:
    plans = [Plan(t, rank=(4, 8, 16)[t], seed=11 + t, steps=14) for t in range(3)]
    total = sum(2 * p.steps for p in plans)
    rng = random.Random(12)
    marks = sorted(rng.sample(range(4, total - 8, 3), 5))  # kill once this many requests were answered...
    kills: list[int] = []

    def kill_pool(out: list[Trained]) -> None:
        for mark in marks:
            while _progress(out) < mark:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.15))  # ...plus a random moment: mid-forward_backward, optim_step, record
            pid = stack.child("pool").pid
            assert pid is not None
            stack.seen_pids.add(pid)  # type: ignore[attr-defined]
            os.kill(pid, signal.SIGKILL)
            kills.append(_progress(out))
            wait_restarted(stack, pid)

    out = _run_with_faults(stack, ["kill-a", "kill-b", "kill-c"], plans, kill_pool)
    assert len(kills) == 5 and stack.child("pool").restarts >= 5
    assert all(k < total for k in kills)  # every kill hit a pool with work left
    _check(stack, plans, out)
    with session_factory(make_db_engine(stack.settings.resolved_database_url))() as session:
        assert all(SnapshotRepository(session).newest_first(o.model_id) for o in out)  # snapshots were taken
    assert "adopted" in (stack.log_dir / "pool.log").read_text()


def test_the_gateway_sigkilled_under_load_is_restarted_and_clients_ride_through(stack: Stack) -> None:
    plans = [Plan(t, rank=4, seed=21 + t, steps=10) for t in range(2)]

    def kill_gateway(out: list[Trained]) -> None:
        for mark in (6, 20):
            while _progress(out) < mark:
                time.sleep(0.01)
            _kill_gateway_and_wait_restarted(stack)

    out = _run_with_faults(stack, ["gw-a", "gw-b"], plans, kill_gateway)
    assert stack.child("api").restarts >= 2
    assert stack.child("pool").alive()  # the pool and redis rode through
    _check(stack, plans, out)


def _kill_gateway_and_wait_restarted(stack: Stack) -> None:
    """SIGKILL the stack's gateway; wait until the supervisor has started a new one."""
    api = stack.child("api")
    assert api.pid is not None
    stack.seen_pids.add(api.pid)  # type: ignore[attr-defined]
    os.kill(api.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (api.pid in stack.seen_pids or not api.alive()) and time.monotonic() < deadline:
        time.sleep(0.05)


def _kill_redis_and_wait_restarted(stack: Stack) -> None:
    """SIGKILL the stack's redis-server, as a crash would; wait until the stack has started it again (same port, same
    folder: its append-only file) and the old process is reaped."""
    server = stack.redis
    assert server is not None and server.pid is not None
    old = server.pid
    stack.seen_pids.add(old)  # type: ignore[attr-defined]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (server.pid == old or not server.ping()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.pid != old and server.ping(), "the stack did not restart redis-server"
    assert not running(old)  # reaped by the stack: no zombie


def _resumes(progress: Callable[[], int], before: int, timeout_s: float = 15.0) -> None:
    """Training answers a request again within `timeout_s` of a restart: well under the 30 s stale-entry claim, so
    nothing the pool had read when Redis died waited for that claim (queue/consumer.py: rescan_pending)."""
    deadline = time.monotonic() + timeout_s
    while progress() <= before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert progress() > before, f"no request answered within {timeout_s} s of the restart"


def _wait_healthy(stack: Stack, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if httpx.get(f"{stack.base_url}/v1/healthz", timeout=5).status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError(f"healthz: {httpx.get(f'{stack.base_url}/v1/healthz', timeout=5).text}")


def test_redis_sigkilled_and_restarted_from_its_append_only_file_loses_nothing_queued(stack: Stack) -> None:
    """The pool is paused (SIGSTOP) so requests pile up in Redis; redis-server is SIGKILLed and the stack starts it
    again on its folder: every queued request, stored result and idempotency key is back, and all of it completes."""
    plans = [Plan(t, rank=8, seed=31 + t, steps=8) for t in range(2)]

    def kill_redis(out: list[Trained]) -> None:
        while _progress(out) < 6:
            time.sleep(0.01)
        pool = stack.child("pool").pid
        assert pool is not None and stack.redis is not None
        os.kill(pool, signal.SIGSTOP)
        try:
            time.sleep(1.0)  # the clients' next requests are accepted and queued meanwhile
            before = _everything(stack.redis.url)
            assert any(k.endswith(b":requests") and n for k, n in before.items())  # requests wait in the streams
            _kill_redis_and_wait_restarted(stack)  # requests get 503s meanwhile; the clients retry them
            assert _everything(stack.redis.url) == before  # streams, results, idempotency keys, request logs: all back
        finally:
            os.kill(pool, signal.SIGCONT)

    out = _run_with_faults(stack, ["aof-a", "aof-b"], plans, kill_redis)
    _check(stack, plans, out)


def test_redis_sigkilled_three_times_under_training_is_restarted_by_the_stack_and_nothing_is_lost(stack: Stack) -> None:
    """redis-server SIGKILLed at random moments while two tenants train (a plan running, results being stored,
    requests being queued), each time restarted by the stack from its append-only file: the pool and the gateway ride
    through without a restart of their own, training resumes at once, every future resolves, healthz is 200 again,
    and the adapters end bit for bit where an uninterrupted run does."""
    plans = [Plan(t, rank=(4, 8)[t], seed=71 + t, steps=10) for t in range(2)]
    rng = random.Random(5)
    assert stack.redis is not None
    restarts, pool_restarts, api_restarts = (stack.redis.restarts, stack.child("pool").restarts,
                                             stack.child("api").restarts)  # fmt: skip

    def kill_redis(out: list[Trained]) -> None:
        for mark in (5, 17, 29):
            while _progress(out) < mark:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.1))
            before = _progress(out)
            _kill_redis_and_wait_restarted(stack)
            _resumes(lambda: _progress(out), before)

    out = _run_with_faults(stack, ["redis-a", "redis-b"], plans, kill_redis)
    assert stack.redis.restarts == restarts + 3
    assert (stack.child("pool").restarts, stack.child("api").restarts) == (pool_restarts, api_restarts)
    _wait_healthy(stack)
    _check(stack, plans, out)


def test_redis_sigkilled_under_a_tinker_sdk_trainer_every_future_resolves_and_the_adapter_ends_bit_identical(
    stack: Stack,
) -> None:
    """The official Tinker SDK, unchanged, training with a forward_backward and an optim_step in flight at a time;
    redis-server SIGKILLed twice and restarted by the stack: the SDK's retries and future polls ride through, training
    resumes at once, every future resolves, and the adapter ends bit for bit where an uninterrupted run does."""
    import tinker

    from tests.helpers.sdk import train_plan
    from tests.helpers.stack import create_tenants

    plan = Plan(0, rank=8, seed=81, steps=10)
    client = tinker.ServiceClient(base_url=stack.base_url, api_key=create_tenants(stack, "sdk-redis")["sdk-redis"])
    out = Trained()
    trainer = threading.Thread(target=train_plan, args=(client, plan, out, "sdk-final"), daemon=True)
    trainer.start()
    try:
        for mark in (4, 13):
            while out.done < mark and trainer.is_alive():
                time.sleep(0.01)
            before = out.done
            _kill_redis_and_wait_restarted(stack)
            _resumes(lambda: out.done, before)
        trainer.join(timeout=600)
        assert not trainer.is_alive()
    finally:
        client.close("success").result()
    assert out.errors == [], out.errors
    want_states, want_losses = reference(stack, [plan])
    assert out.losses == want_losses[0]
    assert_same_state(saved_state(stack, "*", "sdk-final"), want_states[0])  # the one checkpoint of that name


def test_a_corrupt_newest_snapshot_is_skipped_for_the_one_before_it(stack: Stack) -> None:
    plans = [Plan(0, rank=8, seed=41, steps=12)]
    sessions = session_factory(make_db_engine(stack.settings.resolved_database_url))

    def corrupt(out: list[Trained]) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # two snapshots recorded (steps 3 and 6)
            with sessions() as session:
                rows = SnapshotRepository(session).newest_first(out[0].model_id) if out[0].model_id else []
            if len(rows) >= 2 and _progress(out) >= 14:
                break
            time.sleep(0.02)
        pid = stack.child("pool").pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # hold it while the newest file is damaged, then kill it
        with sessions() as session:
            newest = SnapshotRepository(session).newest_first(out[0].model_id)[0]
        with open(newest.path, "r+b") as f:
            f.seek(-16, os.SEEK_END)
            f.write(b"\x7f" * 16)
        os.kill(pid, signal.SIGKILL)
        wait_restarted(stack, pid)
        corrupt.version = newest.version  # type: ignore[attr-defined]

    out = _run_with_faults(stack, ["corrupt-a"], plans, corrupt)
    _check(stack, plans, out)
    text = (stack.log_dir / "pool.log").read_text()
    assert f"snapshot v{corrupt.version} skipped for the one before it" in text  # type: ignore[attr-defined]
    assert "fails its hash check" in text


STACK_SCRIPT = """
import json, sys, time
from pathlib import Path
from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
stack = Stack(Settings(home=Path(sys.argv[1]), slots=1, max_rank=16), api_port=free_port()).start()
print(json.dumps([p.pid for p in stack.children] + [stack.redis._proc.pid]), flush=True)
time.sleep(3600)
"""


def test_the_embedded_stack_sigkilled_leaves_nothingrunning(tmp_path) -> None:
    import json
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", STACK_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": os.getcwd()})  # fmt: skip
    try:
        pids = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert len(pids) == 3 and all(running(p) for p in pids)  # pool, gateway, redis-server
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if running(p)]  # each got SIGTERM when the stack died, and stopped
    finally:
        proc.kill()
        proc.wait()


def test_a_pool_mixing_adapters_killed_three_times_ends_where_an_uninterrupted_run_does(tmp_path) -> None:
    """Four slots, so plans mix the tenants' steps: the replay runs them one at a time, equal to fp32 rounding (see the
    module doc); still every request exactly once (losses and states within 1e-4, Adam steps and seq_ids exact)."""
    settings = Settings(home=tmp_path, slots=4, max_rank=16, pool_heartbeat_seconds=0.5, leader_lease_seconds=2.0,
                        snapshot_every_steps=2, snapshot_every_seconds=0, restart_backoff_seconds=0.2)  # fmt: skip
    plans = [Plan(t, rank=(4, 8, 16)[t], seed=51 + t, steps=10) for t in range(3)]
    with Stack(settings, api_port=free_port()) as mixed:
        kill_pool = _pool_killer(mixed, (8, 24, 40), random.Random(7))
        _check_close(mixed, plans, _run_with_faults(mixed, ["mix-a", "mix-b", "mix-c"], plans, kill_pool))


def test_a_moe_pool_sigkilled_twice_under_load_ends_bit_for_bit_where_an_uninterrupted_run_does(tmp_path) -> None:
    """A pool serving tiny-moe (expert banks in its snapshots, host swaps and replay), killed twice under two
    tenants' load. One slot, so plans hold one adapter's step at a time as the reference runs them (see the module
    doc; with mixed plans the experts' (expert, adapter) grouping changes summation orders): every request exactly
    once, the final state bit for bit."""
    settings = Settings(home=tmp_path, base_model="tiny-moe", slots=1, max_rank=16, pool_heartbeat_seconds=0.5,
                        leader_lease_seconds=2.0, snapshot_every_steps=2, snapshot_every_seconds=0,
                        restart_backoff_seconds=0.2)  # fmt: skip
    plans = [Plan(t, rank=(4, 8)[t], seed=61 + t, steps=6) for t in range(2)]
    with Stack(settings, api_port=free_port()) as moe:
        kill_pool = _pool_killer(moe, (6, 16), random.Random(11))
        _check(moe, plans, _run_with_faults(moe, ["moe-a", "moe-b"], plans, kill_pool))


def test_loraplex_worker_restarts_its_pool_process_and_stops_it_on_sigterm(tmp_path) -> None:
    import subprocess
    import sys

    from loraplex.launch.embedded import ready_file

    settings = Settings(home=tmp_path, slots=1, max_rank=16, pool="worker-test", leader_lease_seconds=2.0)
    with RedisChild(workdir=tmp_path / "redis") as server:
        env = os.environ | {"PYTHONPATH": os.getcwd(), "LORAPLEX_HOME": str(tmp_path), "LORAPLEX_POOL": "worker-test",
                            "LORAPLEX_REDIS_URL": server.url, "LORAPLEX_SLOTS": "1",
                            "LORAPLEX_LEADER_LEASE_SECONDS": "2"}  # fmt: skip
        log_path = tmp_path / "worker.log"  # the worker's and its pool processes' log: shown when this fails
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed in the finally below
        worker = subprocess.Popen([sys.executable, "-m", "loraplex.launch.cli", "worker"], env=env, stdout=log_file,
                                  stderr=subprocess.STDOUT)  # fmt: skip
        ready = ready_file(settings)

        def pool_pid(not_this: int | None, timeout_s: float = 120.0) -> int:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    pid = int(ready.read_text().strip())
                    if pid != not_this and running(pid):
                        return pid
                except (FileNotFoundError, ValueError):
                    pass
                time.sleep(0.1)
            raise TimeoutError("no ready pool")

        try:
            first = pool_pid(None)
            os.kill(first, signal.SIGKILL)
            second = pool_pid(first)  # restarted by `loraplex worker`, which kept running
            assert worker.poll() is None
            worker.send_signal(signal.SIGTERM)
            try:
                code = worker.wait(60)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"loraplex worker after SIGTERM: {code}; its log:\n{log_path.read_text()[-6000:]}"
            assert not running(first) and not running(second)
        finally:
            worker.kill()
            worker.wait()
            log_file.close()


def test_the_pool_sigkilled_in_the_middle_of_a_forward_backward_runs_it_again_once(stack: Stack) -> None:
    """Steps large enough to take a while (48 datums of 120 tokens, ~100x an optim_step's time): the pool is killed
    twice while a request is RUNNING with no result yet, i.e. in the middle of its plan; after each restart that
    request runs again from the adopted state, once."""
    plans = [Plan(0, rank=8, seed=61, steps=4, datums=48, length=120)]
    client = redis.Redis.from_url(stack.settings.redis_url)
    hits: list[bytes] = []

    def kill_mid_step(out: list[Trained]) -> None:
        for _ in range(2):
            deadline = time.monotonic() + 120
            running: list[bytes] = []
            while not running and time.monotonic() < deadline:
                running = [k for k in client.scan_iter(match="loraplex:state:*") if client.get(k) == b"running"
                           and not client.exists(k.replace(b":state:", b":result:"))]  # fmt: skip
                time.sleep(0.005)
            assert running, "no request seen running"
            pid = stack.child("pool").pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            hits.extend(running)
            wait_restarted(stack, pid)

    try:
        out = _run_with_faults(stack, ["mid-fb"], plans, kill_mid_step)
    finally:
        client.close()
    assert len(hits) >= 2
    _check(stack, plans, out)


def test_a_two_rank_pool_loses_a_rank_or_its_leader_and_ends_where_an_uninterrupted_run_does(tmp_path, monkeypatch) -> None:
    """World size 2 on CPU (gloo): rank 1 SIGKILLed twice, then rank 0 (the pool process) once, under two tenants'
    load. A lost rank ends the pool (the other rank sits in a collective), the stack restarts it, and every rank adopts
    the snapshots and replays the log. A dead leader takes its follower with it (no rank left behind). The rows are
    split across ranks, so the runs equal the one-process reference to fp32 rounding (losses and states), with Adam
    steps and seq_ids exact."""
    monkeypatch.setenv("LORAPLEX_WORLD_SIZE", "2")  # the stack's children read it
    settings = Settings(home=tmp_path, slots=1, world_size=2, max_rank=16, pool_heartbeat_seconds=0.5,
                        leader_lease_seconds=2.0, snapshot_every_steps=2, snapshot_every_seconds=0,
                        restart_backoff_seconds=0.2)  # fmt: skip
    plans = [Plan(t, rank=(4, 8)[t], seed=61 + t, steps=8) for t in range(2)]
    rng = random.Random(11)
    killed_ranks: list[int] = []
    with Stack(settings, api_port=free_port()) as two:
        def kill(out: list[Trained]) -> None:
            for mark, which in ((6, "rank"), (14, "rank"), (22, "leader")):
                while _progress(out) < mark:
                    time.sleep(0.01)
                time.sleep(rng.uniform(0.0, 0.1))
                pool = two.child("pool").pid
                assert pool is not None
                ranks = rank_processes(pool)
                assert len(ranks) == 1, ranks
                killed_ranks.extend(ranks)
                os.kill(ranks[0] if which == "rank" else pool, signal.SIGKILL)
                wait_restarted(two, pool)

        _check_close(two, plans, _run_with_faults(two, ["two-a", "two-b"], plans, kill))
        deadline = time.monotonic() + 10
        while any(running(p) for p in killed_ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in killed_ranks if running(p)]  # the last leader's follower died with it


def test_the_pool_a_gateway_and_redis_killed_in_turn_six_times_under_the_sdk_end_bit_identical(stack: Stack) -> None:
    """The official Tinker SDK training while the pool, the gateway and redis-server are SIGKILLed in turn, twice
    each, each brought back by the stack's supervisor: every future resolves, training resumes after every kill, and
    the adapter ends bit for bit where an uninterrupted run does (losses included)."""
    import tinker

    from tests.helpers.sdk import train_plan
    from tests.helpers.stack import create_tenants

    def kill_pool() -> None:
        pid = stack.child("pool").pid
        assert pid is not None
        stack.seen_pids.add(pid)  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        wait_restarted(stack, pid)

    plan = Plan(0, rank=8, seed=91, steps=18)
    client = tinker.ServiceClient(base_url=stack.base_url, api_key=create_tenants(stack, "sdk-six")["sdk-six"])
    out = Trained()
    trainer = threading.Thread(target=train_plan, args=(client, plan, out, "sdk-six-final"), daemon=True)
    trainer.start()
    kills = [kill_pool, lambda: _kill_gateway_and_wait_restarted(stack), lambda: _kill_redis_and_wait_restarted(stack)] * 2
    restarts = (stack.child("pool").restarts, stack.child("api").restarts, stack.child("redis").restarts)
    try:
        for mark, kill in zip((3, 8, 13, 18, 23, 28), kills, strict=True):
            while out.done < mark and trainer.is_alive():
                time.sleep(0.01)
            before = out.done
            kill()
            _resumes(lambda: out.done, before, timeout_s=60.0)
        trainer.join(timeout=600)
        assert not trainer.is_alive()
    finally:
        client.close("success").result()
    assert out.errors == [], out.errors
    assert (stack.child("pool").restarts, stack.child("api").restarts, stack.child("redis").restarts) == tuple(
        n + 2 for n in restarts
    )
    want_states, want_losses = reference(stack, [plan])
    assert out.losses == want_losses[0]
    assert_same_state(saved_state(stack, "*", "sdk-six-final"), want_states[0])

"""A pool killed under training load and kept down: its sibling takes its adapters over (pool/failover.py). An
embedded stack with two `tiny` pools (`default`, `default-2`: real pool processes, redis-server, SQLite), unsupervised
so a killed pool stays down until the test starts it again; four tenants each training one adapter with several
requests in flight at once, two adapters on each pool (which two is the placement's choice by queued tokens).

`default-2` is SIGKILLed (its whole process group) with requests of its adapters queued and running. Once its lease
has lapsed and it stayed dead past LORAPLEX_POOL_FAILOVER_SECONDS, `default` takes its lease, hands its adapters over
to itself and adopts them from their durable snapshots and request logs. Every accepted request is applied exactly
once: every future resolved (none failed), each forward_backward's loss equals the fault-free reference's, the final
weights and Adam moments are bit-identical to it (`slots=1`, as test_recovery.py), the SQL applied seq_id is exact.
The dead pool is started again while the tenants still train: it takes its lease back, adopts none of the adapters
that left it and applies nothing of theirs (their results and final state would differ if it did).

A pool only stalled (SIGSTOP) past the failover time is failed over the same way (once its process, if stopped inside
a database transaction, is woken and ends it); woken, its old process finds its lease taken and stops without writing
a result (fenced by the token the sibling took), and the training ends bit-identical."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import pytest
import redis

from loraplex.launch.embedded import Stack
from loraplex.queue import handoff, keys, replay_log
from loraplex.runtime.netutil import free_port
from loraplex.service.build import build_services
from loraplex.service.moves import placed_pool, wait_placed
from loraplex.settings import Settings
from tests.helpers.pipelined import check_applied_once, join_trainers, start_trainers, wait_done
from tests.helpers.recovery import Plan

pytestmark = [pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Unsupervised: the killed pool is not restarted by the stack. A 6 s lease, so the failover comes within seconds
    # of the kill and a pool busy for a second or two keeps its lease; failover once dead 3 s past its last
    # registration (so in effect once the lease lapsed).
    settings = Settings(home=tmp_path_factory.mktemp("failover"), slots=1, max_rank=16, pool_heartbeat_seconds=0.5,
                        snapshot_every_steps=3, snapshot_every_seconds=0, supervise=False, leader_lease_seconds=6.0,
                        pool_failover_seconds=3.0)  # fmt: skip
    with Stack(settings, api_port=free_port(), pool_models=["tiny", "tiny"]) as running:
        yield running


def _log(stack: Stack, child: str) -> str:
    return (stack.log_dir / f"{child}.log").read_text()


def test_a_killed_pools_adapters_continue_on_its_sibling_bit_identical_and_its_return_applies_nothing_twice(
    stack: Stack,
) -> None:
    services = build_services(stack.settings)
    plans = [Plan(t, rank=(4, 8)[t % 2], seed=61 + t, steps=14) for t in range(4)]
    threads, out, clients = start_trainers(stack, ["fo-a", "fo-b", "fo-c", "fo-d"], plans)
    ids = [o.model_id for o in out]
    # Two on each pool: the first two by free slots, the third by the pools' queued tokens at that moment (both hold
    # one adapter then, each training), the fourth to the pool the third did not take.
    placed = [placed_pool(services, m) for m in ids]
    assert placed[:2] == ["default", "default-2"] and sorted(placed[2:]) == ["default", "default-2"], placed
    orphans = [m for m, pool in zip(ids, placed, strict=True) if pool == "default-2"]

    wait_done(out, 6)  # every tenant has requests answered, and more in flight
    dead = stack.child("pool-default-2")
    dead.kill_group()  # SIGKILL, reaped; nothing restarts it
    killed_at = time.monotonic()
    # An orphan whose client had not read all its steps' answers still sends its final save: it meets the sibling,
    # which adopts it. One that ran ahead and finished on the dead pool has nothing left to adopt.
    live = [o.model_id for o in out if o.model_id in orphans and o.done < 2 * plans[0].steps]
    assert live, "both orphans finished before the kill: nothing was left to hand over"
    for model_id in orphans:
        assert wait_placed(services, model_id, "default", 120), model_id
    assert time.monotonic() - killed_at >= stack.settings.pool_failover_seconds
    logs = _log(stack, "pool")
    taken = {m: re.findall(rf"adapter {m} of dead pool default-2 handed over to pool default with (\d+) queued", logs)
             for m in orphans}  # fmt: skip
    assert all(len(t) == 1 for t in taken.values()), taken  # each handed over once
    assert sum(int(t[0]) for t in taken.values()) > 0  # requests in flight went along

    wait_done(out, 14)  # the orphans train on default now
    before = len(_log(stack, "pool-default-2"))
    dead.respawn()  # the dead pool comes back while its former adapters still train elsewhere
    stack.wait_pool_ready(child="pool-default-2")
    join_trainers(threads, clients)

    check_applied_once(stack, plans, out)
    assert [placed_pool(services, m) for m in ids] == ["default"] * 4
    logs = _log(stack, "pool")
    assert all(f"pool default: adopted adapter {m}" in logs for m in live)
    returned = _log(stack, "pool-default-2")[before:]
    assert "pool default-2 ready" in returned and "adopted" not in returned, returned[-3000:]
    r = redis.Redis.from_url(stack.settings.redis_url)
    assert replay_log.logged_adapters(r, "default-2") == [] and handoff.adopt_orders(r, "default-2") == []
    assert all(handoff.moved_to(r, "default-2", m) == "default" for m in orphans)
    assert all(r.xlen(k) == 0 for k in r.scan_iter(keys.request_stream("default-2", "*")))  # nothing left queued


def test_a_stalled_pool_failed_over_is_fenced_out_when_it_wakes(stack: Stack) -> None:
    services = build_services(stack.settings)
    plans = [Plan(t, rank=(8, 4)[t], seed=71 + t, steps=10) for t in range(2)]
    threads, out, clients = start_trainers(stack, ["st-e", "st-f"], plans)
    ids = [o.model_id for o in out]
    # default holds the first test's four adapters: both new ones went to default-2
    assert [placed_pool(services, m) for m in ids] == ["default-2", "default-2"]

    wait_done(out, 6)
    stalled = stack.child("pool-default-2")
    before = len(_log(stack, "pool-default-2"))
    r = redis.Redis.from_url(stack.settings.redis_url)
    token = int(r.get(keys.pool_leader("default-2")).split()[0])  # type: ignore[union-attr]
    os.kill(stalled.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    try:
        # Until default took the stalled pool's lease: its adapters handed over, or, when the pool was stopped inside
        # a database transaction (SQLite's write lock, the pools row's lock), the hand-over waits for that to end.
        deadline = time.monotonic() + 120
        while int(r.get(keys.pool_leader_token("default-2")) or 0) == token:  # type: ignore[arg-type]
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)  # type: ignore[arg-type]
    for model_id in ids:
        assert wait_placed(services, model_id, "default", 120), model_id
    assert stalled.proc is not None and stalled.proc.wait(60) == 1  # woke deposed: it stopped
    assert "lost its lease" in _log(stack, "pool-default-2")[before:]
    join_trainers(threads, clients)
    check_applied_once(stack, plans, out)
    stalled.kill_group()
    stalled.respawn()  # the stack stops a running pool at its end
    stack.wait_pool_ready(child="pool-default-2")

"""Adapters moved between two pools of one base model while they train: an embedded stack with two `tiny` pools
(`default`, `default-2`: real pool processes, redis-server, SQLite), two tenants each training one adapter with several
requests in flight at once (so requests sit queued and running on the source pool when it hands the adapter over),
and operators' moves through `loraplex pool move` and the service call.

Every accepted request is applied exactly once across the moves: every future resolved (none failed), each
forward_backward's loss equals the uninterrupted reference's, the final weights and Adam moments are bit-identical to
a run without moves on a local engine (`slots=1`: a plan holds one adapter's step, as the reference runs it; see
test_recovery.py), the SQL applied seq_id is exact, and each adapter ends placed where it was last moved."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from sqlalchemy.engine import make_url

from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.launch.embedded import Stack
from loraplex.queue import handoff
from loraplex.runtime.netutil import free_port
from loraplex.service.build import build_services
from loraplex.service.moves import move_adapter, placed_pool, wait_placed
from loraplex.settings import Settings
from tests.helpers.pipelined import check_applied_once, join_trainers, start_trainers, wait_done
from tests.helpers.recovery import Plan
from tests.helpers.stack import tenant_clients

pytestmark = [pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # The lease's default 10 s: a pool paused for a second or two keeps its lease and its registration.
    settings = Settings(home=tmp_path_factory.mktemp("moves"), slots=1, max_rank=16, pool_heartbeat_seconds=0.5,
                        snapshot_every_steps=3, snapshot_every_seconds=0, restart_backoff_seconds=0.2)  # fmt: skip
    with Stack(settings, api_port=free_port(), pool_models=["tiny", "tiny"]) as running:
        yield running


def _cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **stack.child_env()}
    return subprocess.run([sys.executable, "-m", "loraplex.launch.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


@contextmanager
def _paused(stack: Stack, *children: str) -> Iterator[None]:
    """The pool processes stopped (SIGSTOP) meanwhile: the tenants' requests in flight queue up on them, so a move
    asked now is handed over with requests queued, and with requests answered but not yet acked or just read."""
    pids = [stack.child(name).pid for name in children]
    database = Path(make_url(stack.settings.resolved_database_url).database or "")
    for _ in range(100):
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
        if not _exclusive_sqlite_locks(pids, database):
            break
        # Stopped inside a write or a checkpoint: it would keep the lock, and the CLI's first write would wait on
        # it until its busy timeout. Let it finish and stop it again.
        for pid in pids:
            os.kill(pid, signal.SIGCONT)  # type: ignore[arg-type]
        time.sleep(0.01)
    try:
        time.sleep(0.5)
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)  # type: ignore[arg-type]


def _exclusive_sqlite_locks(pids: list[int | None], database: Path) -> list[str]:
    """The exclusive (WRITE) POSIX locks `pids` hold on the database or its -wal / -shm files, from /proc/locks: a
    writer's, a checkpointer's or a read-mark update's. Readers' shared locks do not block a writer in WAL mode."""
    inodes = set()
    for path in (database, database.with_name(database.name + "-wal"), database.with_name(database.name + "-shm")):
        if path.exists():
            inodes.add(path.stat().st_ino)
    return [
        line for line in _lock_lines() if int(line.split()[4]) in pids and int(line.split()[5].split(":")[2]) in inodes
    ]


def _lock_lines() -> list[str]:
    """/proc/locks' exclusive POSIX locks (not the waiters')."""
    lines = []
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[1] == "POSIX" and fields[3] == "WRITE" and fields[4].isdigit():
            lines.append(line)
    return lines


def _handed_over(stack: Stack, model_id: str, target: str) -> list[int]:
    """The queued requests each hand-over of the adapter to `target` took along (from the pools' logs)."""
    logs = "".join(p.read_text() for p in stack.log_dir.glob("pool*.log"))
    return [int(n) for n in re.findall(rf"adapter {model_id} handed over to pool {target} with (\d+) queued", logs)]


def _cli_asking(stack: Stack, pool: str, *args: str) -> subprocess.Popen[str]:
    """`loraplex ARGS` started, returned once it asked `pool` for a move (its orders are in Redis)."""
    cli = subprocess.Popen([sys.executable, "-m", "loraplex.launch.cli", *args], env={**os.environ, **stack.child_env()},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    r = redis.Redis.from_url(stack.settings.redis_url)
    database = Path(make_url(stack.settings.resolved_database_url).database or "")
    while not handoff.move_orders(r, pool):
        if cli.poll() is not None:  # what held the database, should it be a lock: every process's locks on it
            holders = _exclusive_sqlite_locks([int(line.split()[4]) for line in _lock_lines()], database)
            raise AssertionError((cli.communicate(), holders))
        time.sleep(0.05)
    return cli


def test_adapters_moved_under_training_load_end_bit_identical_with_every_request_applied_once(stack: Stack) -> None:
    services = build_services(stack.settings)
    plans = [Plan(t, rank=(4, 8)[t], seed=41 + t, steps=20) for t in range(2)]
    threads, out, clients = start_trainers(stack, ["mv-a", "mv-b"], plans)
    a, b = out[0].model_id, out[1].model_id
    assert [placed_pool(services, a), placed_pool(services, b)] == ["default", "default-2"]

    wait_done(out, 6)  # a moves to default-2 through the service call
    with _paused(stack, "pool", "pool-default-2"):
        assert move_adapter(services, a, "default-2") == "default"
    assert wait_placed(services, a, "default-2", 120)

    wait_done(out, 20)  # a moves back through the CLI, b to default at the same time
    with _paused(stack, "pool", "pool-default-2"):
        cli = _cli_asking(stack, "default-2", "pool", "move", a, "--to", "default")
        assert move_adapter(services, b, "default") == "default-2"
    stdout, stderr = cli.communicate(timeout=120)
    assert cli.returncode == 0, stderr
    assert stdout.strip() == f"adapter {a} is on pool default"
    assert wait_placed(services, b, "default", 120)
    join_trainers(threads, clients)

    check_applied_once(stack, plans, out)
    assert placed_pool(services, a) == placed_pool(services, b) == "default"
    # Each move was one hand-over, and they took queued requests along (the tenants had requests in flight on the
    # paused source). Not each: a resumed pool may finish the plan it was stopped in, and with it an adapter's queue,
    # before it reads its move orders.
    taken = {(model_id, target): _handed_over(stack, model_id, target)
             for model_id, target in ((a, "default-2"), (a, "default"), (b, "default"))}  # fmt: skip
    assert all(len(counts) == 1 for counts in taken.values()) and sum(c for (c,) in taken.values()) > 0, taken
    logs = "".join(p.read_text() for p in stack.log_dir.glob("pool*.log"))
    assert f"pool default-2: adopted adapter {a}" in logs and f"pool default: adopted adapter {b}" in logs

    # An operator's mistakes: one line each, nothing moved.
    with pytest.raises(ConflictError, match="already"):
        move_adapter(services, a, "default")
    with pytest.raises(InvalidRequestError, match="not a live pool of 'tiny'.*default-2"):
        move_adapter(services, a, "nowhere")
    with pytest.raises(NotFoundError):
        move_adapter(services, "no-such-adapter", "default-2")
    bad = _cli(stack, "pool", "move", a, "--to", "nowhere")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("loraplex: pool 'nowhere'")
    assert placed_pool(services, a) == "default"


def test_a_drained_pool_hands_every_adapter_to_its_sibling_under_load_and_takes_no_new_one(stack: Stack) -> None:
    services = build_services(stack.settings)
    # Steps enough that neither trainer is through when the pool stops: wait_done waits for the slower one, and a
    # faster one that had sent its last step by then would be handed over with nothing queued.
    plans = [Plan(t, rank=(8, 4)[t], seed=51 + t, steps=40) for t in range(2)]
    threads, out, clients = start_trainers(stack, ["dr-c", "dr-d"], plans)
    c, d = out[0].model_id, out[1].model_id
    # default holds the earlier test's two adapters: both new ones went to default-2
    assert placed_pool(services, c) == placed_pool(services, d) == "default-2"

    wait_done(out, 6)
    with _paused(stack, "pool", "pool-default-2"):
        cli = _cli_asking(stack, "default-2", "pool", "drain", "default-2")
    stdout, stderr = cli.communicate(timeout=300)
    assert cli.returncode == 0, stderr
    assert stdout.strip().startswith("pool default-2 drained: 2 adapter(s) moved")
    assert placed_pool(services, c) == placed_pool(services, d) == "default"
    join_trainers(threads, clients)
    check_applied_once(stack, plans, out)
    for model_id in (c, d):
        (taken,) = _handed_over(stack, model_id, "default")
        assert taken > 0, model_id  # each went with requests queued

    # Drained: a new adapter goes to default, though default-2 has every slot free; undrained, it takes them again.
    tenant = tenant_clients(stack, "dr-e")["dr-e"]
    assert placed_pool(services, tenant.create_lora_training_client(rank=4).model_id) == "default"
    with pytest.raises(InvalidRequestError, match="drained"):
        move_adapter(services, c, "default-2")
    undrained = _cli(stack, "pool", "undrain", "default-2")
    assert undrained.returncode == 0, undrained.stderr
    assert placed_pool(services, tenant.create_lora_training_client(rank=4).model_id) == "default-2"
    tenant.close()

    # An operator's mistake: one line.
    missing = _cli(stack, "pool", "drain", "nowhere")
    assert missing.returncode == 2 and missing.stderr.strip() == "loraplex: pool 'nowhere' not found"

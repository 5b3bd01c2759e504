"""One leader per pool, end to end (tiny model, CPU): a second `python -m loraplex.pool.process` for the same pool waits
while the first leads (before: both read the stream, "not resident" errors, gap timeouts, and the second overwrote and
then deleted the first's ready file). SIGKILL the leader: the waiting one takes over within about the lease TTL and
training goes on. A pool process whose lease is taken from it stops at once, exit status 1; with
LORAPLEX_LEADER_WAIT=false a second one exits at once naming the holder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from loraplex.client import AdamParams, Datum, ServiceClient, TrainingClient
from loraplex.launch.embedded import Stack
from loraplex.pool.ready import ready_file
from loraplex.queue import keys
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from tests.helpers.stack import create_tenants

TTL_S = 1.5
WAITING = "leads it; waiting for its lease to lapse"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("leader")
    settings = Settings(home=home, slots=4, max_rank=8, pool="leader", leader_lease_seconds=TTL_S)
    with Stack(settings, api_port=free_port()) as running:
        yield running


def _pool_process(stack: Stack, name: str, **env: str) -> tuple[subprocess.Popen, Path]:
    log = stack.log_dir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "loraplex.pool.process"], env=stack.child_env() | env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    return proc, log


def _wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `check()` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def _data(offset: int) -> list[Datum]:
    return [Datum.for_next_token([(offset + 5 * i + j) % 200 + 10 for j in range(10)]) for i in range(2)]


def _train(trainer: TrainingClient, steps: int, offset: int = 1) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = trainer.forward_backward(_data(offset))
        opt = trainer.optim_step(AdamParams(learning_rate=2e-2))
        result = fb.result(timeout=60)
        assert [len(o["logprobs"]) for o in result["loss_fn_outputs"]] == [9, 9]
        losses.append(result["metrics"]["loss:sum"])
        opt.result(timeout=60)
    return losses


def _first_pool(stack: Stack) -> subprocess.Popen:
    return next(p for p in stack.children if "loraplex.pool.process" in p.args)


def test_a_second_pool_process_waits_then_takes_over_when_the_leader_is_killed(stack: Stack) -> None:
    client = ServiceClient(stack.base_url, create_tenants(stack, "leader-t")["leader-t"])
    first = _first_pool(stack)
    ready = ready_file(stack.settings)
    trainer = client.create_lora_training_client(rank=4, seed=3)
    second, second_log = _pool_process(stack, "pool-second")
    try:
        _wait_for("the second pool process's waiting line", lambda: WAITING in second_log.read_text(), 60)
        # The first keeps serving, alone: every step answered, in order, training works.
        losses = _train(trainer, 6)
        assert losses[-1] < 0.7 * losses[0]
        assert trainer.info()["applied_seq_id"] == 12
        assert ready.read_text().strip() == str(first.pid)  # the waiting process never touched the ready file
        pool_log = (stack.log_dir / "pool.log").read_text()
        assert " ERROR " not in pool_log and "Traceback" not in pool_log and "not resident" not in pool_log
        waiting_lines = second_log.read_text().count(WAITING)
        assert 1 <= waiting_lines <= 3  # one line at most every few seconds
        saved = trainer.save_state("before-kill").result(timeout=60)
        assert second.poll() is None

        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        took = _wait_for("the takeover", lambda: "leading it" in second_log.read_text(), TTL_S + 10)
        assert took <= TTL_S + 2.0, f"took over after {took:.1f} s with a {TTL_S} s lease"
        # The dead leader's ready file goes as the new one takes the lease, before it loads: a healthcheck reading
        # the file never calls the loading pool ready.
        _wait_for("the dead leader's ready file gone", lambda: not ready.exists() or
                  ready.read_text().strip() == str(second.pid), 2)  # fmt: skip
        _wait_for("the new leader's ready file", lambda: ready.exists() and ready.read_text().strip() == str(second.pid),
                  120)  # fmt: skip
        # The client's next steps complete on the new leader (the killed pool's in-memory adapters are gone: the
        # tenant continues from its checkpoint, as after any pool restart).
        restored = client.create_training_client_from_state(saved["path"])
        assert len(_train(restored, 2)) == 2
        assert "Traceback" not in second_log.read_text()

        # A third pool process told not to wait exits at once, naming the holder.
        third = subprocess.run([sys.executable, "-m", "loraplex.pool.process"], capture_output=True, text=True,
                               env=stack.child_env() | {"LORAPLEX_LEADER_WAIT": "false"}, timeout=120)  # fmt: skip
        assert third.returncode != 0
        assert f"pool leader: another pool process (holder {os.uname().nodename}:{second.pid}:" in third.stderr
        assert "exiting (LORAPLEX_LEADER_WAIT=false)" in third.stderr and "Traceback" not in third.stderr
        assert ready.read_text().strip() == str(second.pid)

        # The leader's lease taken from it (another process's, with a newer token): it stops at once, exit status 1,
        # its ready file gone.
        r = redis.Redis.from_url(stack.settings.redis_url)
        r.set(keys.pool_leader_token("leader"), "1000")
        r.set(keys.pool_leader("leader"), "1000 usurper", px=60_000)
        assert second.wait(timeout=TTL_S + 30) == 1
        log = second_log.read_text()
        assert "lost its lease" in log and "usurper" in log
        assert not ready.exists()
        r.delete(keys.pool_leader("leader"))
    finally:
        if second.poll() is None:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=30)

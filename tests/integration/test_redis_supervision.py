"""The embedded stack's redis-server under its supervisor (runtime/redis_child.py, runtime/supervisor.py), with real
redis-server processes: SIGKILLed while a client writes, it is reaped (no zombie) and started again on the same port
and folder, and every write it answered is back from its append-only file; a redis-server that cannot start is tried
again with the backoff; and the fsync policy's claim, checked with a slowed fsync: `always` loses nothing answered
when the server is killed, where `everysec` does."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from loraplex.runtime.netutil import free_port
from loraplex.runtime.redis_child import RedisChild
from loraplex.runtime.supervisor import Supervisor
from tests.helpers.processes import running


class Writer:
    """A thread INCRing one counter and XADDing to one stream as fast as the server answers, through the outage
    (errors are retried); `answered` is the last value the server answered."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=2)
        self.answered = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                value = int(self.client.incr("counter"))
                self.client.xadd("stream", {"n": value})
                self.answered = value
            except redis.ConnectionError:
                self.failures += 1
                time.sleep(0.01)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()


def _wait(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[tuple[RedisChild, Supervisor]]:
    server = RedisChild(workdir=tmp_path / "redis").start()
    supervisor = Supervisor([server], backoff_s=0.1).start()
    try:
        yield server, supervisor
    finally:
        supervisor.stop(server.stop)


def test_a_sigkilled_redis_server_is_reaped_restarted_on_its_port_and_loses_nothing_it_answered(
    supervised, caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = supervised
    caplog.set_level(logging.WARNING)
    port = server.port
    with Writer(server.url) as writer:
        for kill in range(3):
            _wait(lambda k=kill: writer.answered > 200 * (k + 1))
            old = server.pid
            assert old is not None
            answered = writer.answered
            os.kill(old, signal.SIGKILL)
            _wait(lambda o=old: server.pid != o and server.ping())
            assert not running(old)  # reaped: neither alive nor a zombie
            assert server.port == port and server.alive()
            _wait(lambda a=answered: writer.answered > a)  # the writer carries on against the new server
        assert writer.failures > 0  # it did meet the outages
    check = redis.Redis.from_url(server.url)
    try:
        counter = int(check.get("counter") or 0)
        assert counter >= writer.answered  # every INCR answered before a kill is in the append-only file
        entries = check.xrange("stream")
        values = [int(fields[b"n"]) for _, fields in entries]
        assert values == sorted(values) and values[-1] == writer.answered  # the XADDs too, in order
    finally:
        check.close()
    assert server.restarts == 3
    lines = [r.getMessage() for r in caplog.records]
    assert sum("redis process" in line and "restarting it in" in line for line in lines) == 3
    assert sum(f"restarting on port {port} from its append-only file" in line for line in lines) == 3


def test_a_redis_server_that_cannot_start_is_tried_again_with_the_backoff(supervised) -> None:
    """Its append-only manifest damaged, the restarted server exits at once; the supervisor tries again (no spin:
    the wait doubles), and once the folder is repaired the next start loads the data."""
    server, _ = supervised
    client = redis.Redis.from_url(server.url)
    client.set("kept", "yes")
    client.close()
    manifest = next((server.workdir / "appendonlydir").glob("*.manifest"))
    good = manifest.read_bytes()
    old = server.pid
    assert old is not None
    os.kill(old, signal.SIGSTOP)  # hold it while its folder is damaged, so it cannot rewrite the manifest
    manifest.write_bytes(b"not a manifest\n")
    os.kill(old, signal.SIGKILL)
    _wait(lambda: server.restarts >= 3)  # each start failed: the manifest is unreadable
    assert not server.ping()
    manifest.write_bytes(good)
    _wait(server.ping)
    assert not running(old)
    assert redis.Redis.from_url(server.url).get("kept") == b"yes"


def _slow_fsync_server(workdir: Path, port: int, policy: str, fsync_s: float) -> subprocess.Popen:
    """redis-server under strace, each fdatasync delayed `fsync_s`: a disk whose fsync is slow, a fault this machine's
    disk does not produce on its own (strace's fault injection, not a mock of redis)."""
    delay = f"inject=fdatasync:delay_exit={int(fsync_s * 1e6)}"
    return subprocess.Popen(
        ["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=fdatasync", "-e", delay,
         "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
         "--appendfsync", policy, "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
        stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _answered_then_recovered(tmp_path: Path, policy: str, fsync_s: float) -> tuple[int, int]:
    """INCRs for 2.3 s against a slow-fsync server, SIGKILL it, start it again on its folder: (answered, recovered)."""
    workdir = tmp_path / policy
    workdir.mkdir()
    traced = _slow_fsync_server(workdir, port := free_port(), policy, fsync_s)
    try:
        probe = RedisChild(port=port, workdir=workdir, persist=False)
        _wait(probe.ping)
        with Writer(f"redis://127.0.0.1:{port}/0") as writer:
            time.sleep(2.3)  # past two of the once-a-second fsyncs of everysec
            server_pid = int(subprocess.check_output(["pgrep", "-P", str(traced.pid), "redis-server"]).split()[0])
            os.kill(server_pid, signal.SIGKILL)
            traced.wait(10)
            answered = writer.answered
    finally:
        traced.kill()
        traced.wait()
    with RedisChild(port=port, workdir=workdir) as again:
        client = redis.Redis.from_url(again.url)
        recovered = int(client.get("counter") or 0)
        client.close()
    return answered, recovered


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (scripts/ensure-services.sh)")
def test_appendfsync_always_loses_nothing_answered_when_fsync_is_slow_and_everysec_does(tmp_path: Path) -> None:
    """Why the embedded redis-server runs with `appendfsync always` (redis_child.py): with `everysec`, while the
    background fsync runs, redis 7 keeps its writes in memory (up to 2 s) yet answers them. `always` fsyncs before
    each answer (0.3 s each here, so a few answers); `everysec`'s background fsync takes 3 s here, so it is nearly
    always running and the kill finds answered writes that never reached the file."""
    answered, recovered = _answered_then_recovered(tmp_path, "always", fsync_s=0.3)
    assert answered > 0 and recovered >= answered
    answered, recovered = _answered_then_recovered(tmp_path, "everysec", fsync_s=3.0)
    assert answered > 100 and recovered < answered, (answered, recovered)

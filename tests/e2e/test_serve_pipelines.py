"""Pipelines that just run: `loraplex serve --embedded` as a real subprocess (its redis-server, gateway, pool and the
pipelines worker it supervises), driven with the real CLI. Its banner names the worker and /admin; `finetune --wait`
trains on the embedded worker; `pipelines status` takes the 8 characters it prints and says whether a worker is alive;
a worker started by hand with only LORAPLEX_HOME finds the stack's Redis; the embedded worker SIGKILLed is restarted.
And on the session's stack, which runs no pipelines worker, `finetune --wait` says so instead of waiting forever."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis

from loraplex.client import ServiceClient
from loraplex.queue import keys
from loraplex.runtime.netutil import free_port
from loraplex.runtime.redis_home import remembered_url
from tests.helpers.stack import create_tenants

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano"]


class Served:
    def __init__(self, home: Path, port: int, proc: subprocess.Popen, out: Path) -> None:
        self.home, self.port, self.proc, self.out = home, port, proc, out
        self.base_url = f"http://127.0.0.1:{port}"

    def env(self, **extra: str) -> dict[str, str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
        return clean | {"LORAPLEX_HOME": str(self.home), "LORAPLEX_BASE_URL": self.base_url, "PYTHONPATH": str(ROOT),
                        "COLUMNS": "160"} | extra  # fmt: skip

    def cli(self, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "loraplex.launch.cli", *args], env=self.env(**extra),
                              cwd=self.home, capture_output=True, text=True, timeout=180)  # fmt: skip

    def worker_pids(self) -> dict[str, int]:
        """Live pipelines workers' heartbeat names -> pids, read from the stack's Redis (its remembered URL)."""
        client = redis.Redis.from_url(cast(str, remembered_url(self.home)))
        try:
            now_ms = int(time.time() * 1000)
            members = client.zrangebyscore(keys.pipeline_workers(), now_ms, "+inf")
        finally:
            client.close()
        return {m.decode(): int(m.decode().rsplit(" pid ", 1)[1]) for m in members}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("served")
    port = free_port()
    out = home / "serve.out"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env = clean | {"LORAPLEX_HOME": str(home), "LORAPLEX_SLOTS": "4", "LORAPLEX_PIPELINE_WORKER_CONCURRENCY": "2",
                   "LORAPLEX_PIPELINE_WORKER_HEARTBEAT_SECONDS": "0.5", "PYTHONPATH": str(ROOT)}  # fmt: skip
    with open(out, "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "loraplex.launch.cli", "serve", "--embedded", "--port", str(port)],
                                env=env, stdout=stdout, stderr=subprocess.STDOUT)  # fmt: skip
    running = Served(home, port, proc, out)
    try:
        deadline = time.monotonic() + 240
        while "create a tenant" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        yield running
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def key(served: Served) -> str:
    done = served.cli("tenant", "create", "pipeline-team")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def small_config(folder: Path, name: str) -> Path:
    records = [{"prompt": f"reverse {w}:", "completion": f" {w[::-1]}"} for w in WORDS * 2]
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = folder / f"{name}.yaml"
    config.write_text(f"name: {name}\ndataset: {{train: {name}.jsonl, eval_fraction: 0.25, max_tokens: 64}}\n"
                      "epochs: 1\nbatch_size: 4\nlora: {rank: 4}\neval_every: 1\ncheckpoint_every: 2\n"
                      "optimizer: {learning_rate: 1.0e-2, warmup_steps: 1}\n")  # fmt: skip
    return config


def one_line(done: subprocess.CompletedProcess, code: int, *words: str) -> str:
    err = done.stderr.strip()
    assert done.returncode == code, done.stdout + done.stderr
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    return err


def test_the_banner_names_the_pipelines_worker_and_the_admin(served: Served) -> None:
    banner = served.out.read_text()
    assert f"{served.base_url}/admin" in banner and "loraplex admin create" in banner
    assert "pipelines: a worker running up to 2 at once" in banner
    assert (served.home / "logs" / "pipelines.log").exists()
    assert len(served.worker_pids()) == 1


def test_finetune_runs_on_the_embedded_worker_and_status_takes_the_ids_it_prints(served: Served, key: str) -> None:
    done = served.cli("finetune", str(small_config(served.home, "reverse")), "--wait", LORAPLEX_API_KEY=key)
    assert done.returncode == 0, done.stdout + done.stderr
    pipeline_id = re.findall(r"pipeline (\S+) \(reverse\) queued", done.stdout)[0]
    listed = served.cli("pipelines", "status", LORAPLEX_API_KEY=key)
    assert listed.returncode == 0 and pipeline_id[:8] in listed.stdout, listed.stdout + listed.stderr
    assert "pipelines workers alive: 1" in listed.stdout
    one = served.cli("pipelines", "status", pipeline_id[:8], LORAPLEX_API_KEY=key)
    assert one.returncode == 0 and f"pipeline-{pipeline_id}" in one.stdout, one.stdout + one.stderr  # its adapter
    one_line(served.cli("pipelines", "status", "ffffffff", LORAPLEX_API_KEY=key), 2, "'ffffffff'")


def test_a_worker_started_by_hand_finds_the_stacks_redis_from_its_home(served: Served, key: str) -> None:
    env = served.env()  # LORAPLEX_HOME only: no LORAPLEX_REDIS_URL
    proc = subprocess.Popen([sys.executable, "-m", "loraplex.launch.cli", "pipelines", "worker", "--concurrency", "1"],
                            env=env, cwd=served.home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        with ServiceClient(served.base_url, key) as client:
            wait_for(lambda: client.pipelines.workers()["alive"] == 2, 60, "the hand-started worker's heartbeat")
            assert proc.pid in served.worker_pids().values()
            proc.send_signal(signal.SIGTERM)  # Celery's warm shutdown: it leaves at once
            assert proc.wait(timeout=30) == 0
            assert client.pipelines.workers()["alive"] == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_embedded_worker_is_restarted_when_it_dies(served: Served) -> None:
    (old,) = served.worker_pids().values()
    os.kill(old, signal.SIGKILL)
    new = wait_for(lambda: [p for p in served.worker_pids().values() if p != old], 60, "a restarted pipelines worker")
    assert len(new) == 1


def test_finetune_wait_says_when_no_worker_is_alive(stack, tmp_path: Path) -> None:
    """The session's stack runs no pipelines worker (the pipeline tests start their own)."""
    redis.Redis.from_url(stack.settings.redis_url).delete(keys.pipeline_workers())  # leftovers of killed test workers
    (key,) = create_tenants(stack, "no-worker").values()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")} | {
        "LORAPLEX_BASE_URL": stack.base_url, "LORAPLEX_API_KEY": key, "PYTHONPATH": str(ROOT)}  # fmt: skip

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "loraplex.launch.cli", *args], env=env, capture_output=True,
                              text=True, timeout=120)  # fmt: skip

    started = time.monotonic()
    done = cli("finetune", str(small_config(tmp_path, "orphan")), "--wait", "--worker-wait", "1")
    one_line(done, 3, "no pipelines worker", "loraplex pipelines worker")
    assert time.monotonic() - started < 60
    pipeline_id = re.findall(r"pipeline (\S+) \(orphan\) queued", done.stdout)[0]
    cancelled = cli("pipelines", "cancel", pipeline_id[:8])  # nothing runs it later: a worker would find it cancelled
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr

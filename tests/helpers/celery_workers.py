"""Real Celery worker processes for the pipeline tests: `celery -A loraplex.pipelines.app:celery_app worker` (the
command compose runs) as a child in its own process group, with the stack's LORAPLEX_* environment, its log in a
file; `kill()` SIGKILLs the whole group (a worker dying mid-pipeline), `stop()` ends it politely."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

CELERY_APP = "loraplex.pipelines.app:celery_app"


class CeleryWorker:
    def __init__(
        self, name: str, env: dict[str, str], log_dir: Path, concurrency: int = 6, pool: str = "threads"
    ) -> None:
        self.name = name
        self.pool = pool
        self.env = env
        self.log_path = log_dir / f"celery-{name}.log"
        self.concurrency = concurrency
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> CeleryWorker:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child's for its lifetime
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", CELERY_APP, "worker", f"--pool={self.pool}",
             f"--concurrency={self.concurrency}", "-n", f"{self.name}@%h", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "--loglevel=INFO"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        _wait_for_line(self.proc, self.log_path, b"ready.", f"celery worker {self.name}", timeout_s, self.log_tail)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the worker's whole process group: nothing acks, nothing releases its leases."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()


class CeleryBeat(CeleryWorker):
    """`celery -A loraplex.pipelines.app:celery_app beat` (the schedule: retention, missed exports), its schedule
    file in the log folder."""

    def start(self, timeout_s: float = 60.0) -> CeleryBeat:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child's for its lifetime
        schedule = self.log_path.with_suffix(".schedule")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", CELERY_APP, "beat", "--schedule", str(schedule), "--loglevel=INFO"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        _wait_for_line(self.proc, self.log_path, b"beat: Starting", "celery beat", timeout_s, self.log_tail)
        return self


def _wait_for_line(proc: subprocess.Popen, log_path: Path, marker: bytes, what: str, timeout_s: float,
                   tail: Callable[[], str]) -> None:  # fmt: skip
    """Until `marker` shows in the child's log; RuntimeError if it exits first, TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {tail()}")
        if marker in log_path.read_bytes():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout_s} s: {tail()}")

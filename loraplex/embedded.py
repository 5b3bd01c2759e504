"""The embedded stack on one machine: a redis-server child (unless LORAPLEX_REDIS_URL is set), the database migrated,
one worker pool process (dispatcher + rank 0), and the gateway under uvicorn. Every child is stopped on exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loraplex.redis_child import RedisChild
from loraplex.settings import Settings
from loraplex.storage.db import migrate


class Stack:
    def __init__(self, settings: Settings, *, api_port: int | None = None, api_in_child: bool = True) -> None:
        self.settings = settings
        self.api_port = api_port or settings.api_port
        self.api_in_child = api_in_child
        self.redis: RedisChild | None = None
        self.children: list[subprocess.Popen] = []
        self.log_dir = settings.home / "logs"

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.api_host}:{self.api_port}"

    def child_env(self) -> dict[str, str]:
        """The environment of the stack's children: every setting of this stack as a LORAPLEX_* variable (so a
        Settings object built in code reaches the pool and the gateway whole), paths resolved."""
        env = dict(os.environ)
        s = self.settings.model_copy(
            update={
                "database_url": self.settings.resolved_database_url,
                "blob_root": self.settings.resolved_blob_root,
                "model_cache": self.settings.resolved_model_cache,
                "spill_dir": self.settings.spill_dir or self.settings.home / "spill",
                "api_port": self.api_port,
            }
        )
        for name in type(s).model_fields:
            value = getattr(s, name)
            if value is None:
                continue
            env[f"LORAPLEX_{name.upper()}"] = ",".join(value) if isinstance(value, tuple) else str(value)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
        env = self.child_env() | (extra_env or {})
        proc = subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        self.children.append(proc)
        return proc

    def start(self, timeout_s: float = 180.0) -> Stack:
        self.settings.home.mkdir(parents=True, exist_ok=True)
        try:
            if not self.settings.redis_url:
                self.redis = RedisChild(workdir=self.settings.home / "redis").start()
                self.settings = self.settings.model_copy(update={"redis_url": self.redis.url})
            migrate(self.settings.resolved_database_url)
            pool = self._spawn("pool", ["-m", "loraplex.pool_process"])
            if self.api_in_child:
                workers = self.settings.resolved_api_workers
                self._spawn(
                    "api",
                    ["-m", "uvicorn", "loraplex.gateway:app", "--host", self.settings.api_host,
                     "--port", str(self.api_port), "--log-level", "warning", "--workers", str(workers)],
                    gateway_metrics_env(self.settings, self.api_port, workers),
                )  # fmt: skip
                self._wait_http(timeout_s)
            self._wait_pool_ready(pool, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_http(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            try:
                if httpx.get(f"{self.base_url}/v1/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.1)
        raise TimeoutError(f"gateway did not answer on {self.base_url}; see {self.log_dir / 'api.log'}")

    def _wait_pool_ready(self, pool: subprocess.Popen, timeout_s: float) -> None:
        ready = ready_file(self.settings)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            if ready.exists() and ready.read_text().strip() == str(pool.pid):
                return
            time.sleep(0.1)
        raise TimeoutError(f"worker pool not ready after {timeout_s} s; see {self.log_dir / 'pool.log'}")

    def check_children(self) -> None:
        for proc in self.children:
            if proc.poll() is not None:
                args = proc.args  # the list _spawn passed: [python, "-m", module, ...]
                which = args[1:3] if isinstance(args, list) else args
                raise RuntimeError(f"child {which!r} exited with {proc.returncode}; logs in {self.log_dir}")

    def stop(self) -> None:
        for proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.children):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.children.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def gateway_metrics_env(settings: Settings, port: int, workers: int) -> dict[str, str]:
    """With several gateway workers, a folder where they share their metrics (api/metrics.py), emptied now."""
    from loraplex.api.metrics import multiprocess_env

    return multiprocess_env(settings.home / "metrics" / f"gateway-{port}", workers)


def ready_file(settings: Settings) -> Path:
    """Written by the pool process (its pid) once the model is loaded and the dispatcher is reading."""
    return settings.home / f"pool-{settings.pool}.ready"

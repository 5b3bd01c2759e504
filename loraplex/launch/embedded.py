"""The embedded stack on one machine: a redis-server child (unless LORAPLEX_REDIS_URL is set; with an append-only
file, redis_child.py), the database migrated, one worker pool process (dispatcher + rank 0), and the gateway under
uvicorn. Once up, a supervisor thread (supervisor.py; setting `supervise`) restarts the redis-server, the pool or the
gateway when it dies, while the rest keeps running: a restarted redis-server loads its append-only file on the same
port (the pool and the gateway retry until it answers), a restarted pool adopts its adapters from their durable
snapshots and request logs (pool/durable/recovery.py), so clients only see latency. Every child is stopped on exit
(its whole process group), redis-server last."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loraplex.pool.ready import ready_file
from loraplex.runtime.redis_child import RedisChild
from loraplex.runtime.supervisor import Child, Supervised, Supervisor
from loraplex.settings import Settings
from loraplex.storage.db import migrate


class Stack:
    def __init__(self, settings: Settings, *, api_port: int | None = None, api_in_child: bool = True) -> None:
        self.settings = settings
        self.api_port = api_port or settings.api_port
        self.api_in_child = api_in_child
        self.redis: RedisChild | None = None
        self._children: list[Child] = []
        self.supervisor: Supervisor | None = None
        self.log_dir = settings.home / "logs"

    @property
    def children(self) -> list[subprocess.Popen]:
        """The running processes, pool first (a restarted child's new process takes its place)."""
        return [c.proc for c in self._children if c.proc is not None]

    def child(self, name: str) -> Supervised:
        """"pool", "api" or "redis" (the stack's own redis-server): the supervised child (its `proc`, `pid`,
        `restarts`; a restarted child's new process takes its place)."""
        if name == "redis":
            if self.redis is None:
                raise LookupError("this stack runs no redis-server of its own (LORAPLEX_REDIS_URL is set)")
            return self.redis
        return next(c for c in self._children if c.name == name)

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
                "tokenizer_id": self.settings.tokenizer_id or local_tokenizer_folder(self.settings),
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
        env = self.child_env() | (extra_env or {})
        child = Child(name, [sys.executable, *args], env, self.log_dir / f"{name}.log")
        self._children.append(child)
        return child.start()

    def start(self, timeout_s: float = 180.0) -> Stack:
        self.settings.home.mkdir(parents=True, exist_ok=True)
        try:
            if not self.settings.redis_url:
                self.redis = RedisChild(workdir=self.settings.home / "redis",
                                        appendfsync=self.settings.redis_appendfsync).start()  # fmt: skip
                self.settings = self.settings.model_copy(update={"redis_url": self.redis.url})
            migrate(self.settings.resolved_database_url)
            pool = self._spawn("pool", ["-m", "loraplex.pool.process"])
            if self.api_in_child:
                workers = self.settings.resolved_api_workers
                self._spawn(
                    "api",
                    ["-m", "uvicorn", "loraplex.launch.gateway:app", "--host", self.settings.api_host,
                     "--port", str(self.api_port), "--log-level", "warning", "--workers", str(workers)],
                    gateway_metrics_env(self.settings, self.api_port, workers),
                )  # fmt: skip
                self._wait_http(timeout_s)
            self._wait_pool_ready(pool, timeout_s)
            if self.settings.supervise:
                watched: list[Supervised] = [*([self.redis] if self.redis is not None else []), *self._children]
                self.supervisor = Supervisor(watched, backoff_s=self.settings.restart_backoff_seconds).start()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_pool_ready(self, timeout_s: float = 180.0) -> None:
        """Wait until the current pool process (a restarted one too) has written its ready file."""
        self._wait_pool_ready(self.child("pool").proc, timeout_s)

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

    def _wait_pool_ready(self, pool: subprocess.Popen | None, timeout_s: float) -> None:
        ready = ready_file(self.settings)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            if self.supervisor is not None:  # the child restarts: follow its current process
                pool = self.child("pool").proc
            try:
                if pool is not None and ready.read_text().strip() == str(pool.pid):
                    return
            except FileNotFoundError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"worker pool not ready after {timeout_s} s; see {self.log_dir / 'pool.log'}")

    def check_children(self) -> None:
        """Raise when a child has exited (while starting, or when nothing restarts it)."""
        if self.supervisor is not None:
            return
        if self.redis is not None and self.redis.proc is not None and not self.redis.alive():
            raise RuntimeError(
                f"redis-server exited with {self.redis.proc.returncode}; see {self.redis.workdir}/redis.log"
            )
        for proc in self.children:
            if proc.poll() is not None:
                args = proc.args  # the list _spawn passed: [python, "-m", module, ...]
                which = args[1:3] if isinstance(args, list) else args
                raise RuntimeError(f"child {which!r} exited with {proc.returncode}; logs in {self.log_dir}")

    def stop(self) -> None:
        supervisor, self.supervisor = self.supervisor, None
        if supervisor is not None:
            supervisor.stop(self._stop_children)  # its thread outlives them (supervisor.py's doc)
        else:
            self._stop_children()

    def _stop_children(self) -> None:
        for child in reversed(self._children):  # SIGTERM to all first: the gateway and the pool stop side by side
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in reversed(self._children):
            child.stop()
        self._children.clear()
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


def local_tokenizer_folder(settings: Settings) -> str:
    """The base model's folder, for Tinker's get_info to name as the tokenizer (so the SDK's `get_tokenizer()` loads it
    offline), when every client shares this machine: a gateway on a loopback address, whose tenants can read its
    folders anyway. Anywhere else "" (get_info then answers a name, never a server path: api/tinker/model_info.py)."""
    if settings.api_host not in ("127.0.0.1", "localhost", "::1"):
        return ""
    given = Path(settings.base_model).expanduser()
    return str(given.resolve() if given.is_dir() else settings.resolved_model_cache / settings.base_model)

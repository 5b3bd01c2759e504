"""The embedded stack on one machine: a redis-server child (unless LORAPLEX_REDIS_URL is set; with an append-only
file, redis_child.py), the database migrated, one worker pool process (dispatcher + rank 0) per base model asked for
(`pool_models`; default one, of settings.base_model), the gateway under uvicorn, and with `pipeline_worker` a
Celery worker of the pipelines (launch/pipeline_worker.py, with the beat). The redis-server listens on the port
remembered in the home folder (runtime/redis_home.py), so a worker started by hand finds it. Once up, a supervisor
thread (supervisor.py; setting `supervise`) restarts the redis-server, a pool, the gateway or the pipelines worker
when it dies, while the rest keeps running: a restarted redis-server loads its append-only file on the same port (the pools and the gateway retry
until it answers), a restarted pool adopts its adapters from their durable snapshots and request logs
(pool/durable/recovery.py), so clients only see latency. Every child is stopped on exit (its whole process group),
redis-server last."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from loraplex.launch.pipeline_worker import celery_worker_argv, wait_worker_alive
from loraplex.pool.ready import ready_file
from loraplex.runtime.redis_child import RedisChild
from loraplex.runtime.redis_home import embedded_redis_port
from loraplex.runtime.supervisor import Child, Supervised, Supervisor
from loraplex.settings import Settings
from loraplex.storage.db import migrate


class Stack:
    def __init__(
        self,
        settings: Settings,
        *,
        api_port: int | None = None,
        api_in_child: bool = True,
        pool_models: Sequence[str] = (),
        pipeline_worker: bool = False,
    ) -> None:
        """pool_models: the base model of each pool, one pool process each (a model may repeat: two pools of it). The
        first pool is settings.pool (child "pool") and its model the gateway's settings.base_model; the others are
        named `<pool>-2`, `<pool>-3`, ... (children "pool-<name>"). Empty: one pool of settings.base_model.
        pipeline_worker: also run a pipelines worker (child "pipelines"; `serve --embedded` asks for it unless the
        setting `embedded_pipeline_worker` is off; the tests run their own)."""
        models = list(pool_models) or [settings.base_model]
        self.settings = settings.model_copy(update={"base_model": models[0]})
        self.pools = pool_layout(self.settings, models)
        self.api_port = api_port or settings.api_port
        self.api_in_child = api_in_child
        self.pipeline_worker = pipeline_worker
        self.redis: RedisChild | None = None
        self._children: list[Child] = []
        self.supervisor: Supervisor | None = None
        self.log_dir = settings.home / "logs"

    @property
    def children(self) -> list[subprocess.Popen]:
        """The running processes, pool first (a restarted child's new process takes its place)."""
        return [c.proc for c in self._children if c.proc is not None]

    def child(self, name: str) -> Supervised:
        """ "pool", "pool-<name>" (a further pool), "api" or "redis" (the stack's own redis-server): the supervised
        child (its `proc`, `pid`, `restarts`; a restarted child's new process takes its place)."""
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
                self.redis = RedisChild(embedded_redis_port(self.settings.home), workdir=self.settings.home / "redis",
                                        appendfsync=self.settings.redis_appendfsync).start()  # fmt: skip
                self.settings = self.settings.model_copy(update={"redis_url": self.redis.url})
            migrate(self.settings.resolved_database_url)
            for child, pool_env in self.pools.items():
                self._spawn(child, ["-m", "loraplex.pool.process"], pool_env)
            if self.api_in_child:
                workers = self.settings.resolved_api_workers
                self._spawn(
                    "api",
                    ["-m", "uvicorn", "loraplex.launch.gateway:app", "--host", self.settings.api_host,
                     "--port", str(self.api_port), "--log-level", "warning", "--workers", str(workers)],
                    gateway_metrics_env(self.settings, self.api_port, workers),
                )  # fmt: skip
                self._wait_http(timeout_s)
            if self.pipeline_worker:
                node = f"pipelines-{self.api_port}"  # one per stack on this host: Celery's node names must differ
                argv = celery_worker_argv(node, self.settings.pipeline_worker_concurrency,
                                          self.settings.home / "pipelines-beat-schedule")  # fmt: skip
                worker = self._spawn("pipelines", argv[1:])
            for child, pool_env in self.pools.items():
                self._wait_pool_ready(child, pool_env["LORAPLEX_POOL"], timeout_s)
            if self.pipeline_worker:
                wait_worker_alive(self.settings.redis_url, worker.pid, timeout_s, self.check_children)
            if self.settings.supervise:
                watched: list[Supervised] = [*([self.redis] if self.redis is not None else []), *self._children]
                self.supervisor = Supervisor(watched, backoff_s=self.settings.restart_backoff_seconds).start()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_pool_ready(self, timeout_s: float = 180.0, child: str = "pool") -> None:
        """Wait until the pool's current process (a restarted one too) has written its ready file."""
        self._wait_pool_ready(child, self.pools[child]["LORAPLEX_POOL"], timeout_s)

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

    def _wait_pool_ready(self, child: str, pool_name: str, timeout_s: float) -> None:
        ready = ready_file(self.settings.model_copy(update={"pool": pool_name}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            pool = self.child(child).proc  # a restarted child's current process
            try:
                if pool is not None and ready.read_text().strip() == str(pool.pid):
                    return
            except FileNotFoundError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"worker pool {pool_name} not ready after {timeout_s} s; see {self.log_dir / child}.log")

    def check_children(self) -> None:
        """Raise when a child has exited (while starting, or when nothing restarts it)."""
        if self.supervisor is not None:
            return
        if self.redis is not None and self.redis.proc is not None and not self.redis.alive():
            raise RuntimeError(
                f"redis-server exited with {self.redis.proc.returncode}; see {self.redis.workdir}/redis.log"
            )
        for child in self._children:
            if child.proc is not None and child.proc.poll() is not None:
                log = self.log_dir / f"{child.name}.log"
                raise RuntimeError(f"the {child.name} process exited with {child.proc.returncode}: "
                                   f"{last_line(log) or 'no output'} (its log: {log})")  # fmt: skip

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


def pool_layout(settings: Settings, models: Sequence[str]) -> dict[str, dict[str, str]]:
    """Child name -> the environment that makes it that pool: its name and base model (and its own metrics port, the
    next ones after settings' when that is set), the first pool being settings.pool as child "pool"."""
    layout: dict[str, dict[str, str]] = {}
    for i, model in enumerate(models):
        name = settings.pool if i == 0 else f"{settings.pool}-{i + 1}"
        env = {"LORAPLEX_POOL": name, "LORAPLEX_BASE_MODEL": model}
        if settings.pool_metrics_port:
            env["LORAPLEX_POOL_METRICS_PORT"] = str(settings.pool_metrics_port + i)
        layout["pool" if i == 0 else f"pool-{name}"] = env
    return layout


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


def last_line(path: Path) -> str:
    """The last non-empty line of a child's log (what it said before it exited), at most 300 characters."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""

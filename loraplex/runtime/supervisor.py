"""Child processes that are restarted when they die: the embedded stack's redis-server (redis_child.py), pool and
gateway (embedded.py), and the pool under `loraplex worker` (cli.py).

Each child runs in its own process group, so whatever it started (a multi-rank pool's ranks, uvicorn's workers, a vLLM
server) is killed with it: when a child is found dead its group is SIGKILLed before the new one starts (nothing
orphaned keeps a port or a GPU), a child gets SIGTERM when its parent dies (`die_with_parent`: the stack's process
SIGKILLed leaves nothing running), and `stop` sends SIGTERM to the child, then SIGKILL to its group. A child
that dies again within `STABLE_S` of its start waits twice as long before the next start (from `backoff_s`, at most
MAX_BACKOFF_S), so a child that cannot start does not spin.

PR_SET_PDEATHSIG follows the *thread* that forked a child: a child restarted by the watching thread gets SIGTERM when
that thread ends. So `Supervisor.stop` keeps the thread alive until the caller has stopped the children in its own
order (the stack stops its pool and gateway before the redis-server they write to).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

log = logging.getLogger("loraplex.runtime.supervisor")

STABLE_S = 60.0
MAX_BACKOFF_S = 30.0
PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """In a forked child before exec (Popen's preexec_fn): SIGTERM it when the thread that started it dies, e.g. the
    embedded stack SIGKILLed (Linux only; elsewhere a no-op). SIGTERM, not SIGKILL: a pool still finishes its plan
    and writes its snapshots, redis-server flushes its append-only file. (A pool's follower ranks ask for SIGKILL:
    they hold nothing of their own and sit in a collective the dead leader will never join.)"""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        pass


class Supervised(Protocol):
    """What the supervisor needs of a child: a `Child` below, or a `RedisChild`."""

    name: str
    restarts: int
    started_at: float

    @property
    def proc(self) -> subprocess.Popen | None: ...

    @property
    def pid(self) -> int | None: ...

    def alive(self) -> bool: ...

    def kill_group(self) -> None: ...

    def respawn(self) -> None:
        """Start the process again, the same way, without waiting for it to be ready (a process that cannot start
        dies, and is restarted with the backoff)."""
        ...


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path | None = None) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None  # a plain attribute: the protocol's read-only property is satisfied
        self.restarts = 0
        self.started_at = 0.0
        self._log_file: BinaryIO | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> subprocess.Popen:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        out = self._log_file if self._log_file is not None else None
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     start_new_session=True, preexec_fn=die_with_parent)  # fmt: skip
        self.started_at = time.monotonic()
        return self.proc

    def respawn(self) -> None:
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill_group(self) -> None:
        """SIGKILL what is left of the child's process group (it died; its own children may live on), and reap it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the child (it stops what it started: a pool its ranks, uvicorn its workers), then SIGKILL to
        whatever is left of its group once it exited or after `grace_s`; reaped."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        self.kill_group()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


class Supervisor:
    """Watches children in a thread and restarts each that dies (until `stop`)."""

    def __init__(self, children: list[Supervised], backoff_s: float = 0.5, poll_s: float = 0.2,
                 on_restart: Callable[[Supervised], None] | None = None) -> None:  # fmt: skip
        self.children = children
        self.backoff_s = backoff_s
        self.poll_s = poll_s
        self.on_restart = on_restart
        self._stop = threading.Event()
        self._watching_done = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._next_wait = {c.name: backoff_s for c in children}

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.poll_s):
                for child in self.children:
                    if self._stop.is_set():
                        break
                    if child.proc is not None and not child.alive():
                        self.restart(child)
        finally:
            self._watching_done.set()
        self._release.wait()  # the children this thread started live until the caller stopped them (module doc)

    def restart(self, child: Supervised) -> None:
        code = child.proc.returncode if child.proc is not None else None
        child.kill_group()  # and reaps it: no zombie is left while it waits
        quick = time.monotonic() - child.started_at < STABLE_S
        wait = self._next_wait[child.name] if quick else self.backoff_s
        self._next_wait[child.name] = min(MAX_BACKOFF_S, max(wait, 0.1) * 2) if quick else self.backoff_s
        log.error("%s process (pid %s) exited with %s; restarting it in %.1f s", child.name, child.pid, code, wait)
        if self._stop.wait(wait):
            return
        child.restarts += 1
        try:
            child.respawn()
        except Exception:  # e.g. the executable is gone: logged, and tried again after the next backoff
            log.exception("%s process could not be started", child.name)
            child.started_at = time.monotonic()
            return
        if self.on_restart is not None:
            self.on_restart(child)

    def stop(self, stop_children: Callable[[], None] | None = None) -> None:
        """No more restarts (a restart in progress finishes first); then `stop_children` runs while the watching
        thread still lives, so the children it restarted are stopped in the caller's order, not by their parent-death
        signal; then the thread ends."""
        self._stop.set()
        if self._thread.is_alive():
            self._watching_done.wait(timeout=60)
        try:
            if stop_children is not None:
                stop_children()
        finally:
            self._release.set()
            if self._thread.is_alive():
                self._thread.join(timeout=60)

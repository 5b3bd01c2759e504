"""compose-check's training phase against the stack compose_pod.py brought up: a tenant made with the CLI inside the
api container trains through the Tinker SDK while the pool container is SIGKILLed twice, and nothing is lost.

  kill 1  `podman kill -s KILL` of the pool container. podman, like Docker, counts a kill it was asked for as the
          operator's stop, so no restart policy restarts it: this script does (`podman start`), as an operator or
          an orchestrator would.
  kill 2  SIGKILL of the container's main process from outside the engine, as the OOM killer or a crash ends it:
          compose.yaml's `restart: unless-stopped` applies and podman restarts it; this script only watches.

The pool's healthcheck (its ready file) is no evidence here: the file of the killed process stays in the volume.
Training is: the first step submitted after each kill, answered by the restarted pool. Then every future has resolved, the adapter's applied seq_id (in the database) is exactly create + 2 per step + the
save, and the losses equal those of a second adapter trained on the same data afterwards with no fault.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compose_pod import Pod, podman, wait_for  # noqa: E402 - beside this file, not a package

POOL = "pool-cpu"
ADAM = types.AdamParams(learning_rate=1e-2)
WINDOW = 2  # optimizer steps in flight at once, so requests are queued when the pool dies


def batch(step: int) -> list[types.Datum]:
    rng = np.random.default_rng(step)
    data = []
    for _ in range(4):
        tokens = rng.integers(3, 250, size=17).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 16}))  # fmt: skip
    return data


def create_tenant(pod: Pod, name: str) -> str:
    """A tenant and its API key through the CLI in the api container (the key is its last line of output)."""
    out = podman("exec", pod.container("api"), "loraplex", "tenant", "create", name).stdout
    return out.strip().splitlines()[-1]


def applied_seq_id(pod: Pod, model_id: str) -> int | None:
    """The adapter's applied seq_id, read in the api container (the database is reachable from the pod only)."""
    code = ("import sys; from loraplex.settings import get_settings; "
            "from loraplex.storage.db import make_db_engine, session_factory; "
            "from loraplex.storage.repositories.pools import PoolRepository; "
            "s = session_factory(make_db_engine(get_settings().resolved_database_url))(); "
            "print(PoolRepository(s).applied_seq_id(sys.argv[1]))")  # fmt: skip
    out = podman("exec", pod.container("api"), "python", "-c", code, model_id).stdout.strip().splitlines()[-1]
    return None if out == "None" else int(out)


def train(client: Any, steps: int, at_step: dict[int, Any]) -> tuple[list[float], list[float]]:
    """`steps` forward_backward + optim_step rounds, WINDOW in flight; `at_step[k]()` runs once step k is answered.
    Each step's loss:sum and the time its optim_step was answered."""
    pending: list[tuple[int, Any, Any]] = []
    losses: list[float] = []
    answered: list[float] = []

    def collect(keep: int) -> None:
        while len(pending) > keep:
            k, fb, optim = pending.pop(0)
            losses.append(fb.result().metrics["loss:sum"])
            optim.result()
            answered.append(time.monotonic())
            if k in at_step:
                at_step[k]()

    for k in range(steps):
        pending.append((k, client.forward_backward(batch(k), "cross_entropy"), client.optim_step(ADAM)))
        collect(WINDOW)
    collect(0)
    return losses, answered


class PoolKiller:
    """The two kills, each in a thread of its own so that training goes on submitting and waiting meanwhile."""

    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.report: list[str] = []
        self.kills: list[tuple[str, float]] = []  # (what, when)

    def _thread(self, work: Any) -> None:
        def guarded() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - reported by join()
                self.errors.append(exc)

        thread = threading.Thread(target=guarded, daemon=True)
        thread.start()
        self.threads.append(thread)

    def podman_kill(self) -> None:
        before = self.pod.state(POOL)
        podman("kill", "-s", "KILL", self.pod.container(POOL))
        killed = time.monotonic()
        self.kills.append(("kill 1", killed))

        def restart() -> None:
            wait_for("pool container exited", lambda: not self.pod.state(POOL)["running"], 30, 0.2)
            time.sleep(3)  # would podman restart it by itself? (it does not: a kill asked for is a stop)
            after = self.pod.state(POOL)
            by = "podman's restart policy" if after["running"] else "this script (podman start)"
            if not after["running"]:
                podman("start", self.pod.container(POOL))
            self.report.append(f"kill 1 (podman kill -s KILL, pid {before['pid']}): restarted by {by}, running "
                               f"{time.monotonic() - killed:.1f} s after the kill")  # fmt: skip

        self._thread(restart)

    def crash(self) -> None:
        before = self.pod.state(POOL)
        os.kill(before["pid"], signal.SIGKILL)  # the container's main process, from outside the engine
        killed = time.monotonic()
        self.kills.append(("kill 2", killed))

        def watch() -> None:
            def restarted() -> bool:
                state = self.pod.state(POOL)
                return state["running"] and state["restarts"] > before["restarts"] and state["pid"] != before["pid"]

            wait_for("podman restarting the pool container", restarted, 120, 0.2)
            self.report.append(f"kill 2 (SIGKILL of pid {before['pid']} from outside podman): restarted by podman's "
                               f"restart policy (unless-stopped), running {time.monotonic() - killed:.1f} s after")  # fmt: skip

        self._thread(watch)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=600)
        if self.errors:
            raise self.errors[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--project", required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    pod = Pod(args.project, {}, {})
    pod.services = {
        POOL: {"healthcheck": {"test": ["CMD-SHELL", 'test -f "$LORAPLEX_HOME/pool-$LORAPLEX_POOL.ready"']}}
    }
    start = time.monotonic()
    key = create_tenant(pod, "compose-check")
    sdk = tinker.ServiceClient(base_url=args.base_url, api_key=key)
    killer = PoolKiller(pod)
    try:
        client = sdk.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
        third = args.steps // 3
        losses, answered = train(client, args.steps, {third: killer.podman_kill, 2 * third: killer.crash})
        client.save_state("after-kills").result()
        killer.join()
        faulted = time.monotonic() - start
        reference = sdk.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
        want, _ = train(reference, args.steps, {})
        applied = applied_seq_id(pod, client.model_id)
    finally:
        sdk.close("success").result()
    print(*killer.report, sep="\n")
    for (what, killed), step in zip(killer.kills, (third, 2 * third), strict=True):
        # The first step submitted after the kill is one the restarted pool computed.
        resumed = step + WINDOW + 1
        print(f"{what}: step {resumed} (the first submitted after it) answered {answered[resumed] - killed:.1f} s "
              "after the kill")  # fmt: skip
    print(f"trained {args.steps} steps through 2 pool kills in {faulted:.1f} s; the same steps with no fault after")
    assert applied == 2 * args.steps + 1, (
        f"applied seq_id {applied}, want {2 * args.steps + 1} (create, 2 per step, save)"
    )
    worst = max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(losses, want, strict=True))
    assert worst <= 1e-5, f"losses differ from the fault-free run's by {worst:.2e}: {losses} vs {want}"
    print(f"nothing lost: every future resolved, applied seq_id {applied} = 2 x {args.steps} steps + create + save, "
          f"losses equal the fault-free run's (largest relative difference {worst:.1e})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

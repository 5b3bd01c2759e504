"""The security suite's harness: a real embedded stack (redis-server child, SQLite, gateway, one CPU pool on the tiny
model) with the settings a test needs, and a Victim: a second tenant training in a closed loop whose step latency
shows whether an attack took the service away from it.

A scenario measures the victim alone first, then while the attack runs, and checks its median and p90 stay under
`factor` x its median alone (the bound: 2x), its p90 a looser bound. Latency is a closed-loop step (forward_backward + optim_step of a
small datum, both results awaited), as a researcher's training loop sees it."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loraplex.client import Datum, ServiceClient
from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from tests.helpers.stack import create_tenants

# A step of one small datum: ~20 ms alone on the CPU tiny model, so a stall of one plan shows plainly.
VICTIM_TOKENS = 24


@contextmanager
def running_stack(home: Path, **overrides: Any) -> Iterator[Stack]:
    """An embedded stack under `home` with these Settings overrides (small limits, say); stopped on exit."""
    settings = Settings(home=home, slots=4, max_rank=16, **overrides)
    with Stack(settings, api_port=free_port()) as stack:
        yield stack


def tenant_key(stack: Stack, name: str) -> str:
    """A new tenant's API key."""
    return create_tenants(stack, name)[name]


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class Victim:
    """Tenant B: one adapter, trained one closed-loop step at a time."""

    def __init__(self, stack: Stack, name: str = "victim") -> None:
        self.client = ServiceClient(stack.base_url, tenant_key(stack, name))
        self.trainer = self.client.create_lora_training_client(rank=4, seed=7)
        self._datum = Datum.for_next_token([(5 * i) % 200 + 10 for i in range(VICTIM_TOKENS)])
        self.step()  # the first step warms the pool's caches for this adapter

    def step(self) -> float:
        """Seconds of one forward_backward + optim_step, both results awaited."""
        start = time.perf_counter()
        fb = self.trainer.forward_backward([self._datum])
        opt = self.trainer.optim_step({"learning_rate": 1e-4})
        fb.result()
        opt.result()
        return time.perf_counter() - start

    def alone(self, n: int = 10) -> list[float]:
        return [self.step() for _ in range(n)]

    @contextmanager
    def training(self, min_steps: int = 5) -> Iterator[list[float]]:
        """Train in a background thread while the body runs; yields the list its step latencies go into. On exit it
        goes on until it has `min_steps` steps, so a short attack still gets a sample."""
        latencies: list[float] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def loop() -> None:
            try:
                while not stop.is_set() or len(latencies) < min_steps:
                    latencies.append(self.step())
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread below
                errors.append(exc)

        thread = threading.Thread(target=loop, name="victim", daemon=True)
        thread.start()
        try:
            yield latencies
        finally:
            stop.set()
            thread.join(timeout=300)
        if errors:
            raise AssertionError(f"the victim's training failed during the attack: {errors[0]!r}") from errors[0]

    def close(self) -> None:
        self.client.close()


def run_attackers(attack: Callable[..., None], args: list[tuple[Any, ...]], seconds: float, stop: threading.Event) -> None:
    """One thread per `args` tuple running `attack(*args)` (each watches `stop`), for `seconds`; then `stop` is set and
    they are joined."""
    threads = [threading.Thread(target=attack, args=a, daemon=True) for a in args]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=30)


def check_victim(
    alone: list[float],
    during: list[float],
    factor: float = 2.0,
    tail_factor: float = 3.0,
    label: str = "",
    alone_after: list[float] | None = None,
) -> dict[str, float]:
    """Assert the victim's median step during an attack stays under `factor` x its median alone (the bound),
    and its p90 under `tail_factor` x (the attack's clients share this machine's two cores with the stack, which
    alone moves the p90 of an idle stack to ~1.9x); returns (and prints) the figures, milliseconds. `alone_after`:
    the victim alone again once the attack has ended; the baseline is then the slower of the two medians, so a
    machine that got busier meanwhile (other processes on a CI runner) is not counted as the attack's doing."""
    base = max(statistics.median(alone), statistics.median(alone_after)) if alone_after else statistics.median(alone)
    figures = {
        "alone_median_ms": 1000 * base,
        "during_median_ms": 1000 * statistics.median(during),
        "during_p90_ms": 1000 * p90(during),
        "during_max_ms": 1000 * max(during),
        "steps_during": float(len(during)),
    }
    print(f"victim {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    assert figures["during_median_ms"] <= factor * figures["alone_median_ms"], figures
    assert figures["during_p90_ms"] <= tail_factor * figures["alone_median_ms"], figures
    return figures

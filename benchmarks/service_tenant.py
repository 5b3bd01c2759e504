"""One benchmark tenant in its own process (benchmarks/bench_service.py starts one per tenant): a training loop through
the Python client, as a researcher's script runs it. Separate processes, so the clients' own Python work (JSON
encoding, HTTP) runs in parallel as it does for real tenants, not behind one interpreter lock.

Two loops: closed (a step's forward_backward and optim_step sent, both awaited, then the next step: the plain loop)
and pipelined (the next step sent before the previous one is awaited, one step ahead: tinker-cookbook's pipelined
supervised loop, which keeps the service from idling while the client reads a result and sends the next batch)."""

from __future__ import annotations

import random
import time
from typing import Any

from loraplex.client import AdamParams, Datum, ServiceClient


def tenant_datums(vocab: int, lengths: list[int], seed: int) -> list[Datum]:
    """One datum per length (its input tokens), random token ids from `seed`."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(vocab) for _ in range(n + 1)]
        out.append(Datum(model_input=ids[:-1], loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * n}))
    return out


# Warm-up steps every tenant starts together, as the timed steps start: the plans of a round that starts at once pack
# other adapter counts than the tenants' free-running warm-up does, and each new count is a new CUDA graph bucket
# (eager, then captured on its second sighting, ~1.2 s on an H100, then replayed): three rounds see it through.
ALIGNED_WARMUP = 3


def run_tenant(
    base_url: str, api_key: str, model_id: str, data_spec: tuple[int, list[int], int], adam: dict[str, float],
    warmup: int, steps: int, barriers: tuple[Any, Any, Any, Any], results: Any, pipelined: bool = False,
) -> None:  # fmt: skip
    """Warm up (`warmup` steps on its own, then ALIGNED_WARMUP from the `aligned` barrier), meet the others at `ready`
    and `start`, time `steps` steps (forward_backward + optim_step sent back to back; closed or pipelined, see the
    module doc), put the step times (from one step's answers to the next's) on `results`, meet at `end`. `barriers`:
    aligned, ready, start, end."""
    aligned, ready, start, end = barriers
    try:
        client = ServiceClient(base_url, api_key, timeout=600)
        trainer = client.training_client(model_id)
        data = tenant_datums(*data_spec)
        params = AdamParams(**adam)

        def send() -> tuple[Any, Any]:
            return trainer.forward_backward(data, "cross_entropy"), trainer.optim_step(params)

        def run(n: int) -> list[float]:
            """n steps, each one's time from the previous step's answers (or the start) to its own; none in flight
            at the end."""
            times, last = [], time.perf_counter()
            sent: tuple[Any, Any] | None = send() if n else None
            for i in range(n):
                ahead = send() if pipelined and i + 1 < n else None
                for future in sent or ():
                    future.result()
                now = time.perf_counter()
                times.append(now - last)
                last = now
                sent = ahead if pipelined else send() if i + 1 < n else None
            return times

        run(warmup)
        aligned.wait()
        run(ALIGNED_WARMUP)
        ready.wait()
        start.wait()
        results.put(run(steps))
        end.wait()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        results.put(f"{type(exc).__name__}: {exc}")
        for barrier in barriers:
            barrier.abort()

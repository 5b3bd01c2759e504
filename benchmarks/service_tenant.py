"""One benchmark tenant in its own process (benchmarks/bench_service.py starts one per tenant): a closed training loop
through the Python client, as a researcher's script runs it. Separate processes, so the clients' own Python work (JSON
encoding, HTTP) runs in parallel as it does for real tenants, not behind one interpreter lock."""

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
    base_url: str, api_key: str, model_id: str, data_spec: tuple[int, int, int, int], adam: dict[str, float],
    warmup: int, steps: int, barriers: tuple[Any, Any, Any, Any], results: Any,
) -> None:  # fmt: skip
    """Warm up (`warmup` steps on its own, then ALIGNED_WARMUP from the `aligned` barrier), meet the others at `ready`
    and `start`, time `steps` steps (forward_backward + optim_step sent back to back, then both awaited), put the step
    times on `results`, meet at `end`. `barriers`: aligned, ready, start, end."""
    aligned, ready, start, end = barriers
    try:
        client = ServiceClient(base_url, api_key, timeout=600)
        trainer = client.training_client(model_id)
        data = tenant_datums(*data_spec)
        params = AdamParams(**adam)

        def step() -> None:
            fb = trainer.forward_backward(data, "cross_entropy")
            opt = trainer.optim_step(params)
            fb.result()
            opt.result()

        for _ in range(warmup):
            step()
        aligned.wait()
        for _ in range(ALIGNED_WARMUP):
            step()
        ready.wait()
        start.wait()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        results.put(times)
        end.wait()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        results.put(f"{type(exc).__name__}: {exc}")
        for barrier in barriers:
            barrier.abort()

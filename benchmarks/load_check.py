"""Load check through the whole embedded stack: N tenants (threads, one client each) train M steps (forward_backward +
optim_step) concurrently; then every future must have its result (0 lost), each adapter's applied_seq_id must be 2 x M,
and the pool must have executed exactly N x M forward_backward requests (0 duplicated). Also reported: each step's
latency (forward_backward sent -> its optim_step answered) p50 / p99, mean adapters per forward_backward step, and the
dispatcher's own seconds per plan (planning, `plan_s`, plus decoding and the rest of its loop around the engine,
`overhead_s`: queue/stats.py), beside the engine's (`busy_s`).

    .venv/bin/python -m benchmarks.load_check [--tenants 32] [--steps 50]
tests/e2e/test_load.py runs it (32 x 50) in CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis

from benchmarks.bench_flood import tenant_keys
from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.launch.embedded import Stack
from loraplex.queue import stats
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def load_check(stack: Stack, tenants: int, steps: int, prefix: str = "t") -> dict[str, Any]:
    keys = tenant_keys(stack.settings, *[f"{prefix}{i}" for i in range(tenants)])
    r = redis.Redis.from_url(stack.settings.redis_url)
    before = stats.read(r, stack.settings.pool)
    answered: list[int] = []
    errors: list[str] = []
    infos: list[dict] = []
    latencies: list[float] = []
    lock = threading.Lock()

    def tenant(key: str, seed: int) -> None:
        client = ServiceClient(stack.base_url, key)
        try:
            trainer = client.create_lora_training_client(rank=4, seed=seed)
            data = [Datum.for_next_token([(seed + k) % 200 + 1 for k in range(9)])]
            n, mine = 0, []
            for _ in range(steps):
                sent = time.monotonic()
                fb, opt = trainer.forward_backward(data), trainer.optim_step(AdamParams(learning_rate=1e-3))
                fb.result(timeout=600)
                opt.result(timeout=600)
                mine.append(time.monotonic() - sent)
                n += 2
            with lock:
                answered.append(n)
                infos.append(trainer.info())
                latencies.extend(mine)
        except Exception as exc:  # noqa: BLE001 - counted and printed
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            client.close()

    started = time.monotonic()
    threads = [threading.Thread(target=tenant, args=(k, i)) for i, k in enumerate(keys.values())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = tenants * steps
    window = stats.read_settled(r, stack.settings.pool, before, fb_requests=expected)
    plans = max(window.plans, 1)
    report: dict[str, Any] = {
        "tenants": tenants, "steps": steps, "seconds": round(time.monotonic() - started, 1),
        "answered": sum(answered), "expected_answers": 2 * expected, "errors": errors[:5],
        "applied_seq_ids_all_right": all(i["applied_seq_id"] == 2 * steps for i in infos) and len(infos) == tenants,
        "fb_requests_executed": window.fb_requests, "fb_requests_expected": expected,
        "plans": window.plans, "adapters_per_fb_step": round(window.adapters_per_fb_step, 2),
        "step_latency_s": {"p50": round(statistics.median(latencies), 3) if latencies else None,
                           "p99": round(_percentile(latencies, 0.99), 3)},
        "per_plan_ms": {"dispatcher": round(1e3 * (window.plan_s + window.overhead_s) / plans, 2),
                        "policy": round(1e3 * window.plan_s / plans, 2),
                        "engine": round(1e3 * window.busy_s / plans, 2),
                        "reading": round(1e3 * window.read_s / plans, 2)},
    }  # fmt: skip
    report["lost"] = 2 * expected - sum(answered)
    report["duplicated"] = window.fb_requests - expected
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenants", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="loraplex-load-")), slots=8, max_rank=16)
    with Stack(settings, api_port=free_port()) as stack:
        print(json.dumps(load_check(stack, args.tenants, args.steps), indent=2))


if __name__ == "__main__":
    main()

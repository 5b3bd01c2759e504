"""Load check through the whole embedded stack: N tenants (threads, one client each) train M steps (forward_backward +
optim_step) concurrently; then every future must have its result (0 lost), each adapter's applied_seq_id must be 2 x M,
and the pool must have executed exactly N x M forward_backward requests (0 duplicated).

    .venv/bin/python benchmarks/load_check.py [--tenants 32] [--steps 50]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import redis

from benchmarks.bench_flood import tenant_keys
from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.embedded import Stack
from loraplex.netutil import free_port
from loraplex.queue import stats
from loraplex.settings import Settings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenants", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="loraplex-load-")), slots=8, max_rank=16)
    with Stack(settings, api_port=free_port()) as stack:
        keys = tenant_keys(stack.settings, *[f"t{i}" for i in range(args.tenants)])
        r = redis.Redis.from_url(stack.settings.redis_url)
        before = stats.read(r, stack.settings.pool)
        answered: list[int] = []
        errors: list[str] = []
        infos: list[dict] = []

        def tenant(key: str, seed: int) -> None:
            client = ServiceClient(stack.base_url, key)
            try:
                trainer = client.create_lora_training_client(rank=4, seed=seed)
                data = [Datum.for_next_token([(seed + k) % 200 + 1 for k in range(9)])]
                n = 0
                for _ in range(args.steps):
                    fb, opt = trainer.forward_backward(data), trainer.optim_step(AdamParams(learning_rate=1e-3))
                    fb.result(timeout=600)
                    opt.result(timeout=600)
                    n += 2
                answered.append(n)
                infos.append(trainer.info())
            except Exception as exc:  # noqa: BLE001 - counted and printed
                errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                client.close()

        started = time.monotonic()
        threads = [threading.Thread(target=tenant, args=(k, i)) for i, k in enumerate(keys.values())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        window = stats.read(r, stack.settings.pool).minus(before)
        expected = args.tenants * args.steps
        report = {
            "tenants": args.tenants, "steps": args.steps, "seconds": round(time.monotonic() - started, 1),
            "answered": sum(answered), "expected_answers": 2 * expected, "errors": errors[:5],
            "applied_seq_ids_all_right": all(i["applied_seq_id"] == 2 * args.steps for i in infos) and len(infos) == args.tenants,
            "fb_requests_executed": window.fb_requests, "fb_requests_expected": expected,
            "plans": window.plans, "adapters_per_fb_step": round(window.adapters_per_fb_step, 2),
        }  # fmt: skip
        report["lost"] = 2 * expected - sum(answered)
        report["duplicated"] = window.fb_requests - expected
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

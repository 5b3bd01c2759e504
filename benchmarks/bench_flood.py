"""One tenant floods, another trains: how long does the other's small step wait, in plans?

Through the whole service (`loraplex serve --embedded`'s stack: redis-server, gateway, dispatcher, pool). The flooder
sends (1) a 24.5 MB body of 1,024 datums x 2,500 tokens, then (2) 5,000 small forward_backward steps as fast as its
client can (the client retries the queue quota's 429s with the same seq_id). Meanwhile a second tenant runs a closed
loop of 1-datum forward_backward steps and we time each; the pool's plan statistics give the mean plan time over the
same window. Printed: the victim's step latency alone (before the flood) and during it, in seconds and in plans.

    .venv/bin/python benchmarks/bench_flood.py [--flood-steps 5000] [--flood-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

from loraplex.client import Datum, ServiceClient
from loraplex.embedded import Stack
from loraplex.errors import LoraplexError
from loraplex.netutil import free_port
from loraplex.queue import stats
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import TenantRepository, unit_of_work


def tenant_keys(settings: Settings, *names: str) -> dict[str, str]:
    with unit_of_work(session_factory(make_db_engine(settings.resolved_database_url))) as session:
        repo = TenantRepository(session)
        return {name: repo.create_tenant(name)[1] for name in names}


def victim_loop(client: ServiceClient, stop: threading.Event, out: list[float]) -> None:
    trainer = client.create_lora_training_client(rank=4)
    data = [Datum.for_next_token([10, 11, 12])]
    while not stop.is_set():
        started = time.monotonic()
        trainer.forward_backward(data).result(timeout=600)
        out.append(time.monotonic() - started)
        stop.wait(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flood-steps", type=int, default=5000)
    parser.add_argument("--flood-tokens", type=int, default=64)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="loraplex-flood-"))
    settings = Settings(home=home, slots=8, max_rank=16)
    with Stack(settings, api_port=free_port()) as stack:
        keys = tenant_keys(stack.settings, "flood", "victim")
        r = redis.Redis.from_url(stack.settings.redis_url)
        flood, victim = ServiceClient(stack.base_url, keys["flood"]), ServiceClient(stack.base_url, keys["victim"])
        flooder = flood.create_lora_training_client(rank=4)
        flooder.forward_backward([Datum.for_next_token([1, 2, 3])]).result(timeout=120)

        alone: list[float] = []
        stop = threading.Event()
        loop = threading.Thread(target=victim_loop, args=(victim, stop, alone))
        loop.start()
        time.sleep(5)
        stop.set()
        loop.join()

        # (1) the 24.5 MB body, as the tester sent it
        tokens = [7] * 2500
        body = {"seq_id": 2, "data": [{"model_input": tokens, "loss_fn_inputs": {"target_tokens": tokens}}] * 1024}
        raw = json.dumps(body).encode()
        started = time.monotonic()
        answer = httpx.post(f"{stack.base_url}/v1/adapters/{flooder.model_id}/forward_backward", content=raw,
                            headers={"X-API-Key": keys["flood"], "Content-Type": "application/json", "X-Seq-Id": "2"},
                            timeout=120)  # fmt: skip
        big = {"bytes": len(raw), "status": answer.status_code, "seconds": round(time.monotonic() - started, 3),
               "detail": answer.json().get("detail")}  # fmt: skip
        flooder._next_seq = 3  # seq_id 2 was the raw request above (held by its rejection)

        # (2) 5,000 queued steps, with the victim training meanwhile
        during: list[float] = []
        stop = threading.Event()
        before = stats.read(r, stack.settings.pool)
        loop = threading.Thread(target=victim_loop, args=(victim, stop, during))
        loop.start()
        data = [Datum.for_next_token([5] * args.flood_tokens)]
        sent_started = time.monotonic()
        futures = []
        refused = 0
        for _ in range(args.flood_steps):
            try:
                futures.append(flooder.forward_backward(data))
            except LoraplexError:
                refused += 1
        sent_s = time.monotonic() - sent_started
        for f in futures[-1:]:
            f.result(timeout=1800)
        stop.set()
        loop.join()
        after = stats.read(r, stack.settings.pool)
        window = after.minus(before)
        plan_s = window.busy_s / max(1, window.plans)
        report = {
            "big_body": big,
            "flood": {"steps": args.flood_steps, "accepted": len(futures), "refused": refused, "send_s": round(sent_s, 1),
                      "plans": window.plans, "mean_plan_s": round(plan_s, 4)},  # fmt: skip
            "victim_alone": summary(alone, plan_s),
            "victim_during_flood": summary(during, plan_s),
        }
        print(json.dumps(report, indent=2))
        flood.close()
        victim.close()


def summary(latencies: list[float], plan_s: float) -> dict[str, float]:
    latencies = sorted(latencies)
    p50, worst = statistics.median(latencies), latencies[-1]
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {"steps": len(latencies), "p50_s": round(p50, 4), "p99_s": round(p99, 4), "max_s": round(worst, 4),
            "p50_plans": round(p50 / plan_s, 2), "max_plans": round(worst / plan_s, 2)}  # fmt: skip


if __name__ == "__main__":
    main()

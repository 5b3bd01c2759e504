"""One tenant floods, another trains: how long does the other's small step wait, in plans?

Through the whole service (`loraplex serve --embedded`'s stack: redis-server, gateway, dispatcher, pool). The flooder
sends (1) a 24.5 MB body of 1,024 datums x 2,500 tokens, (2) a large valid request (64 datums x 2,000 tokens: it
runs in parts, one per plan), then (3) 5,000 small forward_backward steps as fast as its client can (the client
retries the queue quota's 429s with the same seq_id). Meanwhile a second tenant runs a closed
loop of 1-datum forward_backward steps and we time each; the pool's plan statistics give the mean plan time over the
same window. Printed: the victim's step latency alone (before the flood) and during it, in seconds and in plans.

    .venv/bin/python benchmarks/bench_flood.py [--flood-steps 5000] [--flood-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import redis

from loraplex.client import Datum, ServiceClient
from loraplex.errors import LoraplexError
from loraplex.launch.embedded import Stack
from loraplex.queue import stats
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings
from loraplex.storage.db import make_db_engine, session_factory
from loraplex.storage.repositories import TenantRepository, unit_of_work


def tenant_keys(settings: Settings, *names: str) -> dict[str, str]:
    with unit_of_work(session_factory(make_db_engine(settings.resolved_database_url))) as session:
        repo = TenantRepository(session)
        return {name: repo.create_tenant(name)[1] for name in names}


SUBMIT_S: dict[int, list[float]] = {}  # id(out) -> the POST part of each step (the gateway's answer)


def victim_loop(client: ServiceClient, stop: threading.Event, out: list[float]) -> None:
    trainer = client.create_lora_training_client(rank=4)
    data = [Datum.for_next_token([10, 11, 12])]
    posts = SUBMIT_S.setdefault(id(out), [])
    while not stop.is_set():
        started = time.monotonic()
        future = trainer.forward_backward(data)
        posts.append(time.monotonic() - started)
        future.result(timeout=600)
        out.append(time.monotonic() - started)
        stop.wait(0.05)


def flood_steps(base_url: str, key: str, model_id: str, next_seq: int, args: argparse.Namespace) -> tuple[int, int, float]:
    """Send the flood's steps as fast as one client can; wait for the last; (accepted, refused, seconds sending)."""
    client = ServiceClient(base_url, key)
    trainer = client.training_client(model_id)
    trainer._next_seq = next_seq
    data = [Datum.for_next_token([5] * args.flood_tokens)]
    started, futures, refused = time.monotonic(), [], 0
    for _ in range(args.flood_steps):
        try:
            futures.append(trainer.forward_backward(data))
        except LoraplexError:
            refused += 1
    sent_s = time.monotonic() - started
    if futures:
        futures[-1].result(timeout=1800)
    client.close()
    return len(futures), refused, sent_s


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

        # (2) a large valid request, with the victim training meanwhile
        in_parts: list[float] = []
        stop = threading.Event()
        before = stats.read(r, stack.settings.pool)
        loop = threading.Thread(target=victim_loop, args=(victim, stop, in_parts))
        loop.start()
        time.sleep(1)
        started = time.monotonic()
        large = [Datum.for_next_token([(7 * i + k) % 190 + 1 for k in range(2001)]) for i in range(64)]
        flooder.forward_backward(large).result(timeout=1800)
        large_s = time.monotonic() - started
        stop.set()
        loop.join()
        large_window = stats.read(r, stack.settings.pool).minus(before)
        large_plan_s = large_window.busy_s / max(1, large_window.plans)

        # (3) 5,000 queued steps, with the victim training meanwhile
        during: list[float] = []
        stop = threading.Event()
        before = stats.read(r, stack.settings.pool)
        loop = threading.Thread(target=victim_loop, args=(victim, stop, during))
        loop.start()
        # The flooder sends from a process of its own (as a real tenant does): in this process its tight loop would
        # hold the interpreter lock against the victim's client thread and inflate the victim's latency.
        with multiprocessing.get_context("spawn").Pool(1) as sender:
            accepted, refused, sent_s = sender.apply(
                flood_steps, (stack.base_url, keys["flood"], flooder.model_id, flooder._next_seq, args)
            )
        stop.set()
        loop.join()
        after = stats.read(r, stack.settings.pool)
        window = after.minus(before)
        plan_s = window.busy_s / max(1, window.plans)
        report = {
            "big_body": big,
            "flood": {"steps": args.flood_steps, "accepted": accepted, "refused": refused, "send_s": round(sent_s, 1),
                      "plans": window.plans, "mean_plan_s": round(plan_s, 4),
                      "finisher_per_plan_s": round((window.record_s + window.publish_s) / max(1, window.plans), 4),
                      "loop_other_per_plan_s": round((window.read_s + window.coalesce_s + window.overhead_s)
                                                     / max(1, window.plans), 4)},  # fmt: skip
            "large_request": {"tokens": 128_000, "seconds": round(large_s, 2), "plans": large_window.plans,
                              "mean_plan_s": round(large_plan_s, 4)},  # fmt: skip
            "victim_alone": summary(alone, plan_s),
            "victim_during_large_request": summary(in_parts, large_plan_s),
            "victim_during_flood": summary(during, plan_s),
        }
        print(json.dumps(report, indent=2))
        flood.close()
        victim.close()


def summary(latencies: list[float], plan_s: float) -> dict[str, float]:
    key = id(latencies)
    latencies = sorted(latencies)
    p50, worst = statistics.median(latencies), latencies[-1]
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    posts = sorted(SUBMIT_S.get(key, [0.0]))
    return {"steps": len(latencies), "p50_s": round(p50, 4), "p99_s": round(p99, 4), "max_s": round(worst, 4),
            "p50_plans": round(p50 / plan_s, 2), "max_plans": round(worst / plan_s, 2),
            "post_p50_s": round(statistics.median(posts), 4), "post_max_s": round(posts[-1], 4)}  # fmt: skip


if __name__ == "__main__":
    main()

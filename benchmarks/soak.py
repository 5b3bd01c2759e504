"""Soak: many tenants train through the embedded stack for a fixed time while random faults hit it (the pool, the
gateway or redis-server SIGKILLed, and restarted by the stack: redis-server from its append-only file); then
every tenant's futures must have resolved (none lost), each adapter's applied seq_id must equal the steps its client
saw answered (none applied twice), and the memory of every process stays bounded.

    .venv/bin/python -m benchmarks.soak [--tenants 256] [--steps 200] [--duration 600] [--fault-every 45]

Reports requests/s, step latency p50/p99 (forward_backward sent -> its optim_step answered), the faults injected,
and per process role the resident memory (RSS, sampled every 5 s): at 60 s, at the end, and the largest seen.
A tenant stops at its step count or at the deadline, whichever comes first."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_flood import tenant_keys
from loraplex.client import AdamParams, Datum, ServiceClient
from loraplex.launch.embedded import Stack
from loraplex.runtime.netutil import free_port
from loraplex.settings import Settings


def rss_mb(pid: int | None) -> float:
    """Resident memory of a process and its children (uvicorn workers), MB; 0 when gone."""
    if not pid:
        return 0.0
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _wait_new_pid(stack: Stack, name: str, old: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        child = stack.child(name)
        if child.pid not in (None, old) and child.alive():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{name} was not restarted within {timeout_s} s")


def soak(stack: Stack, tenants: int, steps: int, duration_s: float, fault_every_s: float, seed: int) -> dict[str, Any]:
    keys = tenant_keys(stack.settings, *[f"soak{i}" for i in range(tenants)])
    deadline = time.monotonic() + duration_s
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    finished: list[tuple[int, int]] = []  # (steps answered, applied seq_id the service reports)
    faults: list[tuple[float, str]] = []
    memory: dict[str, list[tuple[float, float]]] = {"pool": [], "gateway": [], "redis": [], "driver": []}
    done = threading.Event()
    started = time.monotonic()

    def tenant(key: str, index: int) -> None:
        client = ServiceClient(stack.base_url, key, result_timeout=900)
        try:
            trainer = client.create_lora_training_client(rank=4, seed=index)
            data = [Datum.for_next_token([(index + k) % 200 + 1 for k in range(9)])]
            answered, mine = 0, []
            while answered < steps and time.monotonic() < deadline:
                sent = time.monotonic()
                fb, opt = trainer.forward_backward(data), trainer.optim_step(AdamParams(learning_rate=1e-3))
                fb.result()
                opt.result()
                mine.append(time.monotonic() - sent)
                answered += 1
            info = trainer.info()
            with lock:
                latencies.extend(mine)
                finished.append((answered, int(info["applied_seq_id"] or 0)))
        except Exception as exc:  # noqa: BLE001 - counted and printed
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            client.close()

    def inject() -> None:
        rng = random.Random(seed)
        draw: list[str] = []  # each kind once per three faults, in a random order: every kind is drawn
        while not done.wait(rng.uniform(0.5, 1.5) * fault_every_s):
            if not draw:
                draw = rng.sample(["pool", "gateway", "redis"], 3)
            kind = draw.pop()
            at = time.monotonic() - started
            name = {"pool": "pool", "gateway": "api", "redis": "redis"}[kind]
            pid = stack.child(name).pid
            if pid is None:
                continue
            os.kill(pid, signal.SIGKILL)  # the stack restarts each (redis-server from its append-only file)
            _wait_new_pid(stack, name, pid)
            faults.append((round(at, 1), kind))

    def sample() -> None:
        while not done.wait(5.0):
            t = time.monotonic() - started
            redis_proc = stack.redis._proc if stack.redis is not None else None
            for role, pid in (("pool", stack.child("pool").pid), ("gateway", stack.child("api").pid),
                              ("redis", redis_proc.pid if redis_proc else None), ("driver", os.getpid())):  # fmt: skip
                memory[role].append((round(t, 1), round(rss_mb(pid), 1)))

    helpers = [threading.Thread(target=inject, daemon=True), threading.Thread(target=sample, daemon=True)]
    for h in helpers:
        h.start()
    threads = [threading.Thread(target=tenant, args=(k, i)) for i, k in enumerate(keys.values())]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    elapsed = time.monotonic() - started

    def mem(role: str) -> dict[str, float]:
        series = memory[role]
        at_60 = next((mb for t, mb in series if t >= 60), series[0][1] if series else 0.0)
        return {"at_60s": at_60, "end": series[-1][1] if series else 0.0, "max": max((mb for _, mb in series), default=0.0)}

    answered = sum(a for a, _ in finished)
    return {
        "tenants": tenants, "steps": steps, "duration_s": round(elapsed, 1), "faults": faults,
        "steps_answered": answered, "requests_per_s": round(2 * answered / elapsed, 1),
        "step_latency_s": {"p50": round(statistics.median(latencies), 3) if latencies else None,
                           "p99": round(sorted(latencies)[int(0.99 * len(latencies))], 3) if latencies else None},
        "errors": errors[:5], "errors_total": len(errors),
        "tenants_finished": len(finished),
        "applied_seq_ids_exact": sum(1 for a, applied in finished if applied == 2 * a),
        "memory_mb": {role: mem(role) for role in memory},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenants", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--fault-every", type=float, default=45.0)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out")
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="loraplex-soak-"))
    with Stack(Settings(home=home, slots=args.slots, max_rank=16), api_port=free_port()) as stack:
        report = soak(stack, args.tenants, args.steps, args.duration, args.fault_every, args.seed)
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

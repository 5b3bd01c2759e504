"""Control-plane cost per training step: the embedded stack (its redis-server, SQLite, one gateway process, N pools of
one base model) under T tenants training through the real gateway with the Python client, and what each training
step (forward_backward + optim_step, both awaited) costs the parts that are not the GPU:

- Redis: commands (INFO commandstats deltas, per command) and bytes in and out (INFO stats total_net_input_bytes /
  total_net_output_bytes), every process's together (gateway and pools);
- SQL: statements per plan and per step, of the pools (loraplex_pool_sql_statements_total over
  loraplex_pool_plans_total) and of the gateway (loraplex_gateway_sql_statements_total);
- gateway CPU: user + system seconds of the gateway's processes (/proc/<pid>/stat) per HTTP request it answered
  (loraplex_gateway_requests_total, the benchmark's own /metrics scrapes left out).

A window with no training first gives the background (heartbeats, leases, registrations, metrics publishing) per
second, which runs whatever the step rate; the training window's totals include it. With --monitor, a MONITOR
connection classifies each command of the training window by the key class it touches (per-pool keys vs per-request
keys, queue/keys.py): how the keys would split over Redis shards. MONITOR slows Redis; its run's latencies are not
the plain run's.

    python3 benchmarks/bench_control_plane.py --pools 1,2,4,8 --tenants 64 --out /tmp/control_plane.json

Tenants run as threads of this process (the counts do not depend on where the clients run; the wall time does)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import redis as redis_lib  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.service_tenant import tenant_datums  # noqa: E402
from loraplex.client import AdamParams, ServiceClient  # noqa: E402
from loraplex.launch.embedded import Stack  # noqa: E402
from loraplex.queue import published_metrics  # noqa: E402
from loraplex.runtime.netutil import free_port  # noqa: E402
from loraplex.settings import Settings  # noqa: E402
from loraplex.storage.db import make_db_engine, session_factory, unit_of_work  # noqa: E402
from loraplex.storage.repositories import TenantRepository  # noqa: E402

ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
VOCAB = 512  # the tiny model's
TICKS = os.sysconf("SC_CLK_TCK")
# Key classes for --monitor: the first pattern that matches a command's first key names its class.
KEY_CLASSES = (
    ("per-pool: request streams", re.compile(r"^loraplex:pool:[^:]+:tenant:")),
    ("per-pool: request log", re.compile(r"^loraplex:pool:[^:]+:replay")),
    ("per-pool: other", re.compile(r"^loraplex:pool:")),
    ("per-request: result/notify/state/owner", re.compile(r"^loraplex:(result|notify|state|owner):")),
    ("per-adapter: idempotency", re.compile(r"^loraplex:idem:")),
    ("fleet (global)", re.compile(r"^loraplex:(fleet|metrics|dispatchers)")),
    ("per-tenant: other", re.compile(r"^loraplex:(tenant|pipeline|openai):")),
)


# -- reading the counters --------------------------------------------------------------------------------------------
def redis_snapshot(r: redis_lib.Redis) -> dict[str, Any]:
    """Calls per command so far, and the bytes the server read and wrote."""
    stats = r.info("stats")
    commands = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in r.info("commandstats").items()}
    return {
        "commands": commands,
        "in": int(stats["total_net_input_bytes"]),
        "out": int(stats["total_net_output_bytes"]),
    }


def redis_delta(before: dict[str, Any], after: dict[str, Any], overhead: dict[str, Any]) -> dict[str, Any]:
    """after - before, less one snapshot's own cost (`overhead`: the delta of two snapshots back to back)."""
    commands = {
        c: n - before["commands"].get(c, 0) - overhead["commands"].get(c, 0) for c, n in after["commands"].items()
    }
    return {
        "commands": {c: n for c, n in sorted(commands.items(), key=lambda kv: -kv[1]) if n > 0},
        "in": after["in"] - before["in"] - overhead["in"],
        "out": after["out"] - before["out"] - overhead["out"],
    }


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def gateway_counts(base_url: str) -> dict[str, float]:
    """The gateway's requests answered (its /metrics scrapes left out) and its SQL statements, so far."""
    out = {"requests": 0.0, "sql": 0.0}
    for name, labels, value in samples(httpx.get(f"{base_url}/metrics", timeout=30).text):
        if name == "loraplex_gateway_requests_total" and not labels["route"].startswith("/metrics"):
            out["requests"] += value
            route = f"route {labels['method']} {labels['route']}"
            out[route] = out.get(route, 0.0) + value
        elif name == "loraplex_gateway_sql_statements_total":
            out["sql"] += value
            out[f"sql {labels['verb']}"] = value
    return out


def pool_counts(r: redis_lib.Redis) -> dict[str, float]:
    """Every pool's plans and SQL statements so far, as the pools last published them (all pools summed)."""
    out = {"plans": 0.0, "sql": 0.0, "pools": 0.0}
    for text in published_metrics.read_all(r).values():
        out["pools"] += 1
        for name, labels, value in samples(text.decode()):
            if name == "loraplex_pool_plans_total":
                out["plans"] += value
            elif name == "loraplex_pool_sql_statements_total":
                out["sql"] += value
                out[f"sql {labels['verb']}"] = out.get(f"sql {labels['verb']}", 0.0) + value
    return out


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (uvicorn's workers, when it runs several)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system seconds of these processes so far (/proc/<pid>/stat fields 14 and 15)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


def snapshot(
    stack: Stack, r: redis_lib.Redis, gateway: list[int], pools: list[int], server: list[int]
) -> dict[str, Any]:
    """Everything, Redis first (the other reads go through Redis or the gateway but not through INFO's counts)."""
    red = redis_snapshot(r)
    return {"redis": red, "gateway": gateway_counts(stack.base_url), "gateway_cpu": cpu_seconds(gateway),
            "pool_cpu": cpu_seconds(pools), "redis_cpu": cpu_seconds(server), "t": time.perf_counter()}  # fmt: skip


# -- MONITOR: commands per key class ---------------------------------------------------------------------------------
class KeyClassMonitor:
    """Counts the commands Redis runs per key class (KEY_CLASSES, by each command's first argument) while on."""

    def __init__(self, url: str) -> None:
        self._r = redis_lib.Redis.from_url(url)
        self.counts: Counter[str] = Counter()
        self._on = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> KeyClassMonitor:
        self._thread.start()
        return self

    def measure(self, on: bool) -> None:
        if on:
            self.counts.clear()
        self._on.set() if on else self._on.clear()

    def _run(self) -> None:
        with contextlib.suppress(redis_lib.RedisError):  # the stack stopped its redis-server: the counting is over
            self._listen()

    def _listen(self) -> None:
        with self._r.monitor() as m:
            for event in m.listen():
                if not self._on.is_set():
                    continue
                parts = str(event.get("command", "")).split()
                cmd = parts[0].lower() if parts else ""
                key = parts[1] if len(parts) > 1 else ""
                if cmd in ("info", "monitor", "client", "hello"):
                    continue
                if cmd in ("evalsha", "eval", "fcall") and len(parts) > 3:
                    key = parts[3]  # script sha, numkeys, first key
                elif cmd in ("xreadgroup", "xread"):
                    key = parts[parts.index("STREAMS") + 1] if "STREAMS" in parts else key
                label = next((name for name, pattern in KEY_CLASSES if pattern.match(key)), f"other ({cmd})")
                self.counts[label] += 1


# -- the run ---------------------------------------------------------------------------------------------------------
def train(trainers: list[Any], data: list[Any], steps: int) -> None:
    """Every tenant's closed loop at once: `steps` steps each (forward_backward + optim_step sent, then both awaited)."""
    params = AdamParams(**ADAM)

    def tenant(i: int) -> None:
        for _ in range(steps):
            fb = trainers[i].forward_backward(data[i], "cross_entropy")
            opt = trainers[i].optim_step(params)
            fb.result()
            opt.result()

    with ThreadPoolExecutor(len(trainers)) as pool:
        list(pool.map(tenant, range(len(trainers))))


def per_step(before: dict[str, Any], after: dict[str, Any], overhead: dict[str, Any], pools_before: dict[str, float],
             pools_after: dict[str, float], steps: int) -> dict[str, Any]:  # fmt: skip
    red = redis_delta(before["redis"], after["redis"], overhead)
    requests = after["gateway"]["requests"] - before["gateway"]["requests"]
    plans = pools_after["plans"] - pools_before["plans"]
    pool_sql = pools_after["sql"] - pools_before["sql"]
    gateway_sql = after["gateway"]["sql"] - before["gateway"]["sql"]
    gateway_cpu = after["gateway_cpu"] - before["gateway_cpu"]
    wall = after["t"] - before["t"]
    commands = sum(red["commands"].values())
    return {
        "steps": steps, "wall_s": wall, "steps_per_s": steps / wall, "requests": requests, "plans": plans,
        "redis_commands": commands, "redis_bytes_in": red["in"], "redis_bytes_out": red["out"],
        "redis_commands_per_step": commands / steps, "redis_in_per_step": red["in"] / steps,
        "redis_out_per_step": red["out"] / steps,
        "redis_by_command_per_step": {c: n / steps for c, n in red["commands"].items()},
        "pool_sql": pool_sql, "pool_sql_per_plan": pool_sql / plans if plans else 0.0, "pool_sql_per_step": pool_sql / steps,
        "gateway_sql": gateway_sql, "gateway_sql_per_step": gateway_sql / steps,
        "requests_per_step": requests / steps, "steps_per_plan": steps / plans if plans else 0.0,
        "gateway_cpu_s": gateway_cpu, "gateway_cpu_ms_per_request": 1e3 * gateway_cpu / requests if requests else 0.0,
        "gateway_cpu_ms_per_step": 1e3 * gateway_cpu / steps, "gateway_cpu_share": gateway_cpu / wall,
        "pool_cpu_s": after["pool_cpu"] - before["pool_cpu"],
        "redis_cpu_ms_per_step": 1e3 * (after["redis_cpu"] - before["redis_cpu"]) / steps,
        "pool_sql_by_verb_per_plan": _by_prefix(pools_before, pools_after, "sql ", plans),
        "gateway_sql_by_verb_per_step": _by_prefix(before["gateway"], after["gateway"], "sql ", steps),
        "gateway_requests_by_route_per_step": _by_prefix(before["gateway"], after["gateway"], "route ", steps),
    }  # fmt: skip


def _by_prefix(before: dict[str, float], after: dict[str, float], prefix: str, per: float) -> dict[str, float]:
    """The counts named `prefix`... that grew, per `per`, most first."""
    grown = {k.removeprefix(prefix): (v - before.get(k, 0.0)) / per for k, v in after.items() if k.startswith(prefix)}
    return {k: v for k, v in sorted(grown.items(), key=lambda kv: -kv[1]) if v > 0} if per else {}


def background(before: dict[str, Any], after: dict[str, Any], overhead: dict[str, Any]) -> dict[str, Any]:
    red = redis_delta(before["redis"], after["redis"], overhead)
    wall = after["t"] - before["t"]
    return {"wall_s": wall, "redis_commands_per_s": sum(red["commands"].values()) / wall,
            "redis_bytes_in_per_s": red["in"] / wall, "redis_bytes_out_per_s": red["out"] / wall,
            "redis_by_command_per_s": {c: n / wall for c, n in red["commands"].items()},
            "gateway_cpu_share": (after["gateway_cpu"] - before["gateway_cpu"]) / wall,
            "redis_cpu_share": (after["redis_cpu"] - before["redis_cpu"]) / wall}  # fmt: skip


def run_pools(n: int, args: argparse.Namespace, home: Path) -> dict[str, Any]:
    settings = Settings(home=home / f"pools-{n}", base_model=args.model, device="cpu", slots=args.tenants,
                        max_rank=args.rank, api_workers=args.api_workers, metrics_open=True)  # fmt: skip
    t0 = time.perf_counter()
    with Stack(settings, api_port=free_port(), pool_models=[args.model] * n) as stack:
        started = time.perf_counter() - t0
        print(f"{n} pools: stack up in {started:.1f} s (logs: {stack.log_dir})", flush=True)
        r = redis_lib.Redis.from_url(stack.settings.redis_url)
        sessions = session_factory(make_db_engine(settings.resolved_database_url))
        with unit_of_work(sessions) as session:
            repo = TenantRepository(session)
            keys = [repo.create_tenant(f"t{i}-{uuid.uuid4().hex[:6]}")[1] for i in range(args.tenants)]
        clients = [ServiceClient(stack.base_url, key, timeout=600) for key in keys]
        with ThreadPoolExecutor(8) as pool:
            trainers = list(pool.map(lambda i: clients[i].create_lora_training_client(rank=args.rank, seed=i),
                                     range(args.tenants)))  # fmt: skip
        data = [tenant_datums(VOCAB, [args.seq_len], 1000 + i) for i in range(args.tenants)]
        train(trainers, data, args.warmup)
        api = stack.child("api").proc
        assert api is not None
        gateway = process_tree(api.pid)
        pools = [p.pid for name, p in ((c, stack.child(c).proc) for c in stack.pools) if p is not None]
        server = [stack.redis.pid] if stack.redis is not None and stack.redis.pid is not None else []
        s1, s2 = redis_snapshot(r), redis_snapshot(r)
        overhead = redis_delta(s1, s2, {"commands": {}, "in": 0, "out": 0})

        idle0 = snapshot(stack, r, gateway, pools, server)
        time.sleep(args.idle_s)
        idle1 = snapshot(stack, r, gateway, pools, server)
        monitor = KeyClassMonitor(stack.settings.redis_url).start() if args.monitor else None
        time.sleep(2 * settings.pool_metrics_publish_seconds + 0.5)  # the warm-up's plans published
        pools_before = pool_counts(r)
        if monitor is not None:
            time.sleep(0.5)  # MONITOR connected
            monitor.measure(True)
        before = snapshot(stack, r, gateway, pools, server)
        train(trainers, data, args.steps)
        after = snapshot(stack, r, gateway, pools, server)
        if monitor is not None:
            monitor.measure(False)
        time.sleep(2 * settings.pool_metrics_publish_seconds + 0.5)  # the last plans published
        pools_after = pool_counts(r)
        for c in clients:
            c.close()
    out = per_step(before, after, overhead, pools_before, pools_after, args.tenants * args.steps)
    out |= {"pools": n, "tenants": args.tenants, "stack_start_s": started, "pools_publishing": pools_after["pools"],
            "background": background(idle0, idle1, overhead)}  # fmt: skip
    if monitor is not None:
        total = sum(monitor.counts.values()) or 1
        out["key_classes"] = {k: v / total for k, v in monitor.counts.most_common()}
    return out


def report(results: list[dict[str, Any]]) -> None:
    print("\nper training step (forward_backward + optim_step; all processes' Redis traffic, background included)")
    print(f"{'pools':>5} {'steps/s':>8} {'req/step':>8} {'steps/plan':>10} {'redis cmd':>9} {'in B':>7} {'out B':>7} "
          f"{'SQL/plan':>8} {'poolSQL':>7} {'gwSQL':>6} {'gw CPU ms/req':>13} {'gw CPU':>6} {'redis ms':>8} {'idle cmd/s':>10}")  # fmt: skip
    for o in results:
        print(f"{o['pools']:>5} {o['steps_per_s']:>8.1f} {o['requests_per_step']:>8.2f} {o['steps_per_plan']:>10.1f} "
              f"{o['redis_commands_per_step']:>9.1f} {o['redis_in_per_step']:>7.0f} {o['redis_out_per_step']:>7.0f} "
              f"{o['pool_sql_per_plan']:>8.1f} {o['pool_sql_per_step']:>7.2f} {o['gateway_sql_per_step']:>6.2f} "
              f"{o['gateway_cpu_ms_per_request']:>13.2f} {100 * o['gateway_cpu_share']:>5.0f}% "
              f"{o['redis_cpu_ms_per_step']:>8.3f} {o['background']['redis_commands_per_s']:>10.0f}")  # fmt: skip
    for o in results:
        top = ", ".join(f"{c} {n:.2f}" for c, n in list(o["redis_by_command_per_step"].items())[:12])
        print(f"{o['pools']} pools, Redis commands per step: {top}")
        for title, key in (
            ("pool SQL per plan", "pool_sql_by_verb_per_plan"),
            ("gateway SQL per step", "gateway_sql_by_verb_per_step"),
            ("gateway requests per step", "gateway_requests_by_route_per_step"),
        ):
            print(f"{o['pools']} pools, {title}: " + ", ".join(f"{k} {v:.2f}" for k, v in o[key].items()))
        if "key_classes" in o:
            print(f"{o['pools']} pools, commands by key class: "
                  + ", ".join(f"{k} {100 * v:.0f}%" for k, v in o["key_classes"].items()))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pools", default="1,2,4,8", help="comma list: pools of the model, one stack each")
    p.add_argument("--tenants", type=int, default=64)
    p.add_argument("--model", default="tiny")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="timed steps per tenant")
    p.add_argument("--idle-s", type=float, default=5.0, help="the window with no training (background per second)")
    p.add_argument("--api-workers", type=int, default=1)
    p.add_argument("--monitor", action="store_true", help="also count the commands per key class (MONITOR)")
    p.add_argument("--home", help="the stacks' folder (default: a temp folder)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    home = Path(args.home or tempfile.mkdtemp(prefix="bench-control-plane-"))
    results = []
    for n in (int(x) for x in args.pools.split(",")):
        results.append(run_pools(n, args, home))
        print(json.dumps({k: v for k, v in results[-1].items() if not isinstance(v, dict)}), flush=True)
    report(results)
    if args.out:
        env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(), "args": vars(args)}
        Path(args.out).write_text(json.dumps({"env": env, "results": results}, indent=1))


if __name__ == "__main__":
    main()

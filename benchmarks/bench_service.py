"""Service benchmark: the real stack (the embedded stack's redis-server, SQLite, gateway under uvicorn, dispatcher and
pool process) driven over HTTP by N concurrent tenants with the Python client, and the same work through the engine
alone (PlanExecutor over the plans the dispatch policy makes of the same requests: no HTTP, Redis or SQL) in the same
call, so service / engine is the service's own cost.

    python3 benchmarks/bench_service.py --model qwen3-4b-shape --device cuda --rank 32 --tenants 1,2,4,8,16
    python3 benchmarks/bench_service.py                    # CPU, tiny model: the same code path, seconds (not in CI)
    python3 benchmarks/bench_service.py --world-sizes 1,2,4,8 --layouts fsdp,replicate --tenants 4,16,64   # RESULTS.md, 2026-12-02

Each tenant is one process (benchmarks/service_tenant.py) with its own ServiceClient and adapter; a step is forward_backward + optim_step sent back to
back, then both results awaited (a closed loop, as a training script runs; `--clients pipelined`: the next step sent
before the previous one is awaited, as tinker-cookbook's pipelined supervised loop does). Workloads per step and tenant:
underfilled = 1 sequence, saturated = --saturated-seqs sequences (8 x 512 = one 4,096-token microbatch), ragged =
the saturated tenant's tokens in lognormal lengths (median 256, 32 to 2,048; service_tenant.workload_lengths).
Prints tokens/s, p50/p99 step latency, adapters per forward_backward step (the pool's plan stats in Redis), the
service/engine ratio, and create_lora_training_client latency (warm pool). Engine-only runs first, in this process,
and is freed before the stack starts, so the two never share the device.

--world-sizes: the service once per pool world size and layout (a stack each; on CUDA rank r takes GPU r), with the
per-GPU efficiency tok/s(N) / (N x tok/s(1)) against world size 1 of the same layout, and p50/p99 step latency."""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lengths import workload_lengths  # noqa: E402
from benchmarks.service_tenant import run_tenant, tenant_datums  # noqa: E402
from loraplex.client import ServiceClient  # noqa: E402
from loraplex.dispatch.cost_calibration import OnlineCostModel  # noqa: E402
from loraplex.dispatch.cost_model import default_cost  # noqa: E402
from loraplex.dispatch.policy import PolicyLimits, plan_batch  # noqa: E402
from loraplex.launch.embedded import Stack  # noqa: E402
from loraplex.models import SHAPE_PRESETS, load_base_model, torch_dtype  # noqa: E402
from loraplex.pool.process import engine_spec  # noqa: E402
from loraplex.protocol import PlannedRequest, RequestKind  # noqa: E402
from loraplex.queue import stats as plan_stats  # noqa: E402
from loraplex.runtime.netutil import free_port  # noqa: E402
from loraplex.settings import Settings  # noqa: E402
from loraplex.storage.db import make_db_engine, session_factory  # noqa: E402
from loraplex.storage.repositories import TenantRepository, unit_of_work  # noqa: E402
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.engine import Engine  # noqa: E402
from loraplex.workers.engine.executor import PlanExecutor  # noqa: E402

ADAM = {"learning_rate": 1e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(times: list[float], tokens: int, wall: float, steps: int) -> dict[str, float]:
    return {
        "tok_s": tokens / wall,
        "round_s": wall / steps,
        "p50_ms": 1e3 * statistics.median(times),
        "p99_ms": 1e3 * percentile(times, 0.99),
    }


# ---- engine alone ---------------------------------------------------------------------------------------------------
def bench_engine(settings: Settings, configs: list[tuple[str, int, int]], args: argparse.Namespace, vocab: int) -> dict:
    """Each config's rounds through the policy + PlanExecutor (what the pool runs), timed with the device synced."""
    model, _ = load_base_model(settings.base_model, settings.resolved_model_cache, torch_dtype(settings.resolved_dtype),
                               settings.device)  # fmt: skip
    # The pool's own engine arguments (engine_spec), so the two columns differ only by the service around the engine.
    engine = build_engine(model, engine_spec(settings).config, settings.device)
    print("engine:", engine.summary(), flush=True)
    # The pool's policy: with its cost model calibrated from this executor's step times (LORAPLEX_COST_MODEL).
    cost = OnlineCostModel(default_cost(settings.device), settings.microbatch_tokens) if settings.cost_model else None
    executor = PlanExecutor(engine, on_step=cost.observe_step if cost is not None else None)
    limits = PolicyLimits(plan_tokens=settings.plan_tokens, max_adapters_per_step=settings.slots)
    out: dict[str, Any] = {"create_ms": []}
    for workload, tenants, lengths in configs:
        out[f"{workload}/{tenants}"] = engine_config(executor, limits, tenants, lengths, args, vocab, out["create_ms"],
                                                     cost)  # fmt: skip
        print("engine", workload, tenants, out[f"{workload}/{tenants}"], graphs_state(engine), flush=True)
    del engine, executor, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # What this process still holds while the pool runs beside it (a pool short of memory retries its
        # allocations: the pool's slow-plan lines count them).
        free, total = torch.cuda.mem_get_info()
        print(f"after the engine column: this process holds {torch.cuda.memory_allocated() / 2**30:.2f} GiB "
              f"allocated, {torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved; the device has "
              f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free", flush=True)  # fmt: skip
    return out


def graphs_state(engine: Engine) -> str:
    """The engine's CUDA graphs so far: captured, the memory they hold, and buckets declined for want of room."""
    g = engine.graphs
    if g is None:
        return "(no CUDA graphs)"
    return f"(CUDA graphs: {g.captures} captured, {g.memory_bytes / 2**30:.1f} GiB; {len(g.declined)} declined)"


def engine_config(
    executor: PlanExecutor, limits: PolicyLimits, tenants: int, lengths: list[list[int]], args: argparse.Namespace, vocab: int,
    create_ms: list[float], cost: OnlineCostModel | None = None,
) -> dict[str, float]:  # fmt: skip
    engine = executor.engine
    ids = [f"t{i}" for i in range(tenants)]
    for i, m in enumerate(ids):
        sync()
        c0 = time.perf_counter()
        engine.create_adapter(m, args.rank, 2.0 * args.rank, seed=i)
        sync()
        create_ms.append(1e3 * (time.perf_counter() - c0))
    # The same datums the tenant processes send (service_tenant.tenant_datums), as the executor receives them.
    data = {m: [d.to_json() for d in tenant_datums(vocab, lengths[i], 1000 + i)] for i, m in enumerate(ids)}
    applied: dict[str, int | None] = dict.fromkeys(ids, 0)
    adapters: list[int] = []

    def one_round(seq: int) -> None:
        pending: list[PlannedRequest] = []
        for m in ids:
            fb = {"data": data[m], "loss_fn": "cross_entropy", "loss_fn_config": {}}
            pending.append(PlannedRequest(f"{m}-{seq}", m, m, seq, RequestKind.FORWARD_BACKWARD, fb))
            pending.append(PlannedRequest(f"{m}-{seq}o", m, m, seq + 1, RequestKind.OPTIM_STEP, {"adam_params": ADAM}))
        while pending:
            decision = plan_batch(pending, applied, limits, cost=cost)
            outcomes = executor.execute(decision.plan)
            assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
            adapters.extend(len(s.requests) for s in decision.plan.steps if s.kind == "forward_backward")
            applied.update(decision.applied_seq)
            pending = list(decision.pending)

    seq = 1
    for _ in range(args.warmup):
        one_round(seq)
        seq += 2
    sync()
    adapters.clear()
    times: list[float] = []
    start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        one_round(seq)
        sync()
        times.append(time.perf_counter() - t0)
        seq += 2
    wall = time.perf_counter() - start
    for m in ids:
        engine.delete_adapter(m)
    tokens = sum(map(sum, lengths)) * args.steps
    return summary(times, tokens, wall, args.steps) | {"adapters_per_fb_step": statistics.mean(adapters)}


# ---- through the service ----------------------------------------------------------------------------------------------
def bench_service(settings: Settings, configs: list[tuple[str, int, int]], args: argparse.Namespace, vocab: int) -> dict:
    import redis

    out: dict[str, Any] = {"create_ms": []}
    t0 = time.perf_counter()
    with Stack(settings, api_port=free_port()) as stack:
        out["stack_start_s"] = time.perf_counter() - t0
        print(f"stack up in {out['stack_start_s']:.1f} s; logs in {stack.log_dir}", flush=True)
        sessions = session_factory(make_db_engine(settings.resolved_database_url))
        with unit_of_work(sessions) as session:
            keys = [TenantRepository(session).create_tenant(f"tenant{i}-{uuid.uuid4().hex[:6]}")[1] for i in range(max(t for _, t, _ in configs))]
        clients = [ServiceClient(stack.base_url, key, timeout=600) for key in keys]
        r = redis.Redis.from_url(stack.settings.redis_url)
        api = next(c for c in stack.children if "uvicorn" in " ".join(map(str, c.args)))
        for workload, tenants, lengths in configs:
            for loop in args.clients.split(","):
                key = service_key(workload, tenants, loop)
                out[key] = service_config(stack.base_url, keys[:tenants], clients[:tenants], r, settings.pool,
                                          lengths, args, vocab, out["create_ms"],
                                          lambda pids: gateway_connections(api.pid, stack.api_port, pids),
                                          pipelined=loop == "pipelined")  # fmt: skip
                print("service", key, out[key], flush=True)
        for c in clients:
            c.close()
    return out


def service_key(workload: str, tenants: int, loop: str) -> str:
    """A service row's key in the results: the closed loop's keeps the engine row's key."""
    return f"{workload}/{tenants}" + ("" if loop == "closed" else f"/{loop}")


def gateway_connections(api_pid: int, port: int, tenant_pids: list[int]) -> list[int]:
    """The tenant processes' connections per gateway worker process, most first (the kernel hands each accepted
    connection to whichever worker takes it; tenants pinned to one worker share its interpreter)."""
    try:
        import psutil
    except ImportError:  # not on every machine: the benchmark runs without this figure
        return []
    ours = {c.laddr.port for pid in tenant_pids for c in psutil.Process(pid).net_connections(kind="tcp")}
    parent = psutil.Process(api_pid)
    counts = []
    for w in parent.children() or [parent]:
        conns = w.net_connections(kind="tcp")
        counts.append(sum(bool(c.raddr) and c.laddr.port == port and c.raddr.port in ours for c in conns))
    return sorted((n for n in counts if n), reverse=True)


def service_config(
    base_url: str, keys: list[str], clients: list[ServiceClient], r: Any, pool: str, lengths: list[list[int]], args: argparse.Namespace, vocab: int,
    create_ms: list[float], connections: Any, pipelined: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """N tenant processes (benchmarks/service_tenant.py) train at once, in closed loops or pipelined ones; the wall
    time between the start and end barriers gives tokens/s."""
    tenants = len(clients)
    trainers = []
    for i, client in enumerate(clients):
        c0 = time.perf_counter()
        trainers.append(client.create_lora_training_client(rank=args.rank, seed=i))
        create_ms.append(1e3 * (time.perf_counter() - c0))
    ctx = mp.get_context("spawn")
    aligned = ctx.Barrier(tenants)  # the tenants' aligned warm-up (service_tenant.ALIGNED_WARMUP)
    ready, start, end = (ctx.Barrier(tenants + 1) for _ in range(3))
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=run_tenant,
            args=(base_url, keys[i], trainers[i].model_id, (vocab, lengths[i], 1000 + i),
                  ADAM, args.warmup, args.steps, (aligned, ready, start, end), results, pipelined),
        )  # fmt: skip
        for i in range(tenants)
    ]
    for p in procs:
        p.start()
    try:
        ready.wait(timeout=600)
        per_worker = connections([p.pid for p in procs])  # made during the warm-up, kept alive
        time.sleep(0.5)  # the finisher adds a plan's stats after its results: let the warm-up's last one land
        before = plan_stats.read(r, pool)
        start.wait(timeout=600)
        t0 = time.perf_counter()
        end.wait(timeout=600)
        wall = time.perf_counter() - t0
    except threading.BrokenBarrierError:
        reports = [results.get(timeout=5) for _ in range(results.qsize())]
        raise RuntimeError(f"a tenant failed: {[x for x in reports if isinstance(x, str)]}") from None
    time.sleep(0.5)  # as above, for the last timed plan
    after = plan_stats.read(r, pool).minus(before)
    per_tenant = [results.get(timeout=60) for _ in range(tenants)]
    times = [t for steps in per_tenant for t in steps]
    for p in procs:
        p.join(timeout=30)
    for tc in trainers:
        tc.delete()
    tokens = sum(map(sum, lengths)) * args.steps
    return summary(times, tokens, wall, args.steps) | {
        "adapters_per_fb_step": after.adapters_per_fb_step,
        "plans": after.plans,
        "pool_busy_fraction": after.busy_s / wall,
        "connections_per_gateway_worker": per_worker,
        # each timed step's slowest tenant, in step order: which round a p99 comes from
        "step_max_ms": [round(1e3 * max(steps[i] for steps in per_tenant), 1) for i in range(args.steps)],
        # adapters the coalescing wait expected back that missed its window, a plan (queue/stats.py `lapsed`)
        "lapsed_per_plan": after.lapsed / max(after.plans, 1),
    } | {f"{name}_ms_per_plan": 1e3 * getattr(after, f"{name}_s") / max(after.plans, 1)
         for name in ("busy", "read", "plan", "coalesce", "decide", "overhead", "record", "publish")}  # fmt: skip


def scaling(settings: Settings, configs: list[tuple[str, int, int]], args: argparse.Namespace, vocab: int,
            home: Path) -> dict[str, Any]:  # fmt: skip
    """The service at each world size and layout; returns the world-size-1 run of the first layout under the usual
    keys (so the tables below compare it with the engine) and every run under "scaling"."""
    worlds = [int(w) for w in args.world_sizes.split(",")]
    runs: dict[str, dict[str, Any]] = {}
    for layout in args.layouts.split(","):
        for world in worlds:
            print(f"== pool world size {world}, layout {layout}", flush=True)
            s = settings.model_copy(update={"world_size": world, "pool_layout": layout, "home": home / f"{layout}-{world}"})
            runs[f"{layout}/{world}"] = bench_service(s, configs, args, vocab)
    print(f"\n{'layout':9} {'world':>5} {'workload':12} {'tenants':>7} {'tok/s':>10} {'per-GPU eff':>11} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'adapters/fb':>11}")  # fmt: skip
    for key, run in runs.items():
        layout, world = key.split("/")
        base = runs.get(f"{layout}/1")
        for workload, n, _ in configs:
            r = run[f"{workload}/{n}"]
            eff = f"{r['tok_s'] / (int(world) * base[f'{workload}/{n}']['tok_s']):.3f}" if base else "-"
            print(f"{layout:9} {world:>5} {workload:12} {n:>7} {r['tok_s']:>10,.0f} {eff:>11} {r['p50_ms']:>8.1f} "
                  f"{r['p99_ms']:>8.1f} {r['adapters_per_fb_step']:>11.2f}")  # fmt: skip
    first = runs[f"{args.layouts.split(',')[0]}/{worlds[0]}"]
    return first | {"scaling": runs}


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-4b-shape" if cuda else "tiny")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rank", type=int, default=32 if cuda else 8)
    p.add_argument("--seq-len", type=int, default=512 if cuda else 64)
    p.add_argument("--saturated-seqs", type=int, default=8)
    p.add_argument("--tenants", default="1,2,4,8,16")
    p.add_argument("--workloads", default="underfilled,saturated", help="comma list: underfilled, saturated, ragged")
    p.add_argument("--cap", type=int, default=4096, help="engine microbatch tokens")
    p.add_argument("--slots", type=int, default=0,
                   help="adapter slots of the engine and the pool (0: 8, or the most tenants if more); a big MoE "
                        "fits fewer slots' fp32 expert banks")  # fmt: skip
    p.add_argument("--plan-tokens", type=int, default=16384)
    # 4: enough rounds that the engine has captured the CUDA graphs of the buckets the plans produce (each on its
    # second sighting) before the timed steps; fewer puts captures into them (RESULTS.md, 2026-12-01, H200). The
    # tenants then run service_tenant.ALIGNED_WARMUP more, started together as the timed steps are.
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--bracket", action="store_true", help="run the engine before and after the service; use the mean")
    p.add_argument("--api-workers", type=int, default=0, help="gateway worker processes (0: the setting's auto)")
    p.add_argument("--home", help="the stack's LORAPLEX_HOME (default: a temp folder)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--world-sizes", default="",
                   help="comma list of pool world sizes: the service at each (with --layouts), instead of one run")  # fmt: skip
    p.add_argument("--layouts", default="fsdp", help="--world-sizes: comma list of pool layouts, fsdp and/or replicate")
    p.add_argument("--clients", default="closed",
                   help="closed, pipelined or closed,pipelined: how each tenant's loop sends its steps "
                        "(benchmarks/service_tenant.py); each a row of its own, against the same engine row")
    p.add_argument("--early-full-microbatches", default="",
                   help="off, on or off,on: the service with LORAPLEX_COALESCE_EARLY_FULL_MICROBATCHES so (each its own "
                        "stack, one after the other in this call); default: the setting as it is")  # fmt: skip
    p.add_argument("--no-cost-model", action="store_true",
                   help="LORAPLEX_COST_MODEL=false in the pool and the engine-only run: one mixed step per round")  # fmt: skip
    args = p.parse_args()
    if set(args.clients.split(",")) - {"closed", "pipelined"}:
        p.error(f"--clients takes closed and/or pipelined, got {args.clients!r}")

    tenants = [int(t) for t in args.tenants.split(",")]
    configs = [(w, n, [workload_lengths(w, i, args.seq_len, args.saturated_seqs) for i in range(n)])
               for w in args.workloads.split(",") for n in tenants]  # fmt: skip
    home = Path(args.home or tempfile.mkdtemp(prefix="bench-service-"))
    settings = Settings(home=home, base_model=args.model, device=args.device, dtype=args.dtype,
                        slots=args.slots or max(8, *tenants), max_rank=args.rank, microbatch_tokens=args.cap,
                        plan_tokens=args.plan_tokens, api_workers=args.api_workers,
                        cost_model=not args.no_cost_model)  # fmt: skip
    vocab = SHAPE_PRESETS[args.model]["vocab_size"] if args.model in SHAPE_PRESETS else 512
    results: dict[str, Any] = {
        "env": {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
                "model": args.model, "dtype": settings.resolved_dtype, "rank": args.rank, "seq_len": args.seq_len,
                "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "warmup": args.warmup},
    }  # fmt: skip
    if not args.skip_engine:
        results["engine"] = bench_engine(settings, configs, args, vocab)
    # The service once per coalescing variant, each with a stack of its own (LORAPLEX_COALESCE_EARLY_FULL_MICROBATCHES).
    variants = {v: v == "on" for v in args.early_full_microbatches.split(",")} if args.early_full_microbatches else {}
    for name, early in (variants or {"": settings.coalesce_early_full_microbatches}).items():
        run = settings.model_copy(update={"coalesce_early_full_microbatches": early}
                                  | ({"home": home / f"early-{name}"} if name else {}))  # fmt: skip
        key = f"service_early_{name}" if name else "service"
        results[key] = scaling(run, configs, args, vocab, home) if args.world_sizes else bench_service(run, configs, args, vocab)
    if args.bracket and not args.skip_engine:  # the engine again: the GPU's speed drifts between phases of one call
        results["engine_after"] = bench_engine(settings, configs, args, vocab)
        for key, before in results["engine"].items():
            if key != "create_ms":
                after = results["engine_after"][key]
                before["tok_s_before_after"] = [before["tok_s"], after["tok_s"]]
                before["tok_s"] = (before["tok_s"] + after["tok_s"]) / 2
                before["round_s"] = (before["round_s"] + after["round_s"]) / 2
    if "engine" in results:
        print(f"engine.create_adapter alone: p50 {statistics.median(results['engine']['create_ms']):.1f} ms")
    for key in [k for k in results if k.startswith("service")]:
        report(key, results[key], results.get("engine", {}), configs, args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def report(title: str, service: dict[str, Any], engine: dict[str, Any], configs: list[tuple[str, int, Any]],
           args: argparse.Namespace) -> None:  # fmt: skip
    """The service table (against the engine column where it ran) and where each plan's time went."""
    creates = service["create_ms"]
    print(f"\n{title}: create_lora_training_client (warm pool, through the service): p50 "
          f"{statistics.median(creates):.1f} ms, max {max(creates):.1f} ms over {len(creates)}")  # fmt: skip
    rows = [(workload, n, loop) for workload, n, _ in configs for loop in args.clients.split(",")]
    print(f"{'workload':12} {'tenants':>7} {'loop':>9} {'service tok/s':>14} {'engine tok/s':>13} {'ratio':>6} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'adapters/fb':>11} {'busy':>5}")  # fmt: skip
    for workload, n, loop in rows:
        s = service[service_key(workload, n, loop)]
        e = engine.get(f"{workload}/{n}")
        ratio = f"{s['tok_s'] / e['tok_s']:.3f}" if e else "-"
        etok = f"{e['tok_s']:,.0f}" if e else "-"
        print(f"{workload:12} {n:>7} {loop:>9} {s['tok_s']:>14,.0f} {etok:>13} {ratio:>6} {s['p50_ms']:>8.1f} "
              f"{s['p99_ms']:>8.1f} {s['adapters_per_fb_step']:>11.2f} {s['pool_busy_fraction']:>5.2f}"
              + ("  engine before/after: {:,.0f} / {:,.0f}".format(*e["tok_s_before_after"])
                 if e and "tok_s_before_after" in e else ""))  # fmt: skip
    print("\nwhere a plan's time went, ms per plan (the finisher's record + publish run beside the next plan)")
    parts = ("busy", "read", "plan", "coalesce", "decide", "overhead", "record", "publish")
    print(f"{'workload':12} {'tenants':>7} {'loop':>9} {'engine round':>12} {'plans/round':>11} "
          + " ".join(f"{p:>8}" for p in parts) + f" {'lapsed':>7}")  # fmt: skip
    for workload, n, loop in rows:
        s = service[service_key(workload, n, loop)]
        e = engine.get(f"{workload}/{n}")
        eround = f"{1e3 * e['round_s']:.1f}" if e else "-"
        cells = " ".join(f"{s[f'{p}_ms_per_plan']:>8.1f}" for p in parts)
        print(f"{workload:12} {n:>7} {loop:>9} {eround:>12} {s['plans'] / args.steps:>11.2f} {cells} "
              f"{s.get('lapsed_per_plan', 0.0):>7.2f}  "
              f"connections per gateway worker {s['connections_per_gateway_worker']}")  # fmt: skip


if __name__ == "__main__":
    main()

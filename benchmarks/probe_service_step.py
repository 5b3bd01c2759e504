"""Where a closed-loop training step's time goes through the service: N tenants (one process each) send
forward_backward and optim_step through the Python client and await both, against the embedded stack (real gateway,
Redis, dispatcher, pool). Prints:
- the client's side, p50 over every tenant's timed steps: the two POSTs, the wait for each result, the whole step;
- the pool's side, ms per plan over the same window (the pool's plan totals, queue/stats.py): executing, the read
  wait before a plan (the closed-loop gap as the pool sees it), planning, the coalescing wait, the decision's CPU
  time (the policy and the coalescing replans), the finisher's SQL record and result publish;
- the stages of tenant 0's steps from the pool's request traces (no MONITOR): the result's way to the client, the
  next request's way to the queue and into the pool, the wait before the engine, the engine, the record and store;
- with --trace, the closed loop between processes, from a `redis-cli monitor` of the timed steps (server
  timestamps; the client's own clock beside them, the same host): from a plan's published result to the gateway's
  long-poll reading it, the client holding both results, its next forward_backward queued (XADD) and admitted by
  the pool's loop, the optim_step queued and admitted. MONITOR itself slows Redis: read the trace for where the
  time goes, the untraced run for how much;
- for scale, a `GET /v1/healthz` and a GET of a future already stored.

    python3 benchmarks/probe_service_step.py [--tenants 1] [--steps 60] [--tokens 64] [--trace]
    (LORAPLEX_* settings apply, e.g. LORAPLEX_COALESCE_MS)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_tenant import tenant_datums  # noqa: E402
from loraplex.client import AdamParams, ServiceClient  # noqa: E402
from loraplex.launch.embedded import Stack  # noqa: E402
from loraplex.queue import request_traces  # noqa: E402
from loraplex.queue import stats as plan_stats  # noqa: E402
from loraplex.runtime.netutil import free_port  # noqa: E402
from loraplex.settings import Settings  # noqa: E402
from loraplex.storage.db import make_db_engine, session_factory  # noqa: E402
from loraplex.storage.repositories import TenantRepository, unit_of_work  # noqa: E402

CLIENT_PARTS = ("POST forward_backward", "POST optim_step", "wait forward_backward", "wait optim_step", "step")
POOL_PARTS = ("busy", "read", "plan", "coalesce", "decide", "overhead", "record", "publish")


def p50_ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):6.2f} ms (min {1e3 * min(values):.2f})"


def probe_tenant(base_url: str, key: str, model_id: str, tokens: int, seed: int, warmup: int, steps: int,
                 ready: Any, start: Any, results: Any) -> None:  # fmt: skip
    """One tenant's closed loop; puts (seed, [(fb id, optim id, t0..t4 wall clock)] per timed step) on `results`."""
    try:
        trainer = ServiceClient(base_url, key, timeout=600).training_client(model_id)
        data, adam = tenant_datums(512, [tokens], seed), AdamParams(learning_rate=1e-4)
        out = []
        for i in range(warmup + steps):
            if i == warmup:
                ready.wait()
                start.wait()
            t0 = time.time()
            fb = trainer.forward_backward(data, "cross_entropy")
            t1 = time.time()
            opt = trainer.optim_step(adam)
            t2 = time.time()
            fb.result()
            t3 = time.time()
            opt.result()
            t4 = time.time()
            if i >= warmup:
                out.append((fb.request_id, opt.request_id, t0, t1, t2, t3, t4))
        results.put((seed, out))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        results.put(f"{type(exc).__name__}: {exc}")
        ready.abort()
        start.abort()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tenants", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--tokens", type=int, default=64, help="tokens of each step's one datum")
    p.add_argument("--trace", action="store_true", help="record the timed steps with redis-cli monitor (see the doc)")
    args = p.parse_args()
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="probe-step-")), slots=max(8, args.tenants), max_rank=8)
    monitor_file = settings.home / "monitor.txt"
    with Stack(settings, api_port=free_port()) as stack:
        import redis

        r = redis.Redis.from_url(stack.settings.redis_url)
        with unit_of_work(session_factory(make_db_engine(stack.settings.resolved_database_url))) as session:
            keys = [TenantRepository(session).create_tenant(f"probe{i}-{uuid.uuid4().hex[:6]}")[1]
                    for i in range(args.tenants)]  # fmt: skip
        models = [ServiceClient(stack.base_url, k, timeout=600).create_lora_training_client(rank=8, seed=i).model_id
                  for i, k in enumerate(keys)]  # fmt: skip
        ctx = mp.get_context("spawn")
        ready, start = ctx.Barrier(args.tenants + 1), ctx.Barrier(args.tenants + 1)
        results = ctx.Queue()
        procs = [ctx.Process(target=probe_tenant, args=(stack.base_url, keys[i], models[i], args.tokens, i,
                                                        args.warmup, args.steps, ready, start, results))
                 for i in range(args.tenants)]  # fmt: skip
        for proc in procs:
            proc.start()
        ready.wait(timeout=600)
        time.sleep(0.5)  # the warm-up's last plan's totals land (the finisher adds them after its results)
        before = plan_stats.read(r, settings.pool)
        monitor = None
        if args.trace:
            port = stack.settings.redis_url.rsplit(":", 1)[1].split("/")[0]
            monitor = subprocess.Popen([shutil.which("redis-cli") or "redis-cli", "-p", port, "monitor"],
                                       stdout=monitor_file.open("w"))  # fmt: skip
            time.sleep(0.3)
        start.wait(timeout=600)
        answers = [results.get(timeout=600) for _ in range(args.tenants)]
        if any(isinstance(x, str) for x in answers):
            raise RuntimeError(f"a tenant failed: {[x for x in answers if isinstance(x, str)]}")
        per_tenant = [steps for _, steps in sorted(answers)]  # tenant i's steps at i (keys[i] reads its futures)
        if monitor is not None:
            time.sleep(0.3)
            monitor.terminate()
            monitor.wait()
        for proc in procs:
            proc.join(timeout=30)
        window = plan_stats.read_settled(r, settings.pool, before, fb_requests=args.tenants * args.steps)
        traces = request_traces.read(r, [models[0]])  # written after each plan's results: settled with the window
        parts: dict[str, list[float]] = {name: [] for name in CLIENT_PARTS}
        for steps in per_tenant:
            for _, _, t0, t1, t2, t3, t4 in steps:
                for name, seconds in zip(CLIENT_PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
                    parts[name].append(seconds)
        with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {keys[0]}"}) as http:
            stored = per_tenant[0][-1][0]
            for name, path in (("GET /v1/healthz", "/v1/healthz"), ("GET a stored future", f"/v1/futures/{stored}")):
                times = []
                for _ in range(200):
                    t0 = time.perf_counter()
                    http.get(path).raise_for_status()
                    times.append(time.perf_counter() - t0)
                parts[name] = times[20:]
    print(f"{args.tenants} tenant(s), {args.steps} timed steps each, 1 x {args.tokens} tokens per forward_backward")
    for name, values in parts.items():
        print(f"{name:24} p50 {p50_ms(values)}")
    plans = max(window.plans, 1)
    print(f"pool, ms per plan over {window.plans} plans ({window.plans / args.steps:.2f} per round, "
          f"{window.adapters_per_fb_step:.2f} adapters per forward_backward step, {window.lapsed} expected adapters "
          "not back within the coalescing window):")  # fmt: skip
    print("  " + "  ".join(f"{name} {1e3 * getattr(window, f'{name}_s', 0.0) / plans:.2f}" for name in POOL_PARTS
                           if hasattr(window, f"{name}_s")))  # fmt: skip
    print_stages(traces, per_tenant[0])
    if args.trace:
        print_trace(monitor_file, per_tenant[0])


def print_stages(traces: list[request_traces.TraceRecord], steps: list[tuple[Any, ...]]) -> None:
    """Median stages of tenant 0's timed steps from the pool's request traces (queue/request_traces.py: no MONITOR,
    so these are the untraced run's) and the client's clock, the same host's wall clock: each step from the previous
    step's optim_step result stored. `enqueued` is the stream entry's id, whole milliseconds of Redis's clock, so the
    two gaps that start or end there are ~0.5 ms off each way."""
    by_id = {t.request_id: t for t in traces}
    gaps: dict[str, list[float]] = {}
    for (_pfb, popt, *_, p_done), (fb, opt, *_) in zip(steps, steps[1:], strict=False):
        prev, f, o = by_id.get(popt), by_id.get(fb), by_id.get(opt)
        if prev is None or f is None or o is None:
            continue
        for name, a, b in (
            ("result stored -> the client holds both results", prev.done, p_done),
            ("client holds them -> forward_backward queued", p_done, f.enqueued),
            ("forward_backward queued -> the pool reads it", f.enqueued, f.read),
            ("forward_backward read -> optim_step read", f.read, o.read),
            ("both read -> the engine starts", max(f.read, o.read), min(f.start, o.start)),
            ("the engine runs the plan", min(f.start, o.start), max(f.end, o.end)),
            ("the engine ends -> the results stored", max(f.end, o.end), max(f.done, o.done)),
            ("result stored -> both read (the pool's gap)", prev.done, max(f.read, o.read)),
        ):
            gaps.setdefault(name, []).append(b - a)
    print_gaps(gaps, "stages of a step", "the pool's request traces", "stages: no traced step found")


def print_gaps(gaps: dict[str, list[float]], title: str, source: str, none: str) -> None:
    """Each named gap's median over tenant 0's steps (`none` when no step had them all)."""
    if not gaps:
        print(none)
        return
    print(f"{title} (tenant 0, p50 over {len(next(iter(gaps.values())))} steps, {source}):")
    for name, values in gaps.items():
        print(f"  {name:48} p50 {p50_ms(values)}")


# ---- --trace: the closed loop between processes, from redis-cli monitor -----------------------------------------------
MONITOR_LINE = re.compile(r"([\d.]+) \[\d+ ([^\]]+)\] (.*)")


def print_trace(monitor_file: Path, steps: list[tuple[Any, ...]]) -> None:
    """Median gaps of tenant 0's steps, each from the previous step's results being published (server clock; client
    times from its wall clock). Events: a result stored (the finisher's script: SET result:<id>), the gateway's
    long-poll reading it (GET result:<id> after that), the client holding it, XADD of the next request (the submit
    script), the pool admitting it (its loop's EXISTS result:<id>)."""
    lines = []
    for line in monitor_file.read_text(errors="replace").splitlines():
        m = MONITOR_LINE.match(line)
        if m:
            lines.append((float(m.group(1)), m.group(2) == "lua", m.group(3)))

    def first(commands: tuple[str, ...], needle: str, after: float | None, *, lua: bool | None = None) -> float | None:
        if after is None:
            return None
        for t, in_lua, text in lines:
            if (t >= after and needle in text and text.split(" ", 1)[0].strip('"') in commands
                    and (lua is None or in_lua == lua)):  # fmt: skip
                return t
        return None

    gaps: dict[str, list[float]] = {}
    for (pfb, _popt, *_, p_fb_done, p_opt_done), (fb, opt, *_) in zip(steps, steps[1:], strict=False):
        stored = first(("SET",), f"result:{pfb}", 0.0, lua=True)
        read = first(("GET", "MGET"), f"result:{pfb}", stored, lua=False)
        queued_fb = first(("XADD",), fb, stored, lua=True)
        admitted_fb = first(("EXISTS",), f"result:{fb}", queued_fb)
        queued_opt = first(("XADD",), opt, queued_fb, lua=True)
        admitted_opt = first(("EXISTS",), f"result:{opt}", queued_opt)
        if None in (stored, read, queued_fb, admitted_fb, queued_opt, admitted_opt):
            continue
        for name, a, b in (
            ("result stored -> the long-poll reads it", stored, read),
            ("long-poll read -> the client holds it", read, p_fb_done),
            ("client: -> both results (optim_step's GET)", p_fb_done, p_opt_done),
            ("client: both results -> forward_backward queued", p_opt_done, queued_fb),
            ("forward_backward queued -> the pool admits it", queued_fb, admitted_fb),
            ("forward_backward queued -> optim_step queued", queued_fb, queued_opt),
            ("optim_step queued -> the pool admits it", queued_opt, admitted_opt),
            ("result stored -> forward_backward admitted", stored, admitted_fb),
            ("result stored -> both admitted", stored, max(admitted_fb, admitted_opt)),
        ):
            gaps.setdefault(name, []).append(b - a)  # type: ignore[operator]
    none = "trace: no complete step found in the monitor output"
    print_gaps(gaps, "closed loop between processes", "MONITOR on", none)


if __name__ == "__main__":
    main()

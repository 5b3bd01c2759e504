"""Where one closed-loop training step's time goes through the service: one tenant sends forward_backward and
optim_step through the Python client and awaits both, against the embedded stack (real gateway, Redis, dispatcher,
pool). Prints the p50 of each part: the two POSTs, the wait for each result, the whole step, and for scale a
`GET /v1/healthz` and a GET of a future already stored.

    python3 benchmarks/probe_service_step.py [--steps 80] [--tokens 64]   (LORAPLEX_* settings apply, e.g. COALESCE_MS)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_tenant import tenant_datums  # noqa: E402
from loraplex.client import AdamParams, ServiceClient  # noqa: E402
from loraplex.launch.embedded import Stack  # noqa: E402
from loraplex.runtime.netutil import free_port  # noqa: E402
from loraplex.settings import Settings  # noqa: E402
from loraplex.storage.db import make_db_engine, session_factory  # noqa: E402
from loraplex.storage.repositories import TenantRepository, unit_of_work  # noqa: E402


def p50_ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):6.2f} ms (min {1e3 * min(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--tokens", type=int, default=64, help="tokens of the step's one datum")
    args = p.parse_args()
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="probe-step-")), slots=8, max_rank=8)
    with Stack(settings, api_port=free_port()) as stack:
        with unit_of_work(session_factory(make_db_engine(stack.settings.resolved_database_url))) as session:
            key = TenantRepository(session).create_tenant(f"probe-{uuid.uuid4().hex[:6]}")[1]
        trainer = ServiceClient(stack.base_url, key, timeout=600).create_lora_training_client(rank=8, seed=0)
        data, adam = tenant_datums(512, [args.tokens], 1), AdamParams(learning_rate=1e-4)
        parts: dict[str, list[float]] = {name: [] for name in ("POST forward_backward", "POST optim_step",
                                                               "wait forward_backward", "wait optim_step", "step")}  # fmt: skip
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            fb = trainer.forward_backward(data, "cross_entropy")
            t1 = time.perf_counter()
            opt = trainer.optim_step(adam)
            t2 = time.perf_counter()
            fb.result()
            t3 = time.perf_counter()
            opt.result()
            t4 = time.perf_counter()
            if i >= args.warmup:
                for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
                    parts[name].append(seconds)
        with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}) as http:
            for name, path in (("GET /v1/healthz", "/v1/healthz"), ("GET a stored future", f"/v1/futures/{fb.request_id}")):
                times = []
                for _ in range(200):
                    t0 = time.perf_counter()
                    http.get(path).raise_for_status()
                    times.append(time.perf_counter() - t0)
                parts[name] = times[20:]
    for name, values in parts.items():
        print(f"{name:24} p50 {p50_ms(values)}")


if __name__ == "__main__":
    main()

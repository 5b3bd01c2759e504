"""What one training POST costs the gateway, with the pool stopped (SIGSTOP) so that requests only queue: p50 and min
over N requests of each kind, three ways:
- `service`: service/training.forward_backward called directly (the adapter check and the Redis submit script);
- `asgi`: the app in this process through httpx's ASGI transport (no server, no sockets: the app's own cost plus
  the client's);
- `http`: the embedded stack's uvicorn gateway over HTTP from an httpx client (what a client meets).
The routes: the native forward_backward, forward and optim_step, the Tinker forward_backward (protobuf) and
optim_step, and GET /v1/healthz for scale (measured first: it answers 503 once the stopped pool's heartbeat is stale).

    python3 benchmarks/bench_gateway_post.py [--requests 500] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from benchmarks.service_tenant import tenant_datums  # noqa: E402
from loraplex.api.app import create_app  # noqa: E402
from loraplex.api.deps import tenant_for_key  # noqa: E402
from loraplex.client import ServiceClient  # noqa: E402
from loraplex.launch.embedded import Stack  # noqa: E402
from loraplex.protocol import DatumPayload, ForwardBackwardPayload  # noqa: E402
from loraplex.runtime.netutil import free_port  # noqa: E402
from loraplex.service import training  # noqa: E402
from loraplex.service.build import build_services  # noqa: E402
from loraplex.settings import Settings  # noqa: E402
from loraplex.storage.db import make_db_engine, session_factory  # noqa: E402
from loraplex.storage.repositories import TenantRepository, unit_of_work  # noqa: E402

WARMUP = 30


def report(name: str, seconds: list[float]) -> None:
    s = sorted(seconds[WARMUP:])
    print(f"{name:30s} p50 {1e3 * s[len(s) // 2]:6.3f} ms  (min {1e3 * s[0]:.3f})", flush=True)


def cases(model_id: str, datum: dict[str, Any]) -> list[tuple[str, str, str, Callable[[int], dict[str, Any]]]]:
    """(name, method, path, seq_id -> httpx request arguments)."""
    body = {"data": [datum], "loss_fn": "cross_entropy"}
    adam = {"learning_rate": 1e-4}
    tinker_datum = types.Datum(model_input=types.ModelInput.from_ints(datum["model_input"]),
                               loss_fn_inputs=datum["loss_fn_inputs"])  # fmt: skip

    def tinker_fb(seq_id: int) -> bytes:
        fb_input = types.ForwardBackwardInput(data=[tinker_datum], loss_fn="cross_entropy")
        request = types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id=model_id, seq_id=seq_id)
        return forward_backward_request_to_proto(request).SerializeToString()

    native = f"/v1/adapters/{model_id}"
    return [
        ("healthz", "GET", "/v1/healthz", lambda s: {}),
        ("forward_backward", "POST", f"{native}/forward_backward", lambda s: {"json": {**body, "seq_id": s}}),
        ("forward", "POST", f"{native}/forward", lambda s: {"json": {**body, "seq_id": s}}),
        ("optim_step", "POST", f"{native}/optim_step", lambda s: {"json": {"seq_id": s, "adam_params": adam}}),
        ("tinker forward_backward", "POST", "/api/v1/forward_backward",
         lambda s: {"content": tinker_fb(s), "headers": {"Content-Type": "application/x-protobuf"}}),
        ("tinker optim_step", "POST", "/api/v1/optim_step",
         lambda s: {"json": {"model_id": model_id, "seq_id": s, "adam_params": adam}}),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=500, help="timed requests of each kind, each way")
    p.add_argument("--tokens", type=int, default=64, help="tokens of the one datum of each forward_backward")
    args = p.parse_args()
    n = args.requests + WARMUP
    settings = Settings(home=Path(tempfile.mkdtemp(prefix="bench-gw-")), slots=8, max_rank=8,
                        tenant_requests_per_second=0, max_queued_requests_per_tenant=100_000)  # fmt: skip
    with Stack(settings, api_port=free_port()) as stack:
        with unit_of_work(session_factory(make_db_engine(stack.settings.resolved_database_url))) as db:
            key = TenantRepository(db).create_tenant(f"bench-{uuid.uuid4().hex[:6]}")[1]
        model_id = ServiceClient(stack.base_url, key, timeout=600).create_lora_training_client(rank=8).model_id
        d = tenant_datums(512, [args.tokens], 0)[0]
        datum = {
            "model_input": list(d.model_input),
            "loss_fn_inputs": {k: list(v) for k, v in d.loss_fn_inputs.items()},
        }
        routes = cases(model_id, datum)
        seq_ids = iter(range(1, 10**9))
        services = build_services(stack.settings)
        tenant = asyncio.run(tenant_for_key(services, key))
        headers = {"Authorization": f"Bearer {key}"}
        pool = stack.child("pool").pid
        os.kill(pool, signal.SIGSTOP)
        try:
            seconds = []
            for _ in range(n):
                payload = ForwardBackwardPayload(data=(DatumPayload(datum["model_input"], datum["loss_fn_inputs"]),))
                t0 = time.perf_counter()
                training.forward_backward(services, tenant, model_id, next(seq_ids), payload)
                seconds.append(time.perf_counter() - t0)
            report("service forward_backward", seconds)

            app = create_app(stack.settings)

            async def in_process() -> None:
                async with app.router.lifespan_context(app):
                    transport = httpx.ASGITransport(app=app)
                    async with httpx.AsyncClient(transport=transport, base_url="http://x", headers=headers) as c:
                        for name, method, path, request in routes:
                            seconds = []
                            for _ in range(n):
                                kw = request(next(seq_ids))
                                t0 = time.perf_counter()
                                r = await c.request(method, path, **kw)
                                seconds.append(time.perf_counter() - t0)
                                assert r.status_code < 300, (name, r.status_code, r.text[:300])
                            report(f"asgi {name}", seconds)

            asyncio.run(in_process())
            with httpx.Client(base_url=stack.base_url, headers=headers) as c:
                for name, method, path, request in routes:
                    seconds = []
                    for _ in range(n):
                        kw = request(next(seq_ids))
                        t0 = time.perf_counter()
                        r = c.request(method, path, **kw)
                        seconds.append(time.perf_counter() - t0)
                        assert r.status_code < 300 or name == "healthz", (name, r.status_code, r.text[:300])
                    report(f"http {name}", seconds)
        finally:
            os.kill(pool, signal.SIGCONT)


if __name__ == "__main__":
    main()

"""Pure-policy benchmark: plans per second of dispatch/policy.plan_batch with 1,000 pending requests
from 200 adapters (20 tenants, weighted), as the pool's dispatcher calls it: the pool's limits (16,384-token steps,
8 slots, 256 requests, 8 rounds), the fair-share ledger's view, the tenant weights and the calibrated cost model.
Target: >= 500 plans/s, <= 2 ms per plan.

    .venv/bin/python benchmarks/bench_policy.py            # CPU, seconds; --plans N, --no-cost to leave the cost out

Each adapter holds a chain of 5 requests (forward_backward of 1-4 datums x 64-512 tokens, then optim_step, ...), some
adapters a gap. Every timed call plans from the same 1,000 pending requests, so each is a full-size plan."""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.dispatch.cost_calibration import OnlineCostModel  # noqa: E402
from loraplex.dispatch.cost_model import default_cost  # noqa: E402
from loraplex.dispatch.fair_share import FairShareLedger  # noqa: E402
from loraplex.dispatch.policy import PolicyLimits, plan_batch  # noqa: E402
from loraplex.protocol import PlannedRequest, RequestKind  # noqa: E402


def pending_set(adapters: int, per_adapter: int, tenants: int, seed: int) -> list[PlannedRequest]:
    rng = random.Random(seed)
    out: list[PlannedRequest] = []
    for a in range(adapters):
        tenant = f"t{a % tenants}"
        for seq in range(1, per_adapter + 1):
            if seq % 2 == 1:
                data = [{"model_input": [1] * rng.choice([64, 128, 256, 512]), "loss_fn_inputs": {}}
                        for _ in range(rng.randint(1, 4))]  # fmt: skip
                kind, payload = RequestKind.FORWARD_BACKWARD, {"data": data, "loss_fn": "cross_entropy"}
            else:
                kind, payload = RequestKind.OPTIM_STEP, {"adam_params": {"learning_rate": 1e-4}}
            if a % 50 == 7 and seq == 3:
                continue  # a gap: the adapter's later requests wait (reported as blocked)
            out.append(PlannedRequest(f"r{a}-{seq}", tenant, f"m{a}", seq, kind, payload))
    rng.shuffle(out)  # arrival order interleaves tenants
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapters", type=int, default=200)
    p.add_argument("--per-adapter", type=int, default=5)
    p.add_argument("--tenants", type=int, default=20)
    p.add_argument("--plans", type=int, default=2000)
    p.add_argument("--no-cost", action="store_true", help="plan without the cost model (one mixed step per round)")
    args = p.parse_args()

    pending = pending_set(args.adapters, args.per_adapter, args.tenants, seed=0)
    limits = PolicyLimits(plan_tokens=16384, max_requests=256, max_rounds=8, max_adapters_per_step=8)
    weights = {f"t{i}": 1.0 + i % 3 for i in range(args.tenants)}
    cost = None if args.no_cost else OnlineCostModel(default_cost("cuda"), 4096)
    ledger = FairShareLedger()
    tenants = {r.tenant_id for r in pending}
    last: dict[str, int | None] = {}
    first = plan_batch(pending, last, limits, share=ledger.view(tenants), weights=weights, cost=cost)
    ledger.charge(first.plan, weights, tenants)  # a ledger with history, as in a running pool
    share = ledger.view(tenants)
    gc.collect()
    times: list[float] = []
    for _ in range(args.plans):
        t0 = time.perf_counter()
        plan_batch(pending, last, limits, share=share, weights=weights, cost=cost)
        times.append(time.perf_counter() - t0)
    times.sort()
    mean = statistics.fmean(times)
    steps = first.plan.steps
    print(f"pending {len(pending)} requests from {args.adapters} adapters, {args.tenants} tenants; cost model "
          f"{'off' if cost is None else 'on'}")  # fmt: skip
    print(f"a plan: {len(first.plan.requests)} requests in {len(steps)} steps ({sum(s.kind == 'forward_backward' for s in steps)} "
          f"forward_backward), {len(first.pending)} left pending, {len(first.blocked)} adapters blocked")  # fmt: skip
    print(f"plans/s {1 / mean:,.0f}; ms per plan: mean {1e3 * mean:.3f}, p50 {1e3 * times[len(times) // 2]:.3f}, "
          f"p99 {1e3 * times[int(0.99 * (len(times) - 1))]:.3f}, max {1e3 * times[-1]:.3f} over {args.plans}")  # fmt: skip


if __name__ == "__main__":
    main()

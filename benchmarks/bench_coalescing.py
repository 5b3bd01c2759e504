"""The dispatcher's decision per plan while it coalesces closed-loop tenants (pure logic, no services): N tenants'
forward_backward + optim_step come back one request per read, as the pool's loop sees them after a plan answered all
of them, and the loop decides after each arrival whether to run or wait (dispatch/loop.py `_coalesce`). Timed: the
policy calls and the checks the loop makes for one plan, over all its arrivals (the Redis reads and admits are
not: the real loop's `decide_ms_per_plan`, its thread's CPU time, counts those too: probe_service_step.py).

    python3 benchmarks/bench_coalescing.py [--tenants 4,16] [--plans 300] [--tokens 512]

Modes: `plan-per-arrival` plans the whole buffer again after every arrival (the loop before dispatch/policy.takes_all);
`takes-all` adds each arrival to a PlanFit (dispatch/policy.py: whether the plan surely takes every request) and plans
only when the plan might be full, and once at the end (the loop now). Both end with the same plan (checked)."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.dispatch.cost_calibration import OnlineCostModel  # noqa: E402
from loraplex.dispatch.cost_model import default_cost  # noqa: E402
from loraplex.dispatch.fair_share import FairShareLedger  # noqa: E402
from loraplex.dispatch.policy import PlanFit, PolicyLimits, PolicyResult, plan_batch  # noqa: E402
from loraplex.protocol import PlannedRequest, RequestKind  # noqa: E402

ADAM = {"learning_rate": 1e-4}


def arrivals(tenants: int, tokens: int, seq: int) -> list[PlannedRequest]:
    """Each tenant's next forward_backward (1 x `tokens`) and optim_step, tenant after tenant."""
    out = []
    for t in range(tenants):
        data = [{"model_input": list(range(tokens)), "loss_fn_inputs": {"target_tokens": list(range(tokens))}}]
        fb = {"data": data, "loss_fn": "cross_entropy"}
        out.append(PlannedRequest(f"fb{t}-{seq}", f"t{t}", f"m{t}", seq, RequestKind.FORWARD_BACKWARD, fb))
        out.append(PlannedRequest(f"o{t}-{seq}", f"t{t}", f"m{t}", seq + 1, RequestKind.OPTIM_STEP, {"adam_params": ADAM}))
    return out


class LoopPolicy:
    """What Dispatcher._plan and _coalesce call, with the pool's arguments: the applied seq_ids, the fair-share
    ledger's view, the tenants' weights and the online cost model."""

    def __init__(self, tenants: int, microbatch_tokens: int) -> None:
        self.limits = PolicyLimits(plan_tokens=16384, max_adapters_per_step=max(8, tenants))
        self.cost = OnlineCostModel(default_cost("cpu"), microbatch_tokens)
        self.ledger = FairShareLedger()
        self.applied: dict[str, int | None] = {}
        self.weights: dict[str, float] = {}

    def plan(self, buffer: list[PlannedRequest]) -> PolicyResult:
        view = {m: self.applied.get(m) for m in {r.model_id for r in buffer}}
        tenants = {r.tenant_id for r in buffer}
        weights = {t: self.weights.get(t, 1.0) for t in tenants}
        return plan_batch(buffer, view, self.limits, {}, share=self.ledger.view(tenants), weights=weights,
                          cost=self.cost, sampling={})  # fmt: skip

    def fit(self) -> PlanFit:
        return PlanFit(self.applied, self.limits, {})

    def answered(self, decision: PolicyResult) -> None:
        self.ledger.charge(decision.plan, self.weights, {r.tenant_id for r in decision.plan.requests}, {})
        self.applied.update(decision.applied_seq)


def decide(policy: LoopPolicy, incoming: list[PlannedRequest], mode: str) -> PolicyResult:
    """One plan's decision as the loop makes it, one arrival per read (see the module doc)."""
    buffer = [incoming[0]]
    decision = policy.plan(buffer)  # run_once's plan of the first arrival
    stale, fit = False, None
    for r in incoming[1:]:
        held = len(buffer)
        buffer.append(r)
        if mode == "takes-all":
            if fit is None:
                fit, held = policy.fit(), 0
            if fit.add(buffer[held:]):
                stale = True
                continue
        decision, stale = policy.plan(buffer), False
        if decision.pending:
            return decision
    return policy.plan(buffer) if stale else decision


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tenants", default="4,16")
    p.add_argument("--plans", type=int, default=300)
    p.add_argument("--tokens", type=int, default=512, help="tokens of each forward_backward's one datum")
    p.add_argument("--microbatch-tokens", type=int, default=4096)
    args = p.parse_args()
    for tenants in (int(t) for t in args.tenants.split(",")):  # both modes choose the same plans
        a, b = LoopPolicy(tenants, args.microbatch_tokens), LoopPolicy(tenants, args.microbatch_tokens)
        for seq in range(1, 41, 2):
            incoming = arrivals(tenants, args.tokens, seq)
            one, other = decide(a, incoming, "plan-per-arrival"), decide(b, incoming, "takes-all")
            assert one.plan == other.plan and one.pending == other.pending, (tenants, seq)
            a.answered(one)
            b.answered(other)
    print(f"{'tenants':>7} {'mode':>16} {'ms per plan: mean':>18} {'p50':>7} {'p99':>7} {'policy calls':>12}")
    for tenants in (int(t) for t in args.tenants.split(",")):
        for mode in ("plan-per-arrival", "takes-all"):
            policy = LoopPolicy(tenants, args.microbatch_tokens)
            calls = 0
            real_plan = policy.plan

            def counted(buffer: list[PlannedRequest], real=real_plan) -> PolicyResult:  # type: ignore[no-untyped-def]
                nonlocal calls
                calls += 1
                return real(buffer)

            policy.plan = counted  # type: ignore[method-assign]
            times: list[float] = []
            seq = 1
            gc.collect()
            for _ in range(args.plans):
                incoming = arrivals(tenants, args.tokens, seq)
                t0 = time.perf_counter()
                decision = decide(policy, incoming, mode)
                times.append(time.perf_counter() - t0)
                assert not decision.pending and len(decision.plan.requests) == 2 * tenants
                policy.answered(decision)
                seq += 2
            times.sort()
            print(f"{tenants:>7} {mode:>16} {1e3 * statistics.fmean(times):>18.3f} {1e3 * times[len(times) // 2]:>7.3f} "
                  f"{1e3 * times[int(0.99 * (len(times) - 1))]:>7.3f} {calls / args.plans:>12.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""The pool's SQL record of one closed-loop plan (forward_backward + optim_step of one adapter): `PlanFinish.record`,
the transaction a result waits for before it is stored (pool/finish.py), timed alone on a fresh SQLite database (or
the PostgreSQL at --database-url), fenced by a pools row as a leader's is.

    python3 benchmarks/probe_plan_record.py [--plans 300] [--database-url postgresql+psycopg://...]

Printed: the record's p50 and min in ms. Run it with another tree first on PYTHONPATH for an A/B of the same host."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.pool.finish import PlanFinish  # noqa: E402
from loraplex.protocol import BatchPlan, Outcome, PlannedRequest, RequestKind, Step, StepKind  # noqa: E402
from loraplex.protocol.results import ForwardBackwardResult, OptimStepResult  # noqa: E402
from loraplex.queue.lease import PoolLease  # noqa: E402
from loraplex.storage.db import make_db_engine, migrate, session_factory, unit_of_work  # noqa: E402
from loraplex.storage.repositories import AdapterRepository, PoolRepository, TenantRepository  # noqa: E402


class _Token(PoolLease):
    """A lease held for good, without Redis: the record's fencing check reads its token only."""

    def __init__(self, token: int) -> None:
        self.token = token

    def mark_lost(self, reason: str) -> None:
        raise AssertionError(reason)


def closed_loop_plan(tenant_id: str, model_id: str, step: int) -> tuple[BatchPlan, list[Outcome]]:
    """A closed loop's plan: one forward_backward of 512 tokens, then its optim_step, both answered."""
    datum = {"model_input": list(range(512)), "loss_fn_inputs": {}}
    payload = {"data": [datum], "loss_fn": "cross_entropy"}
    fb = PlannedRequest(f"fb{step}", tenant_id, model_id, 2 * step + 1, RequestKind.FORWARD_BACKWARD, payload)
    opt = PlannedRequest(f"opt{step}", tenant_id, model_id, 2 * step + 2, RequestKind.OPTIM_STEP, {})
    plan = BatchPlan((Step(StepKind.FORWARD_BACKWARD, (fb,)), Step(StepKind.OPTIM_STEP, (opt,))))
    return plan, [
        Outcome(fb.request_id, result=ForwardBackwardResult()),
        Outcome(opt.request_id, result=OptimStepResult()),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plans", type=int, default=300)
    parser.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    args = parser.parse_args()
    url = args.database_url or f"sqlite:///{tempfile.mkdtemp(prefix='probe-record-')}/loraplex.db"
    migrate(url)
    sessions = session_factory(make_db_engine(url))
    pool, model_id = f"probe-{uuid.uuid4().hex[:8]}", f"m-{uuid.uuid4().hex[:8]}"
    with unit_of_work(sessions) as session:
        tenant, _ = TenantRepository(session).create_tenant(f"probe-{uuid.uuid4().hex[:8]}")
        AdapterRepository(session, tenant.id).create(model_id, "tiny", 8, 16.0, ["q_proj"], seed=0)
        PoolRepository(session).take_leadership(pool, 1, "tiny", 1, 4)
        tenant_id = tenant.id
    finish = PlanFinish(sessions, pool=pool, lease=_Token(1))
    seconds: list[float] = []
    for step in range(args.plans + 30):  # the first 30 warm the statement caches and the connection pool
        plan, outcomes = closed_loop_plan(tenant_id, model_id, step)
        start = time.perf_counter()
        finish.record(plan, outcomes, 0.03)
        if step >= 30:
            seconds.append(time.perf_counter() - start)
    print(f"{url.split(':')[0]}: the record of a closed-loop plan p50 {1e3 * statistics.median(seconds):.3f} ms "
          f"(min {1e3 * min(seconds):.3f}) over {len(seconds)} plans")  # fmt: skip


if __name__ == "__main__":
    main()

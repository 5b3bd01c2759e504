"""Around the adapter store: the policy keeps each step within the slots, and the store's tier moves land in the
`residency` table (ResidencyRepository upsert, the pool recorder's one transaction per plan)."""

from __future__ import annotations

import itertools

from sqlalchemy.orm import Session, sessionmaker

from loraplex.dispatch.hooks import AnsweredPlan
from loraplex.dispatch.policy import PolicyLimits, plan_batch
from loraplex.pool.finish import PlanFinish
from loraplex.protocol import BatchPlan, Outcome, PlannedRequest, RequestKind, Step, StepKind
from loraplex.protocol.results import OptimStepResult
from loraplex.storage.db import unit_of_work
from loraplex.storage.enums import ResidencyTier
from loraplex.storage.repositories import AdapterRepository, ResidencyRepository, TenantRepository
from loraplex.workers.state.adapter_store import TierChange

FB, OPT = RequestKind.FORWARD_BACKWARD, RequestKind.OPTIM_STEP
_ids = itertools.count()


def req(model: str, seq: int, kind: RequestKind, tenant: str) -> PlannedRequest:
    payload: dict = {}
    if kind == FB:
        payload = {"data": [{"model_input": [0] * 8, "loss_fn_inputs": {}}], "loss_fn": "cross_entropy"}
    return PlannedRequest(f"r{next(_ids)}", tenant, model, seq, kind, payload)


def test_policy_never_puts_more_adapters_in_a_step_than_slots_and_stays_fair() -> None:
    # Tenant one has six adapters, tenant two has one (arriving last); each adapter: forward_backward, optim_step.
    models = [(f"one-{i}", "one") for i in range(6)] + [("two-0", "two")]
    pending = [req(m, s, kind, t) for m, t in models for s, kind in ((1, FB), (2, OPT))]
    last: dict[str, int | None] = dict.fromkeys((m for m, _ in models), 0)
    limits = PolicyLimits(max_adapters_per_step=2, max_requests=6)
    first_plan = None
    while pending:
        out = plan_batch(pending, last, limits)
        assert out.plan.steps, "no progress"
        for step in out.plan.steps:
            assert step.kind in (StepKind.FORWARD_BACKWARD, StepKind.OPTIM_STEP)
            assert len({r.model_id for r in step.requests}) <= 2
        first_plan = first_plan or out.plan
        last.update(out.applied_seq)
        pending = list(out.pending)
    assert all(v == 2 for v in last.values())
    # Fair share: tenant two's adapter is in the first step although five of tenant one's arrived before it.
    assert "two-0" in {r.model_id for r in first_plan.steps[0].requests}


def test_policy_default_limit_changes_nothing() -> None:
    pending = [req(f"m{i}", 1, FB, f"t{i}") for i in range(20)]
    out = plan_batch(pending, {}, PolicyLimits())
    assert [len(s.requests) for s in out.plan.steps] == [20]


def _adapters(factory: sessionmaker[Session], *model_ids: str) -> str:
    with unit_of_work(factory) as s:
        tenant, _ = TenantRepository(s).create_tenant("acme")
        for m in model_ids:
            AdapterRepository(s, tenant.id).create(m, "tiny", 2, 4.0, ["q_proj"], seed=0)
        return tenant.id


def test_residency_repository_upserts_one_row_per_adapter_pool_and_rank(factory: sessionmaker[Session]) -> None:
    _adapters(factory, "a", "b")
    with unit_of_work(factory) as s:
        repo = ResidencyRepository(s)
        repo.record("a", "pool", 0, "gpu", slot=3)
        repo.record("a", "pool", 1, "gpu", slot=3)
        repo.record("b", "pool", 0, "cpu")
    with unit_of_work(factory) as s:
        repo = ResidencyRepository(s)
        first = repo.get("a", "pool", 0).updated_at
        repo.record("a", "pool", 0, "disk", location="/spill/a.safetensors")
    with factory() as s:
        repo = ResidencyRepository(s)
        row = repo.get("a", "pool", 0)
        assert (row.tier, row.slot, row.location) == (ResidencyTier.DISK, None, "/spill/a.safetensors")
        assert row.updated_at >= first
        assert [(r.model_id, r.rank, str(r.tier)) for r in repo.list("pool")] == [
            ("a", 0, "disk"), ("b", 0, "cpu"), ("a", 1, "gpu"),
        ]  # fmt: skip
        assert [r.model_id for r in repo.list("pool", rank=1)] == ["a"]
    with unit_of_work(factory) as s:
        ResidencyRepository(s).record("b", "other", 0, "gpu", slot=0)
        assert ResidencyRepository(s).clear("pool") == 3  # a starting pool drops its rows, not another pool's
    with factory() as s:
        assert [(r.model_id, r.pool) for r in ResidencyRepository(s).list()] == [("b", "other")]


def test_record_changes_upserts_removes_and_skips_unknown_adapters(factory: sessionmaker[Session]) -> None:
    _adapters(factory, "a", "b")
    with unit_of_work(factory) as s:
        done = ResidencyRepository(s).record_changes(
            "pool", 0, [TierChange("a", "gpu", 0), TierChange("b", "cpu"), TierChange("ghost", "gpu", 1)]
        )
        assert done == 2
    with unit_of_work(factory) as s:
        ResidencyRepository(s).record_changes("pool", 0, [TierChange("a", None), TierChange("b", "disk", None, "/x")])
    with factory() as s:
        rows = ResidencyRepository(s).list()
        assert [(r.model_id, str(r.tier), r.location) for r in rows] == [("b", "disk", "/x")]


class _FakeStore:
    def __init__(self, changes: list[TierChange]) -> None:
        self.changes = changes

    def drain_changes(self) -> list[TierChange]:
        out, self.changes = self.changes, []
        return out


def test_the_pool_recorder_writes_the_drained_changes_with_the_plan(factory: sessionmaker[Session]) -> None:
    tenant = _adapters(factory, "a", "b")
    store = _FakeStore([TierChange("a", "gpu", 1), TierChange("b", "disk", None, "/spill/b"), TierChange("z", "cpu")])
    finish = PlanFinish(factory, pool="p1", store=store)
    plan = BatchPlan((Step(StepKind.OPTIM_STEP, (PlannedRequest("r1", tenant, "a", 1, OPT),)),))
    finish.record(plan, [Outcome("r1", result=OptimStepResult())], tier_moves=finish.on_loop(plan))
    with factory() as s:
        assert [(r.model_id, r.pool, r.rank, str(r.tier), r.slot) for r in ResidencyRepository(s).list()] == [
            ("a", "p1", 0, "gpu", 1), ("b", "p1", 0, "disk", None),
        ]  # fmt: skip
        assert AdapterRepository(s, tenant).get("a").applied_seq_id == 1  # the same transaction
    assert store.changes == []


class _Runs:
    """An executor that moves adapters while it runs (as the store does on the loop thread)."""

    def __init__(self, store: _FakeStore, moves: list[TierChange]) -> None:
        self.store, self.moves = store, moves

    def execute(self, plan: BatchPlan) -> list[Outcome]:
        self.store.changes += self.moves
        return [Outcome(r.request_id, result=OptimStepResult()) for r in plan.requests]


def test_the_pool_drains_tier_moves_on_the_loop_thread_and_records_them_with_their_plan(
    factory: sessionmaker[Session],
) -> None:
    """The finish step drains the store right after each plan (`on_loop`, on the thread that moves adapters), and
    writes each plan's moves with that plan (on the finisher thread, handed back in the answered plan), even when the
    next plan ran in between."""
    tenant = _adapters(factory, "a", "b")
    store = _FakeStore([])
    runs = _Runs(store, [TierChange("a", "gpu", 0)])
    finish = PlanFinish(factory, pool="p1", store=store)
    published: list[list[Outcome]] = []

    def answered(plan: BatchPlan) -> AnsweredPlan:
        outcomes = runs.execute(plan)
        return AnsweredPlan(plan, outcomes, 0.0, finish.on_loop(plan), published.append, lambda: None)

    first = answered(BatchPlan((Step(StepKind.OPTIM_STEP, (PlannedRequest("r1", tenant, "a", 1, OPT),)),)))
    assert store.changes == []  # drained on the loop thread, not left for another thread
    runs.moves = [TierChange("a", "cpu"), TierChange("b", "gpu", 0)]
    second = answered(BatchPlan((Step(StepKind.OPTIM_STEP, (PlannedRequest("r2", tenant, "b", 1, OPT),)),)))
    finish(first)
    with factory() as s:
        assert [(r.model_id, str(r.tier)) for r in ResidencyRepository(s).list()] == [("a", "gpu")]
    finish(second)
    assert len(published) == 2
    with factory() as s:
        assert sorted((r.model_id, str(r.tier)) for r in ResidencyRepository(s).list()) == [("a", "cpu"), ("b", "gpu")]

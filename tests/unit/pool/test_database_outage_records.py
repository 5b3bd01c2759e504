"""A plan's SQL writes while the database is away (tests/e2e/test_postgres_restart.py does it with a real
PostgreSQL crash): `retry_database` waits for an outage and nothing else; the pool's finish step (pool/finish.py) runs
its plan's transaction again (once only when a COMMIT's answer was lost: usage is never counted twice); a save's
checkpoint row waits instead of failing the save. Outages are injected as OperationalError from session hooks, on SQLite."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.pool.finish import PlanFinish
from loraplex.pool.records import applied_seq_lookup
from loraplex.protocol import BatchPlan, Outcome, PlannedRequest, RequestKind, Step, StepKind
from loraplex.protocol.results import OptimStepResult, SaveResult
from loraplex.runtime.logutil import RateLimitedLog
from loraplex.storage.db import database_unavailable, unit_of_work
from loraplex.storage.models import Checkpoint, Usage
from loraplex.storage.outage import retry_database
from loraplex.storage.repositories import AdapterRepository, TenantRepository

WARN = RateLimitedLog(logging.getLogger("test"), every_s=0.0)


def _gone() -> OperationalError:
    return OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_retry_database_waits_out_an_outage_and_returns_the_value() -> None:
    clock, calls = _Clock(), []

    def call() -> str:
        calls.append(clock.now)
        if len(calls) < 4:
            raise _gone()
        return "done"

    assert retry_database(call, "testing", WARN, outage_s=60, clock=clock, sleep=clock.sleep) == "done"
    assert len(calls) == 4 and clock.sleeps == [0.1, 0.2, 0.4]  # backoff, capped at 1 s


def test_retry_database_gives_up_after_the_outage_window_and_never_retries_other_errors() -> None:
    clock = _Clock()

    def down() -> None:
        raise _gone()

    with pytest.raises(OperationalError):
        retry_database(down, "testing", WARN, outage_s=5, clock=clock, sleep=clock.sleep)
    assert 5 <= clock.now < 7

    calls = []

    def broken() -> None:
        calls.append(1)
        raise IntegrityError("INSERT", {}, Exception("duplicate key"))

    with pytest.raises(IntegrityError):
        retry_database(broken, "testing", WARN, clock=clock, sleep=clock.sleep)
    assert calls == [1]
    assert database_unavailable(_gone()) and not database_unavailable(IntegrityError("x", {}, Exception()))


def _tenant_with_adapter(factory: sessionmaker[Session], model_id: str = "m") -> str:
    with unit_of_work(factory) as s:
        tenant, _ = TenantRepository(s).create_tenant("acme")
        AdapterRepository(s, tenant.id).create(model_id, "tiny", 2, 4.0, ["q_proj"], seed=0)
        return tenant.id


def _fail_commits(factory: sessionmaker[Session], times: int, after: bool) -> list[int]:
    """The next `times` COMMITs raise OperationalError: before the COMMIT (rolled back) or after it (it went
    through, its answer lost). Returns the list counting them."""
    failed: list[int] = []
    base = factory.class_

    class Flaky(base):  # type: ignore[misc, valid-type]
        def commit(self) -> None:
            if len(failed) < times and not after:
                failed.append(1)
                raise _gone()
            super().commit()
            if len(failed) < times:
                failed.append(1)
                raise _gone()

    factory.class_ = Flaky
    return failed


def _fb_plan(tenant: str, seq: int) -> BatchPlan:
    fb = PlannedRequest(
        f"r{seq}", tenant, "m", seq, RequestKind.FORWARD_BACKWARD,
        {"data": [{"model_input": [1, 2, 3], "loss_fn_inputs": {}}], "loss_fn": "cross_entropy"},
    )  # fmt: skip
    return BatchPlan((Step(StepKind.FORWARD_BACKWARD, (fb,)),))


def _usage(factory: sessionmaker[Session]) -> int:
    with factory() as s:
        return int(s.scalar(select(func.count()).select_from(Usage)) or 0)


@pytest.mark.parametrize("after", [False, True], ids=["rolled-back", "commit-answer-lost"])
def test_the_recorder_waits_for_the_database_and_records_each_plan_once(
    factory: sessionmaker[Session], after: bool
) -> None:
    tenant = _tenant_with_adapter(factory)
    plan = _fb_plan(tenant, 1)
    failed = _fail_commits(factory, 2 if not after else 1, after=after)
    PlanFinish(factory).record(plan, [Outcome("r1", result=OptimStepResult())], 0.01)
    assert failed  # the outage happened
    with factory() as s:
        assert AdapterRepository(s, tenant).get("m").applied_seq_id == 1
    assert _usage(factory) == 1  # once, also when the first COMMIT went through unanswered
    plan2 = _fb_plan(tenant, 2)  # the next plan is recorded as usual
    PlanFinish(factory).record(plan2, [Outcome("r2", result=OptimStepResult())], 0.01)
    assert _usage(factory) == 2


def test_the_applied_seq_lookup_waits_for_the_database(factory: sessionmaker[Session]) -> None:
    tenant = _tenant_with_adapter(factory)
    with unit_of_work(factory) as s:
        AdapterRepository(s, tenant).record_applied("m", 3)
    failed: list[int] = []

    def hook(session: Session, *args: object) -> None:
        if len(failed) < 2:
            failed.append(1)
            raise _gone()

    event.listen(factory, "do_orm_execute", hook)
    assert applied_seq_lookup(factory)("m") == 3
    assert len(failed) == 2


def test_a_save_whose_row_meets_the_database_away_waits_and_succeeds(factory: sessionmaker[Session]) -> None:
    tenant = _tenant_with_adapter(factory)
    save = PlannedRequest(
        "s1", tenant, "m", 1, RequestKind.SAVE_STATE,
        {"name": "c1", "path": "tinker://m/weights/c1", "blob_uri": "file:///nowhere/c1", "base_model": "tiny"},
    )  # fmt: skip
    failed = _fail_commits(factory, 3, after=False)
    saved = Outcome("s1", result=SaveResult(path="tinker://m/weights/c1", kind="state", name="c1", step=1, size_bytes=1,
                                            sha256="x"))  # fmt: skip
    (outcome,) = PlanFinish(factory).record(BatchPlan((Step(StepKind.CHECKPOINT, (save,)),)), [saved])
    assert outcome.ok, outcome.error  # before: "checkpoint saved but not recorded", a failed save
    assert len(failed) == 3
    with factory() as s:
        assert s.scalar(select(func.count()).select_from(Checkpoint)) == 1

"""Sampling requests in the policy: in no chain (any order, no gaps), one SAMPLE step per plan ahead of training, the
by fair share (then oldest first) within a row budget, runs in flight first, duplicates by (sampling session, seq_id), nothing recorded as applied."""

from __future__ import annotations

from loraplex.dispatch.fair_share import FairShareLedger
from loraplex.dispatch.policy import PolicyLimits, plan_batch
from loraplex.protocol import BatchPlan, Step, StepKind
from tests.helpers.policy import CREATE, OPT, SAMPLE, req, run, steps


def test_samples_run_ahead_of_training_in_any_seq_order() -> None:
    pending = [req("a", 1), req("a", 2, OPT), req("s1", 5, SAMPLE), req("s1", 2, SAMPLE), req("s2", 0, SAMPLE)]
    result = run(pending, {"a": 0})
    assert steps(result.plan) == [
        # fair order (s2's tenant has had nothing yet), else arrival; seq 5 before 2 is fine: no chain
        (StepKind.SAMPLE, [("s1", 5), ("s2", 0), ("s1", 2)]),
        (StepKind.FORWARD_BACKWARD, [("a", 1)]),
        (StepKind.OPTIM_STEP, [("a", 2)]),
    ]
    assert result.applied_seq == {"a": 2} and result.blocked == {}  # samples neither advance nor block anything


def test_a_sample_waits_for_at_most_one_plan_behind_a_deep_training_backlog() -> None:
    backlog = [req("big", s, tenant="trainer") for s in range(1, 200)]
    result = run([*backlog, req("s", 1, SAMPLE, tenant="sampler")], {"big": 0})
    assert result.plan.steps[0].kind == StepKind.SAMPLE and [r.model_id for r in result.plan.steps[0].requests] == ["s"]


def test_the_row_budget_takes_the_oldest_samples_and_one_always_fits() -> None:
    pending = [req("s", i, SAMPLE, datums=3) for i in range(5)]  # 3 samples each
    first = run(pending, max_sample_rows=7)
    assert steps(first.plan) == [(StepKind.SAMPLE, [("s", 0), ("s", 1)])]
    assert [r.seq_id for r in first.pending] == [2, 3, 4]
    huge = run([req("s", 0, SAMPLE, datums=100)], max_sample_rows=7)
    assert steps(huge.plan) == [(StepKind.SAMPLE, [("s", 0)])]


def test_a_repeated_sample_is_a_duplicate_and_creates_still_come_first() -> None:
    first, again = req("s", 3, SAMPLE), req("s", 3, SAMPLE)
    result = run([req("a", -1, CREATE), first, again])
    assert steps(result.plan) == [(StepKind.CREATE, [("a", -1)]), (StepKind.SAMPLE, [("s", 3)])]
    assert [d.request_id for d in result.duplicates] == [again.request_id]


def test_a_tenant_flooding_the_sampler_does_not_starve_another_tenants_sample() -> None:
    flood = [req("s-a", i, SAMPLE, tenant="a", datums=8) for i in range(10)]  # queued first, 80 sequences
    late = req("s-b", 0, SAMPLE, tenant="b", datums=8)
    first = run([*flood, late], max_sample_rows=16)
    assert [r.tenant_id for r in first.plan.steps[0].requests] == ["a", "b"]  # b's is second, not eleventh


def test_runs_in_flight_always_go_on_and_bound_what_starts() -> None:
    going = [req("s-a", 0, SAMPLE, tenant="a", datums=64), req("s-c", 0, SAMPLE, tenant="c", datums=2)]
    new_a, new_b = req("s-a", 1, SAMPLE, tenant="a", datums=1), req("s-b", 0, SAMPLE, tenant="b", datums=4)
    sampling = {going[0].request_id: 1, going[1].request_id: 2}
    both = plan_batch([*going, new_a, new_b], {}, PolicyLimits(max_sample_rows=64), sampling=sampling)
    # a's 64 sequences in flight fill its own share (its new one waits); b starts beside them
    assert [r.request_id for r in both.plan.steps[0].requests] == [*sampling, new_b.request_id]
    full = plan_batch([*going, new_b], {}, PolicyLimits(max_sample_batches=2), sampling=sampling)
    assert [r.request_id for r in full.plan.steps[0].requests] == list(sampling)  # two plans' runs in flight: no more


def test_a_sample_is_charged_its_work_once_in_fair_share() -> None:
    sample = req("s", 0, SAMPLE, tenant="a", tokens=10, datums=4)  # 4 x (10 prompt + 4 new tokens)
    ledger = FairShareLedger()
    plan = BatchPlan((Step(StepKind.SAMPLE, (sample,)),))
    ledger.charge(plan, {}, {"a", "b"})
    assert ledger.view({"a", "b"}) == {"a": 4 * 14 + 1, "b": 0.0}
    ledger.charge(plan, {}, {"a", "b"}, charged={sample.request_id})  # its next slice: already paid for
    assert ledger.view({"a", "b"}) == {"a": 4 * 14 + 1, "b": 0.0}


def test_one_tenant_alone_fills_the_rows_and_another_starts_in_the_next_plan() -> None:
    rollouts = [req("s-a", i, SAMPLE, tenant="a", datums=16) for i in range(64)]  # a GRPO iteration: 64 x 16
    alone = run(rollouts, max_sample_rows=1024)
    assert len(alone.plan.steps[0].requests) == 64  # one plan starts all 1,024 rows
    capped = run(rollouts, max_sample_rows=256)
    assert len(capped.plan.steps[0].requests) == 16  # the pool's rows: 256
    # b arrives while a's 1,024 rows are in flight: a starts nothing more; b's first request starts at once (past
    # the rows: its tenant has nothing in flight), its others wait for room
    going = {r.request_id: 1 for r in rollouts}
    more_a = [req("s-a", 100 + i, SAMPLE, tenant="a", datums=16) for i in range(40)]
    b = [req("s-b", i, SAMPLE, tenant="b", datums=16) for i in range(40)]
    both = plan_batch([*rollouts, *more_a, *b], {}, PolicyLimits(max_sample_rows=1024), sampling=going)
    assert [r.request_id for r in both.plan.steps[0].requests] == [*going, b[0].request_id]
    # once a's rollouts end, each tenant's in flight stays within half the rows
    later = plan_batch([b[0], *more_a, *b[1:]], {}, PolicyLimits(max_sample_rows=1024), sampling={b[0].request_id: 2})
    new = [r for r in later.plan.steps[0].requests if r.request_id != b[0].request_id]
    rows = {t: sum(r.payload.num_samples for r in [b[0], *new] if r.tenant_id == t) for t in "ab"}
    assert rows == {"a": 512, "b": 512}


def test_fair_parts_split_between_every_sampling_tenant_and_each_starts_one() -> None:
    pending = [req(f"s-{t}", i, SAMPLE, tenant=t, datums=8) for i in range(20) for t in "abcd"]
    first = run(pending, max_sample_rows=64)
    started = [r.tenant_id for r in first.plan.steps[0].requests]
    assert sorted(started) == sorted("aabbccdd")  # 64 rows / 4 tenants = 16 each: two requests of 8
    big = [req(f"s-{t}", 0, SAMPLE, tenant=t, datums=40) for t in "abc"]  # each above its fair part (21)
    assert [r.tenant_id for r in run(big, max_sample_rows=64).plan.steps[0].requests] == ["a"]  # the plan's rows
    sampling = {big[0].request_id: 1}
    nxt = plan_batch(big, {}, PolicyLimits(max_sample_rows=64), sampling=sampling)
    assert [r.tenant_id for r in nxt.plan.steps[0].requests] == ["a", "b"]  # b's first always starts

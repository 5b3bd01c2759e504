"""dispatch.policy: seq ordering, gaps, duplicates, coalescing, token cap, fairness, create-before / delete-after."""

from __future__ import annotations

from loraplex.dispatch.policy import plan_rounds
from loraplex.protocol import BatchPlan, PlannedRequest, Step, StepKind
from tests.helpers.policy import CREATE, DELETE, FB, FWD, OPT, REJECTED, req, run, steps


def test_one_adapter_applies_in_seq_order_whatever_the_arrival_order() -> None:
    pending = [req("a", 3, OPT), req("a", 1), req("a", 4), req("a", 2, OPT)]
    out = run(pending, {"a": 0})
    assert steps(out.plan) == [
        (StepKind.FORWARD_BACKWARD, [("a", 1)]),
        (StepKind.OPTIM_STEP, [("a", 2)]),
        (StepKind.OPTIM_STEP, [("a", 3)]),
        (StepKind.FORWARD_BACKWARD, [("a", 4)]),
    ]
    assert out.pending == () and out.duplicates == () and out.blocked == {}
    assert out.applied_seq == {"a": 4}


def test_nothing_applied_yet_starts_at_the_smallest_pending_seq() -> None:
    out = run([req("a", 6), req("a", 5), req("a", 8)])
    assert steps(out.plan) == [(StepKind.FORWARD_BACKWARD, [("a", 5)]), (StepKind.FORWARD_BACKWARD, [("a", 6)])]
    assert [r.seq_id for r in out.pending] == [8]
    assert out.blocked == {"a": 7}


def test_a_gap_holds_the_adapter_and_reports_the_missing_seq() -> None:
    waiting = [req("a", 5), req("a", 6)]
    out = run([*waiting, req("b", 1)], {"a": 3, "b": 0})
    assert steps(out.plan) == [(StepKind.FORWARD_BACKWARD, [("b", 1)])]
    assert out.pending == tuple(waiting)
    assert out.blocked == {"a": 4}
    # Once seq 4 arrives, all three go, in order.
    out = run([*waiting, req("a", 4, OPT)], {"a": 3})
    assert [s for _, s in steps(out.plan)] == [[("a", 4)], [("a", 5)], [("a", 6)]]


def test_duplicates_are_reported_and_never_planned() -> None:
    old = req("a", 2)
    first = req("a", 3)
    same_slot = req("a", 3)  # another request_id for an already pending (model, seq)
    twin = PlannedRequest(first.request_id, first.tenant_id, "a", 3, FB, first.payload)  # redelivered entry
    create, create_again = req("a", -1, CREATE), req("a", -1, CREATE)
    out = run([old, first, same_slot, twin, create, create_again], {"a": 2})
    assert out.duplicates == (old, same_slot, twin, create_again)
    assert out.plan.requests == (create, first)
    assert out.pending == ()


def test_ready_requests_of_many_adapters_coalesce_into_one_step_per_kind() -> None:
    pending = [req(m, 1) for m in "abc"] + [req(m, 2, OPT) for m in "abc"] + [req("d", 1, FWD)]
    out = run(pending, dict.fromkeys("abcd", 0))
    assert steps(out.plan) == [
        (StepKind.FORWARD_BACKWARD, [("a", 1), ("b", 1), ("c", 1), ("d", 1)]),
        (StepKind.OPTIM_STEP, [("a", 2), ("b", 2), ("c", 2)]),
    ]


def test_at_most_one_request_per_adapter_per_step_and_chains_span_steps() -> None:
    # a is mid-way (its optim is next), b starts with a forward_backward: neither waits for the other.
    pending = [req("a", 5, OPT), req("a", 6), req("a", 7, OPT), req("b", 1), req("b", 2), req("b", 3, OPT)]
    out = run(pending, {"a": 4, "b": 0})
    assert steps(out.plan) == [
        (StepKind.FORWARD_BACKWARD, [("b", 1)]),
        (StepKind.OPTIM_STEP, [("a", 5)]),
        (StepKind.FORWARD_BACKWARD, [("a", 6), ("b", 2)]),
        (StepKind.OPTIM_STEP, [("a", 7), ("b", 3)]),
    ]
    for step in out.plan.steps:
        models = [r.model_id for r in step.requests]
        assert len(models) == len(set(models))


def test_token_cap_splits_steps_and_an_oversized_request_goes_alone() -> None:
    pending = [req("a", 1, tokens=300), req("b", 1, tokens=300), req("c", 1, tokens=300)]
    out = run(pending, plan_tokens=700)
    assert steps(out.plan) == [
        (StepKind.FORWARD_BACKWARD, [("a", 1), ("b", 1)]),
        (StepKind.FORWARD_BACKWARD, [("c", 1)]),
    ]
    out = run([req("big", 1, tokens=5000), req("small", 1, tokens=10)], plan_tokens=4096)
    assert steps(out.plan) == [
        (StepKind.FORWARD_BACKWARD, [("big", 1)]),
        (StepKind.FORWARD_BACKWARD, [("small", 1)]),
    ]


def test_max_requests_leaves_the_rest_pending_in_arrival_order() -> None:
    pending = [req(m, 1) for m in "abcde"]
    out = run(pending, max_requests=2)
    assert out.plan.requests == tuple(pending[:2])
    assert out.pending == tuple(pending[2:])
    assert out.blocked == {}  # ready but capped is not blocked


def test_oldest_waiting_adapter_goes_first_when_the_cap_forces_a_choice() -> None:
    # b's oldest request arrived before a's: b waited longer, although a's head arrived first.
    pending = [req("b", 3), req("a", 1, tokens=100), req("b", 2, tokens=100)]
    out = run(pending, {"b": 1}, plan_tokens=100, max_requests=1)
    assert steps(out.plan) == [(StepKind.FORWARD_BACKWARD, [("b", 2)])]
    assert out.duplicates == ()


def test_a_tenant_with_many_adapters_does_not_crowd_out_another() -> None:
    # t1 floods with 6 adapters (arrived first); t2's single adapter arrived last. One request fits per step.
    pending = [req(f"a{i}", 1, tokens=100, tenant="t1") for i in range(6)] + [req("z", 1, tokens=100, tenant="t2")]
    out = run(pending, plan_tokens=100, max_requests=3)
    assert [r.model_id for r in out.plan.requests] == ["a0", "z", "a1"]


def test_no_tenant_starves_under_a_steady_flood() -> None:
    # t1 keeps 8 adapters busy and resubmits after every plan; t2 sends one 3-step chain. Each plan takes 2 requests.
    seq = {f"a{i}": 0 for i in range(8)}
    pending = [req(m, 1, tokens=64, tenant="t1") for m in seq]
    pending += [req("z", 1, tokens=64, tenant="t2"), req("z", 2, OPT, tenant="t2"), req("z", 3, tokens=64, tenant="t2")]
    last: dict[str, int | None] = {}
    served_z = []
    for round_no in range(20):
        out = run(pending, last, plan_tokens=64, max_requests=2)
        assert out.plan.steps
        last.update(out.applied_seq)
        served_z += [(round_no, r.seq_id) for r in out.plan.requests if r.model_id == "z"]
        pending = list(out.pending)
        for r in out.plan.requests:  # t1 refills at once
            if r.tenant_id == "t1":
                seq[r.model_id] = r.seq_id + 1
                pending.append(req(r.model_id, seq[r.model_id], tokens=64, tenant="t1"))
    assert [s for _, s in served_z] == [1, 2, 3]
    assert served_z[-1][0] <= 3  # t2 gets about half the plans, not the leftovers


def test_create_runs_first_and_delete_last() -> None:
    pending = [req("a", 1), req("a", -1, DELETE), req("a", 2, OPT), req("a", -1, CREATE), req("b", 4)]
    out = run(pending, {"b": 3})
    assert steps(out.plan) == [
        (StepKind.CREATE, [("a", -1)]),
        (StepKind.FORWARD_BACKWARD, [("a", 1), ("b", 4)]),
        (StepKind.OPTIM_STEP, [("a", 2)]),
        (StepKind.DELETE, [("a", -1)]),
    ]


def test_delete_waits_for_requests_still_pending_and_chains_wait_for_their_create() -> None:
    blocked_delete = run([req("a", 3), req("a", -1, DELETE)], {"a": 1})
    assert blocked_delete.plan.steps == () and blocked_delete.blocked == {"a": 2}
    # The create does not fit in this plan: nothing of "a" may run before it.
    out = run([req("b", -1, CREATE), req("a", -1, CREATE), req("a", 1)], max_requests=1)
    assert steps(out.plan) == [(StepKind.CREATE, [("b", -1)])]
    assert [r.model_id for r in out.pending] == ["a", "a"] and out.blocked == {}


def test_empty_input_gives_an_empty_plan() -> None:
    out = run([])
    assert out.plan.steps == () and out.pending == () and out.duplicates == ()


def test_a_rejected_seq_id_is_answered_in_order_and_the_chain_moves_on() -> None:
    """A request the gateway rejected after its seq_id was taken is queued in its place: the policy answers it in its
    own REJECT step (no engine work) and the adapter's next request runs in the same plan, without a gap wait."""
    pending = [req("a", 2, OPT), req("a", 3), req("a", 1, REJECTED), req("b", 1)]
    out = run(pending, {"a": 0, "b": 0})
    assert steps(out.plan) == [
        (StepKind.FORWARD_BACKWARD, [("b", 1)]),
        (StepKind.REJECT, [("a", 1)]),
        (StepKind.OPTIM_STEP, [("a", 2)]),
        (StepKind.FORWARD_BACKWARD, [("a", 3)]),
    ]
    assert out.blocked == {} and out.applied_seq == {"a": 3, "b": 1}


def test_a_deep_backlog_goes_a_few_rounds_per_plan_so_plans_stay_short() -> None:
    """One adapter with 300 queued steps: a plan takes `max_rounds` of them (not 256 one-request engine steps), so
    another tenant's step, taken in the plan's first round, is answered after a short plan."""
    pending = [req("deep", seq) for seq in range(1, 301)] + [req("other", 1)]
    out = run(pending, {"deep": 0, "other": 0}, max_rounds=8)
    assert len(out.plan.steps) == 8 and out.plan.steps[0].requests[-1].model_id == "other"
    assert [r.seq_id for r in out.plan.requests if r.model_id == "deep"] == list(range(1, 9))
    assert len(out.pending) == 292


def test_a_request_over_the_token_cap_runs_one_part_per_plan_and_others_go_beside_it() -> None:
    """5 datums x 40 tokens with a 100-token cap: parts [0, 2), [2, 4), [4, 5) in three plans. Until the last part
    the adapter's chain stays put (its optim_step waits, nothing of it is applied); another tenant's small step shares
    the first plan's step (before: the whole request held the pool, 93 s in the issue)."""
    big, small, after = req("a", 1, tokens=40, datums=5), req("b", 1, tokens=10), req("a", 2, OPT)
    out = run([big, small, after], {"a": 0, "b": 0}, plan_tokens=100)
    (first,) = out.plan.steps
    assert [(r.model_id, r.part) for r in first.requests] == [("a", (0, 2)), ("b", None)]
    assert first.requests[0].num_tokens == 80 and first.requests[0].unfinished
    assert out.applied_seq == {"b": 1} and out.pending == (big, after) and out.blocked == {}
    out = run([big, after], {"a": 0}, progress={big.request_id: 2}, plan_tokens=100)
    assert [(r.part, r.unfinished) for r in out.plan.requests] == [((2, 4), True)]
    out = run([big, after], {"a": 0}, progress={big.request_id: 4}, plan_tokens=100)
    assert steps(out.plan) == [(StepKind.FORWARD_BACKWARD, [("a", 1)]), (StepKind.OPTIM_STEP, [("a", 2)])]
    assert out.plan.requests[0].part == (4, 5) and not out.plan.requests[0].unfinished
    assert out.applied_seq == {"a": 2} and out.pending == ()


def test_plan_rounds_cut_before_each_later_round_s_forward_backward() -> None:
    create, delete = req("c", -1, CREATE), req("c", -1, DELETE)
    pending = [create, req("a", 1), req("a", 2, OPT), req("a", 3), req("a", 4, OPT), req("b", 1), req("b", 2), delete]
    out = run(pending, {"a": 0, "b": 0})
    rounds = [steps(r) for r in plan_rounds(out.plan)]
    assert rounds == [
        [(StepKind.CREATE, [("c", -1)]), (StepKind.FORWARD_BACKWARD, [("a", 1), ("b", 1)])],
        [(StepKind.FORWARD_BACKWARD, [("b", 2)]), (StepKind.OPTIM_STEP, [("a", 2)])],
        [(StepKind.FORWARD_BACKWARD, [("a", 3)]), (StepKind.OPTIM_STEP, [("a", 4)]), (StepKind.DELETE, [("c", -1)])],
    ]  # b's second forward_backward is in round 2, beside a's optim_step
    assert tuple(r for p in plan_rounds(out.plan) for r in p.requests) == out.plan.requests


def test_plan_rounds_keep_a_one_round_plan_whole_and_consecutive_forward_backward_steps_together() -> None:
    one = BatchPlan((Step(StepKind.FORWARD_BACKWARD, (req("a", 1),)), Step(StepKind.OPTIM_STEP, (req("a", 2, OPT),))))
    assert plan_rounds(one) == [one]
    split = BatchPlan((Step(StepKind.FORWARD_BACKWARD, (req("a", 1),)), Step(StepKind.FORWARD_BACKWARD, (req("b", 1),)),
                       Step(StepKind.OPTIM_STEP, (req("a", 2, OPT), req("b", 2, OPT)))))  # fmt: skip
    assert plan_rounds(split) == [split]
    assert plan_rounds(BatchPlan(())) == [BatchPlan(())]


def test_plan_rounds_keep_a_round_of_forward_backward_alone_with_the_next_where_its_optim_steps_run() -> None:
    fb = [Step(StepKind.FORWARD_BACKWARD, (req(m, 1),)) for m in "abc"]
    opt = [Step(StepKind.OPTIM_STEP, (req(m, 2, OPT),)) for m in "abc"]
    plan = BatchPlan((fb[0], fb[1], opt[0], fb[2], opt[1], opt[2]))  # the token cap closed each round's step at one
    assert [p.steps for p in plan_rounds(plan)] == [(fb[0], fb[1], opt[0]), (fb[2], opt[1], opt[2])]

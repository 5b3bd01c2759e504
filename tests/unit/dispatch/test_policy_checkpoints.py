"""dispatch.policy: save_state / save_sampler / load_state take their place in the adapter's seq_id order, and a
round's checkpoint requests form one CHECKPOINT step after the round's OPTIM_STEP step."""

from __future__ import annotations

from loraplex.dispatch.policy import plan_batch
from loraplex.protocol import RequestKind, StepKind
from tests.helpers.policy import FB, OPT, req, run, steps

SAVE, SAMPLER, LOAD = RequestKind.SAVE_STATE, RequestKind.SAVE_SAMPLER, RequestKind.LOAD_STATE
FBS, OPTS, CKPT = StepKind.FORWARD_BACKWARD, StepKind.OPTIM_STEP, StepKind.CHECKPOINT


def test_save_sits_between_the_steps_before_and_after_it() -> None:
    # fb 1, optim 2, save 3, fb 4, optim 5: the save sees the weights after optim 2 and before fb 4.
    pending = [req("a", 4, FB), req("a", 3, SAVE), req("a", 5, OPT), req("a", 1, FB), req("a", 2, OPT)]
    out = run(pending, {"a": 0})
    assert steps(out.plan) == [
        (FBS, [("a", 1)]),
        (OPTS, [("a", 2)]),
        (CKPT, [("a", 3)]),
        (FBS, [("a", 4)]),
        (OPTS, [("a", 5)]),
    ]
    assert out.applied_seq == {"a": 5} and out.pending == ()


def test_a_rounds_checkpoints_form_one_step_after_its_optim_step() -> None:
    # Round 1: a's fb, b's optim, c's save, d's load; round 2: a's sampler save, b's fb.
    pending = [
        req("a", 1, FB),
        req("a", 2, SAMPLER),
        req("b", 5, OPT),
        req("b", 6, FB),
        req("c", 3, SAVE),
        req("d", 1, LOAD),
    ]
    out = run(pending, {"a": 0, "b": 4, "c": 2, "d": 0})
    assert steps(out.plan) == [
        (FBS, [("a", 1)]),
        (OPTS, [("b", 5)]),
        (CKPT, [("c", 3), ("d", 1)]),
        (FBS, [("b", 6)]),
        (CKPT, [("a", 2)]),
    ]
    assert out.applied_seq == {"a": 2, "b": 6, "c": 3, "d": 1}


def test_load_then_train_keeps_the_order_and_a_gap_blocks_a_checkpoint() -> None:
    out = run([req("a", 2, FB), req("a", 1, LOAD), req("a", 3, OPT)], {"a": 0})
    assert steps(out.plan) == [(CKPT, [("a", 1)]), (FBS, [("a", 2)]), (OPTS, [("a", 3)])]
    # A save behind a missing seq_id waits, and is reported blocked.
    out = run([req("a", 7, SAVE)], {"a": 5})
    assert steps(out.plan) == [] and out.blocked == {"a": 6} and len(out.pending) == 1


def test_a_repeated_save_is_a_duplicate_and_checkpoints_count_against_max_requests() -> None:
    first = req("a", 1, SAVE)
    out = plan_batch([first, req("a", 1, SAVE)], {"a": 0})
    assert steps(out.plan) == [(CKPT, [("a", 1)])] and len(out.duplicates) == 1
    out = run([req("a", 1, SAVE), req("b", 1, SAVE), req("c", 1, SAVE)], {}, max_requests=2)
    assert len(out.plan.requests) == 2 and len(out.pending) == 1

"""`takes_all` / `PlanFit` (dispatch/policy.py), the check the dispatcher's coalescing wait makes on each arrival
instead of planning again: whenever it says the plan takes every request, the plan does (nothing pending, blocked or
duplicate), so waiting on that answer leaves the loop's choices as they were when it planned on every arrival; and it
says so for the closed-loop tenants' usual buffer, so the wait plans only at its end."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.dispatch.policy import PlanFit, PolicyLimits, plan_batch, takes_all
from loraplex.protocol import RequestKind
from tests.helpers.policy import FB, FWD, OPT, SAMPLE, req

# per adapter: its applied seq_id, how many of its next requests wait (forward_backward / forward and optim_step
# in turn from its next seq_id), their tokens, and a fault: none, a gap (its first request missing), a hole (its
# second one missing), a repeat
adapter = st.tuples(st.one_of(st.none(), st.integers(0, 3)), st.integers(1, 4), st.sampled_from([FB, FWD]),
                    st.sampled_from([8, 64, 300]), st.sampled_from(["", "", "", "gap", "hole", "repeat"]))  # fmt: skip


@settings(max_examples=800, deadline=None)
@given(st.lists(adapter, min_size=1, max_size=6), st.integers(-1, 1), st.integers(1, 6), st.integers(1, 4),
       st.integers(-1, 1), st.booleans(), st.booleans(), st.randoms(use_true_random=False))  # fmt: skip
def test_when_it_says_all_are_taken_the_plan_takes_all(
    spec: list[tuple[int | None, int, RequestKind, int, str]], token_margin: int, slots: int, rounds: int,
    budget_margin: int, with_sample: bool, in_parts: bool, arrival: random.Random,
) -> None:  # fmt: skip
    """Limits at and around what the buffer needs, so each of them is met exactly, missed by one, or left room; the
    requests arrive in any order (an adapter's later request first: a gap that its earlier one fills)."""
    pending, applied = [], {}
    for a, (last, n, kind, tokens, fault) in enumerate(spec):
        applied[f"m{a}"] = last
        chain = [req(f"m{a}", (last or 0) + 1 + k, kind if k % 2 == 0 else OPT, tokens=tokens, datums=1 + k % 2)
                 for k in range(n)]  # fmt: skip
        if fault == "gap" and last is not None:
            chain = chain[1:]
        elif fault == "hole" and n >= 3:
            del chain[1]
        elif fault == "repeat":
            chain.append(req(f"m{a}", chain[-1].seq_id, chain[-1].kind, tokens=tokens))
        pending += chain
    if with_sample:
        pending.append(req("s", 1, SAMPLE))
    arrival.shuffle(pending)
    tokens = sum(r.num_tokens for r in pending if r.kind in (FB, FWD))
    limits = PolicyLimits(plan_tokens=max(1, tokens + 64 * token_margin), max_adapters_per_step=slots,
                          max_rounds=rounds, max_requests=max(1, len(pending) + budget_margin))  # fmt: skip
    progress = {pending[0].request_id: 1} if in_parts and pending and pending[0].kind in (FB, FWD) else {}
    fit = PlanFit(applied, limits, progress)  # the requests arrive one by one, as the coalescing wait adds them
    for k, request in enumerate(pending, 1):
        says = fit.add([request])
        assert says == takes_all(pending[:k], applied, limits, progress)
        if says:
            result = plan_batch(pending[:k], applied, limits, progress)
            assert result.pending == () and result.duplicates == () and result.blocked == {}
            assert sorted(r.request_id for r in result.plan.requests) == sorted(r.request_id for r in pending[:k])


def test_closed_loop_tenants_buffer_is_vouched_for_until_it_fills_a_limit() -> None:
    """16 tenants' forward_backward + optim_step pairs, arriving one by one: every prefix is taken whole, until the
    tokens pass the plan's cap, or the adapters the slots."""
    pending = []
    for t in range(16):
        pending += [req(f"m{t}", 5, FB, tokens=512), req(f"m{t}", 6, OPT)]
    applied = {f"m{t}": 4 for t in range(16)}
    limits = PolicyLimits(plan_tokens=16384, max_adapters_per_step=16)
    assert all(takes_all(pending[:k], applied, limits) for k in range(len(pending) + 1))
    assert not takes_all(pending, applied, PolicyLimits(plan_tokens=8000, max_adapters_per_step=16))
    assert not takes_all(pending, applied, PolicyLimits(plan_tokens=16384, max_adapters_per_step=8))
    assert not takes_all(pending[1:], applied, limits)  # m0's optim_step without its forward_backward: a gap
    fit = PlanFit(applied, limits)
    assert not fit.add([pending[1]])  # the optim_step came first...
    assert fit.add([pending[0]])  # ...and its forward_backward fills the gap
    assert not takes_all([*pending, req("m0", 7, SAMPLE)], applied, limits)

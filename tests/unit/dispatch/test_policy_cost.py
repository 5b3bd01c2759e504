"""Cost-model coalescing in the policy (dispatch/step_split.py): the chosen forward_backward steps are never predicted
slower than running the same requests adapter by adapter, whatever the pending set and the cost parameters; the split
changes steps only, never which requests a plan takes; underfilled tenants mix, and tenants whose mixing would cost
(a grouped op over microbatches they fill) run apart."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.dispatch.cost_model import CostParams, FixedCost, default_cost
from loraplex.dispatch.policy import PolicyLimits, plan_batch
from loraplex.dispatch.step_split import predicted_seconds
from loraplex.protocol import StepKind
from tests.helpers.policy import OPT, req

costs = st.builds(
    CostParams,
    step_s=st.floats(0, 1),
    microbatch_s=st.floats(0, 1),
    token_s=st.floats(0, 1e-3),
    mixed_token_s=st.floats(0, 1e-3),
    adapter_token_s=st.floats(0, 1e-3),
)
adapter_work = st.tuples(st.integers(1, 6), st.sampled_from([8, 64, 256, 512, 700]), st.integers(0, 3), st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(adapter_work, min_size=1, max_size=12), costs, st.sampled_from([256, 1024, 4096]),
       st.sampled_from([1024, 4096, 16384]), st.integers(1, 16))  # fmt: skip
def test_the_chosen_steps_are_never_predicted_slower_than_adapter_by_adapter(
    work: list[tuple[int, int, int, bool]], params: CostParams, microbatch: int, plan_tokens: int, slots: int
) -> None:
    pending = []
    for a, (datums, tokens, tenant, with_optim) in enumerate(work):
        pending.append(req(f"m{a}", 1, tokens=tokens, datums=datums, tenant=f"t{tenant}"))
        if with_optim:
            pending += [req(f"m{a}", 2, OPT, tenant=f"t{tenant}"), req(f"m{a}", 3, tokens=tokens, tenant=f"t{tenant}")]
    limits = PolicyLimits(plan_tokens=plan_tokens, max_adapters_per_step=slots)
    cost = FixedCost(params, microbatch)
    plain = plan_batch(pending, {}, limits)
    chosen = plan_batch(pending, {}, limits, cost=cost)
    assert chosen.plan.requests == tuple(r for s in plain.plan.steps for r in _in_split_order(s, chosen))
    assert {r.request_id for r in chosen.plan.requests} == {r.request_id for r in plain.plan.requests}
    assert chosen.pending == plain.pending and chosen.applied_seq == plain.applied_seq
    fb = [s.requests for s in chosen.plan.steps if s.kind == StepKind.FORWARD_BACKWARD]
    alone = [(r,) for s in fb for r in s]
    mixed = predicted_seconds(fb, cost)
    assert mixed <= predicted_seconds(alone, cost) * (1 + 1e-12) + 1e-12
    assert mixed <= predicted_seconds([s.requests for s in plain.plan.steps if s.kind == StepKind.FORWARD_BACKWARD],
                                      cost) * (1 + 1e-12) + 1e-12  # fmt: skip
    for s in fb:
        assert len({r.model_id for r in s}) == len(s)


def _in_split_order(step, chosen):  # type: ignore[no-untyped-def]
    """The requests of a plain plan's step in the order the cost-split plan runs them (groups may reorder a round)."""
    order = {r.request_id: k for k, r in enumerate(chosen.plan.requests)}
    return sorted(step.requests, key=lambda r: order[r.request_id])


def test_underfilled_tenants_mix_into_one_step() -> None:
    """4 tenants x 1 x 512 tokens: one microbatch for all four instead of four passes through the layers."""
    pending = [req(f"m{i}", 1, tokens=512, tenant=f"t{i}") for i in range(4)]
    out = plan_batch(pending, {}, PolicyLimits(), cost=FixedCost(default_cost("cuda"), 4096))
    assert [len(s.requests) for s in out.plan.steps] == [4]


def test_saturated_tenants_that_fill_microbatches_exactly_share_one_step() -> None:
    """4 x 8 x 512 with 4,096-token microbatches: each microbatch holds one adapter either way, so one step saves the
    per-step cost (and the round's optimizer steps batch as before)."""
    pending = [req(f"m{i}", 1, tokens=512, datums=8, tenant=f"t{i}") for i in range(4)]
    out = plan_batch(pending, {}, PolicyLimits(), cost=FixedCost(default_cost("cuda"), 4096))
    assert [len(s.requests) for s in out.plan.steps] == [4]


def test_mixing_that_would_cost_runs_the_adapters_apart() -> None:
    """3 x 6 x 512 tokens with 4,096-token microbatches: mixed, the microbatches straddle adapters (the grouped op over
    every token); when that op costs much more than a matmul and a microbatch pass is cheap, each adapter goes alone."""
    pending = [req(f"m{i}", 1, tokens=512, datums=6, tenant=f"t{i}") for i in range(3)]
    grouped_is_slow = CostParams(step_s=0.0, microbatch_s=0.001, token_s=1e-5, mixed_token_s=1e-4, adapter_token_s=0)
    out = plan_batch(pending, {}, PolicyLimits(), cost=FixedCost(grouped_is_slow, 4096))
    assert [len(s.requests) for s in out.plan.steps] == [1, 1, 1]
    cheap_mixing = CostParams(step_s=0.01, microbatch_s=0.2, token_s=1e-5, mixed_token_s=1e-7, adapter_token_s=0)
    out = plan_batch(pending, {}, PolicyLimits(), cost=FixedCost(cheap_mixing, 4096))
    assert [len(s.requests) for s in out.plan.steps] == [3]


def test_full_adapters_apart_and_small_ones_mixed() -> None:
    """An adapter over a microbatch (9 x 512) and three small ones (64 tokens): mixed, the big one's last datum shares a
    microbatch with them, padded to 512 and through the grouped op; when that op costs, the big one runs alone and the
    small ones together."""
    small = [req(f"s{i}", 1, tokens=64, tenant=f"b{i}") for i in range(3)]
    pending = [req("big", 1, tokens=512, datums=9, tenant="a"), *small]
    params = CostParams(step_s=0.001, microbatch_s=0.05, token_s=1e-5, mixed_token_s=1e-4, adapter_token_s=0)
    out = plan_batch(pending, {}, PolicyLimits(), cost=FixedCost(params, 4096))
    assert [[r.model_id for r in s.requests] for s in out.plan.steps] == [["big"], ["s0", "s1", "s2"]]

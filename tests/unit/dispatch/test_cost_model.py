"""dispatch/cost_model.py and cost_calibration.py: a step's shape is the engine's microbatch layout, the prediction is
the linear model, and the online fit recovers a device's true parameters from measured steps (outliers barely move it)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.dispatch.cost_calibration import OnlineCostModel
from loraplex.dispatch.cost_model import CostParams, StepShape, default_cost, shape_of, shape_of_lengths
from loraplex.errors import InvalidRequestError
from loraplex.protocol import Outcome, Step, StepKind
from loraplex.protocol.results import ForwardBackwardResult
from loraplex.workers.engine.batching import SeqRef, split_microbatches
from tests.helpers.policy import OPT, req


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=6), min_size=1, max_size=6),
    st.sampled_from([64, 256, 512, 1000]),
)
def test_the_shape_is_the_engines_microbatch_layout(adapters: list[list[int]], cap: int) -> None:
    """Microbatch count, tokens and adapters per microbatch as workers/batching.split_microbatches cuts them for the
    engine's (default) packed layout: real tokens, no padding."""
    seqs = [SeqRef(a, j, n) for a, lengths in enumerate(adapters) for j, n in enumerate(lengths)]
    mbs = split_microbatches(seqs, cap)
    assert mbs == split_microbatches(seqs, cap, packed=True)
    tokens = [sum(s.length for s in mb) for mb in mbs]
    assert all(t <= cap or len(mb) == 1 for t, mb in zip(tokens, mbs, strict=True))  # a longer datum alone
    kinds = [len({s.item for s in mb}) for mb in mbs]
    expected = StepShape(
        1,
        len(mbs),
        sum(tokens),
        sum(t for t, k in zip(tokens, kinds, strict=True) if k > 1),
        sum(t * (k - 1) for t, k in zip(tokens, kinds, strict=True)),
    )
    assert shape_of_lengths(adapters, cap) == expected
    assert expected.tokens == sum(map(sum, adapters))  # every token real


def test_shape_of_requests_groups_by_adapter_and_reads_only_the_part_this_plan_runs() -> None:
    a, b = req("a", 1, tokens=100, datums=3), req("b", 1, tokens=50)
    assert shape_of([a, b], 4096) == StepShape(1, 1, 350, 350, 350)  # one microbatch, 2 adapters, 350 real tokens
    part = a.__class__(a.request_id, a.tenant_id, "a", 1, a.kind, a.payload, part=(1, 2))
    assert shape_of([part], 4096) == StepShape(1, 1, 100, 0, 0)
    assert shape_of([req("c", 2, OPT)], 4096) == StepShape(1, 0, 0, 0, 0)


def test_the_prediction_is_the_linear_model() -> None:
    p = CostParams(step_s=1.0, microbatch_s=2.0, token_s=0.1, mixed_token_s=0.01, adapter_token_s=0.001)
    assert p.predict(StepShape(1, 3, 100, 50, 20)) == pytest.approx(1 + 6 + 10 + 0.5 + 0.02)
    assert default_cost("cuda:1") == default_cost("cuda") != default_cost("cpu")


def _random_shape(rng: random.Random, cap: int) -> StepShape:
    adapters = [[rng.choice([16, 64, 128, 512])] * rng.randint(1, 10) for _ in range(rng.randint(1, 6))]
    return shape_of_lengths(adapters, cap)


def test_calibration_recovers_the_true_parameters_from_measured_steps() -> None:
    """Steps of varied shapes timed by a 'device' 3x slower per microbatch and 0.5x per token than the defaults, with
    2% noise: after 300 steps every prediction is within 5%, where the defaults were off by up to 3x."""
    prior = default_cost("cpu")
    true = CostParams(prior.step_s * 2, prior.microbatch_s * 3, prior.token_s * 0.5, prior.mixed_token_s * 4,
                      prior.adapter_token_s * 0.5)  # fmt: skip
    model = OnlineCostModel(prior, 512)
    rng = random.Random(0)
    for _ in range(300):
        shape = _random_shape(rng, 512)
        model.observe(shape, true.predict(shape) * rng.uniform(0.98, 1.02))
    tests = [_random_shape(rng, 512) for _ in range(50)]
    errors = [abs(model.predict(s) / true.predict(s) - 1) for s in tests]
    assert max(errors) < 0.05, max(errors)
    assert max(abs(prior.predict(s) / true.predict(s) - 1) for s in tests) > 0.5


def test_an_outlier_moves_the_fit_little() -> None:
    """A first call compiling kernels (20x the usual time) after a calibrated run shifts predictions by under 10%."""
    prior = default_cost("cpu")
    model = OnlineCostModel(prior, 512)
    rng = random.Random(1)
    for _ in range(100):
        shape = _random_shape(rng, 512)
        model.observe(shape, prior.predict(shape))
    probe = _random_shape(rng, 512)
    before = model.predict(probe)
    model.observe(probe, 20 * prior.predict(probe))
    assert model.predict(probe) == pytest.approx(before, rel=0.1)


def test_observe_step_reads_forward_backward_steps_of_the_requests_that_ran() -> None:
    model = OnlineCostModel(default_cost("cpu"), 4096)
    ok, failed = req("a", 1, tokens=100), req("b", 1, tokens=100)
    model.observe_step(Step(StepKind.OPTIM_STEP, (req("a", 2, OPT),)), [Outcome("x", {})], 5.0)
    assert model.observations == 0
    outcomes = [Outcome(ok.request_id, ForwardBackwardResult()), Outcome.failed(failed.request_id, InvalidRequestError("bad"))]
    model.observe_step(Step(StepKind.FORWARD_BACKWARD, (ok, failed)), outcomes, 0.5)
    assert model.observations == 1

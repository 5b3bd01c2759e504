"""The token choice (workers/sampling/choice.py), fp32 on the CPU: every row's token equals the row-by-row reference's
for the same uniform (random inputs, hypothesis, every path: greedy, plain, top-k, top-p, sorted); greedy is the first
argmax and top_k = 1 is greedy, ties included; draws follow softmax(z / T) restricted to top-k / top-p; a long tail of
tiny probabilities keeps its mass; a row's tokens do not depend on the rows around it; bad input is a typed error."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.errors import InvalidRequestError
from loraplex.workers.sampling import choice
from loraplex.workers.sampling.choice import (
    Choices,
    choose_tokens,
    choose_tokens_reference,
    stream_key,
    uniform,
)


def expected_distribution(z: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(z / T) kept to the top-k, then to the smallest prefix with top_p of that mass, renormalised (fp64,
    computed here independently of the module: sorted by probability, ties by index)."""
    p = torch.softmax(z.double() / temperature, dim=0)
    order = sorted(range(len(z)), key=lambda i: (-float(z[i]), i))
    k = len(z) if top_k < 0 else min(top_k, len(z))
    kept, mass, total = [], 0.0, float(p[order[:k]].sum())
    for i in order[:k]:
        if mass >= top_p * total:
            break
        kept.append(i)
        mass += float(p[i])
    out = torch.zeros_like(p)
    out[kept] = p[kept] / p[kept].sum()
    return out


def assert_same_choice(got: Choices, want: Choices, tol: float = 1e-5) -> None:
    assert got.tokens.tolist() == want.tokens.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=tol, rtol=1e-6)
    g, w = got.to_host(), want.to_host()
    assert g.tokens == w.tokens
    for a, b in zip(g.top, w.top, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert [i for i, _ in a] == [i for i, _ in b]
            assert all(x == y or abs(x - y) <= tol + 1e-6 * abs(y) for (_, x), (_, y) in zip(a, b, strict=True))


# ---- the draws -------------------------------------------------------------------------------------------------------
def test_int64_tensor_products_and_sums_wrap_mod_2_64() -> None:
    """The hash relies on it: torch's int64 arithmetic is two's complement mod 2^64, as Python's masked integers."""
    rng = random.Random(1)
    a = [rng.randint(-(2**63), 2**63 - 1) for _ in range(2000)] + [-(2**63), 2**63 - 1, -1, 0]
    b = [rng.randint(-(2**63), 2**63 - 1) for _ in range(2000)] + [2**63 - 1, 2**63 - 1, -1, 5]
    ta, tb = torch.tensor(a), torch.tensor(b)
    assert (ta * tb).tolist() == [choice.as_int64(x * y) for x, y in zip(a, b, strict=True)]
    assert (ta + tb).tolist() == [choice.as_int64(x + y) for x, y in zip(a, b, strict=True)]
    assert choice._shr(ta, 11).tolist() == [(x & choice.MASK64) >> 11 for x in a]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-(2**80), 2**80), st.integers(0, 2**31), st.integers(0, 2**40)), min_size=1, max_size=20
    )
)
def test_tensor_draws_equal_the_python_integers(triples: list[tuple[int, int, int]]) -> None:
    seeds = torch.tensor([choice.as_int64(s) for s, _, _ in triples])
    samples = torch.tensor([s for _, s, _ in triples])
    steps = torch.tensor([t for _, _, t in triples])
    keys = choice.stream_keys(seeds, samples)
    assert keys.tolist() == [stream_key(s, i) for s, i, _ in triples]
    assert choice.draw_uniforms(keys, steps).tolist() == [uniform(s, i, t) for s, i, t in triples]


def ks_distance(values: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance of the sample from U[0, 1)."""
    x, _ = values.double().sort()
    n = len(x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - x, x - (i - 1) / n).max())


@pytest.mark.parametrize("axis", ["steps", "samples", "seeds"])
def test_draws_are_in_the_unit_interval_and_look_uniform(axis: str) -> None:
    """20,000 draws along consecutive steps of one stream, samples of one job, or seeds: in [0, 1), KS distance under
    its 1% critical value (1.63 / sqrt(n)), lag-1 correlation under 4 / sqrt(n), and every draw distinct."""
    n = 20_000
    count = torch.arange(n)
    fixed = torch.full((n,), 3)
    seeds = count if axis == "seeds" else torch.full((n,), 12345)
    samples = count if axis == "samples" else fixed
    steps = count if axis == "steps" else fixed
    u = choice.draw_uniforms(choice.stream_keys(seeds, samples), steps)
    assert u.dtype == torch.float64 and bool((u >= 0).all()) and bool((u < 1).all())
    assert ks_distance(u) < 1.63 / math.sqrt(n)
    lag = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(lag)) < 4 / math.sqrt(n)
    assert len(set(u.tolist())) == n


# ---- greedy and top_k = 1 --------------------------------------------------------------------------------------------
def test_greedy_is_the_first_argmax_and_top_k_one_is_greedy() -> None:
    """Logits rounded to bf16 (many ties) and rows whose maximum is tied: temperature 0, top_k = 1 at any temperature
    and a tiny top_p all give the first index of the maximum."""
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(6, 500, generator=g) * 2).bfloat16().float()
    z[1, [7, 40, 300]] = 9.0  # a tie at the maximum: index 7
    z[2, :] = 0.0  # every token tied: index 0
    z[3, [0, 1]] = -0.0  # signed zeros do not break a tie
    z[3, 2:] = -1.0
    first = [int(torch.nonzero(row == row.max())[0, 0]) for row in z]
    assert first[1] == 7 and first[2] == 0 and first[3] == 0
    rows = z.shape[0]
    for temps, ks, ps in [([0.0] * rows, [-1] * rows, [1.0] * rows), ([0.7] * rows, [1] * rows, [1.0] * rows),
                          ([1.3] * rows, [1] * rows, [0.4] * rows), ([1.0] * rows, [-1] * rows, [1e-9] * rows)]:  # fmt: skip
        uniforms = [0.999999] * rows
        got = choose_tokens(z, temps, ks, ps, uniforms)
        assert got.tokens.tolist() == first
        assert_same_choice(got, choose_tokens_reference(z, temps, ks, ps, uniforms))
        torch.testing.assert_close(got.logprobs, torch.log_softmax(z, -1)[torch.arange(rows), got.tokens])


# ---- the fast paths equal the reference ------------------------------------------------------------------------------
@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[float], list[int], list[float], list[float | None], list[int]]:
    rows = draw(st.integers(1, 9))
    vocab = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * draw(st.sampled_from([0.1, 1.0, 4.0, 30.0]))
    if draw(st.booleans()):
        z = z.bfloat16().float()  # ties, as logits from a bf16 head
    if draw(st.booleans()):
        z[:, : vocab // 3] = -math.inf  # masked tokens
    temps = draw(st.lists(st.sampled_from([0.0, 1.0, 1.0, 0.3, 0.7, 1.6]), min_size=rows, max_size=rows))
    ks = draw(st.lists(st.sampled_from([-1, 1, 2, 5, 40, vocab, vocab + 3]), min_size=rows, max_size=rows))
    ps = draw(st.lists(st.sampled_from([1.0, 1.0, 0.95, 0.5, 0.1, 1e-6]), min_size=rows, max_size=rows))
    edge_uniforms = st.sampled_from([0.0, 0.5, 1 - 2**-53])
    us = draw(st.lists(st.floats(0.0, 1.0, exclude_max=True) | edge_uniforms, min_size=rows, max_size=rows))
    counts = draw(st.lists(st.integers(0, min(6, vocab)), min_size=rows, max_size=rows))
    uniforms: list[float | None] = [None if t == 0 else u for t, u in zip(temps, us, strict=True)]
    return z, temps, ks, ps, uniforms, counts


@settings(max_examples=250, deadline=None)
@given(batches(), st.sampled_from([choice.TOPK_LIMIT, 3]))
def test_every_row_equals_the_reference_for_the_same_uniform(
    batch: tuple[torch.Tensor, list[float], list[int], list[float], list[float | None], list[int]], topk_limit: int
) -> None:
    """Mixed batches (greedy, plain, top-k, top-p, both) with ties, masked tokens and edge uniforms; a low TOPK_LIMIT
    sends truncated rows through the full sort instead of topk: the same tokens either way."""
    z, temps, ks, ps, uniforms, counts = batch
    with mock.patch.object(choice, "TOPK_LIMIT", topk_limit):
        got = choose_tokens(z, temps, ks, ps, uniforms, topk_logprobs=counts)
    assert_same_choice(got, choose_tokens_reference(z, temps, ks, ps, uniforms, counts))


def test_wide_top_k_rows_sort_and_equal_the_reference() -> None:
    """Vocabulary 5,000: top_k above TOPK_LIMIT (sorted), below it (topk), with and without top_p, plain rows."""
    g = torch.Generator().manual_seed(8)
    z = (torch.randn(8, 5000, generator=g) * 3).bfloat16().float()
    temps = [1.0, 0.8, 1.0, 1.2, 1.0, 0.5, 1.0, 0.0]
    ks = [2000, 2000, 100, -1, -1, 4999, 1, 3]
    ps = [1.0, 0.9, 0.7, 0.9, 1.0, 0.99, 1.0, 1.0]
    rng = random.Random(4)
    for _ in range(20):
        uniforms: list[float | None] = [rng.random() if t else None for t in temps]
        got = choose_tokens(z, temps, ks, ps, uniforms, topk_logprobs=[0, 3, 0, 0, 20, 0, 1, 2])
        assert_same_choice(got, choose_tokens_reference(z, temps, ks, ps, uniforms, [0, 3, 0, 0, 20, 0, 1, 2]))


# ---- the draws' distribution -----------------------------------------------------------------------------------------
CASES = [  # (temperature, top_k, top_p)
    (1.0, -1, 1.0),
    (0.6, -1, 1.0),
    (1.0, 5, 1.0),
    (1.0, -1, 0.8),
    (1.4, 8, 0.9),
    (0.8, 3, 0.5),
]


@pytest.mark.parametrize("case", CASES)
def test_draw_frequencies_follow_the_restricted_softmax(case: tuple[float, int, float]) -> None:
    """20,000 draws of one row (steps 0..n-1 of one stream, through the device hash): total variation from the expected
    distribution under 0.02 (its standard error here is ~0.005), and no token outside the kept set."""
    temperature, top_k, top_p = case
    n, vocab = 20_000, 30
    z = torch.randn(vocab, generator=torch.Generator().manual_seed(11)) * 1.5
    got = choose_tokens(
        z.expand(n, vocab).contiguous(), [temperature] * n, [top_k] * n, [top_p] * n,
        streams=[stream_key(77, 2)] * n, steps=list(range(n)),
    )  # fmt: skip
    freq = torch.bincount(got.tokens, minlength=vocab).double() / n
    want = expected_distribution(z, temperature, top_k, top_p)
    assert 0.5 * float((freq - want).abs().sum()) < 0.02
    assert float(freq[want == 0].sum()) == 0.0


def test_hand_made_distributions_are_drawn_from_renormalised() -> None:
    """Probabilities (0.05, 0.4, 0.1, 0.3, 0.15): top_k 2 keeps 0.4 and 0.3; top_p 0.75 needs the 0.15 too (0.4 + 0.3
    < 0.75); temperature 0.5 squares them; 4,000 draws each within 0.03 of the renormalised probabilities."""
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    cases = [
        ((1.0, 2, 1.0), torch.tensor([0.0, 0.4, 0.0, 0.3, 0.0]) / 0.7),
        ((1.0, -1, 0.75), torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15]) / 0.85),
        ((0.5, -1, 1.0), probs**2 / (probs**2).sum()),
    ]
    n = 4000
    for (temperature, top_k, top_p), expected in cases:
        got = choose_tokens(
            probs.log().expand(n, 5).contiguous(), [temperature] * n, [top_k] * n, [top_p] * n,
            streams=[stream_key(5, 0)] * n, steps=list(range(n)),
        )  # fmt: skip
        freq = torch.bincount(got.tokens, minlength=5).double() / n
        assert float((freq - expected).abs().max()) < 0.03, (top_k, top_p, freq)
        assert float(freq[expected == 0].sum()) == 0.0


def test_a_long_tail_of_tiny_probabilities_keeps_its_mass() -> None:
    """One token of weight 1 first in the vocabulary, then 50,000 tokens of weight w = 2e-8 (0.1% of the mass
    together): a uniform u above 1 / total draws the tail token 1 + floor((u * total - 1) / w), give or take one. An
    fp32 running sum would stay at 1 (each w is under half its ulp): token 0 every time; fp32 prefix sums rounded
    from exact ones move in steps of ~6 tail tokens."""
    vocab = 50_001
    z = torch.full((vocab,), math.log(2e-8))
    z[0] = 0.0
    w = float(z[1].exp())
    total = 1 + (vocab - 1) * w
    rows = 100
    uniforms = [(1 + (vocab - 1) * w * (i + 0.5) / rows) / total for i in range(rows)]
    got = choose_tokens(z.expand(rows, vocab).contiguous(), [1.0] * rows, [-1] * rows, [1.0] * rows, uniforms)
    want = [1 + math.floor((u * total - 1) / w) for u in uniforms]
    assert all(abs(a - b) <= 1 for a, b in zip(got.tokens.tolist(), want, strict=True)), (got.tokens, want)
    head = choose_tokens(z[None], [1.0], [-1], [1.0], [0.99899])
    assert head.tokens.tolist() == [0]


# ---- batch independence ----------------------------------------------------------------------------------------------
PROBES = [  # (temperature, top_k, top_p, top-k logprobs): one row of each path
    (0.0, -1, 1.0, 2),
    (1.0, -1, 1.0, 0),
    (0.7, -1, 1.0, 3),
    (1.0, 20, 1.0, 0),
    (0.9, -1, 0.9, 0),
    (1.1, 40, 0.8, 1),
]


def run_rows(
    z: torch.Tensor, params: Sequence[tuple[float, int, float, int]], streams: Sequence[int], step: int
) -> Choices:
    return choose_tokens(
        z, [p[0] for p in params], [p[1] for p in params], [p[2] for p in params],
        streams=[None if p[0] == 0 else s for p, s in zip(params, streams, strict=True)], steps=[step] * len(params),
        topk_logprobs=[p[3] for p in params],
    )  # fmt: skip


def test_a_rows_tokens_do_not_depend_on_the_rows_around_it() -> None:
    """Each probe row alone, then at random places among random other rows (other paths, temperatures and streams),
    over 30 steps with fresh logits: the same tokens, logprobs and top-k logprobs."""
    rng = random.Random(21)
    g = torch.Generator().manual_seed(21)
    vocab = 1000
    for step in range(30):
        probe_logits = torch.randn(len(PROBES), vocab, generator=g) * 3
        probe_streams = [stream_key(1234, i) for i in range(len(PROBES))]
        alone = [run_rows(probe_logits[i : i + 1], [p], [probe_streams[i]], step) for i, p in enumerate(PROBES)]
        others = rng.randint(1, 40)
        params = [(rng.choice([0.0, 1.0, 0.5]), rng.choice([-1, 3, 50]), rng.choice([1.0, 0.7]), rng.choice([0, 4]))
                  for _ in range(others)] + list(PROBES)  # fmt: skip
        streams = [stream_key(rng.randint(0, 99), rng.randint(0, 9)) for _ in range(others)] + probe_streams
        logits = torch.cat([torch.randn(others, vocab, generator=g) * 3, probe_logits])
        order = list(range(len(params)))
        rng.shuffle(order)
        mixed = run_rows(logits[order], [params[i] for i in order], [streams[i] for i in order], step).to_host()
        for i in range(len(PROBES)):
            at = order.index(others + i)
            one = alone[i].to_host()
            assert mixed.tokens[at] == one.tokens[0], (step, PROBES[i])
            assert abs(mixed.logprobs[at] - one.logprobs[0]) <= 1e-6
            got_top, want_top = mixed.top[at] or [], one.top[0] or []
            assert [t for t, _ in got_top] == [t for t, _ in want_top]
            assert all(abs(a - b) <= 1e-6 for (_, a), (_, b) in zip(got_top, want_top, strict=True))


# ---- bad input -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, match",
    [
        ({"temperatures": [-1.0]}, "temperature"),
        ({"temperatures": [math.nan]}, "temperature"),
        ({"temperatures": [math.inf]}, "temperature"),
        ({"top_ks": [0]}, "top_k"),
        ({"top_ks": [True]}, "top_k"),
        ({"top_ps": [0.0]}, "top_p"),
        ({"top_ps": [1.5]}, "top_p"),
        ({"uniforms": [None]}, "draw"),
        ({"topk_logprobs": [11]}, "top-k logprobs"),
        ({"top_ps": [1.0, 1.0]}, "entries"),
        ({"logits": torch.zeros(1, 10, dtype=torch.float64)}, "fp32"),
        ({"logits": torch.zeros(10)}, "fp32"),
        ({"uniforms": None}, "either"),
        ({"uniforms": None, "streams": [1]}, "step"),
    ],
)
def test_bad_input_is_a_typed_error(change: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"logits": torch.zeros(1, 10), "temperatures": [1.0], "top_ks": [-1], "top_ps": [1.0],
                               "uniforms": [0.5], "topk_logprobs": [0]}  # fmt: skip
    args.update(change)
    with pytest.raises(InvalidRequestError, match=match):
        choose_tokens(**args)  # type: ignore[arg-type]

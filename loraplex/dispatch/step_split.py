"""One round's forward_backward requests -> the engine steps that run them, by predicted cost (pure).

Mixing adapters in one step pays when they underfill a microbatch (one pass through the layers instead of several)
and can cost when they fill it (a microbatch straddling two adapters takes the grouped op, not a plain matmul). The
candidates: one mixed step; every adapter alone; the adapters that fill a microbatch by themselves alone and the rest
mixed; those full ones in one step of their own and the rest mixed. The cheapest predicted wins, ties going to fewer
steps. Running every adapter alone is always a candidate, so the chosen split is never predicted slower than it.

One exception to "fewer steps": a candidate whose microbatches are exactly those of every adapter alone (no microbatch
would hold two adapters, so the same passes run either way; likewise against any candidate with more steps) saves nothing but the model's fixed step cost, and the
H200 measured that saving as a loss (4 saturated tenants mixed: 0.993x one by one, benchmarks/RESULTS.md; the fit
cannot learn it, since a pool that always mixes never observes the alternative). Such a candidate is not taken: the
adapters run alone, each step's outputs ready a step earlier.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.dispatch.cost_model import StepCost, StepShape, datum_lengths, shape_of, shape_of_lengths
from loraplex.protocol import PlannedRequest


def split_step(requests: Sequence[PlannedRequest], cost: StepCost | None) -> list[list[int]]:
    """Groups of indices into `requests` (order kept within and across groups), one engine step each. The policy
    puts at most one request per adapter in a round, so a request is an adapter here."""
    n = len(requests)
    if cost is None or n <= 1:
        return [list(range(n))] if n else []
    lengths = [datum_lengths(r) for r in requests]
    cap = cost.microbatch_tokens
    full = [i for i in range(n) if sum(lengths[i]) >= cap]
    rest = [i for i in range(n) if sum(lengths[i]) < cap]
    candidates: list[list[list[int]]] = [[list(range(n))]]
    if full and rest:
        candidates += [[full, rest], [*([i] for i in full), rest]]
    candidates.append([[i] for i in range(n)])
    memo: dict[tuple[int, ...], StepShape] = {}

    def shape(group: list[int]) -> StepShape:
        key = tuple(group)
        if key not in memo:
            memo[key] = shape_of_lengths([lengths[i] for i in group], cap)
        return memo[key]

    works = [_work([shape(g) for g in groups]) for groups in candidates]
    best, best_cost = candidates[0], float("inf")
    for groups, work in zip(candidates, works, strict=True):
        if any(w == work and len(other) > len(groups) for other, w in zip(candidates, works, strict=True)):
            continue  # the same microbatches as another candidate's, in fewer steps: see the module doc
        total = sum(cost.predict(shape(g)) for g in groups)
        if total < best_cost:  # strict: a tie keeps the earlier candidate (fewer steps)
            best, best_cost = groups, total
    return best


def _work(shapes: Sequence[StepShape]) -> tuple[int, int, int, int]:
    """What a split's steps do on the device, whatever the number of steps: microbatches, padded tokens, tokens in
    mixed microbatches, extra adapters' tokens."""
    return (sum(s.microbatches for s in shapes), sum(s.tokens for s in shapes), sum(s.mixed_tokens for s in shapes),
            sum(s.adapter_tokens for s in shapes))  # fmt: skip


def predicted_seconds(groups: Sequence[Sequence[PlannedRequest]], cost: StepCost) -> float:
    """The predicted seconds of running each group as one step (for tests and the benchmark)."""
    return sum(cost.predict(shape_of(list(g), cost.microbatch_tokens)) for g in groups)

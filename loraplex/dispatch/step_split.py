"""One round's forward_backward requests -> the engine steps that run them, by predicted cost (pure).

Mixing adapters in one step pays when they underfill a microbatch (one pass through the layers instead of several)
and can cost when they fill it (a microbatch straddling two adapters takes the grouped op, not a plain matmul). The
candidates: one mixed step; every adapter alone; the adapters that fill a microbatch by themselves alone and the rest
mixed; those full ones in one step of their own and the rest mixed. The cheapest predicted wins, ties going to fewer
steps. Running every adapter alone is always a candidate, so the chosen split is never predicted slower than it.
"""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.dispatch.cost_model import StepCost, datum_lengths, shape_of, shape_of_lengths
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
    memo: dict[tuple[int, ...], float] = {}

    def step_cost(group: list[int]) -> float:
        key = tuple(group)
        if key not in memo:
            memo[key] = cost.predict(shape_of_lengths([lengths[i] for i in group], cap))
        return memo[key]

    best, best_cost = candidates[0], float("inf")
    for groups in candidates:
        total = sum(step_cost(g) for g in groups)
        if total < best_cost:  # strict: a tie keeps the earlier candidate (fewer steps)
            best, best_cost = groups, total
    return best


def predicted_seconds(groups: Sequence[Sequence[PlannedRequest]], cost: StepCost) -> float:
    """The predicted seconds of running each group as one step (for tests and the benchmark)."""
    return sum(cost.predict(shape_of(list(g), cost.microbatch_tokens)) for g in groups)

"""A finish step for dispatcher tests: tells `record(outcomes, plan)` about each answered plan before its results are
stored, as the pool's finish step records it in SQL first (pool/finish.py), then stores the results and acks."""

from __future__ import annotations

from collections.abc import Callable

from loraplex.dispatch.hooks import AnsweredPlan, FinishStep
from loraplex.protocol import BatchPlan, Outcome


class Recording(FinishStep):
    def __init__(self, record: Callable[[list[Outcome], BatchPlan], object]) -> None:
        self.record = record

    def __call__(self, answer: AnsweredPlan) -> None:
        self.record(answer.outcomes, answer.plan)
        super().__call__(answer)

"""What the dispatcher writes to SQL after each plan: adapter status, the applied seq_id per adapter (so a restarted
pool continues in order), and usage per tenant. One transaction per plan."""

from __future__ import annotations

import time
from contextlib import suppress

from sqlalchemy.orm import Session, sessionmaker

from loraplex.dispatch.loop import Executor
from loraplex.dispatch.plan import BatchPlan, Outcome, RequestKind
from loraplex.errors import NotFoundError
from loraplex.storage.models import AdapterStatus
from loraplex.storage.repositories import AdapterRepository, PoolRepository, UsageRepository, unit_of_work


class OutcomeRecorder:
    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        self._last_plan_seconds = 0.0

    def timed(self, executor: Executor) -> Executor:
        """Wrap the executor so each plan's wall time is known when its outcomes are recorded (usage seconds)."""
        recorder = self

        class _Timed:
            def execute(self, plan: BatchPlan) -> list[Outcome]:
                started = time.monotonic()
                try:
                    return executor.execute(plan)
                finally:
                    recorder._last_plan_seconds = time.monotonic() - started

        return _Timed()

    def applied_seq(self, model_id: str) -> int | None:
        with self._sessions() as session:
            return PoolRepository(session).applied_seq_id(model_id)

    def __call__(self, outcomes: list[Outcome], plan: BatchPlan) -> None:
        seconds = self._last_plan_seconds
        by_id = {o.request_id: o for o in outcomes}
        tokens = sum(r.num_tokens for r in plan.requests) or 1
        with unit_of_work(self._sessions) as session:
            for request in plan.requests:
                outcome = by_id.get(request.request_id)
                if outcome is None:
                    continue
                adapters = AdapterRepository(session, request.tenant_id)
                if request.kind == RequestKind.CREATE_ADAPTER:
                    with suppress(NotFoundError):  # deleted before its creation finished
                        adapters.set_status(request.model_id, AdapterStatus.READY if outcome.ok else AdapterStatus.FAILED)
                if request.kind in (RequestKind.CREATE_ADAPTER, RequestKind.DELETE_ADAPTER):
                    continue  # outside the seq_id chain
                # A failed request still takes its place in the order: later seq_ids must not wait for it.
                adapters.record_applied(request.model_id, request.seq_id, include_deleted=True)
                if outcome.ok and request.kind in (RequestKind.FORWARD_BACKWARD, RequestKind.FORWARD):
                    share = seconds * request.num_tokens / tokens  # the plan's time split by token share
                    UsageRepository(session, request.tenant_id).record(
                        request.model_id, str(request.kind), request.num_tokens, share
                    )

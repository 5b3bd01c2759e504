"""Offline fine-tuning pipelines of one tenant: what the gateway creates, lists and cancels, and what the Celery task
that drives a pipeline records as it goes. Progress writes never move a pipeline out of a finished state (a cancel
that lands between two steps stays a cancel)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from loraplex.errors import ConflictError, NotFoundError
from loraplex.storage.models import Pipeline, PipelineState
from loraplex.storage.types import utcnow

ERROR_LENGTH = 4000  # a failed pipeline's message is cut here (the task's traceback never lands in the row)


class PipelineRepository:
    def __init__(self, session: Session, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    # ---- the gateway's side ----------------------------------------------------------------------------------------
    def create(
        self,
        *,
        name: str,
        config: dict[str, Any],
        dataset_key: str,
        total_steps: int,
        sweep_id: str | None = None,
        sweep_point: dict[str, Any] | None = None,
    ) -> Pipeline:
        row = Pipeline(
            tenant_id=self.tenant_id,
            name=name,
            config=config,
            dataset_key=dataset_key,
            total_steps=total_steps,
            sweep_id=sweep_id,
            sweep_point=dict(sweep_point or {}),
            state=PipelineState.QUEUED,
            step=0,
            attempt=0,
            eval_losses=[],
            train_losses=[],
        )
        self.session.add(row)
        self.session.flush()
        return row

    def get(self, pipeline_id: str) -> Pipeline:
        row = self.session.scalar(
            select(Pipeline).where(Pipeline.id == pipeline_id, Pipeline.tenant_id == self.tenant_id)
        )
        if row is None:
            raise NotFoundError(f"pipeline {pipeline_id!r} not found")
        return row

    def list(self, sweep_id: str | None = None, limit: int = 100, offset: int = 0) -> list[Pipeline]:
        stmt = select(Pipeline).where(Pipeline.tenant_id == self.tenant_id)
        if sweep_id is not None:
            stmt = stmt.where(Pipeline.sweep_id == sweep_id)
        stmt = stmt.order_by(Pipeline.created_at.desc(), Pipeline.id).limit(limit).offset(offset)
        return list(self.session.scalars(stmt))

    def count(self, sweep_id: str | None = None) -> int:
        stmt = select(func.count()).select_from(Pipeline).where(Pipeline.tenant_id == self.tenant_id)
        if sweep_id is not None:
            stmt = stmt.where(Pipeline.sweep_id == sweep_id)
        return int(self.session.scalar(stmt) or 0)

    def count_unfinished(self) -> int:
        """This tenant's pipelines queued or running (its quota's use)."""
        stmt = select(func.count()).select_from(Pipeline).where(
            Pipeline.tenant_id == self.tenant_id, Pipeline.state.in_([PipelineState.QUEUED, PipelineState.RUNNING])
        )
        return int(self.session.scalar(stmt) or 0)

    def cancel(self, pipeline_id: str) -> Pipeline:
        """Mark a queued or running pipeline cancelled (its task stops before its next step). Cancelling a cancelled
        one answers it as it is; a succeeded or failed one is a ConflictError."""
        row = self.get(pipeline_id)
        if row.state == PipelineState.CANCELLED:
            return row
        if row.state.finished:
            raise ConflictError(f"pipeline {pipeline_id!r} already {row.state}; nothing to cancel")
        row.state = PipelineState.CANCELLED
        row.finished_at = utcnow()
        self.session.flush()
        return row

    # ---- the Celery task's side ------------------------------------------------------------------------------------
    def start_attempt(self, pipeline_id: str) -> Pipeline | None:
        """A run of the task takes the pipeline: RUNNING, attempt + 1. None when it is already finished (a task
        delivered again after the end, or cancelled before it started)."""
        row = self.get(pipeline_id)
        if row.state.finished:
            return None
        row.state = PipelineState.RUNNING
        row.attempt = (row.attempt or 0) + 1
        row.started_at = row.started_at or utcnow()
        self.session.flush()
        return row

    def set_adapter(self, pipeline_id: str, model_id: str) -> None:
        self.get(pipeline_id).model_id = model_id
        self.session.flush()

    def rewind(self, pipeline_id: str, step: int) -> Pipeline:
        """A resumed run restarts after `step` (its checkpoint's): progress past it is dropped, to be written again."""
        row = self.get(pipeline_id)
        row.step = step
        row.eval_losses = [e for e in row.eval_losses if e[0] <= step]
        row.train_losses = [t for t in row.train_losses if t[0] <= step]
        self.session.flush()
        return row

    def record_step(self, pipeline_id: str, step: int, train_loss: float) -> PipelineState:
        """Step `step` done with this mean train loss; returns the state (CANCELLED: stop)."""
        row = self.get(pipeline_id)
        if row.state == PipelineState.RUNNING:
            row.step = step
            row.train_losses = [*[t for t in row.train_losses if t[0] < step], [step, train_loss]]
            self.session.flush()
        return row.state

    def record_eval(self, pipeline_id: str, step: int, loss: float) -> None:
        row = self.get(pipeline_id)
        if row.state == PipelineState.RUNNING:
            row.eval_losses = [*[e for e in row.eval_losses if e[0] < step], [step, loss]]
            self.session.flush()

    def record_checkpoint(self, pipeline_id: str, path: str, step: int) -> None:
        row = self.get(pipeline_id)
        row.last_checkpoint, row.last_checkpoint_step = path, step
        self.session.flush()

    def record_final(self, pipeline_id: str, final_checkpoint: str) -> None:
        self.get(pipeline_id).final_checkpoint = final_checkpoint
        self.session.flush()

    def record_export(self, pipeline_id: str, export_path: str) -> None:
        self.get(pipeline_id).export_path = export_path
        self.session.flush()

    def finish(self, pipeline_id: str, state: PipelineState, error: str | None = None) -> PipelineState:
        """End a running (or queued) pipeline as `state`; a pipeline cancelled meanwhile stays cancelled. Returns the
        state it ends in."""
        row = self.get(pipeline_id)
        if not row.state.finished:
            row.state = state
            row.error = error[:ERROR_LENGTH] if error else None
            row.finished_at = utcnow()
            self.session.flush()
        return row.state


def pipeline_tenant(session: Session, pipeline_id: str) -> str:
    """The tenant a pipeline belongs to (operator side: the Celery task is given the pipeline id only)."""
    tenant_id = session.scalar(select(Pipeline.tenant_id).where(Pipeline.id == pipeline_id))
    if tenant_id is None:
        raise NotFoundError(f"pipeline {pipeline_id!r} not found")
    return tenant_id


def pipelines_missing_export(session: Session, limit: int = 100) -> list[Pipeline]:
    """Every tenant's succeeded pipelines with a final checkpoint but no export yet (the beat's export sweep)."""
    stmt = select(Pipeline).where(
        Pipeline.state == PipelineState.SUCCEEDED,
        Pipeline.final_checkpoint.is_not(None),
        Pipeline.export_path.is_(None),
    )
    return list(session.scalars(stmt.order_by(Pipeline.finished_at).limit(limit)))

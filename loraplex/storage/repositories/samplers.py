"""Sampling sessions (samplers) of one tenant."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraplex.errors import NotFoundError
from loraplex.storage.models import SamplingSession
from loraplex.storage.repositories._common import add_or_conflict


class SamplerRepository:
    def __init__(self, session: Session, tenant_id: str) -> None:
        self.session = session
        self.tenant_id = tenant_id

    def create(
        self,
        base_model: str,
        model_path: str | None,
        session_id: str | None = None,
        sampling_session_seq_id: int | None = None,
    ) -> SamplingSession:
        row = SamplingSession(
            tenant_id=self.tenant_id,
            session_id=session_id,
            sampling_session_seq_id=sampling_session_seq_id,
            base_model=base_model,
            model_path=model_path,
        )
        add_or_conflict(self.session, row, f"sampler {sampling_session_seq_id} of session {session_id!r} already exists")
        return row

    def find_by_seq(self, session_id: str, sampling_session_seq_id: int) -> SamplingSession | None:
        return self.session.scalar(
            select(SamplingSession).where(
                SamplingSession.tenant_id == self.tenant_id,
                SamplingSession.session_id == session_id,
                SamplingSession.sampling_session_seq_id == sampling_session_seq_id,
            )
        )

    def get(self, sampler_id: str) -> SamplingSession:
        row = self.session.scalar(
            select(SamplingSession).where(SamplingSession.id == sampler_id, SamplingSession.tenant_id == self.tenant_id)
        )
        if row is None:
            raise NotFoundError(f"sampler {sampler_id!r} not found")
        return row

"""Helpers shared by the repositories."""

from __future__ import annotations

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.errors import ConflictError


def add_or_conflict(session: Session, row: object, message: str) -> None:
    """Insert `row` inside a SAVEPOINT: a unique-key clash (e.g. a concurrent insert of the same name) becomes
    ConflictError and the caller's transaction stays usable. Other pending changes are flushed before the SAVEPOINT,
    so their errors are not mistaken for a conflict."""
    session.flush()
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError as exc:
        raise ConflictError(message) from exc

"""Checkpoint retention: expired checkpoints lose their row and their files. A plain function for now (the Celery
task of DESIGN.md will call it on a schedule); operator-side, so it spans every tenant.

Rows go first, in one transaction, and the files after it commits: a crash in between leaves orphan files (harmless,
a later sweep of the blob root can reclaim them), never a row pointing at missing files."""

from __future__ import annotations

import logging
import shutil
from datetime import datetime

from sqlalchemy.orm import Session, sessionmaker

from loraplex.errors import InvalidRequestError
from loraplex.storage.blobs import BlobStore
from loraplex.storage.db import unit_of_work
from loraplex.storage.repositories.checkpoints import expired_checkpoints
from loraplex.storage.types import utcnow

log = logging.getLogger(__name__)


def delete_checkpoint_files(blob_store: BlobStore, blob_uri: str) -> bool:
    """Remove a checkpoint's folder (or file) named by its file:// URI inside the store; False when already gone."""
    try:
        path = blob_store.path(blob_store.key_for_uri(blob_uri))
    except InvalidRequestError:
        log.warning("checkpoint files %s are outside the blob store %s: left alone", blob_uri, blob_store.root)
        return False
    if path.is_dir():
        try:
            shutil.rmtree(path)
        except FileNotFoundError:  # another deleter removed some of it meanwhile: remove what is left
            shutil.rmtree(path, ignore_errors=True)
        return True
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def delete_expired(sessions: sessionmaker[Session], blob_store: BlobStore, now: datetime | None = None) -> int:
    """Delete every checkpoint whose `expires_at` is at or before `now` (default: the current time); returns how many
    rows were deleted."""
    now = now or utcnow()
    with unit_of_work(sessions) as session:
        expired = expired_checkpoints(session, now)
        uris = [c.blob_uri for c in expired]
        for checkpoint in expired:
            session.delete(checkpoint)
    for uri in uris:
        delete_checkpoint_files(blob_store, uri)
    if uris:
        log.info("retention: deleted %d expired checkpoint(s)", len(uris))
    return len(uris)

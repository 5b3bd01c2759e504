"""Persistent state: SQLAlchemy models, tenant-scoped repositories, transactions, migrations, and the blob store.

Typical use::

    migrate(url)  # once at start; a no-op when the schema is at head
    factory = session_factory(make_db_engine(url))
    with unit_of_work(factory) as s:  # commits at the end, rolls back on any error
        adapter = AdapterRepository(s, tenant_id).create(...)
"""

from loraplex.storage.blobs import BlobStore
from loraplex.storage.db import downgrade, make_db_engine, migrate, session_factory, unit_of_work
from loraplex.storage.enums import AdapterStatus, CheckpointKind, ResidencyTier

__all__ = [
    "AdapterStatus",
    "BlobStore",
    "CheckpointKind",
    "ResidencyTier",
    "downgrade",
    "make_db_engine",
    "migrate",
    "session_factory",
    "unit_of_work",
]

"""Column types shared by the models: timezone-aware UTC datetimes and string-valued enums."""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum

from sqlalchemy import DateTime, Dialect, Enum
from sqlalchemy.types import TypeDecorator

# Widest enum value we store is well below this; a fixed length keeps models and migrations byte-identical.
ENUM_LENGTH = 16


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """`DateTime(timezone=True)` that only accepts aware datetimes and always returns aware UTC ones.

    SQLite keeps no zone, so values are normalised to UTC on the way in and tagged UTC on the way out;
    PostgreSQL (timestamptz) round-trips them natively."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given; use an aware one (datetime.now(UTC))")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def str_enum(enum_cls: type[StrEnum]) -> Enum:
    """A VARCHAR column holding the enum's *values* (not member names), with no DB-side enum type or CHECK."""
    return Enum(
        enum_cls,
        native_enum=False,
        create_constraint=False,
        length=ENUM_LENGTH,
        values_callable=lambda members: [m.value for m in members],
        validate_strings=True,
    )

"""Offset pagination of the listings (runs, checkpoints, pipelines): one rule for every front end."""

from __future__ import annotations

from loraplex.errors import InvalidRequestError
from loraplex.service.schemas import Cursor

MAX_PAGE_LIMIT = 1000
DEFAULT_PAGE_LIMIT = 20
MAX_PAGE_OFFSET = 2**63 - 1  # SQL's BIGINT: a larger OFFSET is an overflow in the database driver


def check_page(limit: int, offset: int) -> None:
    """InvalidRequestError unless 1 <= limit <= MAX_PAGE_LIMIT and 0 <= offset <= MAX_PAGE_OFFSET (both integers)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE_LIMIT:
        raise InvalidRequestError(f"limit must be an integer from 1 to {MAX_PAGE_LIMIT}, got {limit!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= MAX_PAGE_OFFSET:
        raise InvalidRequestError(f"offset must be an integer from 0 to {MAX_PAGE_OFFSET}, got {offset!r}")


def cursor(limit: int, offset: int, total_count: int) -> Cursor:
    return Cursor(offset=offset, limit=limit, total_count=total_count)

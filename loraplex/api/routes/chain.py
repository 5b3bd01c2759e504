"""Which routes are steps in an adapter's seq_id chain: their rejections are queued in the seq_id's place
(service/rejections.py), also when the body fails validation before the route runs (api/errors.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request

from loraplex.protocol import RequestKind

F = TypeVar("F", bound=Callable[..., Any])


def seq_step(kind: RequestKind) -> Callable[[F], F]:
    """Mark a route's endpoint as the chain step `kind` (its body carries the seq_id, its path the model_id)."""

    def mark(endpoint: F) -> F:
        endpoint.seq_step_kind = kind  # type: ignore[attr-defined]
        return endpoint

    return mark


def seq_step_kind(request: Request) -> RequestKind | None:
    """The chain step kind of the route a request matched, or None."""
    route = request.scope.get("route")
    return getattr(getattr(route, "endpoint", None), "seq_step_kind", None)

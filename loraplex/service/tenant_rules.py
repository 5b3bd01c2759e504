"""The rules of the operator controls, as pure functions (no I/O): which state changes are allowed, what a suspended
or draining tenant is told, which requests a draining tenant may still queue, and how an operator's typed reason,
weight and quotas are read.

- Suspended: every authenticated call of the tenant is a 403 naming the reason (native, Tinker and OpenAI routes: they
  all authenticate through api/deps.py). Its queued requests stay queued and run; their results are kept the results'
  TTL (24 h), so after a resume its clients read them.
- Draining: the calls that would queue new work are a 403 naming the reason; everything else is served (futures,
  listings, downloads, deletes), so its clients collect the results of what is queued while the queue empties. Nothing
  queued is cancelled: draining is "finish what you have, take nothing new".
- Resume: back to active, from either.
- A chain step refused for either state has its seq_id filled with the refusal (service/rejections.py), so the
  tenant's clients, which took the seq_id before they sent the step, go on after the resume without waiting for it."""

from __future__ import annotations

import math

from loraplex.errors import ConflictError, ForbiddenError, InvalidRequestError
from loraplex.protocol import WHILE_DRAINING_KINDS, WHILE_SUSPENDED_KINDS, RequestKind
from loraplex.storage.enums import TenantState

REASON_CHARS = 255


def check_transition(name: str, current: TenantState, target: TenantState) -> None:
    """ConflictError unless `current` -> `target` is a change: suspend and drain from any other state, resume
    (target ACTIVE) from suspended or draining."""
    if current == target:
        raise ConflictError(f"tenant {name} is {current.value} already")


def refusal(name: str, state: TenantState, reason: str | None) -> ForbiddenError:
    why = reason or "no reason given"
    if state == TenantState.SUSPENDED:
        return ForbiddenError(f"tenant {name} is suspended by an operator: {why}")
    return ForbiddenError(
        f"tenant {name} is draining: {why}. It accepts no new work; its queued requests still run and their "
        "futures can be read"
    )


def check_serves(name: str, state: TenantState, reason: str | None) -> None:
    """Any authenticated call: a 403 for a suspended tenant."""
    if state == TenantState.SUSPENDED:
        raise refusal(name, state, reason)


def check_queues(name: str, state: TenantState, reason: str | None, kind: RequestKind) -> None:
    """A call that queues `kind`: a 403 for a suspended tenant unless the kind fills a refused step's seq_id, and for
    a draining one unless the kind frees or fills."""
    if (state == TenantState.SUSPENDED and kind not in WHILE_SUSPENDED_KINDS) or (
        state == TenantState.DRAINING and kind not in WHILE_DRAINING_KINDS
    ):
        raise refusal(name, state, reason)


def parse_reason(raw: str) -> str:
    """An operator's reason: required (it is what the tenant reads), one line, at most REASON_CHARS characters."""
    reason = " ".join(raw.split())
    if not reason:
        raise InvalidRequestError("give a reason: the tenant's clients are told it")
    if len(reason) > REASON_CHARS or not reason.isprintable():
        raise InvalidRequestError(f"a reason must be at most {REASON_CHARS} printable characters")
    return reason


def parse_quota(what: str, raw: str) -> int | None:
    """A quota as typed: empty reads the setting's (None); else a whole number >= 0, 0 meaning no limit."""
    text = raw.strip().replace("_", "").replace(",", "")
    if not text:
        return None
    if not text.isdigit() or len(text) > 18:
        raise InvalidRequestError(f"{what} must be a whole number >= 0 (0: no limit; empty: the default), got {raw[:40]!r}")
    return int(text)


def parse_weight(raw: str) -> float:
    """A fair-share weight as typed: a positive finite number."""
    try:
        weight = float(raw.strip())
    except ValueError:
        raise InvalidRequestError(f"weight must be a positive number, got {raw[:40]!r}") from None
    if not (weight > 0 and math.isfinite(weight)):
        raise InvalidRequestError(f"weight must be a positive finite number, got {raw[:40]!r}")
    return weight

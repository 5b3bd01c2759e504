"""The operator controls' rules (service/tenant_rules.py), no I/O: which changes are allowed, what a suspended or
draining tenant may still do and is told, and how typed reasons, weights and quotas are read."""

from __future__ import annotations

import pytest

from loraplex.errors import ConflictError, ForbiddenError, InvalidRequestError, http_status_for
from loraplex.protocol import WHILE_DRAINING_KINDS, WHILE_SUSPENDED_KINDS, RequestKind
from loraplex.service import tenant_rules as rules
from loraplex.storage.enums import TenantState

A, S, D = TenantState.ACTIVE, TenantState.SUSPENDED, TenantState.DRAINING


def test_every_state_change_but_to_the_same_state_is_allowed() -> None:
    for current in (A, S, D):
        for target in (A, S, D):
            if current == target:
                with pytest.raises(ConflictError, match=f"{current.value} already"):
                    rules.check_transition("acme", current, target)
            else:
                rules.check_transition("acme", current, target)


def test_suspended_refuses_everything_but_a_refusals_fill_draining_only_new_work() -> None:
    with pytest.raises(ForbiddenError, match="acme is suspended by an operator: unpaid") as refused:
        rules.check_serves("acme", S, "unpaid")
    assert http_status_for(refused.value) == 403
    rules.check_serves("acme", D, "moving")
    rules.check_serves("acme", A, None)
    assert set(WHILE_SUSPENDED_KINDS) == {RequestKind.REJECTED}  # it queues no work: it fills a refused step's seq_id
    for kind in RequestKind:
        if kind in WHILE_SUSPENDED_KINDS:
            rules.check_queues("acme", S, "unpaid", kind)
        else:
            with pytest.raises(ForbiddenError):
                rules.check_queues("acme", S, "unpaid", kind)
        rules.check_queues("acme", A, None, kind)
        if kind in WHILE_DRAINING_KINDS:
            rules.check_queues("acme", D, "moving", kind)
        else:
            with pytest.raises(ForbiddenError, match="acme is draining: moving. It accepts no new work"):
                rules.check_queues("acme", D, "moving", kind)


def test_reasons_are_required_one_line_and_bounded() -> None:
    assert rules.parse_reason("  unpaid\n invoice  ") == "unpaid invoice"
    for bad in ("", "   ", "x" * 256, "bell\x07"):
        with pytest.raises(InvalidRequestError):
            rules.parse_reason(bad)


def test_quotas_and_weights_as_typed() -> None:
    assert [rules.parse_quota("q", raw) for raw in ("", "  ", "0", "12", "4_096", "1,000")] == [
        None, None, 0, 12, 4096, 1000]  # fmt: skip
    for bad in ("-1", "1.5", "lots", "9" * 19):
        with pytest.raises(InvalidRequestError, match="q must be a whole number"):
            rules.parse_quota("q", bad)
    assert rules.parse_weight(" 2.5 ") == 2.5
    for bad in ("0", "-1", "inf", "nan", "heavy", ""):
        with pytest.raises(InvalidRequestError, match="weight must be a positive"):
            rules.parse_weight(bad)

"""The coalescing window: an underfilled plan waits for the adapters just answered, never past one window, and not at
all when nobody is expected back."""

from __future__ import annotations

import pytest

from loraplex.dispatch.coalescing import Coalescer


def test_nobody_expected_no_wait() -> None:
    c = Coalescer(0.05, quiet_s=0.002)
    assert c.wait_s(10.0, {"a"}, started=10.0) == 0.0


def test_waits_for_the_answered_adapters_still_missing() -> None:
    c = Coalescer(0.05, quiet_s=0.002)
    c.answered(["a", "b", "c"], now=1.0)
    c.arrived(["a"], now=1.01)
    # b and c are missing: wait until their expectation lapses (1.05), capped by the window from `started`.
    assert c.wait_s(1.02, {"a"}, started=1.02) == pytest.approx(0.03)
    assert c.wait_s(1.02, {"a"}, started=1.0) == pytest.approx(0.03)
    c.arrived(["b", "c"], now=1.03)
    # all back: only the quiet gap after the last arrival remains
    assert c.wait_s(1.031, {"a", "b", "c"}, started=1.02) == pytest.approx(0.001)
    assert c.wait_s(1.033, {"a", "b", "c"}, started=1.02) == 0.0


def test_an_adapter_that_went_quiet_costs_one_window_only() -> None:
    c = Coalescer(0.05, quiet_s=0.0)
    c.answered(["idle"], now=0.0)
    assert c.wait_s(0.01, set(), started=0.01) == pytest.approx(0.04)
    assert c.wait_s(0.06, set(), started=0.06) == 0.0  # lapsed, and forgotten
    assert c.wait_s(0.07, set(), started=0.07) == 0.0


def test_the_total_wait_never_exceeds_one_window() -> None:
    c = Coalescer(0.05, quiet_s=0.002)
    c.answered(["x"], now=0.0)
    c.answered(["y"], now=0.04)  # y expected until 0.09
    assert c.wait_s(0.045, {"x"}, started=0.0) == pytest.approx(0.005)  # cap: started + window


def test_window_zero_disables_it() -> None:
    c = Coalescer(0.0, quiet_s=0.002)
    c.answered(["a"], now=0.0)
    c.arrived(["b"], now=0.0)
    assert c.wait_s(0.0, set(), started=0.0) == 0.0

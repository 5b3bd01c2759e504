"""The coalescing window: an underfilled plan waits for the adapters just answered (and for the optim_step that
follows a forward_backward, for adapters that send them in pairs), never past one window, and not at all when nobody
is expected back."""

from __future__ import annotations

import pytest

from loraplex.dispatch.coalescing import Coalescer, full_microbatch_tokens

FB, OPT = "forward_backward", "optim_step"


def test_nobody_expected_no_wait() -> None:
    c = Coalescer(0.05, quiet_s=0.002)
    assert c.wait_s(10.0, started=10.0) == 0.0


def test_waits_for_the_answered_adapters_still_missing() -> None:
    c = Coalescer(0.05, quiet_s=0.002)
    c.answered([("a", FB, 1), ("b", FB, 1), ("c", FB, 1)], now=1.0)
    c.arrived([("a", FB, 9)], now=1.01)
    # b and c are missing: wait until their expectation lapses (1.05), capped by the window from `started`.
    assert c.wait_s(1.02, started=1.02) == pytest.approx(0.03)
    c.arrived([("b", FB, 9), ("c", FB, 9)], now=1.03)
    assert c.wait_s(1.031, started=1.02) == 0.0  # all back: run at once (the quiet gap is for unannounced bursts)
    assert c.take_lapsed() == 0


def test_an_expectation_that_runs_out_is_counted_once() -> None:
    c = Coalescer(0.05, quiet_s=0.002)
    c.answered([("a", FB, 1), ("b", FB, 1)], now=1.0)
    c.arrived([("a", FB, 3)], now=1.01)
    assert c.wait_s(1.02, started=1.01) > 0 and c.take_lapsed() == 0
    assert c.wait_s(1.06, started=1.01) == 0.0 and c.take_lapsed() == 1  # b did not come back within its window
    c.wait_s(1.07, started=1.07)
    assert c.take_lapsed() == 0  # counted once, and taken


def test_an_adapter_still_missing_is_waited_for_a_window_from_when_its_result_became_visible() -> None:
    """The finisher stores results after their SQL record, milliseconds after the plan was answered: the tenants'
    round trips start then. An adapter already back is not expected again by the late notice."""
    c = Coalescer(0.05, quiet_s=0.002)
    c.answered([("a", FB, 1), ("b", FB, 1)], now=1.0)
    c.arrived([("a", FB, 3)], now=1.025)  # a saw its result early (another plan's finish published it)
    c.published(["a", "b"], now=1.02)
    assert c.awaited(1.03) == {"b"}
    assert c.wait_s(1.06, started=1.03) == pytest.approx(0.01)  # b: until 1.07, not 1.05
    c.published(["b"], now=1.0)  # an older notice never shortens it
    assert c.awaited(1.06) == {"b"}
    off = Coalescer(0.0)
    off.published(["a"], now=1.0)
    assert off.awaited(1.0) == set()


def test_a_burst_nobody_announced_is_waited_for_while_it_keeps_coming() -> None:
    c = Coalescer(0.05, quiet_s=0.002)
    c.arrived([("new1", FB, 9)], now=2.0)
    assert c.wait_s(2.0005, started=2.0) == pytest.approx(0.0015)
    c.arrived([("new2", FB, 9)], now=2.0015)
    assert c.wait_s(2.002, started=2.0) == pytest.approx(0.0015)
    assert c.wait_s(2.004, started=2.0) == 0.0


def test_a_pair_sender_back_after_a_pause_still_brings_its_optim_step() -> None:
    c = Coalescer(0.05, quiet_s=0.0)
    c.answered([("a", FB, 1), ("a", OPT, 2)], now=0.0)
    assert c.wait_s(1.0, started=1.0) == 0.0  # its expectation lapsed long ago
    c.arrived([("a", FB, 9)], now=1.0)
    assert c.wait_s(1.001, started=1.001) == pytest.approx(0.049)  # waits for the optim_step, up to one window
    c.arrived([("a", OPT, 10)], now=1.003)
    assert c.wait_s(1.003, started=1.001) == 0.0


def test_an_adapter_that_pairs_optim_with_forward_backward_is_awaited_until_its_optim_is_in() -> None:
    c = Coalescer(0.05, quiet_s=0.0)
    c.answered([("a", FB, 1), ("a", OPT, 2)], now=0.0)  # learned: a sends pairs
    c.arrived([("a", FB, 9)], now=0.01)
    assert c.wait_s(0.011, started=0.011) > 0.0  # its optim_step is on the way
    c.arrived([("a", OPT, 10)], now=0.012)
    assert c.wait_s(0.012, started=0.011) == 0.0
    c.answered([("a", FB, 3)], now=0.1)
    c.answered([("a", FB, 4)], now=0.2)  # two forward_backwards in a row: no longer a pair sender
    c.arrived([("a", FB, 11)], now=0.21)
    assert c.wait_s(0.21, started=0.21) == 0.0


def test_an_optim_step_queued_before_its_forward_backward_awaits_it_and_the_pair_completes_when_it_comes() -> None:
    """A client sending the two concurrently: the optim_step may be read first. Its forward_backward is awaited (a plan
    made without it would split the round), and waits for nothing once it comes (its optim_step is in)."""
    c = Coalescer(0.05, quiet_s=0.002)
    c.answered([("a", FB, 1), ("a", OPT, 2)], now=0.0)  # a sends pairs
    c.arrived([("a", OPT, 4)], now=0.01)
    assert c.awaited(0.01) == {"a"} and c.wait_s(0.01, started=0.01) == pytest.approx(0.05)  # its fb is on the way
    c.arrived([("a", FB, 3)], now=0.011)
    assert c.wait_s(0.011, started=0.01) == 0.0 and c.awaited(0.011) == set()
    c.answered([("a", FB, 3), ("a", OPT, 4)], now=0.09)
    c.arrived([("a", OPT, 6), ("a", FB, 5)], now=0.1)  # both in one read
    assert c.wait_s(0.1, started=0.1) == 0.0
    c.arrived([("a", FB, 7)], now=0.2)  # in order again: its optim_step is awaited
    assert c.wait_s(0.2, started=0.2) == pytest.approx(0.05)
    c.arrived([("a", OPT, 8)], now=0.201)
    assert c.awaited(0.201) == set() and c.wait_s(0.203, started=0.2) == 0.0  # (the quiet gap: it came unannounced)


def test_an_adapter_that_went_quiet_costs_one_window_only() -> None:
    c = Coalescer(0.05, quiet_s=0.0)
    c.answered([("idle", FB, 1)], now=0.0)
    assert c.wait_s(0.01, started=0.01) == pytest.approx(0.04)
    assert c.wait_s(0.06, started=0.06) == 0.0  # lapsed, and forgotten
    assert c.wait_s(0.07, started=0.07) == 0.0


def test_the_total_wait_never_exceeds_one_window() -> None:
    c = Coalescer(0.05, quiet_s=0.002)
    c.answered([("x", FB, 1)], now=0.0)
    c.answered([("y", FB, 1)], now=0.04)  # y expected until 0.09
    assert c.wait_s(0.045, started=0.0) == pytest.approx(0.005)  # cap: started + window


def test_window_zero_disables_it() -> None:
    c = Coalescer(0.0, quiet_s=0.002)
    c.answered([("a", FB, 1)], now=0.0)
    c.arrived([("b", FB, 9)], now=0.0)
    assert c.wait_s(0.0, started=0.0) == 0.0


def test_awaited_names_the_adapters_still_expected_and_an_arrived_pair_senders_optim() -> None:
    c = Coalescer(0.05, quiet_s=0.0)
    c.answered([("a", FB, 1), ("a", OPT, 2), ("b", FB, 1)], now=0.0)
    assert c.awaited(0.01) == {"a", "b"}
    c.arrived([("a", FB, 9)], now=0.01)  # a sends pairs: its optim_step is awaited
    c.arrived([("b", FB, 9)], now=0.01)
    assert c.awaited(0.02) == {"a"}
    assert c.awaited(0.07) == set()  # lapsed


@pytest.mark.parametrize(("tokens", "microbatch", "full"), [(0, 4096, 0), (4095, 4096, 0), (4096, 4096, 4096),
                                                            (9000, 4096, 8192), (512, 0, 0)])  # fmt: skip
def test_full_microbatch_tokens(tokens: int, microbatch: int, full: int) -> None:
    assert full_microbatch_tokens(tokens, microbatch) == full

"""runtime/thread_switch.ThreadSwitch: on inside its block, as it was after (nested blocks, an exception), and per
thread: another thread's block does not turn it on here."""

from __future__ import annotations

import threading

import pytest

from loraplex.runtime.thread_switch import ThreadSwitch


def test_a_block_turns_it_on_and_leaves_it_as_it_was() -> None:
    switch = ThreadSwitch()
    assert not switch.on
    with switch.set():
        assert switch.on
        with switch.set(False):
            assert not switch.on
        assert switch.on
    assert not switch.on
    with pytest.raises(RuntimeError), switch.set():
        raise RuntimeError("inside")
    assert not switch.on


def test_another_threads_block_is_its_own() -> None:
    switch = ThreadSwitch()
    inside, seen_here = threading.Event(), threading.Event()

    def other() -> None:
        with switch.set():
            inside.set()
            seen_here.wait(5)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(5)
    assert not switch.on
    seen_here.set()
    thread.join(5)

"""loraplex/runtime/stop_signals.py: a SIGTERM that arrives while the main thread is inside the stop event's set() (holding its
lock, as during an earlier signal's handler) still stops the process, instead of deadlocking it. Run in a child
process, so a regression fails on a timeout instead of hanging the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, signal, threading
    from loraplex.runtime.stop_signals import stop_on_signals

    stop = threading.Event()
    {install}
    with stop._cond:  # where stop.set() holds the lock while it notifies (Event.set's own code)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in this thread, with the lock held
        for _ in range(1000):  # bytecodes for the handler to run on
            pass
    print("stopped" if stop.wait(5) else "not stopped")
    """
)


def _run(install: str, timeout_s: float) -> str:
    code = CHILD.format(install=install)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "hung"
    return done.stdout.strip() or done.stderr


def test_a_signal_during_the_events_own_set_stops_the_process() -> None:
    assert _run("stop_on_signals(stop)", timeout_s=30) == "stopped"


def test_the_plain_handler_it_replaces_deadlocks_there() -> None:
    # The pattern this module replaced (`signal.signal(sig, lambda *_: stop.set())`) hangs there: so the test above
    # does recreate the deadlock (its child would print "stopped" after 5 s at most).
    assert _run("signal.signal(signal.SIGTERM, lambda *_: stop.set())", timeout_s=7) == "hung"

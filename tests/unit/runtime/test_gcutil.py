"""loraplex/runtime/gcutil.py: the pool's garbage-collector clock and the startup freeze, against the real collector."""

from __future__ import annotations

import gc
import subprocess
import sys
import time

from loraplex.runtime.gcutil import GcClock, freeze_startup_objects


def test_the_clock_adds_each_collection_and_stops_when_closed() -> None:
    clock = GcClock()
    try:
        before = time.perf_counter()
        gc.collect()
        gc.collect()
        spent = time.perf_counter() - before
        assert clock.collections >= 2 and 0 < clock.seconds <= spent
    finally:
        clock.close()
    seen = clock.collections
    gc.collect()
    assert clock.collections == seen
    clock.close()  # twice: nothing to remove, no error


def test_freezing_moves_what_is_alive_out_of_later_collections() -> None:
    kept = [[i] for i in range(10_000)]  # alive now: frozen with everything else
    try:
        frozen = freeze_startup_objects()
        # Frozen objects that die leave the permanent generation (a finaliser or another thread may free one between
        # the two reads), so the count can only have dropped since.
        assert len(kept) <= gc.get_freeze_count() <= frozen
        assert not any(o is kept[0] for o in gc.get_objects())  # no longer tracked by any generation
        made_after = [[i] for i in range(100)]
        assert any(o is made_after[0] for o in gc.get_objects())  # new objects are collected as before
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_what_was_frozen_is_unfrozen_at_exit() -> None:
    """atexit runs its handlers last registered first: one registered before the freeze sees what is still frozen
    once the freeze's own handler has run."""
    code = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
        "from loraplex.runtime.gcutil import freeze_startup_objects\n"
        "assert freeze_startup_objects() > 0 and freeze_startup_objects() > 0  # twice: one unfreeze registered\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "frozen at exit: 0", done.stderr

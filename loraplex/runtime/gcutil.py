"""Python's garbage collector in a long-running process: freeze what startup made, and clock the collections.

A full (generation 2) collection walks every tracked object while holding the GIL, so the thread it runs in and every
other Python thread pause. A pool process holds ~450k such objects once its model and libraries are loaded (the
imported modules, the model's modules and parameters): a full collection over them took ~220 ms here (a tiny engine
on the CPU; the real model's process holds more), a pause of the dispatcher loop between two launches. Freezing them
after startup (gc.freeze: moved to a permanent generation, never scanned again) takes that to under 1 ms; what the
process makes afterwards is collected as before."""

from __future__ import annotations

import atexit
import gc
import time
from typing import Any


def freeze_startup_objects() -> int:
    """Collect once (startup's own garbage), then freeze everything alive now. Returns how many objects were frozen.
    At exit they are unfrozen again, so the interpreter's last collections free them as usual (frozen, extension
    objects outlived their modules: triton's nanobind bindings printed ~80 lines of "leaked" at every pool stop)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


class GcClock:
    """Seconds spent in collections since it was made, in any thread (collections hold the GIL and never overlap, so
    the callback needs no lock)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.collections += 1

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

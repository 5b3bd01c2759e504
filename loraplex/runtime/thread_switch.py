"""A per-thread switch that a block turns on for the calls inside it, read by code deep in those calls that has no
other way to be told (an autograd Function's backward, a module forward that transformers calls). Per thread: the
pool's other threads (the finisher, the adapter store's copies) run their own calls beside it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ThreadSwitch:
    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def on(self) -> bool:
        """Whether this thread is inside a `set(True)` block (and not inside a nested `set(False)`)."""
        return bool(getattr(self._local, "on", False))

    @contextmanager
    def set(self, on: bool = True) -> Iterator[None]:
        """The switch at `on` for this thread inside the block; as it was, after."""
        before = self.on
        self._local.on = on
        try:
            yield
        finally:
            self._local.on = before

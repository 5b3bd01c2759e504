"""When to hold an underfilled plan back for a moment (pure: no I/O, no clock of its own).

Tenants that train in a closed loop (send forward_backward + optim_step, await both, send the next) come back a few
milliseconds after their results are stored, one after another. Planning at the first arrival would run them one by
one (the pool idles between plans anyway, waiting for the next arrival), so an underfilled plan waits, up to `window_s`,
for the adapters whose results it just handed out, and, while entries keep arriving less than `quiet_s` apart, for the
rest of a burst (a forward_backward's optim_step sent right behind it). A full plan never waits, nor does a plan when
nobody is expected back (a first request, or a tenant that went quiet: its expectation lapses after one window).
"""

from __future__ import annotations

from collections.abc import Iterable, Set


class Coalescer:
    def __init__(self, window_s: float, quiet_s: float = 0.002) -> None:
        self.window_s = window_s
        self.quiet_s = quiet_s
        self._expected: dict[str, float] = {}  # model_id -> when we stop waiting for its next request
        self._last_arrival = float("-inf")

    def answered(self, model_ids: Iterable[str], now: float) -> None:
        """These adapters' requests were just answered: their next ones are likely on the way."""
        if self.window_s > 0:
            for m in model_ids:
                self._expected[m] = now + self.window_s

    def arrived(self, model_ids: Iterable[str], now: float) -> None:
        for m in model_ids:
            self._expected.pop(m, None)
            self._last_arrival = now

    def wait_s(self, now: float, buffered: Set[str], started: float) -> float:
        """How long to wait for more before running an underfilled plan (0: run it now). `buffered`: adapters with a
        request in the buffer; `started`: when this plan's wait began (the total wait never exceeds one window)."""
        self._expected = {m: t for m, t in self._expected.items() if t > now}
        if self.window_s <= 0:
            return 0.0
        cap = started + self.window_s - now
        missing = [t for m, t in self._expected.items() if m not in buffered]
        wait = max(max(missing, default=now), self._last_arrival + self.quiet_s) - now
        return max(0.0, min(wait, cap))

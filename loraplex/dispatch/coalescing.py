"""When to hold an underfilled plan back for a moment (pure: no I/O, no clock of its own; kinds from the protocol).

Tenants that train in a closed loop (send forward_backward + optim_step, await both, send the next) come back a few
milliseconds after their results are stored, one after another, each pair as two HTTP requests. Planning at the first
arrival would run them one by one, and a forward_backward apart from its optim_step (the pool idles between plans
anyway, waiting for the next arrival). So an underfilled plan waits, up to `window_s` from when their results became
visible (`published`), for the adapters whose results it just handed out, and runs as soon as they are all in. An
adapter that sent an optim_step right behind its last forward_backward is waited for until that optim_step is in too,
whether it was expected or not (a tenant coming back after a pause still brings its pair). A client sending the two
concurrently may have them queued optim_step first: the forward_backward is then awaited, and completes the pair. While
entries of adapters nobody expected keep arriving less than `quiet_s` apart, it also waits for the rest of that burst. A
full plan never waits, nor does one when nobody is expected back (a first request, or a tenant that went quiet: its
expectation lapses after one window).

Waiting only pays when the awaited requests would share a microbatch with what is here. A plan whose forward_backward
tokens already fill whole microbatches (`full_microbatch_tokens`) runs those at once, and only the rest waits: the
tenants still on their way start the next plan, and their round trips overlap this one's run instead of idling the
pool (16 closed-loop tenants of 512 tokens each, two microbatches: the pool ran ~70 ms of round trips per 400 ms
round). The optim_step of an adapter in the plan is still waited for: it is a few milliseconds out, and it keeps a
forward_backward and its optim_step in one plan.
"""

from __future__ import annotations

from collections.abc import Iterable

from loraplex.protocol import RequestKind

FORWARD_BACKWARD = RequestKind.FORWARD_BACKWARD
OPTIM_STEP = RequestKind.OPTIM_STEP


class Coalescer:
    def __init__(self, window_s: float, quiet_s: float = 0.002) -> None:
        self.window_s = window_s
        self.quiet_s = quiet_s
        self._expected: dict[str, float] = {}  # model_id -> when we stop waiting for its next request
        self._last: dict[str, tuple[str, int]] = {}  # model_id -> (kind, seq_id) last answered
        self._pairs: set[str] = set()  # adapters that send optim_step right behind forward_backward
        self._last_fb: dict[str, int] = {}  # model_id -> seq_id of its last forward_backward read
        self._optim_ahead: dict[str, int] = {}  # model_id -> seq_id of an optim_step read before its forward_backward
        self._last_arrival = float("-inf")
        self._lapsed = 0  # expectations that ran out (the adapter not back within its window), for the statistics

    def answered(self, requests: Iterable[tuple[str, str, int]], now: float) -> None:
        """These (model_id, kind, seq_id) were just answered, in seq order: their next ones are likely on the way."""
        for model_id, kind, seq_id in requests:
            prev = self._last.get(model_id)
            if kind == OPTIM_STEP and prev == (FORWARD_BACKWARD, seq_id - 1):
                self._pairs.add(model_id)
            elif kind == FORWARD_BACKWARD and prev is not None and prev[0] == FORWARD_BACKWARD:
                self._pairs.discard(model_id)
            self._last[model_id] = (kind, seq_id)
            if self.window_s > 0:
                self._expected[model_id] = now + self.window_s

    def published(self, model_ids: Iterable[str], now: float) -> None:
        """Results of these adapters became visible to their clients just now (stored after their SQL record, on the
        finisher thread, milliseconds after `answered`): a round trip starts here, so an adapter still expected is
        waited for a whole window from now. One already back is not expected again."""
        if self.window_s <= 0:
            return
        for model_id in model_ids:
            if model_id in self._expected:
                self._expected[model_id] = max(self._expected[model_id], now + self.window_s)

    def arrived(self, requests: Iterable[tuple[str, str, int | None]], now: float) -> None:
        """(model_id, kind, seq_id) of requests just read, in queue order."""
        for model_id, kind, seq_id in requests:
            # A pair sent concurrently may be queued optim_step first: then its forward_backward is still on the way
            # (awaited), and completes the pair when it comes.
            completes = (
                kind == FORWARD_BACKWARD and seq_id is not None and self._optim_ahead.get(model_id) == seq_id + 1
            )
            ahead = (
                kind == OPTIM_STEP and seq_id is not None and model_id in self._pairs
                and self._last_fb.get(model_id) != seq_id - 1
            )  # fmt: skip
            if model_id not in self._expected and not completes:
                self._last_arrival = now  # part of a burst nobody announced
            if kind == FORWARD_BACKWARD and seq_id is not None:
                self._last_fb[model_id] = seq_id
            if completes:
                del self._optim_ahead[model_id]
            if ahead and seq_id is not None:
                self._optim_ahead[model_id] = seq_id
            followed = kind == FORWARD_BACKWARD and model_id in self._pairs and not completes  # its optim_step follows
            if (followed or ahead) and self.window_s > 0:
                self._expected[model_id] = now + self.window_s
            else:
                self._expected.pop(model_id, None)

    def forget(self, model_id: str) -> None:
        """A deleted adapter."""
        for table in (self._expected, self._last, self._last_fb, self._optim_ahead):
            table.pop(model_id, None)
        self._pairs.discard(model_id)

    def awaited(self, now: float) -> set[str]:
        """The adapters still expected back (an adapter in the buffer: its optim_step)."""
        return {m for m, t in self._expected.items() if t > now}

    def take_lapsed(self) -> int:
        """The expectations that ran out since the last call (a plan's statistics)."""
        lapsed, self._lapsed = self._lapsed, 0
        return lapsed

    def wait_s(self, now: float, started: float) -> float:
        """How long to wait for more before running an underfilled plan (0: run it now); `started`: when this plan's
        wait began (the total wait never exceeds one window)."""
        expected = {m: t for m, t in self._expected.items() if t > now}
        self._lapsed += len(self._expected) - len(expected)
        self._expected = expected
        if self.window_s <= 0:
            return 0.0
        wait = max(max(self._expected.values(), default=now), self._last_arrival + self.quiet_s) - now
        return max(0.0, min(wait, started + self.window_s - now))


def full_microbatch_tokens(tokens: int, microbatch_tokens: int) -> int:
    """The tokens of the whole microbatches that `tokens` fill (0: not one, or no microbatch size)."""
    return tokens // microbatch_tokens * microbatch_tokens if microbatch_tokens > 0 else 0

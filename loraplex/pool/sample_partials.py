"""The pool's SAMPLE step, whatever the sampler, with the partials of its streaming requests published
(queue/sample_partials.py): after each step, what the runs in flight of the requests that stream have sampled so far
(the native sampler's `SampleStep.progress`; a sampler without one, vLLM or a multi-rank pool, publishes none), and an
end entry for each such request whose outcome is final, so a reader stops waiting on the stream and reads the result.
A step without streaming requests costs one scan of their payloads' flag."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loraplex.protocol import Outcome, SamplePayload, Step
from loraplex.queue.sample_partials import PartialWriter


class PublishingSampleStep:
    def __init__(self, step: Callable[[Step], list[Outcome]], writer: PartialWriter) -> None:
        self.step = step
        self.writer = writer

    def __call__(self, step: Step) -> list[Outcome]:
        streaming = {r.request_id for r in step.requests
                     if isinstance(r.payload, SamplePayload) and r.payload.stream_partials}  # fmt: skip
        if not streaming:
            return self.step(step)
        try:
            outcomes = self.step(step)
        except BaseException:  # the executor fails every request of the step: their readers go to the result
            for request_id in streaming:
                self.writer.end(request_id)
            self.writer.flush()
            raise
        final = {o.request_id for o in outcomes if not o.unfinished} & streaming
        progress: Callable[[set[str]], dict[str, Any]] | None = getattr(self.step, "progress", None)
        if progress is not None and streaming - final:
            for request_id, sequences in progress(streaming - final).items():
                self.writer.update(request_id, sequences)
        for request_id in final:
            self.writer.end(request_id)
        self.writer.flush()
        return outcomes

"""What the pool adds to the fleet's timeline (queue/timeline.py) every publishing round: its answered requests since
the last round (from their traces: ok and failed per tenant, tokens per tenant, queue-wait and compute histograms,
overall and per tenant), each adapter's last loss and steps, and the memory and disk it sees now. The dispatcher's
finisher thread adds (`answered`), the metrics publisher's thread takes (`take`); a lock between them.

A round with no request and nothing changed in memory still adds an entry every `IDLE_EVERY_S`, so the dashboard
always has a recent memory reading and a quiet pool is seen alive."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loraplex.queue import latency_histogram
from loraplex.queue.request_traces import TraceRecord

IDLE_EVERY_S = 30.0
TRAINING_KINDS = frozenset({"forward_backward", "forward"})
LOSSES_PER_ROUND = 64  # an adapter's losses per entry, the newest (its steps' curve, drawn by seq_id)


class PoolTimeline:
    def __init__(self, gauges: Callable[[], Mapping[str, Any]] | None = None) -> None:
        """gauges: what the pool reads now (memory, disk, slots), added to each entry as it is."""
        self._gauges = gauges
        self._lock = threading.Lock()
        self._fresh()
        self._last_sent = 0.0

    def _fresh(self) -> None:
        self._requests: dict[str, list[int]] = {}  # tenant -> [ok, failed]
        self._tokens: dict[str, int] = {}  # tenant -> training input tokens
        self._sampled: dict[str, int] = {}  # tenant -> sample requests answered
        self._wait: latency_histogram.Histogram = {}
        self._compute: latency_histogram.Histogram = {}
        self._wait_by_tenant: dict[str, latency_histogram.Histogram] = {}
        # model_id -> [tenant, last loss:sum, forward_backward, optim_step, [[seq_id, loss:sum], ...] (the newest)]
        self._adapters: dict[str, list[Any]] = {}

    def answered(self, records: Sequence[TraceRecord]) -> None:
        with self._lock:
            for r in records:
                counts = self._requests.setdefault(r.tenant_id, [0, 0])
                counts[0 if r.ok else 1] += 1
                if r.ok and r.kind in TRAINING_KINDS:
                    self._tokens[r.tenant_id] = self._tokens.get(r.tenant_id, 0) + r.tokens
                if r.kind == "sample":
                    self._sampled[r.tenant_id] = self._sampled.get(r.tenant_id, 0) + 1
                latency_histogram.observe(self._wait, r.queue_wait_s)
                latency_histogram.observe(self._compute, r.compute_s)
                latency_histogram.observe(self._wait_by_tenant.setdefault(r.tenant_id, {}), r.queue_wait_s)
                if r.kind in ("forward_backward", "optim_step") and r.ok:
                    adapter = self._adapters.setdefault(r.model_id, [r.tenant_id, None, 0, 0, []])
                    if r.kind == "forward_backward":
                        adapter[2] += 1
                        if r.loss is not None:
                            adapter[1] = r.loss
                            adapter[4] = [*adapter[4][-(LOSSES_PER_ROUND - 1) :], [r.seq_id, r.loss]]
                    else:
                        adapter[3] += 1

    def take(self, queued: Mapping[str, int] | None = None) -> dict[str, Any] | None:
        """The entry for this round (None: nothing to say yet); `queued`: requests queued per tenant now."""
        gauges = dict(self._gauges()) if self._gauges is not None else {}
        now = time.monotonic()
        with self._lock:
            busy = bool(self._requests) or any(queued.values() if queued else ())
            if not busy and now - self._last_sent < IDLE_EVERY_S:
                return None
            entry: dict[str, Any] = {
                "requests": self._requests, "tokens": self._tokens, "samples": self._sampled,
                "wait": self._wait, "compute": self._compute, "wait_by_tenant": self._wait_by_tenant,
                "adapters": self._adapters, "queued": {t: n for t, n in (queued or {}).items() if n}, **gauges,
            }  # fmt: skip
            self._fresh()
            self._last_sent = now
        return entry

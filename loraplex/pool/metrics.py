"""The pool's Prometheus metrics, every one defined here, in a registry of the pool process's own. The dispatcher loop
reports each executed plan (`executed`) and where its seconds went (`timed`); what the workers measure reaches this
module through plain callables the composition root (pool/process.py) passes in: the rank-0 executor's per-step
seconds, the adapter store's cumulative swap counts and its tier sizes (workers/ import no prometheus). The names and
labels are documented in docs/architecture/metrics.md. Every series carries the pool's name; per-tenant series carry the
tenant id and nothing else of the tenant's.

The registry is served on the pool's own port (loraplex/runtime/metrics_server.py) and published to Redis for the gateways
(pool/metrics_publisher.py)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loraplex.pool.timeline import PoolTimeline
from loraplex.protocol import KINDS, BatchPlan, Outcome, RequestKind, StepKind
from loraplex.protocol.results import SampleResult
from loraplex.queue.request_traces import TraceRecord

# Phases of the time split (loraplex_pool_seconds_total{phase}). The loop's (read: waiting for requests included,
# plan, coalesce, loop_other) and the executor's (swap, one per step kind, execute_other: the rest of executing a
# plan, e.g. its broadcast to the other ranks) add up to the loop thread's time in rounds that ran a plan; the
# finisher's (record, publish) run beside the next plan, on a thread of their own.
LOOP_PHASES = ("read", "plan", "coalesce", "loop_other")
FINISH_PHASES = ("record", "publish")
EXECUTE_PHASES = ("swap", *(k.value for k in StepKind), "execute_other")
# Adapter moves between the store's tiers (loraplex_pool_swaps_total{move}).
MOVES = ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_disk", "disk_to_gpu")
TIERS = ("gpu", "cpu", "disk")
# The CUDA caching allocator's device-synchronizing events (loraplex_pool_cuda_allocator_events_total{event};
# workers/engine/allocator_events.py).
ALLOCATOR_EVENTS = ("device_alloc", "device_free", "alloc_retry")
TRAINING_KINDS = frozenset(k for k, spec in KINDS.items() if spec.step == StepKind.FORWARD_BACKWARD)
# What the `resources` callable may answer (pool/resources.py), each in bytes.
RESOURCES = ("host_memory_bytes", "gpu_memory_allocated_bytes", "gpu_memory_reserved_bytes", "gpu_memory_total_bytes",
             "checkpoint_disk_free_bytes", "checkpoint_disk_size_bytes")

log = logging.getLogger(__name__)

_COUNT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
_TOKEN_BUCKETS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144)
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class StepTiming(Protocol):
    """One step's host seconds as the executor reports them (workers/executor.StepTime)."""

    @property
    def kind(self) -> StepKind: ...
    @property
    def swap_s(self) -> float: ...
    @property
    def run_s(self) -> float: ...


# move -> (count, seconds), cumulative since the store was built (workers/adapter_store.SwapStats, converted)
SwapTotals = Mapping[str, tuple[int, float]]


class PoolMetrics:
    def __init__(
        self,
        pool: str,
        *,
        slots: int = 0,
        step_times: Callable[[], Iterable[StepTiming]] | None = None,
        swaps: Callable[[], SwapTotals] | None = None,
        tiers: Callable[[], Mapping[str, int]] | None = None,
        graph_captures: Callable[[], int] | None = None,
        graph_memory: Callable[[], int] | None = None,
        gc_seconds: Callable[[], float] | None = None,
        allocator_events: Callable[[], Mapping[str, int]] | None = None,
        resources: Callable[[], Mapping[str, float]] | None = None,
        slow_plan_s: float = 0.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """step_times: drains the executor's step timings since the last call; swaps: the store's cumulative swap
        totals; tiers: adapters per tier now; graph_captures: the engine's CUDA-graph captures so far; graph_memory: the
        bytes they hold on the device; gc_seconds: the process's seconds in Python's garbage collector so far
        (gcutil.GcClock); allocator_events: rank 0's CUDA allocator events so far, per name in ALLOCATOR_EVENTS
        (workers/engine/allocator_events.py). All are called on the loop
        thread, right after each plan. resources: memory and disk now, keyed as RESOURCES (any left out: unknown),
        read at each scrape and publishing round. slow_plan_s: a plan whose executor took at least this long is logged (INFO)
        with where its seconds went, its tokens and adapters, the captures it made, the collector's seconds and the
        allocator events in it (0: none logged)."""
        self.pool = pool
        self.registry = registry or CollectorRegistry()
        self._step_times, self._swaps, self._tiers = step_times, swaps, tiers
        self._graph_memory = graph_memory
        self.slow_plan_s = slow_plan_s
        self._swaps_seen: dict[str, tuple[int, float]] = {}
        self._tenants_seen: set[str] = set()
        self._depths_lock = threading.Lock()  # the publisher thread and scrapes both refresh the depths
        r, p = self.registry, ("pool",)

        self.plans = Counter("loraplex_pool_plans", "Plans the pool executed.", p, registry=r)
        self.steps = Counter("loraplex_pool_steps", "Steps the pool executed, per step kind.", (*p, "kind"), registry=r)
        self.fb_steps = Counter(
            "loraplex_pool_fb_steps",
            "forward_backward steps by layout: mixed (several adapters in one batch) or single (one adapter).",
            (*p, "layout"), registry=r,
        )  # fmt: skip
        self.fb_adapters = Histogram("loraplex_pool_fb_step_adapters", "Adapters per forward_backward step.", p,
                                     buckets=_COUNT_BUCKETS, registry=r)  # fmt: skip
        self.fb_rows = Histogram("loraplex_pool_fb_step_rows", "Rows (datums) per forward_backward step.", p,
                                 buckets=_ROW_BUCKETS, registry=r)  # fmt: skip
        self.fb_tokens = Histogram("loraplex_pool_fb_step_tokens", "Input tokens per forward_backward step.", p,
                                   buckets=_TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.seconds = Counter(
            "loraplex_pool_seconds",
            "Seconds the pool spent, per phase: read, plan, coalesce, loop_other (dispatcher loop); swap, one per "
            "step kind, execute_other (executing plans); record, publish (finishing them).",
            (*p, "phase"), registry=r,
        )  # fmt: skip
        self.step_seconds = Histogram("loraplex_pool_step_seconds", "Seconds each step ran (its swaps not included).",
                                      (*p, "kind"), buckets=_SECONDS_BUCKETS, registry=r)  # fmt: skip
        self.requests = Counter("loraplex_pool_requests", "Requests the pool executed, per tenant, kind and result.",
                                (*p, "tenant", "kind", "result"), registry=r)  # fmt: skip
        self.tokens = Counter(
            "loraplex_pool_tokens",
            "Input tokens of forward_backward and forward requests that ran without error, per tenant (rate(): "
            "tokens/s).",
            (*p, "tenant", "kind"), registry=r,
        )  # fmt: skip
        self.sampled_tokens = Counter("loraplex_pool_sampled_tokens", "Tokens the sampler generated, per tenant.",
                                      (*p, "tenant"), registry=r)  # fmt: skip
        self.swaps = Counter("loraplex_pool_swaps", "Adapter moves between the store's tiers.", (*p, "move"),
                             registry=r)  # fmt: skip
        self.swap_seconds = Counter("loraplex_pool_swap_seconds", "Seconds spent moving adapters between tiers.",
                                    (*p, "move"), registry=r)  # fmt: skip
        self.adapters = Gauge("loraplex_pool_adapters", "Adapters (sampler copies included) per tier of rank 0.",
                              (*p, "tier"), registry=r)  # fmt: skip
        self.slots = Gauge("loraplex_pool_slots", "Adapter slots per rank.", p, registry=r)
        self.graph_captures = Counter("loraplex_pool_graph_captures",
                                      "CUDA graphs the engine captured (each costs about three eager steps).", p,
                                      registry=r)  # fmt: skip
        self.graph_memory = Gauge("loraplex_pool_graph_memory_bytes",
                                  "Device memory rank 0's CUDA graphs hold (their pool and static buffers), which the "
                                  "eager path cannot use.", p, registry=r)  # fmt: skip
        self.gc_seconds = Counter("loraplex_pool_gc_seconds",
                                  "Seconds the pool process spent in Python's garbage collector (any thread).", p,
                                  registry=r)  # fmt: skip
        self.allocator_events = Counter(
            "loraplex_pool_cuda_allocator_events",
            "Rank 0's CUDA caching-allocator events that synchronize the device: device_alloc (cudaMalloc), "
            "device_free (cudaFree), alloc_retry (no cached block fitted: the cache was freed and cudaMalloc retried).",
            (*p, "event"), registry=r,
        )  # fmt: skip
        self.queued_requests = Gauge("loraplex_pool_queued_requests",
                                     "Requests accepted and not yet answered, per tenant (its stream's length).",
                                     (*p, "tenant"), registry=r)  # fmt: skip
        self.queued_tokens = Gauge("loraplex_pool_queued_tokens", "Tokens of the queued requests, per tenant.",
                                   (*p, "tenant"), registry=r)  # fmt: skip
        self.sql_statements = Counter("loraplex_pool_sql_statements",
                                      "SQL statements the pool process sent to the database, per verb (select, "
                                      "insert, update, delete, begin, commit, rollback, other).", (*p, "verb"),
                                      registry=r)  # fmt: skip
        self.request_queue_seconds = Histogram(
            "loraplex_pool_request_queue_seconds",
            "Seconds from a request's arrival to the start of the engine work that answered it, per kind.",
            (*p, "kind"), buckets=_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_compute_seconds = Histogram(
            "loraplex_pool_request_compute_seconds",
            "Seconds of engine work of the plan(s) that answered a request (shared with its plan's other requests).",
            (*p, "kind"), buckets=_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.host_memory = Gauge("loraplex_pool_host_memory_bytes", "Resident memory of the pool's rank-0 process.",
                                 p, registry=r)  # fmt: skip
        self.gpu_memory = Gauge("loraplex_pool_gpu_memory_bytes",
                                "Rank 0's device memory: allocated (tensors), reserved (the caching allocator's), "
                                "total (the device's).", (*p, "kind"), registry=r)  # fmt: skip
        self.disk_free = Gauge("loraplex_pool_checkpoint_disk_free_bytes",
                               "Free bytes on the file system of the checkpoint store (blob_root).", p, registry=r)
        self.disk_size = Gauge("loraplex_pool_checkpoint_disk_size_bytes",
                               "Size of the file system of the checkpoint store (blob_root).", p, registry=r)
        self._resources = resources
        self.timeline = PoolTimeline(gauges=self.read_resources)
        self.slots.labels(pool).set(slots)
        self._slots = slots
        self._captures = _RunningTotal(graph_captures, self.graph_captures.labels(pool))
        self._gc = _RunningTotal(gc_seconds, self.gc_seconds.labels(pool))
        self._allocator = _RunningTotals(
            allocator_events, {event: self.allocator_events.labels(pool, event) for event in ALLOCATOR_EVENTS}
        )
        for move in MOVES:  # every series present from the start, so rate() sees the first increase
            self.swaps.labels(pool, move)
            self.swap_seconds.labels(pool, move)
        for phase in (*LOOP_PHASES, *EXECUTE_PHASES, *FINISH_PHASES):
            self.seconds.labels(pool, phase)
        for tier in TIERS:
            self.adapters.labels(pool, tier)

    def sql_statement(self, verb: str) -> None:
        """One SQL statement the process sent (any thread; storage/statement_count.py calls it)."""
        self.sql_statements.labels(self.pool, verb).inc()

    # -- reports from the dispatcher -----------------------------------------------------------------------------
    def executed(self, plan: BatchPlan, outcomes: Sequence[Outcome], busy_s: float) -> None:
        """One executed plan (loop thread): its outcomes in plan order (a request running in parts: this part's);
        busy_s: the seconds the executor took."""
        pool = self.pool
        self.plans.labels(pool).inc()
        fb: list[tuple[int, int]] = []  # (adapters, tokens) per forward_backward step
        for step in plan.steps:
            self.steps.labels(pool, step.kind.value).inc()
            if step.kind == StepKind.FORWARD_BACKWARD:
                adapters = len({r.model_id for r in step.requests})
                tokens = sum(r.num_tokens for r in step.requests)
                self.fb_steps.labels(pool, "mixed" if adapters > 1 else "single").inc()
                self.fb_adapters.labels(pool).observe(adapters)
                self.fb_rows.labels(pool).observe(sum(_rows(r.payload, r.part) for r in step.requests))
                self.fb_tokens.labels(pool).observe(tokens)
                fb.append((adapters, tokens))
        for request, outcome in zip(plan.requests, outcomes, strict=True):
            self._request(request, outcome)
        split = self._executor_time(busy_s)
        captures, gc_s = self._captures.advance(), self._gc.advance()
        allocator = self._allocator.advance()
        self._store_state()
        if self.slow_plan_s > 0 and busy_s >= self.slow_plan_s:
            where = ", ".join(f"{phase} {s * 1e3:.0f}" for phase, s in split.items() if s >= 0.0005)
            log.info("pool %s: slow plan, %.0f ms executing (ms: %s); %d requests, forward_backward steps (adapters, "
                     "tokens) %s; %d CUDA graphs captured in it; Python's garbage collector %.0f ms since the last "
                     "plan; CUDA allocator since the last plan: %s", pool, busy_s * 1e3, where or "-",
                     len(plan.requests), fb or "none", captures, gc_s * 1e3,
                     ", ".join(f"{n:.0f} {event}" for event, n in allocator.items()))  # fmt: skip

    def timed(self, seconds: Mapping[str, float]) -> None:
        """Seconds per phase of the loop or the finisher (any thread). A plan's finishing (its SQL record, then
        its results stored and acked: every client of the plan waits on both) that took `slow_plan_s` or more is
        logged like a slow plan."""
        for phase, value in seconds.items():
            if value > 0:
                self.seconds.labels(self.pool, phase).inc(value)
        finish = {phase: seconds[phase] for phase in FINISH_PHASES if phase in seconds}
        if finish and self.slow_plan_s > 0 and sum(finish.values()) >= self.slow_plan_s:
            log.info("pool %s: slow finish, %s (a plan's results wait for both)", self.pool,
                     ", ".join(f"{phase} {s * 1e3:.0f} ms" for phase, s in finish.items()))  # fmt: skip

    def queue_depths(self, depths: Mapping[str, tuple[int, int]]) -> None:
        """tenant -> (queued requests, queued tokens) as Redis holds them now (queue/published_metrics.py); a tenant
        seen before and absent now reads zero."""
        with self._depths_lock:
            depths = {**dict.fromkeys(self._tenants_seen, (0, 0)), **depths}
            for tenant, (requests, tokens) in depths.items():
                self.queued_requests.labels(self.pool, tenant).set(requests)
                self.queued_tokens.labels(self.pool, tenant).set(tokens)
            self._tenants_seen |= set(depths)

    def answered(self, records: Sequence[TraceRecord]) -> None:
        """Each answered plan's request traces (finisher thread, once the results are stored)."""
        for r in records:
            self.request_queue_seconds.labels(self.pool, r.kind).observe(r.queue_wait_s)
            self.request_compute_seconds.labels(self.pool, r.kind).observe(r.compute_s)
        self.timeline.answered(records)

    def read_resources(self) -> dict[str, float]:
        """Memory and disk now (RESOURCES' keys, those known), set into their gauges too; and the slots."""
        now = {k: float(v) for k, v in (self._resources() if self._resources is not None else {}).items()}
        gauges = {"host_memory_bytes": self.host_memory.labels(self.pool),
                  "checkpoint_disk_free_bytes": self.disk_free.labels(self.pool),
                  "checkpoint_disk_size_bytes": self.disk_size.labels(self.pool),
                  **{f"gpu_memory_{kind}_bytes": self.gpu_memory.labels(self.pool, kind)
                     for kind in ("allocated", "reserved", "total")}}  # fmt: skip
        for key, value in now.items():
            if key in gauges:
                gauges[key].set(value)
        return {**now, "slots": float(self._slots)}

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format."""
        return generate_latest(self.registry)

    # -- parts ------------------------------------------------------------------------------------------------------
    def _request(self, request: Any, outcome: Outcome) -> None:
        kind, tenant = request.kind.value, request.tenant_id
        if outcome.ok and request.kind in TRAINING_KINDS:
            self.tokens.labels(self.pool, tenant, kind).inc(request.num_tokens)
        if outcome.ok and request.kind == RequestKind.SAMPLE:
            sampled = outcome.result.num_tokens if isinstance(outcome.result, SampleResult) else 0
            self.sampled_tokens.labels(self.pool, tenant).inc(sampled)
        # a part that leaves datums for later plans, or a slice of a sample run: not answered yet
        if (request.unfinished or outcome.unfinished) and outcome.ok:
            return
        self.requests.labels(self.pool, tenant, kind, "ok" if outcome.ok else "error").inc()

    def _executor_time(self, busy_s: float) -> dict[str, float]:
        timings = list(self._step_times()) if self._step_times is not None else []
        split: dict[str, float] = {}
        for t in timings:
            split["swap"] = split.get("swap", 0.0) + t.swap_s
            split[t.kind.value] = split.get(t.kind.value, 0.0) + t.run_s
            self.step_seconds.labels(self.pool, t.kind.value).observe(t.run_s)
        split["execute_other"] = max(0.0, busy_s - sum(split.values()))
        self.timed(split)
        return split

    def _store_state(self) -> None:
        if self._swaps is not None:
            for move, (count, seconds) in self._swaps().items():
                seen_count, seen_s = self._swaps_seen.get(move, (0, 0.0))
                if count > seen_count:
                    self.swaps.labels(self.pool, move).inc(count - seen_count)
                if seconds > seen_s:
                    self.swap_seconds.labels(self.pool, move).inc(seconds - seen_s)
                self._swaps_seen[move] = (count, seconds)
        if self._tiers is not None:
            for tier, n in self._tiers().items():
                self.adapters.labels(self.pool, tier).set(n)
        if self._graph_memory is not None:
            self.graph_memory.labels(self.pool).set(self._graph_memory())


def _rows(payload: Any, part: tuple[int, int] | None) -> int:
    data = getattr(payload, "data", ())
    return len(data) if part is None else part[1] - part[0]


class _RunningTotal:
    """A total kept elsewhere (`read`: the engine's captures, the collector's seconds), added to `counter` as it grows;
    what it held when this was made is not counted. Without `read`, nothing."""

    def __init__(self, read: Callable[[], float] | None, counter: Any) -> None:
        self.read, self.counter = read, counter
        self.seen = read() if read is not None else 0

    def advance(self) -> float:
        """What the total gained since the last call (also added to the counter)."""
        return self.move_to(self.read()) if self.read is not None else 0

    def move_to(self, now: float) -> float:
        """The total is `now`: what it gained since it was last seen (also added to the counter)."""
        new, self.seen = max(0, now - self.seen), now
        if new:
            self.counter.inc(new)
        return new


class _RunningTotals:
    """Several totals read together (`read`: one call for all, e.g. the allocator's events), each added to its
    counter as it grows, as _RunningTotal does for one. Without `read`, all zero."""

    def __init__(self, read: Callable[[], Mapping[str, float]] | None, counters: Mapping[str, Any]) -> None:
        self.read = read
        self.totals = {name: _RunningTotal(None, counter) for name, counter in counters.items()}
        if read is not None:  # what they held when this was made is not counted
            for name, held in read().items():
                if name in self.totals:
                    self.totals[name].seen = held

    def advance(self) -> dict[str, float]:
        """What each total gained since the last call (also added to its counter)."""
        return self._advance(self.read()) if self.read is not None else dict.fromkeys(self.totals, 0.0)

    def _advance(self, now: Mapping[str, float]) -> dict[str, float]:
        return {name: total.move_to(now[name]) for name, total in self.totals.items()}

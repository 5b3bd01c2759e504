"""The dispatcher loop: thin I/O around dispatch/policy.py. One Dispatcher (the pool leader) per pool, reading
every tenant's request stream of it (queue/consumer.py).

Each `run_once`: read envelopes (this consumer's un-acked backlog first, entries of dead consumers every few seconds,
then new ones), keep them in an arrival-ordered buffer, ask the policy for a plan, mark its requests running, execute
it, and hand the answered plan to the finish step (`PlanHooks.finish`, dispatch/hooks.py: the pool's records it in SQL),
which stores the outcomes and only then acks the entries (at-least-once delivery; with the idempotency keys and the
stored-result check below, each request is applied once):
- an entry whose request already has a stored result (a crash between storing and acking) is acked, never re-applied;
- a duplicate (seq_id at or below the adapter's last applied one, or a second request for the same slot) is answered
  with the first request's stored result;
- requests of an adapter stuck behind a seq_id gap longer than `seq_gap_timeout_s` fail with InvalidRequestError
  naming the missing seq_id, and the adapter moves past them.

Every answered request, failed or not, advances its adapter's seq_id: the client holds an answer for it.

Once per request id: an entry is never run while its request is held (in the buffer, or a sample run in flight across
plans) or being finished (its result not stored yet): the stale-entry claim skips this dispatcher's own entries, whose
idle time it refreshes meanwhile (so no other consumer takes them either), and a redelivered twin of a request being
finished waits for its result. A sample run in slices (an unfinished Outcome) stays held, unanswered, until it ends.

Pipelined (`DispatchConfig.pipelined`, the pool's mode; dispatch/stages.py): a prefetch thread reads and decodes the
streams while a plan runs, and a finisher thread runs each plan's finish step (its records, results and acks) while the
next plan runs; the loop itself only plans and executes. Seq_ids advance in the loop at once, so
the next plan never waits for the finisher. An underfilled plan waits a moment for the tenants it just answered
(dispatch/coalescing.py, `settings.coalesce_ms`), so closed-loop tenants keep sharing one step.

A Dispatcher is built from its knobs (`DispatchConfig`) and what the pool plugs in (`PlanHooks`), both in
dispatch/hooks.py; no hook is handed the dispatcher.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from types import MappingProxyType

import redis as redis_lib

from loraplex.dispatch.coalescing import Coalescer, full_microbatch_tokens
from loraplex.dispatch.fair_share import FairShareLedger
from loraplex.dispatch.hooks import AnsweredPlan, DispatchConfig, LoopProgress, PlanHooks
from loraplex.dispatch.policy import PlanFit, PolicyLimits, PolicyResult, plan_batch, plan_rounds
from loraplex.dispatch.stages import Finisher, Prefetcher, lost_group, retry_redis
from loraplex.errors import ConflictError, EngineError, InvalidRequestError, LoraplexError
from loraplex.protocol import (
    CONTROL_KINDS,
    KINDS,
    UNCHAINED_KINDS,
    UNORDERED_KINDS,
    BatchPlan,
    Executor,
    Outcome,
    PlannedRequest,
    RequestKind,
    Step,
    StepKind,
)
from loraplex.queue import keys, request_traces, stats
from loraplex.queue.consumer import Consumer, Entry, EntryRef
from loraplex.queue.envelope import to_planned
from loraplex.queue.keys import JobState
from loraplex.queue.producer import Claim
from loraplex.queue.redis_text import text
from loraplex.queue.results import ResultStore
from loraplex.runtime.logutil import Backoff, RateLimitedLog

log = logging.getLogger(__name__)

IDLE_TICK_S = 1.0  # how often an idle loop calls after_plan (with an empty plan)
HANDOFF_CHECK_S = 0.25  # how often the loop looks for move orders (queue/handoff.py)


@dataclass
class _Held:
    stream_id: EntryRef
    request: PlannedRequest
    first_seen: float
    # Its result is already stored (delivered before a crash) but its effect is not in the adopted state: it runs
    # again to rebuild that state, and its stored result is not sent again.
    silent: bool = False


class Dispatcher:
    def __init__(
        self,
        redis: redis_lib.Redis,
        pool: str,
        executor: Executor,
        config: DispatchConfig | None = None,
        hooks: PlanHooks | None = None,
    ) -> None:
        """config: the knobs (default: DispatchConfig.from_settings()); hooks: what the pool plugs in (default: none;
        results stored in a plain ResultStore on `redis`). With `config.pipelined`, call `close` after."""
        self.config = config = config or DispatchConfig.from_settings()
        self.hooks = hooks = hooks or PlanHooks()
        self.executor = executor
        self.pool = pool
        self.results = hooks.results or ResultStore(redis)
        self.consumer = Consumer(redis, pool, config.consumer_name, self.results, window=config.read_count)
        self.redis = redis
        self.limits = PolicyLimits(
            plan_tokens=config.plan_tokens, max_requests=config.max_requests_per_plan,
            max_adapters_per_step=config.slots, max_sample_batches=config.sample_runs_in_flight,
            max_sample_rows=config.sample_rows,
        )  # fmt: skip
        self._buffer: list[_Held] = []  # arrival order
        self._held_ids: set[EntryRef] = set()  # stream entries in the buffer
        self._applied: dict[str, int | None] = {}  # model_id -> last applied seq_id
        self._advanced = 0  # calls of _advance so far (the coalescing wait's PlanFit starts over after one)
        self._progress: dict[str, int] = {}  # request_id -> datums run so far, of a request running in parts
        self._sampling: dict[str, int] = {}  # request_id -> the plan that started it, of a sample run in flight
        self._plans = 0  # plans executed (numbers the sample runs)
        self._engine_started: dict[str, float] = {}  # request id -> when the engine first ran it (wall clock)
        # entries answered and not yet acked (the finisher's), request_id by entry; read by both threads
        self._finishing: dict[EntryRef, str] = {}
        self._finishing_lock = threading.Lock()
        self._next_claim = 0.0
        self.fair_share = FairShareLedger()  # weighted tokens served per tenant, across plans
        self._share_context: tuple[set[str], dict[str, float]] = (set(), {})  # the last plan's tenants and weights
        self._more_ready = False  # the last plan was capped: read without blocking
        self.coalescer = Coalescer(config.coalesce_s)
        # (adapters, when) of results the finisher made visible, for the coalescer (the loop thread's)
        self._published: deque[tuple[list[str], float]] = deque()
        self._finisher = Finisher(background=config.pipelined)
        self._prefetcher: Prefetcher | None = None  # started by the first read
        self._recovered: set[str] = set()  # adapters whose state was rebuilt exactly up to _applied (seed_applied)
        self._last_after_plan = float("-inf")
        self._held_waiting_s = 0.0  # rounds that held requests but planned none, counted into the next plan's read
        self._next_handoff_check = 0.0

    # -- public ---------------------------------------------------------------------------------------------------
    @property
    def pending(self) -> tuple[PlannedRequest, ...]:
        return tuple(h.request for h in self._buffer)

    def last_applied(self, model_id: str) -> int | None:
        return self._applied.get(model_id)

    def seed_applied(self, applied: Mapping[str, int | None]) -> None:
        """Adapters a restarted pool rebuilt from their snapshot and request log: their state holds exactly the
        requests up to these seq_ids (None: no step yet), so a redelivered request above it runs (silently if its
        result was stored)."""
        self._applied.update(applied)
        self._recovered.update(applied)

    def in_parts(self) -> set[str]:
        """Adapters with a request running in parts right now (part of its gradient is in the adapter's state)."""
        return {h.request.model_id for h in self._buffer if h.request.request_id in self._progress}

    def after_finished(self, job: Callable[[], None]) -> None:
        """Run `job` once every plan finished so far has its records, results and acks written (finisher order)."""
        self._finisher.submit(job)

    def progress(self) -> LoopProgress:
        """What the loop has answered so far (its applied seq_ids, adapters in parts), for `after_plan` and a clean
        stop's last snapshots."""
        return LoopProgress(MappingProxyType(self._applied), frozenset(self.in_parts()), self.after_finished)

    def run_once(self) -> int:
        """One read + plan + execute round; returns how many requests it answered."""
        now = time.monotonic()
        t_start = now
        entries = self._claim_if_due(now)
        entries += self._read(None if self._more_ready else self.config.block_ms / 1000)
        self._admit(entries, time.monotonic())  # read now, not when the wait began (their traces' `read`)
        self._note_published()
        self._hand_over_if_asked(now)
        t_read = time.monotonic()
        if not self._buffer:
            self._more_ready = False
            self._idle_tick(now)
            return 0
        cpu_start = time.thread_time()
        decision = self._plan()
        t_coalesce = time.monotonic()
        planning = t_coalesce - t_read
        decision = self._coalesce(decision)
        coalesce = time.monotonic() - t_coalesce
        deciding = time.thread_time() - cpu_start  # this thread's CPU in the policy and coalescing, waits left out
        by_obj = {id(h.request): h for h in self._buffer}
        answered = 0
        busy = 0.0
        if decision.plan.steps:
            self.fair_share.charge(decision.plan, self._share_context[1], self._share_context[0], self._sampling)
            answered, busy = self._execute_plan(decision.plan, by_obj)
            self._call_after_plan(decision.plan)
        answered += self._answer_duplicates(decision.duplicates, by_obj)
        answered += self._expire_gaps(decision.blocked, time.monotonic())
        # a sample run in flight goes on at once (its next slice); otherwise only a capped plan reads without waiting
        self._more_ready = (bool(decision.plan.steps) and bool(decision.pending)) or bool(self._sampling)
        if decision.plan.steps:
            overhead = time.monotonic() - t_read - busy - coalesce - planning
            read = t_read - t_start + self._held_waiting_s
            self._held_waiting_s = 0.0
            timing = {"busy_s": busy, "read_s": read, "plan_s": planning, "coalesce_s": coalesce,
                      "decide_s": deciding, "overhead_s": overhead}  # fmt: skip
            plan_stats = stats.PlanStats.of(decision.plan, **timing, lapsed=self.coalescer.take_lapsed())
            self._finisher.submit(stats.add, self.redis, self.pool, plan_stats)
            self._observe("timed", {"read": read, "plan": planning, "coalesce": coalesce,
                                    "loop_other": overhead})  # fmt: skip
        elif self._buffer:  # e.g. an optim_step read before its forward_backward: the wait goes on, for the next plan
            self._held_waiting_s += time.monotonic() - t_start
        return answered

    def _call_after_plan(self, plan: BatchPlan) -> None:
        if self.hooks.after_plan is None:
            return
        self._last_after_plan = time.monotonic()
        try:
            self.hooks.after_plan(plan, self.progress())
        except Exception:  # noqa: BLE001 - snapshots are retried later; serving must go on
            log.exception("after_plan failed")

    def _idle_tick(self, now: float) -> None:
        """No work: once a second, `after_plan` with an empty plan (time-based snapshots of idle adapters)."""
        if self.hooks.after_plan is not None and now - self._last_after_plan >= IDLE_TICK_S:
            self._call_after_plan(BatchPlan(()))

    def run_forever(self, stop_event: threading.Event) -> None:
        """Run until `stop_event`. Redis going away is ridden out: retried with backoff (at most one log line per
        5 s), and a consumer group lost with Redis's data is recreated. Entries read but not admitted when a Redis call
        failed (e.g. the stored-result check in `_admit`) stay pending to this consumer: the next read scans them
        again (`Consumer.rescan_pending`; `_admit` passes over those it holds), rather than waiting for the
        stale-entry claim."""
        backoff, warn = Backoff(), RateLimitedLog(log, every_s=5.0)
        try:
            while not stop_event.is_set():
                try:
                    self.run_once()
                    backoff.reset()
                except (redis_lib.ConnectionError, redis_lib.TimeoutError) as exc:
                    warn.warning("redis unavailable (%s); retrying", exc)
                    self.consumer.rescan_pending()
                    stop_event.wait(backoff.next())
                except redis_lib.ResponseError as exc:
                    if not lost_group(exc):
                        raise
                    warn.warning("consumer group of %s missing (redis restarted empty?); recreating it", self.pool)
                    with suppress(redis_lib.RedisError):
                        self.consumer.ensure_group()
                    stop_event.wait(backoff.next())
        finally:
            self.close()

    def close(self) -> None:
        """Stop reading ahead and finish every plan handed to the finisher (pipelined mode; a no-op otherwise)."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        self._finisher.close()

    # -- reading and planning ---------------------------------------------------------------------------------------
    def _read(self, wait_s: float | None) -> list[Entry]:
        """New entries, waiting up to `wait_s` seconds for some (None: don't wait)."""
        if not self.config.pipelined:
            block = None if wait_s is None else max(1, round(wait_s * 1000))
            return self.consumer.read(block, self.config.read_count)
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self.consumer, self.config.block_ms, self.config.read_count,
                                          others_waiting=self.hooks.others_waiting)  # fmt: skip
        return self._prefetcher.take(wait_s)

    def _plan(self, limits: PolicyLimits | None = None, adapters: set[str] | None = None) -> PolicyResult:
        """The policy's plan of the buffer (only these adapters' requests, with `adapters`)."""
        requests = [h.request for h in self._buffer if adapters is None or h.request.model_id in adapters]
        view = {m: self._applied.get(m) for m in {r.model_id for r in requests}}
        tenants = {r.tenant_id for r in requests}
        weights = self.hooks.tenant_weights.of(tenants) if self.hooks.tenant_weights is not None else {}
        self._share_context = (tenants, weights)
        return plan_batch(requests, view, limits or self.limits, self._progress, share=self.fair_share.view(tenants),
                          weights=weights, cost=self.hooks.cost_model, sampling=self._sampling)  # fmt: skip

    def _coalesce(self, decision: PolicyResult) -> PolicyResult:
        """Hold an underfilled forward_backward plan back while the tenants just answered are on their way back;
        the whole microbatches it already fills run at once (dispatch/coalescing.py)."""
        if _full(decision) or not any(s.kind == StepKind.FORWARD_BACKWARD for s in decision.plan.steps):
            return decision
        started = time.monotonic()
        stale = False  # requests arrived that `decision` has not planned
        fit: PlanFit | None = None  # takes_all of the buffer and the arrivals, kept as they grow
        # What the wait reads is admitted in one go when the plan is made (its stored-result check one Redis round
        # trip a plan, not one per arrival: 32 a plan at 16 closed-loop tenants); the coalescer hears of each arrival
        # at once. Early microbatches cut plans from the buffer as it stands, so they admit each arrival at once.
        arrived: list[Entry] = []
        deferred = not self.config.early_microbatch_tokens
        while True:
            self._note_published()
            now = time.monotonic()
            wait = self.coalescer.wait_s(now, started)
            if wait <= 0:
                self._admit(arrived, now, noted=True)
                return self._plan() if stale else decision
            if stale and not deferred:
                decision, stale = self._plan(), False
            early = self._full_microbatches(decision, now)
            if early is not None:
                return early
            entries = self._read(wait)
            if not entries:
                continue
            stale = True
            if not deferred:
                held, advanced = len(self._buffer), self._advanced
                self._admit(entries, time.monotonic())
                if fit is None or self._advanced != advanced:
                    fit, held = PlanFit(self._applied, self.limits, self._progress), 0
                if fit.add(h.request for h in self._buffer[held:]):
                    continue
            else:
                fresh = [(sid, env) for sid, env in entries if sid not in self._held_ids]
                now = time.monotonic()
                self.coalescer.arrived(((env.model_id, str(env.kind), env.seq_id) for _, env in fresh), now)
                arrived += entries
                if fit is None:
                    fit = PlanFit(self._applied, self.limits, self._progress)
                    fit.add(h.request for h in self._buffer)
                if fit.add(to_planned(env) for _, env in fresh):
                    continue
                self._admit(arrived, time.monotonic(), noted=True)
                arrived, fit = [], None  # the admit may have moved an adapter's applied seq_id: the fit starts over
            # Plan again only when the plan might be full now (PlanFit: each arrival looked at once, no plan);
            # otherwise the plan of everything waits for the end of the wait. A plan per arrival cost ~10 ms a plan
            # at 16 closed-loop tenants (benchmarks/bench_coalescing.py).
            decision, stale = self._plan(), False
            if _full(decision):
                return decision

    def _note_published(self) -> None:
        """Tell the coalescer which adapters' results the finisher made visible since the last call, and when."""
        while self._published:
            model_ids, when = self._published.popleft()
            self.coalescer.published(model_ids, when)

    def _full_microbatches(self, decision: PolicyResult, now: float) -> PolicyResult | None:
        """The plan cut to the adapters whose forward_backward requests fill whole microbatches, to run now while the
        tenants still expected come back (the other requests wait for them); None to keep waiting: not one full
        microbatch, an adapter of the plan has its optim_step on the way, or no whole requests fill the microbatches
        (to within an eighth of one) without splitting one."""
        fb = [r for s in decision.plan.steps if s.kind == StepKind.FORWARD_BACKWARD for r in s.requests]
        tokens = sum(r.num_tokens for r in fb)
        bound = full_microbatch_tokens(tokens, self.config.early_microbatch_tokens)
        if bound == 0 or self.coalescer.awaited(now) & {r.model_id for r in fb}:
            return None
        if bound == tokens:  # nothing to cut: it is whole microbatches already
            return decision
        # Which adapters' forward_backwards fill `bound` (the policy's fair order: one round of at most that many
        # tokens), then the plan of those adapters alone (their optim_steps too).
        first = self._plan(replace(self.limits, plan_tokens=bound, max_rounds=1))
        first_fb = [r for s in first.plan.steps if s.kind == StepKind.FORWARD_BACKWARD for r in s.requests]
        already_in_parts = {r.request_id for r in fb if r.part is not None}
        if sum(r.num_tokens for r in first_fb) < bound - self.config.early_microbatch_tokens // 8 or any(
            r.part is not None and r.request_id not in already_in_parts for r in first_fb
        ):  # the lengths do not pack into whole microbatches (within an eighth of one), or a request would split
            return None
        cut = self._plan(adapters={r.model_id for r in first_fb})
        taken = {r.request_id for r in cut.plan.requests} | {r.request_id for r in cut.duplicates}
        rest = tuple(h.request for h in self._buffer if h.request.request_id not in taken)
        return replace(cut, pending=rest)

    # -- moves between pools ----------------------------------------------------------------------------------------
    def _hand_over_if_asked(self, now: float) -> None:
        """Hand over the adapters an operator asked this pool to move (at most every HANDOFF_CHECK_S), here between
        two plans: every plan before is finished first (its answers in the request log), so the adapter's state is
        exactly its snapshot plus that log; an adapter with a request running in parts, or any sample run in flight,
        waits for a later round. Its requests held here leave with their entries."""
        handoff = self.hooks.handoff
        if handoff is None or now < self._next_handoff_check:
            return
        self._next_handoff_check = now + HANDOFF_CHECK_S
        orders = handoff.orders()
        busy = self.in_parts()
        for model_id, target in orders.items():
            if model_id in busy or self._sampling:
                continue
            self._finisher.drain()
            try:
                done = handoff.hand_over(model_id, target)
            except Exception:  # noqa: BLE001 - the order stays; tried again next round (a lost lease stops the loop)
                log.exception("handing adapter %s over to pool %s failed; trying again", model_id, target)
                continue
            if not done:
                continue
            held = [h for h in self._buffer if h.request.model_id == model_id]
            self._forget(held)
            self.consumer.forget(h.stream_id for h in held)
            self._applied.pop(model_id, None)
            self._recovered.discard(model_id)
            self.coalescer.forget(model_id)

    def _first_meeting(self, sid: EntryRef, req: PlannedRequest, moved: dict[str, str]) -> bool:
        """The loop meets an adapter for the first time: note where its seq_ids stand (adopting it first when it was
        handed to this pool); False when it was handed to another pool and this entry was forwarded there."""
        handoff = self.hooks.handoff
        target = moved.get(req.model_id)
        for _ in range(2):  # twice: an adapter handed back here between the two reads is adopted, not looked up
            if target is None and handoff is not None:
                found = handoff.meet(req.model_id)
                if found is not None and found.adopted:
                    self._applied[req.model_id] = found.applied
                    self._recovered.add(req.model_id)
                    return True
                target = found.forward_to if found is not None else None
            if target is None:
                break
            if self.consumer.forward(sid, req.model_id) is not None:
                moved[req.model_id] = target
                log.info("adapter %s: %s seq_id %d forwarded to pool %s", req.model_id, req.kind, req.seq_id, target)
                return False
            moved.pop(req.model_id, None)
            target = None
        lookup = self.hooks.applied_seq_lookup
        self._applied[req.model_id] = lookup(req.model_id) if lookup else None
        return True

    # -- steps ----------------------------------------------------------------------------------------------------
    def _claim_if_due(self, now: float) -> list[Entry]:
        if now < self._next_claim:
            return []
        self._next_claim = now + self.config.claim_every_s
        with self._finishing_lock:
            ours = self._held_ids | set(self._finishing)
        self.consumer.keep(ours)  # still ours: their idle time starts again, no consumer's claim takes them
        return [(sid, env) for sid, env in self.consumer.claim_stale(self.config.claim_idle_ms, self.config.read_count)
                if sid not in ours]  # fmt: skip

    def _admit(self, entries: Sequence[Entry], now: float, noted: bool = False) -> None:
        """Take entries into the buffer (those answered before are acked, those of adapters handed to another pool
        forwarded there). `noted`: the coalescer has heard of their arrival already (`_coalesce`)."""
        if not entries:
            return
        # A claim and the backlog scan can both return one of our own entries: keep one per stream id.
        with self._finishing_lock:
            finishing = dict(self._finishing)
        fresh = list({sid: env for sid, env in entries if sid not in self._held_ids and sid not in finishing}.items())
        if set(finishing.values()) & {env.request_id for _, env in fresh}:
            self._finisher.drain()  # a twin of a request being finished: its result is stored first, and answers it
        done = self.results.has_many([env.request_id for _, env in fresh])
        stale: list[EntryRef] = []
        moved: dict[str, str] = {}  # adapters of this batch that were handed to another pool
        for (sid, env), answered in zip(fresh, done, strict=True):
            req = to_planned(env)
            first = req.model_id not in self._applied and req.kind not in UNORDERED_KINDS  # a sampler is no adapter
            if first and not self._first_meeting(sid, req, moved):
                continue  # forwarded to the pool it was handed to
            silent = False
            if answered:  # stored before a crash, never acked: never apply twice...
                last = self._applied.get(req.model_id)
                if not (req.model_id in self._recovered and (last is None or req.seq_id > last)
                        and req.kind not in UNCHAINED_KINDS):  # fmt: skip
                    self._advance([req])
                    stale.append(sid)
                    continue
                silent = True  # ...unless the rebuilt state lacks it: run it again, without sending its result
                log.info("adapter %s: %s seq_id %d was answered but not acked before a restart; running it again "
                         "for its state only", req.model_id, req.kind, req.seq_id)  # fmt: skip
            self._buffer.append(_Held(sid, req, now, silent))
            self._held_ids.add(sid)
        if not noted:
            self.coalescer.arrived(((env.model_id, str(env.kind), env.seq_id) for _, env in fresh), time.monotonic())
        self.consumer.ack(stale)

    def _execute_plan(self, plan: BatchPlan, by_obj: dict[int, _Held]) -> tuple[int, float]:
        """The plan's training steps, round by round with `answer_rounds` (`plan_rounds`: each executed and handed to
        the finisher as it ends, so a tenant answered early sends its next step while the later rounds run), else
        whole. Its SAMPLE step runs after them (so their results do not wait for the slice), for at most as long as
        they took: beside training, sampling takes at most half the pool's time, and a training tenant waits for at
        most one slice. Returns (answered, executor seconds)."""
        sample = [s for s in plan.steps if s.kind == StepKind.SAMPLE]
        rest = tuple(s for s in plan.steps if s.kind != StepKind.SAMPLE)
        if not rest:
            return self._execute(plan, by_obj)
        answered, busy = 0, 0.0
        for round_plan in plan_rounds(BatchPlan(rest)) if self.config.answer_rounds else [BatchPlan(rest)]:
            done, seconds = self._execute(round_plan, by_obj)
            answered, busy = answered + done, busy + seconds
        if not sample:
            return answered, busy
        sampled, sampling = self._execute(BatchPlan(tuple(replace(s, seconds=busy) for s in sample)), by_obj)
        return answered + sampled, busy + sampling

    def _execute(self, plan: BatchPlan, by_obj: dict[int, _Held]) -> tuple[int, float]:
        """Run the plan and finish its requests; returns (requests answered, seconds the executor took)."""
        requests = plan.requests
        # A silent rerun's stored result stays as it was shown (no RUNNING over it).
        running = [r.request_id for r in requests if not getattr(by_obj.get(id(r)), "silent", False)]
        self._finisher.submit(self.results.set_states, running, JobState.RUNNING)
        started_wall = time.time()
        started = time.monotonic()
        try:
            outcomes = list(self.executor.execute(plan))
        except Exception as exc:  # the engine failed as a whole: every request of the plan gets the error
            log.exception("plan of %d requests failed", len(requests))
            outcomes = [_failed(r, EngineError(f"{type(exc).__name__}: {exc}")) for r in requests]
        busy = time.monotonic() - started
        self._plans += 1
        for r in requests:  # a sample run in slices, a request in parts: its first engine work starts its span
            self._engine_started.setdefault(r.request_id, started_wall)
        try:
            from_loop = self.hooks.finish.on_loop(plan)
        except Exception:  # noqa: BLE001 - the plan ran: its answers go out without what it read
            log.exception("the finish step's on_loop failed")
            from_loop = None
        outcomes = _one_per_request(outcomes, requests)
        if self._sampling:  # a run that ended is in flight no more (a stale entry would count against new runs)
            for r, outcome in zip(requests, outcomes, strict=True):
                if not outcome.unfinished:
                    self._sampling.pop(r.request_id, None)
        self._observe("executed", plan, outcomes, busy)  # before any result is visible: a client reads it counted
        if any(r.part is not None for r in requests) or any(o.unfinished for o in outcomes):
            plan, outcomes = self._settle_parts(plan, outcomes)
            requests = plan.requests
        self._finish(outcomes, plan, [by_obj[id(r)] for r in requests], busy, from_loop, started_wall + busy)
        steps = [(r.model_id, str(r.kind), r.seq_id) for r in requests if r.kind not in UNCHAINED_KINDS]
        self.coalescer.answered(sorted(steps, key=lambda a: a[2]), time.monotonic())
        for r in requests:
            if r.kind == RequestKind.DELETE_ADAPTER:
                self.coalescer.forget(r.model_id)
        return len(outcomes), busy

    def _settle_parts(self, plan: BatchPlan, outcomes: list[Outcome]) -> tuple[BatchPlan, list[Outcome]]:
        """Requests that ran in parts (dispatch/policy.py): an unfinished part that went well stays pending with its
        progress noted (no result, no seq_id applied, no ack); a last part, or a failed one, finishes the request as
        the buffered request itself. A sample run not done yet (an unfinished Outcome) stays pending the same way,
        in flight. Returns the plan and outcomes of what finishes now."""
        held: dict[str, PlannedRequest] = {}
        for h in self._buffer:  # the first of a request id: a redelivered twin comes later and is answered as a repeat
            held.setdefault(h.request.request_id, h.request)
        finished: dict[str, Outcome] = {}
        for r, outcome in zip(plan.requests, outcomes, strict=True):
            if outcome.unfinished:
                self._sampling.setdefault(r.request_id, self._plans)
                continue
            if r.part is not None and r.unfinished and outcome.ok:
                self._progress[r.request_id] = r.part[1]
                continue
            self._progress.pop(r.request_id, None)
            self._sampling.pop(r.request_id, None)
            finished[r.request_id] = outcome
        steps = []
        for s in plan.steps:
            kept = tuple(held[r.request_id] if r.part is not None else r for r in s.requests if r.request_id in finished)
            if kept:
                steps.append(Step(s.kind, kept))
        done = BatchPlan(tuple(steps))
        return done, [finished[r.request_id] for r in done.requests]

    def _answer_duplicates(self, duplicates: Sequence[PlannedRequest], by_obj: dict[int, _Held]) -> int:
        if not duplicates:
            return 0
        self._finisher.drain()  # the first requests' results must be stored before they answer for their repeats
        dup_objs = {id(r) for r in duplicates}
        live_slots = {_slot(h.request): h.request.request_id for h in self._buffer if id(h.request) not in dup_objs}
        own = self.results.has_many([d.request_id for d in duplicates])
        outcomes: list[Outcome] = []
        drop: list[_Held] = []
        for dup, answered in zip(duplicates, own, strict=True):
            first_id = live_slots.get(_slot(dup))
            if answered or first_id == dup.request_id:  # the same request delivered twice: its twin answers for it
                drop.append(by_obj[id(dup)])
            elif first_id is None:
                outcomes.append(self._copy_first_result(dup))
                drop.append(by_obj[id(dup)])
            # else: the first request of this slot is still pending; answer this one after it
        if outcomes:
            self.results.put_many(outcomes)
        self._release(drop)
        return len(outcomes)

    def _copy_first_result(self, dup: PlannedRequest) -> Outcome:
        raw = self.redis.get(keys.request_idempotency_key(dup.kind, dup.model_id, dup.seq_id))
        first_id = Claim.decode(text(raw)).request_id if raw is not None else None
        first = self.results.get(first_id) if first_id and first_id != dup.request_id else None
        if first is not None:
            return replace(first, request_id=dup.request_id)
        last = self._applied.get(dup.model_id)
        return _failed(
            dup,
            ConflictError(
                f"adapter {dup.model_id}: {dup.kind} seq_id {dup.seq_id} is a repeat of an earlier request or at or "
                f"below the last applied seq_id ({last}), and no stored result can answer it"
            ),
        )

    def _expire_gaps(self, blocked: dict[str, int], now: float) -> int:
        held: list[_Held] = []
        outcomes: list[Outcome] = []
        for model_id, missing in blocked.items():
            waiting = [
                h for h in self._buffer if h.request.model_id == model_id and h.request.kind not in UNCHAINED_KINDS
            ]
            if not waiting or now - min(h.first_seen for h in waiting) < self.config.seq_gap_timeout_s:
                continue
            for h in waiting:
                msg = (
                    f"adapter {model_id}: seq_id {h.request.seq_id} waited over {self.config.seq_gap_timeout_s:g} s "
                    f"for seq_id {missing}, which never arrived"
                )
                outcomes.append(_failed(h.request, InvalidRequestError(msg)))
                held.append(h)
        if not held:
            return 0
        plan = _plan_of([h.request for h in held])
        self._finish(outcomes, plan, held)
        return len(outcomes)

    def _finish(
        self,
        outcomes: list[Outcome],
        plan: BatchPlan,
        held: list[_Held],
        busy_s: float = 0.0,
        from_loop: object = None,
        engine_end: float | None = None,
    ) -> None:
        """Advance seq_ids and drop the requests from the buffer now; then (finisher) the finish step: record, store
        and ack, in this order, so a crash never loses an answer. engine_end: when the engine finished the plan (wall
        clock; None: the loop answered these requests itself), for their traces."""
        stages = self._stages(held, time.time() if engine_end is None else engine_end)
        self._advance(plan.requests)
        self._forget(held)
        actions = self._log_actions(outcomes, plan, held) if self.hooks.request_log else {}
        silent = {h.request.request_id for h in held if h.silent}
        stream_ids = [h.stream_id for h in held]
        published: list[float] = []  # when the finish step stored the results (the plan's timing)
        answered: list[list[Outcome]] = []
        chained = [r.model_id for r in plan.requests if r.kind not in UNCHAINED_KINDS]

        def publish(shown: list[Outcome]) -> None:
            published.append(time.monotonic())
            answered.append(list(shown))  # as answered (a save whose row failed: failed), for the traces
            # a silent rerun's first result stays as it was delivered
            shown = [o for o in shown if o.request_id not in silent] if silent else shown
            # A finisher write must land (the plan already ran): ride out a Redis outage (dispatch/stages.py).
            retry_redis(lambda: self.results.put_many(shown), "finishing a plan", self._finisher.warn)
            self._published.append((chained, time.monotonic()))

        def ack() -> None:  # with the request log's moves when it is on
            call = (lambda: self.consumer.ack(stream_ids, actions)) if actions else (lambda: self.consumer.ack(stream_ids))
            retry_redis(call, "finishing a plan", self._finisher.warn)

        with self._finishing_lock:
            self._finishing.update((h.stream_id, h.request.request_id) for h in held)
        answer = AnsweredPlan(plan, outcomes, busy_s, from_loop, publish, ack)
        self._finisher.submit(self._end_plan, answer, stream_ids, published, (stages, answered))

    def _stages(self, held: list[_Held], engine_end: float) -> list[request_traces.Stages]:
        """Each answered request's times so far (request_traces.py): its stream entry's id is when it was enqueued."""
        wall_minus_mono = time.time() - time.monotonic()
        out = []
        for h in held:
            start = self._engine_started.pop(h.request.request_id, engine_end)
            read = h.first_seen + wall_minus_mono
            out.append(request_traces.Stages(min(request_traces.entry_time(h.stream_id.id), read), read, start,
                                             engine_end))  # fmt: skip
        return out

    @staticmethod
    def _log_actions(
        outcomes: list[Outcome], plan: BatchPlan, held: list[_Held]
    ) -> dict[EntryRef, tuple[str, str, int]]:
        """What the ack does with each answered entry in the request log (queue/replay_log.py)."""
        out: dict[EntryRef, tuple[str, str, int]] = {}
        for r, o, h in zip(plan.requests, outcomes, held, strict=True):
            if r.kind == RequestKind.DELETE_ADAPTER:
                if o.ok:
                    out[h.stream_id] = ("x", r.model_id, r.seq_id)
            elif r.kind == RequestKind.CREATE_ADAPTER:
                if o.ok:
                    out[h.stream_id] = ("a", r.model_id, r.seq_id)
            elif r.kind not in UNCHAINED_KINDS:
                out[h.stream_id] = ("a" if o.ok and KINDS[r.kind].changes_state else "s", r.model_id, r.seq_id)
        return out

    def _end_plan(
        self,
        answer: AnsweredPlan,
        stream_ids: list[EntryRef],
        published: list[float],
        traced: tuple[Sequence[request_traces.Stages], list[list[Outcome]]] = ((), []),
    ) -> None:
        """The finisher's part of a plan: its finish step (DESIGN: a result is visible only after its step's SQL
        record, so a client that sees it reads the adapter's new state and tiers; then the acks), timed."""
        started = time.monotonic()
        try:
            self.hooks.finish(answer)
        finally:  # acked, or given up on: a claim may take the entries again (their stored results answer them)
            with self._finishing_lock:
                for sid in stream_ids:
                    self._finishing.pop(sid, None)
        recorded = published[0] if published else time.monotonic()
        timing = stats.PlanStats(record_s=recorded - started, publish_s=time.monotonic() - recorded)
        self._observe("timed", {"record": timing.record_s, "publish": timing.publish_s})
        with suppress(redis_lib.RedisError):  # statistics only
            stats.add(self.redis, self.pool, timing)
        stages, answered = traced
        if published and answered and stages:  # the answers went out: their traces (request_traces.py), not before
            done = published[0] + time.time() - time.monotonic()
            records = request_traces.records_of(answer.plan.requests, answered[0], stages, self.pool, done)
            with suppress(redis_lib.RedisError):  # traces only
                request_traces.write(self.redis, records)
            self._observe("answered", records)

    def _observe(self, method: str, *args: object) -> None:
        if self.hooks.observer is None or not hasattr(self.hooks.observer, method):
            return
        try:
            getattr(self.hooks.observer, method)(*args)
        except Exception:  # metrics must never stop the pool
            log.exception("the plan observer failed (%s)", method)

    def _advance(self, requests: Iterable[PlannedRequest]) -> None:
        self._advanced += 1
        for r in requests:
            if r.kind in UNCHAINED_KINDS:
                continue
            last = self._applied.get(r.model_id)
            self._applied[r.model_id] = r.seq_id if last is None else max(last, r.seq_id)

    def _release(self, held: list[_Held]) -> None:
        self._forget(held)
        self.consumer.ack(h.stream_id for h in held)

    def _forget(self, held: list[_Held]) -> None:
        if not held:
            return
        gone = {h.stream_id for h in held}
        self._buffer = [h for h in self._buffer if h.stream_id not in gone]
        self._held_ids -= gone


def _slot(r: PlannedRequest) -> tuple[str, str | int]:
    return (r.model_id, str(r.kind) if r.kind in CONTROL_KINDS else r.seq_id)


def _failed(r: PlannedRequest, exc: LoraplexError) -> Outcome:
    return Outcome.failed(r.request_id, exc)


def _one_per_request(outcomes: list[Outcome], requests: Sequence[PlannedRequest]) -> list[Outcome]:
    """Exactly one outcome per planned request, in plan order; a request the executor skipped gets an EngineError."""
    by_id = {o.request_id: o for o in outcomes}
    return [by_id.get(r.request_id) or _failed(r, EngineError("the engine returned no outcome")) for r in requests]


def _plan_of(requests: Sequence[PlannedRequest]) -> BatchPlan:
    """A plan holding `requests` under their natural step kinds (to report requests the loop failed itself)."""
    steps: list[Step] = []
    for r in requests:
        kind = KINDS[r.kind].step
        if steps and steps[-1].kind == kind:
            steps[-1] = Step(kind, (*steps[-1].requests, r))
        else:
            steps.append(Step(kind, (r,)))
    return BatchPlan(tuple(steps))


def _full(decision: PolicyResult) -> bool:
    """The plan left requests out for want of room, not only ones waiting for an earlier seq_id of their adapter (a
    client's concurrent calls may be queued out of order: an optim_step before its forward_backward)."""
    return any(r.model_id not in decision.blocked for r in decision.pending)

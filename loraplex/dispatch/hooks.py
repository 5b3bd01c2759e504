"""What a Dispatcher is built from besides Redis and its executor: its knobs (`DispatchConfig`, from Settings) and what
the pool plugs in (`PlanHooks`: the end of each plan, the applied seq_id lookup, the snapshot cadence, metrics, tenant
weights, the cost model), and what those hooks are handed: one answered plan (`AnsweredPlan`) and the loop's progress
(`LoopProgress`). No hook is handed the dispatcher itself. No SQL, storage or pool here: the pool's hooks live in pool/
(finish.py, records.py, durable/)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.dispatch.cost_model import StepCost
from loraplex.dispatch.tenant_weights import TenantWeights
from loraplex.protocol import BatchPlan, Outcome
from loraplex.queue.results import ResultStore
from loraplex.settings import Settings, get_settings

AppliedSeqLookup = Callable[[str], int | None]


@dataclass(frozen=True)
class DispatchConfig:
    """The dispatcher's knobs. `from_settings` takes the Settings' ones; the rest have the pool's values."""

    plan_tokens: int  # the most tokens one plan runs (settings.plan_tokens)
    slots: int  # the most adapters one step holds: the engine's slots (settings.slots)
    sample_runs_in_flight: int  # sample runs decoding at once across plans (settings.sample_runs_in_flight)
    claim_idle_ms: int  # an entry idle this long in another consumer's hands is claimed (settings.stale_claim_ms)
    coalesce_s: float  # how long an underfilled plan may wait for the tenants it just answered (settings.coalesce_ms)
    # an underfilled plan runs the whole microbatches of this many tokens it fills without waiting (0: never;
    # settings.microbatch_tokens when settings.coalesce_early_full_microbatches; dispatch/coalescing.py)
    early_microbatch_tokens: int = 0
    consumer_name: str = "dispatcher"
    seq_gap_timeout_s: float = 60.0  # requests behind a missing seq_id fail after this long
    max_requests_per_plan: int = 256
    block_ms: int = 100  # how long one read waits for new entries
    # the most of one tenant's requests the dispatcher holds unanswered (the consumer stops reading a tenant's stream
    # there), so one tenant's backlog never crowds another out of the policy's view; also the most entries per read
    read_count: int = 128
    claim_every_s: float = 5.0  # how often entries of dead consumers are looked for
    # read ahead and finish plans in background threads (dispatch/stages.py; the pool's mode); call `close` after
    pipelined: bool = False
    # sampled sequences one plan starts: the rows the pool's sampler decodes at once (the pool passes its native
    # sampler's, sized from memory; else an integer settings.sampler_max_rows, else 64)
    sample_rows: int = 64
    # answer a plan's rounds each as it ends (settings.answer_rounds; dispatch/policy.plan_rounds), else the plan whole
    answer_rounds: bool = False

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **knobs: object) -> DispatchConfig:
        """The Settings' knobs (default: get_settings()), with `knobs` given here on top."""
        s = settings or get_settings()
        base: dict[str, object] = {
            "plan_tokens": s.plan_tokens,
            "slots": s.slots,
            "sample_runs_in_flight": s.sample_runs_in_flight,
            "claim_idle_ms": s.stale_claim_ms,
            "coalesce_s": s.coalesce_ms / 1000,
            "early_microbatch_tokens": s.microbatch_tokens if s.coalesce_early_full_microbatches else 0,
            "answer_rounds": s.resolved_answer_rounds,
        }
        if isinstance(s.sampler_max_rows, int):
            base["sample_rows"] = s.sampler_max_rows
        return cls(**{**base, **knobs})  # type: ignore[arg-type]


@dataclass(frozen=True)
class AnsweredPlan:
    """One plan's answered requests as the finisher hands them to `PlanHooks.finish`, on the finisher thread, plan
    after plan in order. `plan.requests` holds every request of `outcomes` (one outcome each, in order); requests the
    loop failed itself (a seq_id gap timed out) come in a plan of their own, under their natural step kinds."""

    plan: BatchPlan
    outcomes: list[Outcome]
    busy_s: float  # the executor's seconds for the plan (0 for requests the loop answered itself)
    from_loop: object  # what the finish step's `on_loop` returned for this plan (None: the engine did not run it)
    # Store these outcomes as the results (a silent rerun's stored result stays as it was delivered); rides out a
    # Redis outage (dispatch/stages.retry_redis).
    publish: Callable[[list[Outcome]], None]
    # Ack the plan's stream entries (and move them into the request log when it is on); after `publish` only.
    ack: Callable[[], None]


class FinishStep:
    """The end of each answered plan. This one stores the results, then acks; the pool's (pool/finish.PlanFinish)
    writes the plan's SQL record before that (a result is visible only after its record)."""

    def on_loop(self, plan: BatchPlan) -> object:
        """On the loop thread, right after the engine ran `plan` (the one thread that moves adapters): what the
        finish needs to read there (handed back as `AnsweredPlan.from_loop`)."""
        return None

    def __call__(self, answer: AnsweredPlan) -> None:
        answer.publish(answer.outcomes)
        answer.ack()


class PlanObserver(Protocol):
    """Told about each executed plan and where the seconds went (pool/metrics.PoolMetrics). Its failures are logged
    and never reach the loop."""

    def executed(self, plan: BatchPlan, outcomes: Sequence[Outcome], busy_s: float) -> None: ...

    def timed(self, seconds: Mapping[str, float]) -> None: ...

    # Optional: `answered(records)`, each answered plan's request traces (queue/request_traces.TraceRecord), on the
    # finisher thread once their results are stored (the pool's timeline counts them: pool/timeline.py).


@dataclass(frozen=True)
class LoopProgress:
    """What the loop has answered, as `after_plan` reads it on the loop thread."""

    applied: Mapping[str, int | None]  # model_id -> its last applied seq_id (a read-only view)
    in_parts: frozenset[str]  # adapters with a request running in parts (part of its gradient is in their state)
    # run a job once every plan finished so far has its records, results and acks written (finisher order)
    after_finished: Callable[[Callable[[], None]], None]


AfterPlan = Callable[[BatchPlan, LoopProgress], None]


@dataclass(frozen=True)
class Meeting:
    """What the pool says of an adapter the loop meets for the first time (Handoff.meet)."""

    forward_to: str | None = None  # it was handed to that pool: its entries here go there
    adopted: bool = False  # it was handed to this pool and is adopted now: its state holds exactly up to `applied`
    applied: int | None = None


class Handoff(Protocol):
    """Moving adapters between pools, the pool's side (pool/handoff.py); the loop calls it between plans."""

    def orders(self) -> Mapping[str, str]:
        """Adapters an operator asked this pool to hand over: model_id -> the target pool."""
        ...

    def hand_over(self, model_id: str, target: str) -> bool:
        """Hand the adapter over now (every plan before is finished; none of its requests runs): its request log and
        its entries go to the target, which adopts it. False: not done (tried again later, or the order dropped)."""
        ...

    def meet(self, model_id: str) -> Meeting | None:
        """An adapter the loop meets for the first time: moved away, handed here (adopted now), or None: neither."""
        ...


@dataclass(frozen=True)
class PlanHooks:
    """What the pool plugs into its dispatcher (pool/process.py); a test leaves out what it does not need."""

    # the result store (the pool's is fenced by its lease, queue/results.py); None: a plain one on the same Redis
    results: ResultStore | None = None
    finish: FinishStep = field(default_factory=FinishStep)  # the end of each plan (the pool's: its SQL record)
    # an adapter's last applied seq_id when the loop first meets it (the pool's: from SQL); None: none applied
    applied_seq_lookup: AppliedSeqLookup | None = None
    # after each executed plan on the loop thread (the pool's snapshot cadence, durable/), and with an empty plan
    # once a second while there is nothing to do; its failures are logged
    after_plan: AfterPlan | None = None
    observer: PlanObserver | None = None  # told about each plan and the seconds of each phase (the pool's metrics)
    # move each answered request into its adapter's durable request log when it is acked (queue/replay_log.py), for
    # a restarted pool to replay after the adapter's snapshot
    request_log: bool = False
    tenant_weights: TenantWeights | None = None  # fair-share weights; None: all 1
    # splits forward_backward steps by predicted cost (dispatch/step_split.py; the pool's learns from its executor's
    # step times); None: one mixed step per round
    cost_model: StepCost | None = None
    # moves of adapters between pools (pool/handoff.py); None: this pool neither hands over nor adopts
    handoff: Handoff | None = None
    # set by the prefetch thread while requests other than samples wait unplanned (the pool's native sampler reads
    # it to end a slice early)
    others_waiting: threading.Event | None = None

"""Running totals of a pool's plans in one Redis hash (keys.pool_stats): how many plans, forward_backward steps,
adapters and tokens per step, optimizer steps, and where the dispatcher's seconds went (executing, reading, planning,
coalescing, the decision's CPU time, the rest of the loop, and the finisher's SQL records and result writes).
Operators and benchmarks/bench_service.py read them; two readings apart give the mean adapters per step over that stretch."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis as redis_lib

from loraplex.protocol import BatchPlan, StepKind
from loraplex.queue import keys
from loraplex.queue.redis_text import text


@dataclass(frozen=True)
class PlanStats:
    plans: int = 0
    fb_steps: int = 0
    fb_requests: int = 0
    fb_adapters: int = 0
    fb_tokens: int = 0
    optim_steps: int = 0
    busy_s: float = 0.0  # executing plans
    # reading the stream before a plan, waits for entries included (and the rounds before it that held requests
    # but could plan none, e.g. an optim_step read before its forward_backward)
    read_s: float = 0.0
    plan_s: float = 0.0  # the policy choosing the plan (dispatch/policy.py), before any coalescing wait
    coalesce_s: float = 0.0  # holding underfilled plans back for the tenants just answered (dispatch/coalescing.py)
    # the loop thread's CPU seconds in the policy and the coalescing (admitting arrivals, planning again), waits
    # left out: what deciding a plan costs (inside plan_s + coalesce_s, which are wall time)
    decide_s: float = 0.0
    overhead_s: float = 0.0  # the rest of the loop around each plan: decoding, admitting (plus finishing, not pipelined)
    record_s: float = 0.0  # finishing: each plan's finish step up to storing its results (its SQL record)
    publish_s: float = 0.0  # finishing: storing the results and acking the entries
    # adapters a coalescing wait expected back that were not back within its window (dispatch/coalescing.py): a round
    # split between plans, or a tenant that stopped
    lapsed: int = 0

    @classmethod
    def of(
        cls,
        plan: BatchPlan,
        busy_s: float = 0.0,
        read_s: float = 0.0,
        coalesce_s: float = 0.0,
        overhead_s: float = 0.0,
        plan_s: float = 0.0,
        decide_s: float = 0.0,
        lapsed: int = 0,
    ) -> PlanStats:
        fb = [s for s in plan.steps if s.kind == StepKind.FORWARD_BACKWARD]
        return cls(
            plans=1,
            fb_steps=len(fb),
            fb_requests=sum(len(s.requests) for s in fb),
            fb_adapters=sum(len({r.model_id for r in s.requests}) for s in fb),
            fb_tokens=sum(r.num_tokens for s in fb for r in s.requests),
            optim_steps=sum(s.kind == StepKind.OPTIM_STEP for s in plan.steps),
            busy_s=busy_s,
            read_s=read_s,
            plan_s=plan_s,
            coalesce_s=coalesce_s,
            decide_s=decide_s,
            overhead_s=overhead_s,
            lapsed=lapsed,
        )

    def minus(self, earlier: PlanStats) -> PlanStats:
        return PlanStats(**{f: getattr(self, f) - getattr(earlier, f) for f in self.__dataclass_fields__})

    @property
    def adapters_per_fb_step(self) -> float:
        return self.fb_adapters / self.fb_steps if self.fb_steps else 0.0


def add(redis: redis_lib.Redis, pool: str, stats: PlanStats) -> None:
    """Add one plan's numbers to the pool's totals (one round trip)."""
    key = keys.pool_stats(pool)
    pipe = redis.pipeline(transaction=False)
    for name in PlanStats.__dataclass_fields__:
        value = getattr(stats, name)
        if isinstance(value, float):
            pipe.hincrbyfloat(key, name, value)
        elif value:
            pipe.hincrby(key, name, value)
    pipe.execute()


def read(redis: redis_lib.Redis, pool: str) -> PlanStats:
    raw = cast(Mapping[bytes | str, bytes | str], redis.hgetall(keys.pool_stats(pool)))
    fields = {text(k): text(v) for k, v in raw.items()}
    values: dict[str, Any] = {
        f: (float if f.endswith("_s") else int)(fields[f]) for f in PlanStats.__dataclass_fields__ if f in fields
    }
    return PlanStats(**values)


def read_settled(
    redis: redis_lib.Redis, pool: str, since: PlanStats, *, fb_requests: int, timeout_s: float = 10.0
) -> PlanStats:
    """The totals since `since`, once they count at least `fb_requests` forward_backward requests (or at `timeout_s`).
    The dispatcher adds a plan's numbers after it has published that plan's results (off the hot path), so a reader
    who has just seen the last answer may be a moment ahead of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        window = read(redis, pool).minus(since)
        if window.fb_requests >= fb_requests or time.monotonic() >= deadline:
            return window
        time.sleep(0.02)

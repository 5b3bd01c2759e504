"""The dispatch policy: pending requests + what each adapter has applied -> one BatchPlan. Pure: no Redis, asyncio or
torch; the loop (dispatch/loop.py) does the I/O around it.

Ordering. Per adapter (model_id), training requests take effect strictly in seq_id order. A request is *ready* when its
seq_id is last_applied + 1, or, when nothing is applied yet (last_applied None), when it is the adapter's smallest
pending seq_id. seq_id <= last_applied (or a request_id / (model_id, seq_id) already seen earlier in the input) is a
*duplicate*: reported apart, never planned. A higher seq_id waits; if the adapter has nothing ready because of a gap it
is reported in `blocked` (model_id -> missing seq_id) so the loop can time it out. create_adapter and delete_adapter
(seq_id -1) sit outside the chain: a create runs before anything else of its model_id, a delete after all of them.

The plan's steps, in order:
  1. one CREATE step with every pending create_adapter; then one SAMPLE step: every sampling request in flight
     (`sampling`: started by an earlier plan, it runs one more slice in this one, workers/sampling/step.py), then
     new ones by fair share (least virtual time, then arrival; each charged num_samples x (prompt + max_tokens)), up
     while the sequences in flight (all runs, this plan's new ones included) stay within `max_sample_rows` (the
     rows the pool's sampler decodes at once, sized from its memory) and fewer than `max_sample_batches` plans'
     samples are in flight. Per tenant: its sequences in flight stay within its fair part of the rows,
     `max_sample_rows` // the tenants with samples in flight or waiting (all of them when it is alone). The plan's
     first new request always starts when its tenant has nothing in flight, even past the rows (by at most one
     request a plan), so no tenant waits for another's rollouts to end. So one tenant's 1,024 rollouts fill the
     sampler while nobody else samples, another's request starts in the next plan, and the first tenant starts
     nothing more until its rows in flight are back within its part. Samples sit in no chain (any order), so a
     sample waits for at most one plan of training, and a tenant's flood of samples neither starves another's
     samples nor holds its training for more than a slice per plan;
  2. rounds: each round takes at most one ready request (its next seq_id) per adapter; the round's forward_backward /
     forward requests form ONE FORWARD_BACKWARD step (up to the plan token cap; a request over the cap runs in parts
     of at most the cap, one part per plan; `progress` says how many of its datums earlier
     plans ran, and until its last part its adapter's chain stays where it is), its optim_step requests ONE OPTIM_STEP step after it, and its
     checkpoint requests (save_state / save_sampler / load_state) ONE CHECKPOINT step after that (and the
     requests the gateway rejected after their seq_id was taken, one REJECT step: answered with their error). Taking a
     request advances that adapter's seq_id, so its next request can join the next round (an adapter's
     forward_backward in one step, its optim_step in a later step of the same plan). Rounds repeat while anything is
     ready, the plan holds fewer than `max_requests` requests and has run fewer than `max_rounds` rounds;
  3. one DELETE step with the deletes whose adapter has nothing else pending.

Fair share (dispatch/fair_share.py). Within a round, candidates are taken in order of (their tenant's virtual time: its
weighted tokens served in earlier plans, `share`, plus what this plan already took for it, each request's tokens + 1
divided by the tenant's weight; then how long their adapter has waited: its oldest pending request's arrival index).
When the token cap closes the FORWARD_BACKWARD step, candidates behind are not skipped over by later ones: they lead the
next round (or the next plan, since leftovers keep their arrival order). The same holds when a step reaches
`max_adapters_per_step` (the resident slots). So a tenant with many adapters or many requests cannot starve another,
and backlogged tenants' token shares follow their weights.

Cost-model coalescing (dispatch/step_split.py). With a `cost` model, a round's forward_backward requests run as the
split into engine steps predicted cheapest: one mixed step, each adapter alone, or the microbatch-filling adapters
apart from the rest; never one predicted slower than running them adapter by adapter. Without one: one mixed step.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from loraplex.dispatch.cost_model import StepCost
from loraplex.dispatch.fair_share import charge_of, weight_of
from loraplex.dispatch.step_split import split_step
from loraplex.protocol import (
    CONTROL_KINDS,
    KINDS,
    PLAIN_STEP_KINDS,
    UNCHAINED_KINDS,
    UNORDERED_KINDS,
    BatchPlan,
    ForwardBackwardPayload,
    PlannedRequest,
    RequestKind,
    SamplePayload,
    Step,
    StepKind,
)


@dataclass(frozen=True)
class PolicyLimits:
    plan_tokens: int = 16384  # token cap of one FORWARD_BACKWARD step (the engine microbatches it)
    max_requests: int = 256  # requests in one plan, all steps together
    # rounds in one plan: an adapter's deep backlog (a chain of hundreds of small steps) goes a few per plan, so a plan
    # stays short and another tenant's step never waits behind hundreds of engine steps of it (results go out per plan)
    max_rounds: int = 8
    # distinct adapters in one FORWARD_BACKWARD or OPTIM_STEP step: the pool's resident slots (each step's adapters are
    # swapped in before it runs), so the Dispatcher sets it to settings.slots
    max_adapters_per_step: int = 1 << 30
    # sampled sequences (requests x num_samples) in flight at once: the rows the pool's sampler decodes at once (the
    # Dispatcher sets it from DispatchConfig.sample_rows); a tenant's stay within its fair part of it
    max_sample_rows: int = 64
    # plans whose sample runs are still in flight (each started run holds its decode cache): no new ones past it
    max_sample_batches: int = 4


@dataclass(frozen=True)
class PolicyResult:
    plan: BatchPlan
    pending: tuple[PlannedRequest, ...]  # not planned yet, in arrival order
    duplicates: tuple[PlannedRequest, ...]  # already applied or repeated: answer with the stored result, never apply
    blocked: dict[str, int] = field(default_factory=dict)  # model_id -> the missing seq_id its requests wait for

    @property
    def applied_seq(self) -> dict[str, int]:
        """model_id -> the highest seq_id this plan takes (what last_applied becomes once the plan is answered)."""
        out: dict[str, int] = {}
        for r in self.plan.requests:
            if r.kind not in UNCHAINED_KINDS and not r.unfinished:
                out[r.model_id] = max(out.get(r.model_id, r.seq_id), r.seq_id)
        return out


def plan_batch(
    pending: Sequence[PlannedRequest],
    last_applied: Mapping[str, int | None],
    limits: PolicyLimits | None = None,
    progress: Mapping[str, int] | None = None,
    *,
    share: Mapping[str, float] | None = None,
    weights: Mapping[str, float] | None = None,
    cost: StepCost | None = None,
    sampling: Mapping[str, int] | None = None,
) -> PolicyResult:
    """Plan the next batch. `pending` is in arrival order; `last_applied` maps model_id -> last applied seq_id (None or
    absent: none yet); `progress` maps request_id -> datums of it that earlier plans ran (a request in parts);
    `share`: tenant -> virtual time from earlier plans (dispatch/fair_share.FairShareLedger.view; absent: 0);
    `weights`: tenant -> weight (absent: 1); `cost`: the step cost model that splits forward_backward steps;
    `sampling`: request_id -> the number of the plan that started it, for sampling requests in flight."""
    progress = progress or {}
    sampling = sampling or {}
    share = share or {}
    weights = weights or {}
    limits = limits or PolicyLimits()
    reqs = list(pending)  # requests are referred to by their index (= arrival order) below
    duplicates, creates, deletes, samples, chains, step_of = _sort_out(reqs, last_applied)

    budget = limits.max_requests
    taken: set[int] = set()
    steps: list[Step] = []

    create_step = creates[:budget]
    budget -= len(create_step)
    waiting_create = {reqs[i].model_id for i in creates[len(create_step) :]}  # their chains and deletes wait
    if create_step:
        steps.append(Step(StepKind.CREATE, tuple(reqs[i] for i in create_step)))

    served: defaultdict[str, float] = defaultdict(float, share)  # tenant -> virtual time: earlier plans' + this plan's
    sample_step, budget = _samples(reqs, samples, sampling, served, weights, limits, budget)
    if sample_step:
        steps.append(Step(StepKind.SAMPLE, tuple(reqs[i] for i in sample_step)))
    taken.update(sample_step)

    last = {m: last_applied.get(m) for m in chains}
    pos = dict.fromkeys(chains, 0)
    # waited[m][k]: arrival index of the oldest request in chains[m][k:] (how long the adapter has waited from there).
    waited = {m: _suffix_min(chain) for m, chain in chains.items()}
    parts: dict[int, PlannedRequest] = {}  # index -> the part of it this plan runs

    def priority(i: int) -> tuple[float, int]:
        m = reqs[i].model_id
        return served[reqs[i].tenant_id], waited[m][pos[m]]

    # The candidates (each adapter's ready head) in two heaps on (priority, index), kept across rounds: forward_backward
    # heads, and the rest. Taking a request only raises its own tenant's priority, so an entry is refreshed lazily
    # when it reaches the top (no re-sort of every head per pick, no rebuild per round).
    fb_heap: list[tuple[float, int, int]] = []
    other_heap: list[tuple[float, int, int]] = []

    def push(i: int) -> None:
        heapq.heappush(fb_heap if step_of[i] == StepKind.FORWARD_BACKWARD else other_heap, (*priority(i), i))

    def fresh_top(heap: list[tuple[float, int, int]]) -> tuple[float, int, int] | None:
        while heap:
            vt, age, i = heap[0]
            now = priority(i)
            if (vt, age) == now:
                return heap[0]
            heapq.heapreplace(heap, (*now, i))
        return None

    for m, chain in chains.items():
        if m not in waiting_create and chain and _ready(reqs[chain[0]], last[m]):
            push(chain[0])

    rounds = 0
    while budget > 0 and rounds < limits.max_rounds and (fb_heap or other_heap):
        rounds += 1
        fb: list[int] = []
        opt: list[int] = []
        ckpt: list[int] = []
        rejected: list[int] = []
        deferred: list[tuple[float, int, int]] = []  # optim_steps past the slots: they lead the next round
        fb_tokens, fb_open = 0, True
        while budget > 0:
            top_fb = fresh_top(fb_heap) if fb_open else None
            top_other = fresh_top(other_heap)
            if top_fb is None and top_other is None:
                break
            heap = fb_heap if top_other is None or (top_fb is not None and top_fb < top_other) else other_heap
            entry = heapq.heappop(heap)
            i = entry[2]
            r = reqs[i]
            step_kind = step_of[i]
            if step_kind == StepKind.FORWARD_BACKWARD:
                full = len(fb) >= limits.max_adapters_per_step  # one request per adapter and round: len = adapters
                piece = _part_of(r, progress.get(r.request_id, 0), limits.plan_tokens)
                if fb and (full or fb_tokens + piece.num_tokens > limits.plan_tokens):
                    # later candidates must not jump it: it leads the next round; the other kinds' go on
                    heapq.heappush(fb_heap, entry)
                    fb_open = False
                    continue
                fb.append(i)
                fb_tokens += piece.num_tokens
                if piece is not r:
                    parts[i] = piece
            elif step_kind == StepKind.CHECKPOINT:
                ckpt.append(i)
            elif step_kind == StepKind.REJECT:
                rejected.append(i)
            else:
                if opt and len(opt) >= limits.max_adapters_per_step:
                    deferred.append(entry)  # the step holds as many adapters as there are slots
                    continue
                opt.append(i)
            served[r.tenant_id] += charge_of(parts.get(i, r)) / weight_of(weights, r.tenant_id)
            budget -= 1
        for entry in deferred:
            heapq.heappush(other_heap, entry)
        answered = [i for i in fb + opt + ckpt + rejected if not (i in parts and parts[i].unfinished)]
        for i in answered:
            m = reqs[i].model_id
            pos[m] += 1
            last[m] = reqs[i].seq_id
            chain = chains[m]
            if pos[m] < len(chain) and _ready(reqs[chain[pos[m]]], last[m]):
                push(chain[pos[m]])  # the adapter's next request: a candidate from the next round on
        taken.update(answered)
        # (an adapter whose request runs in parts is not pushed back: nothing more of it in this plan)
        if fb:
            fb_requests = [parts.get(i, reqs[i]) for i in fb]
            for group in split_step(fb_requests, cost):
                steps.append(Step(StepKind.FORWARD_BACKWARD, tuple(fb_requests[k] for k in group)))
        if opt:
            steps.append(Step(StepKind.OPTIM_STEP, tuple(reqs[i] for i in opt)))
        if ckpt:
            steps.append(Step(StepKind.CHECKPOINT, tuple(reqs[i] for i in ckpt)))
        if rejected:
            steps.append(Step(StepKind.REJECT, tuple(reqs[i] for i in rejected)))

    delete_step: list[int] = []
    for i in deletes:
        m = reqs[i].model_id
        if budget > 0 and m not in waiting_create and pos.get(m, 0) >= len(chains.get(m, ())):
            delete_step.append(i)
            budget -= 1
    if delete_step:
        steps.append(Step(StepKind.DELETE, tuple(reqs[i] for i in delete_step)))
    taken.update(create_step + delete_step)

    blocked: dict[str, int] = {}
    for m, chain in chains.items():
        lm = last[m]
        if m not in waiting_create and pos[m] < len(chain) and lm is not None and reqs[chain[pos[m]]].seq_id > lm + 1:
            blocked[m] = lm + 1
    dups = set(duplicates)
    left = tuple(r for i, r in enumerate(reqs) if i not in taken and i not in dups)
    return PolicyResult(BatchPlan(tuple(steps)), left, tuple(reqs[i] for i in duplicates), blocked)


def plan_rounds(plan: BatchPlan) -> list[BatchPlan]:
    """`plan` cut where a later round's work starts, so the loop runs and answers it piece by piece: before a
    forward_backward step that follows another kind of step (a round's optim_steps, checkpoints) or that holds an
    adapter already trained since the last cut (`plan_batch` puts a round's forward_backward steps first, and an
    adapter in at most one of them). A round of forward_backward steps alone stays with the next one, where its
    adapters' optim_steps run: their answers could go out no sooner. A tenant that sent its next step before awaiting
    this one (that step is in a later round) has its answer while the later rounds run, and its step after that is
    back before the plan ends. Steps keep their order; a plan of one round comes back whole; creates stay with the
    first piece and deletes with the last."""
    rounds: list[list[Step]] = [[]]
    trained: set[str] = set()  # adapters in the forward_backward steps since the last cut
    for step in plan.steps:
        if step.kind == StepKind.FORWARD_BACKWARD:
            models = {r.model_id for r in step.requests}
            if trained and (rounds[-1][-1].kind != StepKind.FORWARD_BACKWARD or models & trained):
                rounds.append([])
                trained = set()
            trained |= models
        rounds[-1].append(step)
    return [BatchPlan(tuple(steps)) for steps in rounds]


def takes_all(
    pending: Sequence[PlannedRequest],
    last_applied: Mapping[str, int | None],
    limits: PolicyLimits | None = None,
    progress: Mapping[str, int] | None = None,
) -> bool:
    """Whether `plan_batch` with these arguments surely plans every request of `pending` (none left pending, blocked
    or duplicate), told in one pass without planning: only forward_backward / forward / optim_step requests, none
    running in parts, each adapter's seq_ids contiguous from its next one and at most `max_rounds` of them, and all
    of them within one step's tokens, the slots and the request budget. False means "perhaps not": plan to know."""
    fit = PlanFit(last_applied, limits, progress)
    fit.add(pending)
    return fit.takes_all


class PlanFit:
    """`takes_all` of a buffer that only grows, kept as requests are added (each looked at once): the dispatcher's
    coalescing wait adds each arrival and plans again only when the answer turns False (dispatch/loop.py)."""

    def __init__(
        self,
        last_applied: Mapping[str, int | None],
        limits: PolicyLimits | None = None,
        progress: Mapping[str, int] | None = None,
    ) -> None:
        self._last = last_applied
        self._limits = limits or PolicyLimits()
        self._progress = progress or {}
        self._chains: dict[str, tuple[int, int, int]] = {}  # model_id -> (lowest seq_id, highest, how many)
        self._seen: set[tuple[str, int]] = set()  # (model_id, seq_id) of each request added
        self._broken: set[str] = set()  # adapters whose seq_ids so far are not a run from their next one
        self._requests = 0
        self._tokens = 0
        self._simple = True  # only simple kinds so far, none in parts, no seq_id twice

    def add(self, requests: Iterable[PlannedRequest]) -> bool:
        """Add requests to the buffer; returns `takes_all` of the buffer now."""
        simple, optim = PLAIN_STEP_KINDS, RequestKind.OPTIM_STEP
        for r in requests:
            self._requests += 1
            slot = (r.model_id, r.seq_id)
            if r.kind not in simple or r.request_id in self._progress or slot in self._seen:  # a repeat: a duplicate
                self._simple = False
                continue
            self._seen.add(slot)
            chain = self._chains.get(r.model_id)
            low, high, n = (r.seq_id, r.seq_id, 1) if chain is None else (
                min(chain[0], r.seq_id), max(chain[1], r.seq_id), chain[2] + 1)  # fmt: skip
            self._chains[r.model_id] = (low, high, n)
            last = self._last.get(r.model_id)
            # n distinct seq_ids spanning n values are a run: it must start at the adapter's next one
            if n > self._limits.max_rounds or high - low + 1 != n or (last is not None and low != last + 1):
                self._broken.add(r.model_id)
            else:
                self._broken.discard(r.model_id)
            if r.kind != optim:
                self._tokens += r.num_tokens
        return self.takes_all

    @property
    def takes_all(self) -> bool:
        limits = self._limits
        return (self._simple and not self._broken and self._requests <= limits.max_requests
                and self._tokens <= limits.plan_tokens and len(self._chains) <= limits.max_adapters_per_step)  # fmt: skip


def _rows(r: PlannedRequest) -> int:
    p = r.payload
    return p.num_samples if isinstance(p, SamplePayload) else 1


def _samples(
    reqs: list[PlannedRequest],
    samples: list[int],
    sampling: Mapping[str, int],
    served: defaultdict[str, float],
    weights: Mapping[str, float],
    limits: PolicyLimits,
    budget: int,
) -> tuple[list[int], int]:
    """The SAMPLE step's request indices (see the module doc) and the request budget left; charges `served`."""
    step = [i for i in samples if reqs[i].request_id in sampling][: max(0, budget)]
    budget -= len(step)
    tenant_rows: defaultdict[str, int] = defaultdict(int)
    for i in step:
        tenant_rows[reqs[i].tenant_id] += _rows(reqs[i])
    if len(set(sampling.values())) >= limits.max_sample_batches:
        return step, budget
    new = [(served[reqs[i].tenant_id], i) for i in samples if reqs[i].request_id not in sampling]
    heapq.heapify(new)
    # each tenant's fair part of the rows: split between the tenants sampling or waiting to
    fair = max(1, limits.max_sample_rows // max(1, len({reqs[i].tenant_id for i in samples})))
    rows = sum(tenant_rows.values())  # in flight, then with this plan's new ones
    started = False
    while new and budget > 0:
        vt, i = heapq.heappop(new)
        r = reqs[i]
        if vt != served[r.tenant_id]:  # its tenant was charged since: back in line at its new virtual time
            heapq.heappush(new, (served[r.tenant_id], i))
            continue
        n = _rows(r)
        # within the pool's rows and the tenant's part; the plan's first new request of a tenant with nothing in
        # flight starts anyway
        first = not started and tenant_rows[r.tenant_id] == 0
        if not first and (rows + n > limits.max_sample_rows or tenant_rows[r.tenant_id] + n > fair):
            continue
        started = True
        step.append(i)
        rows += n
        tenant_rows[r.tenant_id] += n
        served[r.tenant_id] += charge_of(r) / weight_of(weights, r.tenant_id)
        budget -= 1
    return step, budget


def _sort_out(
    reqs: list[PlannedRequest], last_applied: Mapping[str, int | None]
) -> tuple[list[int], list[int], list[int], list[int], dict[str, list[int]], list[StepKind]]:
    """Split request indices into duplicates, creates, deletes, samples (arrival order) and per-adapter chains sorted
    by seq_id; and each request's step kind. (The policy's hottest loop: one pass, locals only.)"""
    duplicates: list[int] = []
    creates: list[int] = []
    deletes: list[int] = []
    samples: list[int] = []
    chains: dict[str, list[int]] = {}
    step_of: list[StepKind] = []
    seen_ids: set[str] = set()
    seen_slots: set[tuple[str, str | int]] = set()
    control_kinds, unordered_kinds, kinds = CONTROL_KINDS, UNORDERED_KINDS, KINDS
    create, delete = StepKind.CREATE, StepKind.DELETE
    for i, r in enumerate(reqs):
        kind = r.kind
        step_kind = kinds[kind].step
        step_of.append(step_kind)
        control = kind in control_kinds
        slot = (r.model_id, str(kind) if control else r.seq_id)
        unordered = kind in unordered_kinds
        if r.request_id in seen_ids or slot in seen_slots:
            duplicates.append(i)
            continue
        if not control and not unordered:
            last = last_applied.get(r.model_id)
            if last is not None and r.seq_id <= last:
                duplicates.append(i)
                continue
        seen_ids.add(r.request_id)
        seen_slots.add(slot)
        if unordered:
            samples.append(i)
        elif step_kind == create:
            creates.append(i)
        elif step_kind == delete:
            deletes.append(i)
        else:
            chain = chains.get(r.model_id)
            if chain is None:
                chains[r.model_id] = [i]
            else:
                chain.append(i)
    for chain in chains.values():
        if len(chain) > 1:
            chain.sort(key=lambda i: reqs[i].seq_id)
    return duplicates, creates, deletes, samples, chains, step_of


def _part_of(r: PlannedRequest, done: int, plan_tokens: int) -> PlannedRequest:
    """`r` itself when all of it is left and fits in `plan_tokens`; else its next part: datums from `done` on while
    they fit (at least one)."""
    p = r.payload
    if not isinstance(p, ForwardBackwardPayload) or (done == 0 and r.num_tokens <= plan_tokens):
        return r
    stop, tokens = done, 0
    while stop < len(p.data) and (stop == done or tokens + len(p.data[stop].model_input) <= plan_tokens):
        tokens += len(p.data[stop].model_input)
        stop += 1
    return r if (done, stop) == (0, len(p.data)) else replace(r, part=(done, stop))


def _ready(r: PlannedRequest, last: int | None) -> bool:
    # last is None only until the adapter's first request is taken, and chains are sorted: the head is the smallest.
    return last is None or r.seq_id == last + 1


def _suffix_min(values: list[int]) -> list[int]:
    out = list(values)
    for k in range(len(out) - 2, -1, -1):
        out[k] = min(out[k], out[k + 1])
    return out

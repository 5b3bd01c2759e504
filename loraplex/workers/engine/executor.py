"""BatchPlan -> engine calls. One request's error becomes that request's Outcome and never fails the others."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loraplex.errors import EngineError, InvalidRequestError, LoraplexError, NotSupportedError, error_class
from loraplex.protocol import (
    KINDS,
    BatchPlan,
    CreateAdapterPayload,
    ForwardBackwardPayload,
    LoadStatePayload,
    OptimStepPayload,
    Outcome,
    PlannedRequest,
    RejectedPayload,
    SaveCheckpointPayload,
    Step,
    StepKind,
)
from loraplex.protocol.checkpoint_paths import CheckpointKind
from loraplex.protocol.results import (
    CreateResult,
    DeleteResult,
    ForwardBackwardResult,
    LoadResult,
    OptimStepResult,
    PartDone,
    Result,
    SaveResult,
)
from loraplex.runtime.background_writes import BackgroundWrites
from loraplex.workers.engine.batching import PreparedItem
from loraplex.workers.engine.engine import Engine
from loraplex.workers.ranks.distributed import lost_a_rank
from loraplex.workers.state.adapter_store import AdapterStore

log = logging.getLogger(__name__)

# Steps whose adapters must be in slots first (with a store: swapped in, LRU adapters out): the table's needs_residency.
RESIDENT_STEPS = frozenset(spec.step for spec in KINDS.values() if spec.needs_residency)

# Step timings kept for drain_step_times (a plan has a few dozen steps at most).
STEP_TIMES_KEPT = 1024

# What a create payload may leave out (the gateway normally fills it): alpha = 2 x rank, as the API's default.
DEFAULT_ALPHA_PER_RANK = 2.0


def _adam_params(request: PlannedRequest) -> dict[str, Any] | None:
    p = request.payload
    assert isinstance(p, OptimStepPayload)
    return p.adam_params


def error_outcome(request: PlannedRequest, exc: BaseException) -> Outcome:
    """The Outcome of a request that failed with `exc` (typed errors as they are; anything else as an EngineError).
    A collective that failed because a rank is gone is raised again instead: the request was not at fault, and the
    pool ends without answering it (workers/rank_loop.LeaderExecutor; the restarted pool replays it)."""
    if lost_a_rank(exc):
        raise exc
    if not isinstance(exc, LoraplexError):
        # A bug or a device failure: keep the worker alive, report it for the request(s) it hit, and log the trace.
        log.exception("request %s (%s) failed", request.request_id, request.kind, exc_info=exc)
        exc = EngineError(f"{type(exc).__name__}: {exc}")
    return Outcome.failed(request.request_id, exc)


def restore_checkpoint(
    engine: Engine,
    store: AdapterStore | None,
    model_id: str,
    directory: Path,
    with_optimizer: bool | None,
    modules_given: bool = False,
    modules: tuple[str, ...] | None = None,
) -> None:
    """A new adapter `model_id` restored from a checkpoint folder (checked in full before a slot is claimed; through
    the store when there is one), training the checkpoint's target modules; target modules given with it must be
    those. Also how a pool loads a sampler copy it does not hold (workers/sampling/step.py)."""
    from loraplex.workers.state.checkpoint import read_checkpoint
    from loraplex.workers.state.checkpoint_state import check_signature, load_into_engine

    state = read_checkpoint(directory)
    with_optimizer = True if with_optimizer is None else bool(with_optimizer)
    check_signature(engine, state)
    saved = engine.resolve_target_modules(state.target_modules)
    if modules_given and modules != saved:
        raise InvalidRequestError(
            f"target_modules {list(modules or engine.target_modules)} differ from the checkpoint's "
            f"{list(saved or engine.target_modules)}"
        )
    if with_optimizer and state.optimizer is None:
        raise InvalidRequestError(f"checkpoint of kind {state.kind!r} has no optimizer state to load")
    if store is None:
        load_into_engine(engine, state, model_id, with_optimizer=with_optimizer, existing=False)
    else:  # the store makes room and tracks it; the zeroed slot is then filled in place
        store.claim_slot(model_id, state.rank, state.alpha, state.seed, state.target_modules)
        load_into_engine(engine, state, model_id, with_optimizer=with_optimizer, existing=True)


@dataclass(frozen=True)
class StepTime:
    """Host seconds one step of a plan took on this rank: swapping its adapters in (and others out), then running it.
    (On CUDA a step's time includes the device work it waits for: its results are copied to the host.)"""

    kind: StepKind
    swap_s: float
    run_s: float


@dataclass
class _Parts:
    """A request running in parts: the whole validated item, and the outputs and loss of the parts so far."""

    whole: PreparedItem
    outputs: list[dict[str, Any]] = field(default_factory=list)
    loss_sum: float = 0.0


class PlanExecutor:
    def __init__(
        self,
        engine: Engine,
        store: AdapterStore | None = None,
        sampling: Callable[[Step], list[Outcome]] | None = None,
        writes: BackgroundWrites | None = None,
        on_step: Callable[[Step, list[Outcome], float], None] | None = None,
    ) -> None:
        """store: the tiered adapter store (adapter_store.py) over `engine`; without one, adapters live in slots only.
        sampling: runs a SAMPLE step (the native sampler over this engine); None: this pool does not sample, and each
        sampling request fails with a NotSupportedError saying so. writes: where a sampler save's files are written
        off the training path (the plan copies the weights, the file write runs beside the next plans; whoever
        publishes the result waits for it: pool/finish.py); None: written in the plan. on_step: told
        (step, its outcomes, seconds) after each step ran (the pool's cost model calibrates from it,
        dispatch/cost_calibration.py)."""
        self.on_step = on_step
        self.engine = engine
        self.store = store
        self.sampling = sampling
        self.writes = writes
        self._parts: dict[str, _Parts] = {}  # request_id -> a request running in parts (dispatch/policy.py)
        # Since the last drain (rank 0's metrics read them per plan); bounded, as a follower rank never drains them.
        self._step_times: deque[StepTime] = deque(maxlen=STEP_TIMES_KEPT)
        self._swap_s = 0.0  # the current step's swap seconds
        self._handlers: dict[StepKind, Callable[[Step], list[Outcome]]] = {
            StepKind.CREATE: self._create,
            StepKind.DELETE: self._delete,
            StepKind.FORWARD_BACKWARD: self._forward_backward,
            StepKind.OPTIM_STEP: self._optim_step,
            StepKind.CHECKPOINT: self._checkpoint,
            StepKind.REJECT: self._reject,
            StepKind.SAMPLE: self._sample,
        }

    def execute(self, plan: BatchPlan) -> list[Outcome]:
        """Run the steps in order; outcomes in the order of `plan.requests`."""
        outcomes: list[Outcome] = []
        for step in plan.steps:
            started, self._swap_s = time.perf_counter(), 0.0
            if self.store is not None and step.kind in RESIDENT_STEPS:
                outcomes.extend(self._resident_then(step))
            else:
                outcomes.extend(self._timed(step))
            total = time.perf_counter() - started
            self._step_times.append(StepTime(step.kind, self._swap_s, total - self._swap_s))
        return outcomes

    def _timed(self, step: Step) -> list[Outcome]:
        """Run one step's handler; tell `on_step` how long it took (swaps before it excluded: they are not the step's
        cost). A FORWARD_BACKWARD handler reads its outputs back to the host, so the time covers the device's work."""
        if self.on_step is None:
            return self._handlers[step.kind](step)
        started = time.perf_counter()
        outcomes = self._handlers[step.kind](step)
        try:
            self.on_step(step, outcomes, time.perf_counter() - started)
        except Exception:  # noqa: BLE001 - statistics only: the step's outcomes stand
            log.exception("on_step failed for a %s step", step.kind)
        return outcomes

    def drain_step_times(self) -> list[StepTime]:
        """The steps run since the last drain, in order, with their swap and run seconds."""
        out = list(self._step_times)
        self._step_times.clear()
        return out

    def _resident_then(self, step: Step) -> list[Outcome]:
        """Swap the step's adapters in, then run it. The policy keeps a step within the slots; a longer one (a plan
        built elsewhere) runs in consecutive parts of at most `slots` adapters, in request order. Ids the store does
        not know are left to the handler (NotFoundError per request)."""
        assert self.store is not None
        parts: list[list[PlannedRequest]] = []
        seen: set[str] = set()
        for request in step.requests:
            known = request.model_id in self.store
            if not parts or (known and request.model_id not in seen and len(seen) == self.engine.num_slots):
                parts.append([])
                seen = set()
            parts[-1].append(request)
            if known:
                seen.add(request.model_id)
        outcomes: list[Outcome] = []
        for part in parts:
            swap_started = time.perf_counter()
            try:
                self.store.ensure_resident(r.model_id for r in part if r.model_id in self.store)
            except Exception as exc:  # noqa: BLE001 - a failed swap (disk full...) fails this part's requests only
                outcomes.extend(error_outcome(r, exc) for r in part)
                continue
            finally:
                self._swap_s += time.perf_counter() - swap_started
            outcomes.extend(self._timed(Step(step.kind, tuple(part))))
        return outcomes

    def _one_by_one(self, step: Step, call: Callable[[PlannedRequest], Result]) -> list[Outcome]:
        outcomes = []
        for request in step.requests:
            try:
                outcomes.append(Outcome(request.request_id, result=call(request)))
            except Exception as exc:  # noqa: BLE001 - reported per request, see _error
                outcomes.append(error_outcome(request, exc))
        return outcomes

    def _create(self, step: Step) -> list[Outcome]:
        def create(request: PlannedRequest) -> CreateResult:
            p = request.payload
            assert isinstance(p, CreateAdapterPayload)
            if p.rank is None:
                raise InvalidRequestError("create_adapter needs a rank")
            # A non-empty subset of the pool's target modules (None: all); unknown or empty: InvalidRequestError.
            modules = self.engine.resolve_target_modules(p.target_modules)
            alpha = p.alpha if p.alpha is not None else DEFAULT_ALPHA_PER_RANK * p.rank
            source = p.from_checkpoint  # a new adapter from a checkpoint folder
            if source is not None:
                self._written(source.directory)
                restore_checkpoint(self.engine, self.store,
                    request.model_id, Path(source.directory), source.with_optimizer, p.target_modules is not None,
                    modules,
                )  # fmt: skip
            else:
                create_adapter = self.store.create if self.store is not None else self.engine.create_adapter
                create_adapter(request.model_id, p.rank, alpha, p.seed, modules)
            return CreateResult(request.model_id)

        return self._one_by_one(step, create)

    def _delete(self, step: Step) -> list[Outcome]:
        def delete(request: PlannedRequest) -> DeleteResult:
            (self.store.delete if self.store is not None else self.engine.delete_adapter)(request.model_id)
            return DeleteResult()

        return self._one_by_one(step, delete)

    def _reject(self, step: Step) -> list[Outcome]:
        """Requests the gateway rejected after their seq_id was taken: the error the caller was already given."""
        outcomes = []
        for request in step.requests:
            p = request.payload
            assert isinstance(p, RejectedPayload)
            message = f"the gateway rejected this {p.rejected_kind or 'request'}: {p.message}"
            outcomes.append(Outcome(request.request_id, error_type=error_class(p.error_type), error=message))
        return outcomes

    def _sample(self, step: Step) -> list[Outcome]:
        if self.sampling is None:
            exc = NotSupportedError("this pool has no sampler (its pool process was started without one)")
            return [error_outcome(r, exc) for r in step.requests]
        try:
            return self.sampling(step)
        except Exception as exc:  # noqa: BLE001 - the step failed as a whole: each of its requests gets the error
            return [error_outcome(r, exc) for r in step.requests]

    def _forward_backward(self, step: Step) -> list[Outcome]:
        """Validate each request alone, then run every valid one in a single mixed batch."""
        outcomes: dict[str, Outcome] = {}
        valid: list[tuple[PlannedRequest, PreparedItem]] = []
        for request in step.requests:
            p = request.payload
            assert isinstance(p, ForwardBackwardPayload)
            try:
                valid.append((request, self._prepare(request, p)))
            except Exception as exc:  # noqa: BLE001
                self._parts.pop(request.request_id, None)
                outcomes[request.request_id] = error_outcome(request, exc)
        if valid:
            try:
                results = self.engine.forward_backward([item for _, item in valid])
                for (request, _), result in zip(valid, results, strict=True):
                    outcomes[request.request_id] = Outcome(request.request_id, result=self._merge_part(request, result))
            except Exception as exc:  # noqa: BLE001 - the whole batch failed: every request in it gets the error
                for request, _ in valid:
                    self._parts.pop(request.request_id, None)
                    outcomes[request.request_id] = error_outcome(request, exc)
        return [outcomes[r.request_id] for r in step.requests]

    def _prepare(self, request: PlannedRequest, p: ForwardBackwardPayload) -> PreparedItem:
        """The engine item for the request, or for its part: the whole request is validated at its first part (so a
        bad datum in a later part fails it before any gradient), and the parts are slices of that."""
        forward_only = not KINDS[request.kind].trains
        if request.part is None or request.part[0] == 0:
            item = self.engine.prepare(request.model_id, p.data, p.loss_fn, p.loss_fn_config, forward_only)
            if request.part is None:
                return item
            self._parts[request.request_id] = _Parts(item)
        start, stop = request.part
        parts = self._parts.get(request.request_id)
        if parts is None:
            raise EngineError(f"request {request.request_id}: datums [{start}, {stop}) came without its first part")
        return replace(parts.whole, datums=parts.whole.datums[start:stop])

    def _merge_part(self, request: PlannedRequest, result: dict[str, Any]) -> ForwardBackwardResult | PartDone:
        """A part's result kept until the last part, which answers for the whole request: every datum's outputs in
        order, loss:sum over all, and the loss's other metrics computed over all datums."""
        if request.part is None:
            return ForwardBackwardResult.from_wire(result)
        parts = self._parts[request.request_id]
        parts.outputs += result["loss_fn_outputs"]
        parts.loss_sum += result["metrics"]["loss:sum"]
        if request.unfinished:
            return PartDone(request.part)
        del self._parts[request.request_id]
        metrics = parts.whole.metrics([o["logprobs"] for o in parts.outputs])
        return ForwardBackwardResult.from_wire(
            {"loss_fn_outputs": parts.outputs, "metrics": {"loss:sum": parts.loss_sum, **metrics}}
        )

    def _optim_step(self, step: Step) -> list[Outcome]:
        try:
            results = self.engine.optim_step([(r.model_id, _adam_params(r)) for r in step.requests])
        except Exception as exc:  # noqa: BLE001
            return [error_outcome(r, exc) for r in step.requests]
        return [
            error_outcome(r, res) if isinstance(res, BaseException) else Outcome(r.request_id, OptimStepResult.from_wire(res))
            for r, res in zip(step.requests, results, strict=True)
        ]

    def _written(self, folder: str) -> None:
        """Before reading a checkpoint folder: wait for a background write into it still running."""
        if self.writes is not None:
            self.writes.wait_folder(folder)

    def _checkpoint(self, step: Step) -> list[Outcome]:
        """save_state / save_sampler / load_state, one by one (at most one per adapter in a step). The payload names
        the checkpoint's folder (the gateway chose it in the blob store); only the leader rank writes it (the banks are
        replicated, every rank holds the same state), every rank loads it."""
        return self._one_by_one(step, self._checkpoint_one)

    def _checkpoint_one(self, request: PlannedRequest) -> SaveResult | LoadResult:
        from loraplex.workers.state.checkpoint import read_checkpoint, write_checkpoint
        from loraplex.workers.state.checkpoint_state import load_into_engine, state_from_engine, state_from_rows

        p = request.payload
        if not isinstance(p, LoadStatePayload | SaveCheckpointPayload):
            raise InvalidRequestError(f"{request.kind} is not a checkpoint request")
        if not p.directory:
            raise InvalidRequestError(f"{request.kind} needs the checkpoint's directory")
        directory = Path(p.directory)
        if isinstance(p, LoadStatePayload):
            self._written(p.directory)
            state = read_checkpoint(directory)
            with_optimizer = p.with_optimizer
            load_into_engine(self.engine, state, request.model_id, with_optimizer=with_optimizer, existing=True)
            return LoadResult(request.model_id, p.path, with_optimizer)
        saves = KINDS[request.kind].saves  # STATE (weights + optimizer) or SAMPLER (weights)
        with_optimizer = saves == CheckpointKind.STATE
        record = self.engine.adapter(request.model_id)
        step_count = int(self.engine.optimizer.steps[record.slot])
        result = SaveResult(p.path, str(saves), p.name, step_count)
        writer = self.engine.dist is None or self.engine.dist.is_leader
        if writer and saves == CheckpointKind.SAMPLER and self.writes is not None:
            rows = self.engine.weights_to_host_async(record.slot)  # the plan's part: a device copy
            engine, base_model = self.engine, p.base_model

            def write() -> dict[str, Any]:  # beside the next plans
                state = state_from_rows(engine, record, step_count, rows(), base_model=base_model, with_optimizer=False)
                files = write_checkpoint(state, directory)
                return {"size_bytes": int(files.total_size), "sha256": files.sha256}

            self.writes.submit(request.request_id, p.directory, write)
        elif writer:
            state = state_from_engine(
                self.engine, request.model_id, base_model=p.base_model, with_optimizer=with_optimizer
            )
            files = write_checkpoint(state, directory)
            result = replace(result, size_bytes=int(files.total_size), sha256=files.sha256)
        if saves == CheckpointKind.SAMPLER and self.store is not None and p.path:
            # The frozen copy sampling reads (workers/state/adapter_store.py: freeze_copy): a slot-row copy, no file read
            # back; every rank keeps one (the banks are replicated).
            self.store.freeze_copy(request.model_id, p.path)
        return result

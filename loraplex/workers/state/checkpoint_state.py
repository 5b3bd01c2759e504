"""Copying an adapter between its engine slot and a CheckpointState (checkpoint.py holds the state's format on disk).

A slot holds the adapter zero padded to the pool's r_max, each bank as A [in, r_max] and B [r_max, out] in one row of
the optimizer's flat buffers; a CheckpointState holds only the real-rank parts in PEFT's layout (A [r, in], B [out, r]),
fp32 on the CPU. Saving copies the slot's rows to the host (Engine.read_slot) and slices them; loading builds the rows
on the host (zero padding included) and copies them into a zeroed slot (Engine.write_slot). Gradients are never saved.
An adapter that trains a subset of the pool's target modules saves only those (target_modules and modules in the
signature list the subset) and restores into the same subset: the other modules' banks stay zero.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from loraplex.errors import InvalidRequestError
from loraplex.workers.engine.engine import AdapterRecord, Engine
from loraplex.workers.state.checkpoint import KINDS, CheckpointState, Moments, Weights, validate_state

WEIGHT_ROWS = ("weights",)
OPTIMIZER_ROWS = ("weights", "exp_avg", "exp_avg_sq")  # weights and AdamW's moments, in that order


def state_from_engine(
    engine: Engine,
    model_id: str,
    *,
    base_model: str,
    with_optimizer: bool,
    kind: str | None = None,
    user_metadata: Mapping[str, Any] | None = None,
) -> CheckpointState:
    """Copy an adapter's weights (and Adam moments + step count when `with_optimizer`) out of its slot: fp32 CPU
    copies of the real-rank parts. `kind` defaults to "state" with the optimizer, "sampler" without."""
    record = engine.adapter(model_id)
    rows = engine.read_slot(record.slot, OPTIMIZER_ROWS if with_optimizer else WEIGHT_ROWS)
    step = int(engine.optimizer.steps[record.slot])
    return state_from_rows(
        engine, record, step, rows, base_model=base_model, with_optimizer=with_optimizer, kind=kind,
        user_metadata=user_metadata,
    )  # fmt: skip


def state_from_rows(
    engine: Engine,
    record: AdapterRecord,
    step: int,
    rows: torch.Tensor,
    *,
    base_model: str,
    with_optimizer: bool,
    kind: str | None = None,
    user_metadata: Mapping[str, Any] | None = None,
) -> CheckpointState:
    """As state_from_engine, from host copies of the adapter's slot rows (OPTIMIZER_ROWS, or WEIGHT_ROWS without the
    optimizer) taken earlier: reads only the engine's layout, so it may run beside the engine (a background write)."""
    kind = kind or ("state" if with_optimizer else "sampler")
    if kind not in KINDS:
        raise InvalidRequestError(f"checkpoint kind must be one of {KINDS}, got {kind!r}")
    if kind == "sampler" and with_optimizer:
        raise InvalidRequestError("a sampler checkpoint holds weights only (with_optimizer=False)")
    r = record.rank
    weights: Weights = {}
    moments: Moments = {}
    modules = engine.adapter_modules(record)
    for name, a, b in _bank_views(engine, rows):
        if name not in modules:
            continue  # not trained by this adapter: zero, not saved
        weights[name] = _real_parts(a[0], b[0], r)
        if with_optimizer:
            (m_a, m_b), (v_a, v_b) = _real_parts(a[1], b[1], r), _real_parts(a[2], b[2], r)
            moments[name] = (m_a, v_a, m_b, v_b)
    return CheckpointState(
        model_id=record.model_id,
        rank=record.rank,
        alpha=record.alpha,
        seed=record.seed,
        step=step,
        base_model=str(base_model),
        target_modules=tuple(engine.adapter_target_modules(record)),
        modules=tuple(modules),
        max_rank_hint=engine.max_rank,
        weights=weights,
        optimizer=moments if with_optimizer else None,
        kind=kind,
        user_metadata=dict(user_metadata or {}),
    )


def check_signature(engine: Engine, state: CheckpointState) -> None:
    """Whether `state` fits this pool: rank <= r_max, its target modules a subset of the pool's, its modules the pool's
    banks of those target modules, with the same shapes. InvalidRequestError naming what differs."""
    if state.rank > engine.max_rank:
        raise InvalidRequestError(f"checkpoint rank {state.rank} exceeds this pool's max rank {engine.max_rank}")
    ours, theirs = set(engine.target_modules), set(state.target_modules)
    if not theirs <= ours:
        raise InvalidRequestError(
            f"checkpoint target modules {sorted(theirs)} are not among this pool's {sorted(ours)} "
            f"(missing here: {sorted(theirs - ours)})"
        )
    pool_modules = {name for name in engine.banks if name.rsplit(".", 1)[-1] in theirs}
    if set(state.modules) != pool_modules:
        extra, missing = sorted(set(state.modules) - pool_modules), sorted(pool_modules - set(state.modules))
        raise InvalidRequestError(
            f"checkpoint modules do not match this pool's base model: {len(extra)} unknown here "
            f"(e.g. {extra[:3]}), {len(missing)} missing from the checkpoint (e.g. {missing[:3]})"
        )
    for name in state.modules:
        bank = engine.banks[name]
        a, b = state.weights[name]
        lead = tuple(bank.lora_A.shape[1:-2])  # () dense, (E,) an MoE's expert projection
        want_a, want_b = (*lead, state.rank, bank.in_features), (*lead, bank.out_features, state.rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise InvalidRequestError(
                f"checkpoint module {name}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit this pool's "
                f"A {want_a}, B {want_b} (a different base model?)"
            )


def load_into_engine(
    engine: Engine, state: CheckpointState, model_id: str, *, with_optimizer: bool, existing: bool
) -> AdapterRecord:
    """Restore `state` as adapter `model_id`: into a newly claimed slot (existing=False), or over that adapter's slot in
    place (existing=True: its weights, Adam moments and step are replaced and its unconsumed gradients cleared; rank,
    alpha and seed become the checkpoint's). With the optimizer: moments and step restored, so training continues
    bit-identically to an uninterrupted run; without: zero moments, step 0 (a fresh AdamW from those weights).

    Everything is checked before the engine is touched: a bad signature (InvalidRequestError), an unknown adapter
    (existing=True: NotFoundError), a taken id or no free slot (existing=False: ConflictError / CapacityError)."""
    validate_state(state)
    check_signature(engine, state)
    if with_optimizer and state.optimizer is None:
        raise InvalidRequestError(f"checkpoint of kind {state.kind!r} has no optimizer state to load")
    targets = state.target_modules  # the same subset as saved
    if existing:
        record = engine.reset_adapter(model_id, state.rank, state.alpha, state.seed, targets)  # same slot, zeroed
    else:
        record = engine.claim_slot(model_id, state.rank, state.alpha, state.seed, targets)  # a zeroed slot
    names = OPTIMIZER_ROWS if with_optimizer else WEIGHT_ROWS
    rows = torch.zeros((len(names), engine.slot_width))  # the zero padding stays zero
    r = record.rank
    with torch.no_grad():
        for name, a, b in _bank_views(engine, rows):
            if name not in state.weights:
                continue  # a module the adapter does not train: stays zero
            parts = [state.weights[name]]
            if with_optimizer:
                assert state.optimizer is not None
                m_a, v_a, m_b, v_b = state.optimizer[name]
                parts += [(m_a, m_b), (v_a, v_b)]
            for k, (part_a, part_b) in enumerate(parts):  # PEFT's A [(E,) r, in], B [(E,) out, r] -> the banks'
                a[k, ..., :r] = part_a.transpose(-1, -2)
                b[k, ..., :r, :] = part_b.transpose(-1, -2)
    engine.write_slot(record.slot, rows, names)
    engine.optimizer.steps[record.slot] = int(state.step) if with_optimizer else 0
    return record


def _bank_views(engine: Engine, rows: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Per bank, in the engine's order: its name and its views into `rows` [k, P] (slot rows): A [k, (E,) in, r_max]
    and B [k, (E,) r_max, out]."""
    segments = engine.optimizer.segments
    for i, (name, bank) in enumerate(engine.banks.items()):
        (a_start, a_size), (b_start, b_size) = segments[2 * i], segments[2 * i + 1]
        a = rows[:, a_start : a_start + a_size].view(-1, *bank.lora_A.shape[1:])
        b = rows[:, b_start : b_start + b_size].view(-1, *bank.lora_B.shape[1:])
        yield name, a, b


def _real_parts(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bank's real-rank (A [r, in], B [out, r]; an expert projection's [E, r, in], [E, out, r]) from its padded
    views, each with its own contiguous storage (safetensors refuses shared storage)."""
    own = torch.contiguous_format
    real_a, real_b = a[..., :rank].transpose(-1, -2), b[..., :rank, :].transpose(-1, -2)
    return real_a.clone(memory_format=own), real_b.clone(memory_format=own)

"""An adapter's whole training state as one host tensor (a slot image), for moves between the GPU slots and host
memory or disk.

A slot image is the slot's four rows of the optimizer's flat buffer (weights, unconsumed gradients, Adam exp_avg and
exp_avg_sq; zero padding included; copied by Engine.read_slot / write_slot) plus its Adam step count and
hyperparameters. The banks are replicated on every rank, so each rank takes and restores its own copy: no collective,
nothing gathered. Restoring copies the rows back bit for bit into any free slot, so training continues exactly as if
the adapter had never left.

Named "image", not "snapshot": a snapshot is the durable copy of an adapter's state (workers/state/durable_snapshot.py,
pool/durable/), which is written from a slot image; the adapter store's host and disk tiers hold slot images too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.errors import InvalidRequestError
from loraplex.workers.engine.engine import AdapterRecord, Engine
from loraplex.workers.state.slot_rows import SLOT_ROWS

ROWS = SLOT_ROWS  # an image holds all four of a slot's rows


@dataclass(frozen=True)
class PoolSignature:
    """What an image's rows are laid out for: the same r_max and bank modules (in order) give the same layout."""

    max_rank: int
    modules: tuple[str, ...]
    width: int  # P: floats per row

    @classmethod
    def of(cls, engine: Engine) -> PoolSignature:
        return cls(engine.max_rank, tuple(engine.banks), engine.slot_width)


@dataclass
class SlotImage:
    model_id: str
    rank: int
    alpha: float
    seed: int
    step: int
    signature: PoolSignature
    rows: torch.Tensor  # [4, P] fp32 on the CPU (pinned when the engine is on CUDA)
    target_modules: tuple[str, ...] | None = None  # AdapterRecord.target_modules: the subset it trains (None: all)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


def take_image(engine: Engine, model_id: str, out: torch.Tensor | None = None) -> SlotImage:
    """Copy an adapter's slot to host memory (into `out` [4, P] when given, e.g. a reused pinned buffer)."""
    record = engine.adapter(model_id)
    if out is None:
        out = torch.empty((len(ROWS), engine.slot_width), pin_memory=engine.device.type == "cuda")
    engine.read_slot(record.slot, ROWS, out=out)
    step = engine.optimizer.steps[record.slot]
    return SlotImage(
        model_id, record.rank, record.alpha, record.seed, step, PoolSignature.of(engine), out, record.target_modules
    )


def take_image_async(engine: Engine, model_id: str) -> Callable[[], SlotImage]:
    """The adapter's state as it is now, copied to host memory later: a device clone now, the device-to-host copy
    when the returned function is called (from any thread; Engine.rows_to_host_async)."""
    record = engine.adapter(model_id)
    rows = engine.rows_to_host_async(record.slot, ROWS)
    step, signature = engine.optimizer.steps[record.slot], PoolSignature.of(engine)
    return lambda: SlotImage(
        model_id, record.rank, record.alpha, record.seed, step, signature, rows(), record.target_modules
    )


def restore_image(engine: Engine, image: SlotImage, model_id: str | None = None) -> AdapterRecord:
    """Put an image into a free slot (as `model_id`, default its own id); bit-identical to the state it was taken."""
    if image.signature != PoolSignature.of(engine):
        raise InvalidRequestError(
            f"adapter state laid out for r_max {image.signature.max_rank} and {len(image.signature.modules)} "
            f"modules does not fit this pool (r_max {engine.max_rank}, {len(engine.banks)} modules)"
        )
    record = engine.claim_slot(
        model_id or image.model_id, image.rank, image.alpha, image.seed, image.target_modules
    )
    engine.write_slot(record.slot, image.rows, ROWS)
    engine.optimizer.steps[record.slot] = image.step
    return record

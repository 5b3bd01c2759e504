"""The engine's slot rows: a slot's four fp32 rows of the optimizer's flat buffers (weights, gradients, Adam's two
moments), copied to and from host memory: slot images (swaps), durable snapshots and checkpoints share them. A
mixin of `Engine` (workers/engine/engine.py), kept apart so the engine's file holds its training path."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from loraplex.workers.engine.optimizer import SlotAdamW
from loraplex.workers.engine.pinned_staging import PinnedStaging

SLOT_ROWS = ("weights", "grads", "exp_avg", "exp_avg_sq")


class SlotRows:
    """Needs `optimizer` (SlotAdamW), `device` and `_staging` (a PinnedStaging on CUDA, else None)."""

    optimizer: SlotAdamW
    device: torch.device
    _staging: PinnedStaging | None

    @property
    def slot_width(self) -> int:
        """P: floats per slot row (every bank's A and B, zero padding to r_max included)."""
        return int(self.optimizer.data.shape[1])

    def read_slot(self, slot: int, rows: Sequence[str] = SLOT_ROWS, out: torch.Tensor | None = None) -> torch.Tensor:
        """A host copy of the slot's `rows` (names from SLOT_ROWS, in the order given): [len(rows), P] fp32, into `out`
        when given (e.g. a reused pinned buffer), else a new tensor. The copies are done when it returns."""
        flats = self._flat_rows(rows)
        if out is None:
            out = torch.empty((len(flats), self.slot_width))
        for i, flat in enumerate(flats):
            out[i].copy_(flat[slot], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # done before the slot is reused
        return out

    def write_slot(self, slot: int, values: torch.Tensor, rows: Sequence[str] = SLOT_ROWS) -> None:
        """Copy `values` [len(rows), P] into the slot's `rows` bit for bit (other rows untouched). The copies are done
        when it returns (the host buffer may be reused right after)."""
        flats = self._flat_rows(rows)
        with torch.no_grad():
            for i, flat in enumerate(flats):
                flat[slot].copy_(values[i], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def copy_weights(self, source_slot: int, target_slot: int) -> None:
        """Copy one slot's weights row into another (device to device; rank padding included, so it stays zero)."""
        (weights,) = self._flat_rows(("weights",))
        with torch.no_grad():
            weights[target_slot].copy_(weights[source_slot])

    def weights_to_host_async(self, slot: int) -> Callable[[], torch.Tensor]:
        """The slot's weights row as it is now, on its way to host memory (`rows_to_host_async`): a function that
        copies it and gives the [1, P] fp32 host row."""
        return self.rows_to_host_async(slot, ("weights",))

    def rows_to_host_async(self, slot: int, rows: Sequence[str] = SLOT_ROWS) -> Callable[[], torch.Tensor]:
        """The slot's `rows` as they are now, for host memory: a device clone at once (the slot may change right
        after); the returned function, callable from another thread (the snapshot or checkpoint writer), copies it to
        the host and gives the [len(rows), P] fp32 rows. On CUDA the copy goes through the engine's two pinned
        buffers on a side stream (pinned_staging.py): the training thread spends only the clone, and neither a
        pinned allocation nor a pageable copy holds the driver while it trains (a fresh pinned tensor per copy
        stalled the pool's loop ~0.65 s per GiB on the H200, RESULTS.md 2026-12-04). The clone holds GPU memory until
        the copy is done."""
        flats = self._flat_rows(rows)
        with torch.no_grad():
            clone = torch.stack([flat[slot] for flat in flats])
        if self._staging is None:
            return lambda: clone
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        staging = self._staging
        return lambda: staging.to_host(clone, ready)

    def _flat_rows(self, rows: Sequence[str]) -> list[torch.Tensor]:
        opt = self.optimizer
        opt.adopt_views()  # the banks are views of the flat buffers (cheap check)
        flats = dict(zip(SLOT_ROWS, (opt.data, opt.grad, opt.exp_avg_flat, opt.exp_avg_sq_flat), strict=True))
        return [flats[name] for name in rows]

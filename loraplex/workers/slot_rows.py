"""The engine's slot rows: a slot's four fp32 rows of the optimizer's flat buffers (weights, gradients, Adam's two
moments), copied to and from host memory as snapshots, swaps and checkpoints share them. A mixin of `Engine`
(workers/engine.py), kept apart so the engine's file holds its training path."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from loraplex.workers.optimizer import SlotAdamW

SLOT_ROWS = ("weights", "grads", "exp_avg", "exp_avg_sq")


class SlotRows:
    """Needs `optimizer` (SlotAdamW), `device` and `_copy_stream` (a torch.cuda.Stream made on first use, or None)."""

    optimizer: SlotAdamW
    device: torch.device
    _copy_stream: Any

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
        """The slot's weights row as it is now, on its way to host memory (`rows_to_host_async`, the copy started at
        once): a function that waits for it and gives the [1, P] fp32 host row."""
        return self.rows_to_host_async(slot, ("weights",), copy_now=True)

    def rows_to_host_async(
        self, slot: int, rows: Sequence[str] = SLOT_ROWS, *, copy_now: bool = False
    ) -> Callable[[], torch.Tensor]:
        """The slot's `rows` as they are now, for host memory: a device clone at once (the slot may change right
        after), then on CUDA the device-to-host copy into pinned memory on a side stream, so the training kernels
        queued next never wait behind it. Returns a function that gives the [len(rows), P] fp32 host rows, callable
        from another thread. copy_now False: that function starts the copy (and allocates the pinned buffer) in the
        thread that calls it, e.g. the snapshot writer, so the calling thread spends only the device clone: a
        synchronous copy of four rows of every due adapter stalled the pool's loop ~1.2 s per snapshot round on the
        H200 (RESULTS.md, session 9). The clone holds GPU memory until the copy is done."""
        flats = self._flat_rows(rows)
        with torch.no_grad():
            clone = torch.stack([flat[slot] for flat in flats])
        if self.device.type != "cuda":
            return lambda: clone
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        side, device = self._copy_stream, self.device
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))

        def start() -> tuple[torch.Tensor, torch.cuda.Event]:
            with torch.cuda.device(device):
                host = torch.empty(clone.shape, pin_memory=True)
                done = torch.cuda.Event()
                with torch.cuda.stream(side):
                    side.wait_event(ready)
                    host.copy_(clone, non_blocking=True)
                    done.record(side)
                clone.record_stream(side)  # its memory is not reused before the side stream has read it
            return host, done

        def finish(started: tuple[torch.Tensor, torch.cuda.Event]) -> torch.Tensor:
            host, done = started
            done.synchronize()
            return host

        if copy_now:
            started = start()
            return lambda: finish(started)
        return lambda: finish(start())

    def _flat_rows(self, rows: Sequence[str]) -> list[torch.Tensor]:
        opt = self.optimizer
        opt.adopt_views()  # the banks are views of the flat buffers (cheap check)
        flats = dict(zip(SLOT_ROWS, (opt.data, opt.grad, opt.exp_avg_flat, opt.exp_avg_sq_flat), strict=True))
        return [flats[name] for name in rows]

"""The tiered adapter store (DESIGN.md, key technical choice 7): more adapters than resident slots, nothing lost on a swap.

Tiers: *gpu* (resident in an engine slot) <-> *cpu* (a SlotImage in host memory, pinned when the engine is on
CUDA) <-> *disk* (a spill file of the image: its [4, P] rows, hyperparameters and pool signature; spill_format.py).
An image holds weights, unconsumed gradients and Adam state, so a swap at any point (even between forward_backward
and optim_step) continues bit for bit.

Policy: least recently used. `ensure_resident` brings a step's adapters into slots, evicting the LRU resident adapters
that the step does not need; an evicted adapter goes to host memory; while the host tier holds more than the budget,
its LRU images are written to disk (atomically). A swap-in from disk removes the file: each adapter lives in exactly
one tier. Host buffers are recycled through a small free list (pinned allocations are slow on CUDA); `host_bytes`
counts the images of the cpu tier only, and is <= the budget after every call (during a call, one image more may
be in flight).

A new store removes the spill files a previous run left (or adopts them: `recover=True`).

Every rank of a pool has its own store over its own (replicated) banks and runs the same plans, so all ranks make the
same swaps; swaps copy local data only, with a barrier after them when distributed. Each tier move is logged as a
TierChange; `drain_changes` hands them (the last one per adapter) to whoever records them. Not thread-safe: call it from
the thread that moves adapters (the pool drains it in pool/finish.py's on_loop right after each plan).

Imports: torch, stdlib, loraplex.errors and workers/ only.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplex.errors import CapacityError, ConflictError, InvalidRequestError, NotFoundError
from loraplex.runtime.fsutil import private_dirs
from loraplex.workers.engine.engine import AdapterRecord, Engine
from loraplex.workers.ranks.distributed import barrier
from loraplex.workers.state.slot_images import (
    ROWS,
    PoolSignature,
    SlotImage,
    restore_image,
    take_image,
    take_image_async,
)
from loraplex.workers.state.spill_format import SPILL_SUFFIX, read_spill, read_spill_metadata, write_spill

GPU, CPU, DISK = "gpu", "cpu", "disk"
SPARE_BUFFERS = 2  # host buffers kept for reuse beyond the cpu tier's own


def is_sampler_copy_id(model_id: str) -> bool:
    """Sampler copies are named by their sampler checkpoint's tinker path (tinker://<model>/sampler_weights/<name>),
    which no adapter id can be (ids hold no '/')."""
    return model_id.startswith("tinker://")


@dataclass(frozen=True)
class TierChange:
    """Where an adapter is now. tier None: it is gone (deleted); its record should be removed."""

    model_id: str
    tier: str | None  # "gpu" | "cpu" | "disk" | None
    slot: int | None = None  # gpu only
    location: str | None = None  # disk only: the file


@dataclass
class SwapStats:
    """Cumulative swap counts and seconds (for benchmarks and logs)."""

    out_host: int = 0  # gpu -> cpu
    out_host_s: float = 0.0
    in_host: int = 0  # cpu -> gpu
    in_host_s: float = 0.0
    spills: int = 0  # cpu -> disk
    spill_s: float = 0.0
    in_disk: int = 0  # disk -> gpu
    in_disk_s: float = 0.0
    bytes_per_adapter: int = 0
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class AdapterStoreSpec:
    """How each rank builds its store (picklable: it crosses into spawned ranks). Rank k spills to spill_root/rank<k>."""

    host_budget_bytes: int
    spill_root: str
    copies_per_adapter: int = 4

    def build(self, engine: Engine, rank: int = 0) -> AdapterStore:
        return AdapterStore(
            engine, self.host_budget_bytes, Path(self.spill_root) / f"rank{rank}",
            copies_per_adapter=self.copies_per_adapter,
        )  # fmt: skip


class AdapterStore:
    def __init__(
        self,
        engine: Engine,
        host_budget_bytes: int,
        spill_dir: str | os.PathLike[str],
        *,
        recover: bool = False,
        copies_per_adapter: int = 4,
    ) -> None:
        """recover: adopt the spill files a previous run left in `spill_dir` (as disk-tier adapters); by default they
        are removed. Only safe when their state is known to match the applied seq_ids (a file written during a plan
        whose results were never stored would apply those requests twice when they are redelivered).
        copies_per_adapter: sampler copies kept per adapter (freeze_copy): an RL loop saves one per iteration,
        so the oldest beyond this are dropped (a sample naming one reloads it from its checkpoint folder)."""
        if host_budget_bytes < 0:
            raise ValueError("host_budget_bytes must be >= 0")
        if copies_per_adapter < 1:
            raise ValueError("copies_per_adapter must be >= 1")
        self.copies_per_adapter = copies_per_adapter
        self._copies: dict[str, list[str]] = {}  # adapter -> its sampler copies in the store, oldest first
        self._source: dict[str, str] = {}  # sampler copy -> its adapter
        self.engine = engine
        self.host_budget_bytes = int(host_budget_bytes)
        self.spill_dir = Path(spill_dir)
        private_dirs(self.spill_dir)  # owner-only, as its files (fsutil.atomic_write)
        self.signature = PoolSignature.of(engine)
        self._pinned = engine.device.type == "cuda"
        self._lru: OrderedDict[str, None] = OrderedDict()  # every known adapter, least recently used first
        self._host: dict[str, SlotImage] = {}
        self._disk: dict[str, Path] = {}
        self._spare: list[torch.Tensor] = []  # free host buffers, all [4, P]
        self._changes: dict[str, TierChange] = {}  # model_id -> its latest change (insertion order kept)
        self.stats = SwapStats(bytes_per_adapter=len(ROWS) * self.signature.width * 4)
        self._scan_spill_dir(adopt=recover)

    # ---- queries -----------------------------------------------------------------------------------------------------
    def __contains__(self, model_id: object) -> bool:
        self._sync()
        return model_id in self._lru

    def __len__(self) -> int:
        self._sync()
        return len(self._lru)

    @property
    def host_bytes(self) -> int:
        return sum(s.nbytes for s in self._host.values())

    @property
    def spare_bytes(self) -> int:
        """Host memory held by recycled buffers, outside the cpu tier (at most SPARE_BUFFERS of them)."""
        return sum(b.numel() * b.element_size() for b in self._spare)

    def tier_of(self, model_id: str) -> str:
        self._sync()
        if self.engine.is_resident(model_id):
            return GPU
        if model_id in self._host:
            return CPU
        if model_id in self._disk:
            return DISK
        raise NotFoundError(f"adapter {model_id!r} not found on this pool")

    def tier_counts(self) -> dict[str, int]:
        """How many adapters (sampler copies included) each tier holds now: gpu, cpu, disk."""
        self._sync()
        return {GPU: len(self.engine.adapters), CPU: len(self._host), DISK: len(self._disk)}

    def spill_path(self, model_id: str) -> Path:
        """The adapter's file when on disk: a readable, filesystem-safe name made unique by a hash of the id."""
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", model_id)[:80]
        return self.spill_dir / f"{safe}-{zlib.crc32(model_id.encode()):08x}{SPILL_SUFFIX}"

    def peek(self, model_id: str) -> SlotImage:
        """A copy of an adapter's whole state from whichever tier holds it, leaving it there (for checkpoints of
        adapters out of their slot, and tests)."""
        tier = self.tier_of(model_id)
        out = torch.empty((len(ROWS), self.signature.width))
        if tier == GPU:
            return take_image(self.engine, model_id, out=out)
        if tier == CPU:
            held = self._host[model_id]
            out.copy_(held.rows)
            return SlotImage(
                held.model_id, held.rank, held.alpha, held.seed, held.step, held.signature, out, held.target_modules
            )
        return read_spill(self._disk[model_id], out)

    def peek_async(self, model_id: str, clone_limit_bytes: int) -> Callable[[], SlotImage]:
        """As `peek`, for the durable snapshot writer: a resident adapter's state is cloned on the device now and
        copied to the host when the returned function is called (in the writer's thread), so the caller (the pool's
        loop) never waits for a device-to-host copy; an adapter in host memory or on disk, or one whose state is over
        `clone_limit_bytes` (an MoE's expert banks: ~14 GB at 30B-A3B rank 16, more than a full GPU can spare), is
        copied now."""
        if self.tier_of(model_id) == GPU and self.stats.bytes_per_adapter <= clone_limit_bytes:
            return take_image_async(self.engine, model_id)
        image = self.peek(model_id)
        return lambda: image

    def lru_order(self) -> list[str]:
        """Every known adapter, least recently used first."""
        self._sync()
        return list(self._lru)

    # ---- lifecycle ---------------------------------------------------------------------------------------------------
    def create(
        self, model_id: str, rank: int, alpha: float, seed: int, target_modules: Iterable[str] | None = None
    ) -> AdapterRecord:
        """A new adapter from its seed in a slot (the LRU resident adapter makes room when none is free), training
        `target_modules` (a subset of the pool's; None = all: Engine.create_adapter)."""
        self._check_new(model_id)
        targets = self.engine.resolve_target_modules(target_modules)  # refused before anything is evicted
        self._free_slots(1, protect=())
        record = self.engine.create_adapter(model_id, rank, alpha, seed, targets)
        self._placed(record)
        return record

    def claim_slot(
        self, model_id: str, rank: int, alpha: float, seed: int, target_modules: Iterable[str] | None = None
    ) -> AdapterRecord:
        """As Engine.claim_slot (a zeroed slot for the caller to fill, e.g. from a checkpoint), making room as `create`."""
        self._check_new(model_id)
        targets = self.engine.resolve_target_modules(target_modules)
        self._free_slots(1, protect=())
        record = self.engine.claim_slot(model_id, rank, alpha, seed, targets)
        self._placed(record)
        return record

    def delete(self, model_id: str) -> None:
        """Drop an adapter from whichever tier holds it (its file too)."""
        tier = self.tier_of(model_id)
        if tier == GPU:
            self.engine.delete_adapter(model_id)
        elif tier == CPU:
            self._recycle(self._host.pop(model_id).rows)
        else:
            self._disk.pop(model_id).unlink(missing_ok=True)
        del self._lru[model_id]
        self._note(TierChange(model_id, None))
        source = self._source.pop(model_id, None)
        if source is not None:
            self._copies[source].remove(model_id)
            if not self._copies[source]:
                del self._copies[source]
        for copy_id in self._copies.pop(model_id, []):  # an adapter's sampler copies go with it
            self._source.pop(copy_id, None)
            if copy_id in self._lru:
                self.delete(copy_id)

    def freeze_copy(self, model_id: str, copy_id: str) -> None:
        """A sampler copy: `copy_id` becomes an adapter of its own holding `model_id`'s weights as they are now
        (its gradients and Adam moments zero), while `model_id` trains on. With a free slot it is a weights-row copy
        into that slot (device to device: on the training path it costs a fraction of a millisecond), else a host
        copy in the CPU tier; no file either way. A copy of that id already there is replaced. Swapped like any
        adapter afterwards; its tier moves are not recorded in SQL (it is no adapter row: `is_sampler_copy_id`)."""
        if model_id not in self:
            raise NotFoundError(f"adapter {model_id!r} not found on this pool")
        if copy_id in self._lru:
            self.delete(copy_id)
        self.ensure_resident([model_id])
        self._copies.setdefault(model_id, []).append(copy_id)
        self._source[copy_id] = model_id
        while len(self._copies[model_id]) > self.copies_per_adapter:
            self.delete(self._copies[model_id][0])
        source = self.engine.adapter(model_id)
        if not self.engine.free_slots:
            self._swap_out_a_resident_copy(keep={model_id, copy_id})
        if self.engine.free_slots:
            record = self.engine.claim_slot(copy_id, source.rank, source.alpha, source.seed, source.target_modules)
            self.engine.copy_weights(source.slot, record.slot)
            self.engine.optimizer.steps[record.slot] = self.engine.optimizer.steps[source.slot]
            self._placed(record)
            return
        image = take_image(self.engine, model_id, out=self._buffer())
        image.rows[1:].zero_()  # weights only: SLOT_ROWS = weights, grads, exp_avg, exp_avg_sq
        image.model_id = copy_id
        self._host[copy_id] = image
        self._lru[copy_id] = None
        self._lru.move_to_end(copy_id)
        self._note(TierChange(copy_id, CPU))
        self._enforce_budget(prefer_keep=(copy_id,))

    def adopt(self, image: SlotImage) -> None:
        """Take an adapter's whole state, read from its durable snapshot (a restarting pool: pool/durable/recovery.py),
        into the host tier (spilled past the budget); the next step that needs it swaps it in bit for bit."""
        self._check_new(image.model_id)
        if image.signature != self.signature:
            raise InvalidRequestError(f"state of {image.model_id!r} is laid out for another pool signature")
        buf = self._buffer()
        buf.copy_(image.rows)
        self._host[image.model_id] = SlotImage(
            image.model_id, image.rank, image.alpha, image.seed, image.step, image.signature, buf,
            image.target_modules,
        )  # fmt: skip
        self._lru[image.model_id] = None
        self._lru.move_to_end(image.model_id)
        self._note(TierChange(image.model_id, CPU))
        self._enforce_budget(prefer_keep=(image.model_id,))

    def touch(self, model_id: str) -> None:
        """Mark as just used (most recently used)."""
        self.tier_of(model_id)
        self._lru.move_to_end(model_id)

    def ensure_resident(self, model_ids: Iterable[str]) -> list[AdapterRecord]:
        """Bring these adapters into slots (evicting LRU adapters not among them) and mark them used; their records
        in the given order. CapacityError when they are more than the slots; NotFoundError for an unknown one."""
        wanted = list(dict.fromkeys(model_ids))
        for m in wanted:
            self.tier_of(m)
        if len(wanted) > self.engine.num_slots:
            raise CapacityError(
                f"{len(wanted)} adapters cannot be resident at once: this pool has {self.engine.num_slots} slots"
            )
        missing = [m for m in wanted if not self.engine.is_resident(m)]
        protect = set(wanted)
        for m in missing:
            self._free_slots(1, protect=protect)
            self._swap_in(m)
            self._enforce_budget(prefer_keep=protect)
        if missing and self.engine.dist is not None:
            barrier(self.engine.dist)  # every rank made the same swaps; all are done before the step
        for m in wanted:
            self._lru.move_to_end(m)
        return [self.engine.adapter(m) for m in wanted]

    def evict(self, model_id: str) -> None:
        """Move a resident adapter out of its slot (to host memory, or to disk past the budget)."""
        if self.tier_of(model_id) == GPU:
            self._swap_out(model_id)
            self._enforce_budget(prefer_keep=())

    def drain_changes(self) -> list[TierChange]:
        """The tier changes since the last drain: the latest per adapter, oldest first."""
        self._sync()
        out = [c for c in self._changes.values() if not is_sampler_copy_id(c.model_id)]
        self._changes.clear()
        return out

    # ---- moves -------------------------------------------------------------------------------------------------------
    def _check_new(self, model_id: str) -> None:
        self._sync()
        if model_id in self._lru:
            raise ConflictError(f"adapter {model_id!r} already exists")

    def _placed(self, record: AdapterRecord) -> None:
        self._lru[record.model_id] = None
        self._lru.move_to_end(record.model_id)
        self._note(TierChange(record.model_id, GPU, record.slot))

    def _free_slots(self, n: int, protect: Iterable[str]) -> None:
        keep = set(protect)
        while self.engine.free_slots < n:
            victim = next((m for m in self._lru if self.engine.is_resident(m) and m not in keep), None)
            if victim is None:  # cannot happen through ensure_resident (it checks the count first)
                raise CapacityError(f"all {self.engine.num_slots} adapter slots hold adapters needed now")
            self._swap_out(victim)
            self._enforce_budget(prefer_keep=keep)

    def _swap_out_a_resident_copy(self, keep: set[str]) -> None:
        """Free a slot for a new sampler copy by moving the least recently used resident copy not in `keep` to host
        memory, if there is one (a new copy is sampled next; an older one seldom is)."""
        victim = next(
            (m for m in self._lru if is_sampler_copy_id(m) and m not in keep and self.engine.is_resident(m)), None
        )
        if victim is not None:
            self._swap_out(victim)
            self._enforce_budget(prefer_keep=keep)

    def _swap_out(self, model_id: str) -> None:
        started = time.perf_counter()
        image = take_image(self.engine, model_id, out=self._buffer())
        self.engine.delete_adapter(model_id)
        self._host[model_id] = image
        self._note(TierChange(model_id, CPU))
        self.stats.out_host += 1
        self.stats.out_host_s += time.perf_counter() - started

    def _swap_in(self, model_id: str) -> None:
        started = time.perf_counter()
        if model_id in self._host:
            image = self._host.pop(model_id)
            try:
                record = restore_image(self.engine, image)
            except BaseException:
                self._host[model_id] = image
                raise
            self._recycle(image.rows)
            self.stats.in_host += 1
            self.stats.in_host_s += time.perf_counter() - started
        else:
            path = self._disk[model_id]
            buf = self._buffer()
            try:
                image = read_spill(path, buf)
                record = restore_image(self.engine, image, model_id)
            finally:
                self._recycle(buf)
            del self._disk[model_id]
            path.unlink(missing_ok=True)
            self.stats.in_disk += 1
            self.stats.in_disk_s += time.perf_counter() - started
        self._note(TierChange(model_id, GPU, record.slot))

    def _enforce_budget(self, prefer_keep: Iterable[str]) -> None:
        """Spill LRU host images to disk until the cpu tier fits the budget (those in `prefer_keep` last). A sampler
        copy is dropped instead: its checkpoint folder holds the same weights (a sample naming it reloads it there),
        while spilling its whole slot image (~1 GB for a Qwen3-4B adapter at rank 32) cost seconds of disk writes in
        every RL iteration of a few tenants (benchmarks/RESULTS.md)."""
        keep = set(prefer_keep)
        while self._host and self.host_bytes > self.host_budget_bytes:
            order = [m for m in self._lru if m in self._host]
            victim = next((m for m in order if m not in keep), order[0])
            if is_sampler_copy_id(victim) and victim not in keep:  # a copy needed now is spilled like any other
                self.delete(victim)
            else:
                self._spill(victim)

    def _spill(self, model_id: str) -> None:
        started = time.perf_counter()
        image = self._host[model_id]
        path = self.spill_path(model_id)
        write_spill(path, image)  # raises (disk full...) with the image still in host memory: nothing lost
        del self._host[model_id]
        self._disk[model_id] = path
        self._recycle(image.rows)
        self._note(TierChange(model_id, DISK, location=str(path)))
        self.stats.spills += 1
        self.stats.spill_s += time.perf_counter() - started

    def _note(self, change: TierChange) -> None:
        self._changes.pop(change.model_id, None)
        self._changes[change.model_id] = change

    # ---- host buffers ------------------------------------------------------------------------------------------------
    def _buffer(self) -> torch.Tensor:
        if self._spare:
            return self._spare.pop()
        return torch.empty((len(ROWS), self.signature.width), pin_memory=self._pinned)

    def _recycle(self, buf: torch.Tensor) -> None:
        if len(self._spare) < SPARE_BUFFERS:
            self._spare.append(buf)

    # ---- consistency with the engine ---------------------------------------------------------------------------------
    def _sync(self) -> None:
        """Adopt adapters created or deleted on the engine directly (not through the store)."""
        resident = self.engine.adapters
        if len(self._lru) == len(resident) + len(self._host) + len(self._disk) and all(
            m in self._lru for m in resident
        ):
            return
        for m, record in resident.items():
            if m not in self._lru:
                self._placed(record)
        for m in [m for m in self._lru if m not in resident and m not in self._host and m not in self._disk]:
            del self._lru[m]
            self._note(TierChange(m, None))

    def _scan_spill_dir(self, adopt: bool) -> None:
        """Spill files a previous run left: adopted (an adapter on disk is exactly its state when it was spilled: it was
        not trained since) or removed. Unfinished temp files are removed; files that are not ours stay as they are."""
        for tmp in self.spill_dir.glob(f"*{SPILL_SUFFIX}.tmp*"):  # ".<file>.tmp-*" (fsutil), "<file>.tmp<pid>" (older)
            tmp.unlink(missing_ok=True)
        for path in sorted(self.spill_dir.glob(f"*{SPILL_SUFFIX}")):
            try:
                meta = read_spill_metadata(path)
            except (OSError, ValueError, KeyError):
                continue
            model_id = meta["model_id"]
            if not adopt:
                path.unlink(missing_ok=True)
                continue
            if meta["signature"] != self.signature or model_id in self._lru or path != self.spill_path(model_id):
                continue
            self._disk[model_id] = path
            self._lru[model_id] = None
            self._note(TierChange(model_id, DISK, location=str(path)))

"""The rank loop: how a batch plan reaches every rank of a pool, and how the extra rank processes are started.

Rank 0 is the pool leader: it runs the dispatcher, and its executor (`LeaderExecutor`) broadcasts each plan on the
control group before executing it; every other rank sits in `follow`: receive a plan, execute it, repeat, until the
leader's stop message. All ranks run the same PlanExecutor on the same plan and the same engine state, so they decide
every validation error alike and take part in every collective; only rank 0's outcomes are used.

Launch: under torchrun every process reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (see
`distributed.torchrun_env`); otherwise the pool process is rank 0 and `spawn_ranks` starts ranks 1..N-1 with
torch.multiprocessing (start method "spawn"). Imports: torch, stdlib, loraplex.protocol and workers/ only.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.multiprocessing as mp
from torch import nn

from loraplex.protocol import BatchPlan, Outcome
from loraplex.runtime.netutil import free_port
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.executor import PlanExecutor
from loraplex.workers.ranks.distributed import (
    RankEnv,
    RankGroup,
    barrier,
    broadcast_message,
    destroy_rank_group,
    init_rank_group,
    lost_a_rank,
)
from loraplex.workers.state.slot_images import SlotImage

log = logging.getLogger(__name__)

STOP = "stop"
PLAN = "plan"
ADOPT = "adopt"  # a durable snapshot for every rank's adapter store (a restarting pool's recovery)

# device -> base model on that device (a picklable callable: it crosses into spawned ranks).
ModelLoader = Callable[[torch.device], nn.Module]


@dataclass(frozen=True)
class EngineSpec:
    """Everything a rank needs to build its engine; the same on every rank."""

    load_model: ModelLoader
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL; each rank takes cuda:LOCAL_RANK)
    config: EngineConfig = field(default_factory=EngineConfig)
    cpu_threads: int = 0  # torch's intra-op threads on a CPU rank (0: torch's default)


def build_rank_engine(spec: EngineSpec, group: RankGroup | None) -> Engine:
    """The engine of this rank (build.build_engine): with a group of several ranks, base weights sharded (unless the
    config replicates them) and rows split (distributed.py)."""
    device = group.device if group is not None else torch.device(spec.device)
    if device.type == "cpu" and spec.cpu_threads:
        torch.set_num_threads(spec.cpu_threads)
    model = spec.load_model(device)
    engine = build_engine(model, spec.config, device, group)
    if group is not None:
        barrier(group)  # every rank has its engine: a rank that failed to build one fails the pool's start here
    log.info("rank %d engine: %s", group.rank if group is not None else 0, engine.summary())
    return engine


class LeaderExecutor:
    """Rank 0's executor: every plan goes to all ranks first, then runs here (in step with them)."""

    def __init__(self, executor: PlanExecutor, group: RankGroup) -> None:
        if not group.is_leader:
            raise ValueError("only rank 0 leads")
        self.executor = executor
        self.group = group
        self.closed = False

    @property
    def engine(self) -> Engine:
        return self.executor.engine

    def execute(self, plan: BatchPlan) -> list[Outcome]:
        if self.closed:
            raise RuntimeError("the pool's ranks were stopped")
        try:
            broadcast_message(self.group, (PLAN, plan))
            return self.executor.execute(plan)
        except Exception as exc:
            if lost_a_rank(exc):
                leave_without_answering(exc)
            raise

    def adopt(self, image: SlotImage) -> None:
        """Every rank's store takes this adapter's state (AdapterStore.adopt), so the ranks stay replicas."""
        if self.closed:
            raise RuntimeError("the pool's ranks were stopped")
        if self.executor.store is None:
            raise RuntimeError("this pool's executor has no adapter store")
        broadcast_message(self.group, (ADOPT, image))
        self.executor.store.adopt(image)

    def close(self) -> None:
        """Tell the other ranks to leave `follow` (once)."""
        if not self.closed:
            self.closed = True
            broadcast_message(self.group, (STOP, None))


def leave_without_answering(exc: BaseException) -> None:
    """End this process now: the plan's requests must not be answered with this error (they were accepted, and the
    restarted pool replays them from its durable log), and the ranks are out of step for any further plan."""
    log.error("a rank of this pool is gone (%s); exiting without answering the plan", str(exc).splitlines()[0][:300])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def follow(executor: PlanExecutor, group: RankGroup) -> int:
    """A non-leader rank's loop: execute each plan the leader sends, until it says stop. Returns the plans executed."""
    executed = 0
    while True:
        kind, plan = cast(tuple[str, Any], broadcast_message(group))
        if kind == STOP:
            return executed
        if kind == ADOPT:
            try:
                executor.store.adopt(plan)  # type: ignore[union-attr]  # a follower's executor has its store
            except Exception:  # rank 0's store refuses it alike and its recovery reports it
                log.exception("rank %d: could not adopt a snapshot", group.rank)
            continue
        executor.execute(plan)  # outcomes are rank 0's to report; per-request errors are decided alike everywhere
        executed += 1


# ---- launching ranks -----------------------------------------------------------------------------------------------
RankEntry = Callable[..., None]  # entry(group, *args), run in every spawned rank after the group is up


def spawn_ranks(
    entry: RankEntry,
    args: tuple[Any, ...],
    *,
    world_size: int,
    ranks: range,
    device: str,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> tuple[mp.ProcessContext, int]:
    """Start one process per rank in `ranks` (spawn): each joins the group (`init_rank_group`), runs
    `entry(group, *args)`, leaves the group and exits with os._exit(0). Returns (the processes, the master port); the
    caller joins them (`ProcessContext.join` raises with the child's traceback if one fails)."""
    port = master_port or free_port()
    context = mp.start_processes(
        _rank_main,
        args=(entry, args, world_size, ranks.start, master_addr, port, device),
        nprocs=len(ranks),
        join=False,
        start_method="spawn",
    )
    assert context is not None
    return context, port


def _rank_main(
    index: int,
    entry: RankEntry,
    args: tuple[Any, ...],
    world_size: int,
    first_rank: int,
    master_addr: str,
    master_port: int,
    device: str,
) -> None:
    rank = first_rank + index
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    env = RankEnv(rank=rank, world_size=world_size, local_rank=rank, master_addr=master_addr, master_port=master_port)
    group = init_rank_group(env, device)
    entry(group, *args)  # an exception propagates: torch's wrapper reports it to the parent and exits 1
    destroy_rank_group()
    # A rare abort at interpreter exit after all work is done (platform.md): leave without the exit handlers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

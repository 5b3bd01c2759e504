"""Data parallelism across the ranks of one worker pool (DESIGN.md, key technical choice 4).

- Base weights: sharded with FSDP2 `fully_shard`, one unit per decoder layer plus a root unit (embeddings, final norm, LM
  head). The LoRA slot banks are `ignored_params`: plain fp32 Parameters, replicated on every rank, never all-gathered.
- Rows: a plan's sequences (adapter-contiguous, see batching.layout) are cut into `world_size` contiguous ranges balanced
  by tokens (`split_rows`), so each rank's rows stay adapter-contiguous. Every rank runs the same number of microbatches
  (a rank with fewer runs dummy ones) and does backward in the same microbatches, so the FSDP all-gathers line up.
- Gradients: after a forward_backward, the touched slots' bank gradients are all-reduced with SUM (losses are sums),
  so every rank holds the same, global gradients and the optimizer runs identically everywhere.
- Outputs: per-datum logprobs and per-request loss partial sums are all-gathered; every rank returns the same results.

Every decision that shapes a collective is a pure function of the plan and the engine state, which all ranks share, so
no rank needs to ask another what to do. Imports: torch and stdlib only (runs on the GPU machine as is).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

# Followers wait on the control group between plans; an idle pool must not time them out (gloo's default is 30 min).
CONTROL_TIMEOUT = timedelta(days=365)


class HasLength(Protocol):
    @property
    def length(self) -> int: ...


S = TypeVar("S", bound=HasLength)


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the pool (torchrun's variables)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def torchrun_env(environ: dict[str, str] | None = None) -> RankEnv | None:
    """RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT when launched by torchrun, else None."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    return RankEnv(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
    )


@dataclass
class RankGroup:
    """This process's place in the pool's process group. Rank 0 is the pool leader."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh  # 1-D, all ranks: FSDP2 shards over it
    control: Any  # a gloo ProcessGroup with a long timeout: the leader's plans travel on it

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def init_rank_group(env: RankEnv, device: str = "cpu") -> RankGroup:
    """Join the pool's process group: NCCL on CUDA (this rank's GPU is cuda:LOCAL_RANK), gloo on CPU."""
    kind = torch.device(device).type
    os.environ["MASTER_ADDR"] = env.master_addr
    os.environ["MASTER_PORT"] = str(env.master_port)
    kwargs: dict[str, Any] = {"rank": env.rank, "world_size": env.world_size, "init_method": "env://"}
    if kind == "cuda":
        rank_device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(rank_device)
        dist.init_process_group("nccl", device_id=rank_device, **kwargs)
    elif kind == "cpu":
        rank_device = torch.device("cpu")
        dist.init_process_group("gloo", **kwargs)
    else:
        raise ValueError(f"no process-group backend for device {device!r} (cpu: gloo, cuda: nccl)")
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    mesh = init_device_mesh(kind, (env.world_size,))
    return RankGroup(env.rank, env.world_size, env.local_rank, rank_device, mesh, control)


def destroy_rank_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---- sharding ------------------------------------------------------------------------------------------------------
def shard_base_model(
    root: nn.Module, layers: Iterable[nn.Module], replicated: Iterable[nn.Parameter], mesh: DeviceMesh
) -> None:
    """fully_shard every decoder layer, then `root` (what is left: embeddings, final norm, LM head). `replicated`
    parameters (the LoRA banks) are ignored by FSDP: they stay plain Parameters, whole on every rank."""
    keep = set(replicated)
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=keep)
    fully_shard(root, mesh=mesh, ignored_params=keep)


def is_sharded(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


# ---- rows ----------------------------------------------------------------------------------------------------------
def split_rows(seqs: Sequence[S], world_size: int) -> list[list[S]]:
    """Cut `seqs` into `world_size` contiguous ranges balanced by tokens: a sequence goes to the rank whose share of the
    token count holds its midpoint. Contiguous ranges of an adapter-contiguous layout stay adapter-contiguous; order is
    kept, and a range may be empty (fewer sequences than ranks, or one long sequence)."""
    parts: list[list[S]] = [[] for _ in range(world_size)]
    total = sum(s.length for s in seqs)
    before = 0
    for s in seqs:
        # 2 * W * midpoint // (2 * total): integer maths, the same on every rank.
        r = (world_size * (2 * before + s.length)) // (2 * total) if total else 0
        parts[min(r, world_size - 1)].append(s)
        before += s.length
    return parts


# ---- collectives ---------------------------------------------------------------------------------------------------
def all_reduce_slot_grads(params: Sequence[nn.Parameter], slots: Sequence[int]) -> list[torch.Tensor]:
    """SUM over ranks of each param's gradient at `slots` (dim 0), in one collective. Returns one tensor per param shaped
    [len(slots), *p.shape[1:]] (zeros where this rank has no gradient yet)."""
    idx = torch.tensor(list(slots), dtype=torch.int64, device=params[0].device)
    parts = [
        p.grad.index_select(0, idx) if p.grad is not None else p.new_zeros((len(slots), *p.shape[1:])) for p in params
    ]
    flat = torch.cat([t.reshape(-1) for t in parts])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return [t.view(part.shape) for t, part in zip(flat.split([t.numel() for t in parts]), parts, strict=True)]


def all_gather_varlen(local: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Every rank's 1-D `local` (rank r's has sizes[r] elements, known to all) on every rank, in rank order."""
    width = max(sizes)
    if width == 0:
        return [local[:0] for _ in sizes]
    buf = local.new_zeros(width)
    buf[: local.numel()] = local
    out = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(out, buf)
    return [t[:n] for t, n in zip(out, sizes, strict=True)]


def lost_a_rank(exc: BaseException) -> bool:
    """A collective failed because another rank is gone (gloo reports a closed connection; NCCL mostly hangs instead,
    which the pool's rank watcher catches). The executor lets it through instead of failing the
    requests (executor.error_outcome), so that the pool ends without answering them (rank_loop.LeaderExecutor)."""
    text = str(exc)
    return isinstance(exc, torch.distributed.DistError) or (
        isinstance(exc, RuntimeError) and ("gloo/transport" in text or "Connection closed by peer" in text)
    )


def broadcast_message(group: RankGroup, message: object = None) -> object:
    """The leader's `message` on every rank (pickled, over the gloo control group)."""
    box = [message if group.is_leader else None]
    dist.broadcast_object_list(box, src=0, group=group.control)
    return box[0]


def barrier(group: RankGroup) -> None:
    """Wait for every rank (on the control group: a dead rank makes it fail rather than time out)."""
    dist.barrier(group=group.control)

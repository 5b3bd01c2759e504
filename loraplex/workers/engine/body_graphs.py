"""The decoder body's forward and backward of a packed training microbatch replayed as two CUDA graphs (without
them the step is host-bound: ~6,000 kernel launches from Python for ~200 ms of device work per 4,096 tokens).

A graph replays fixed shapes and addresses, so a microbatch is padded to a bucket (`pad_microbatch`, pure):
  * tokens up to a multiple of `TOKEN_BUCKET`: the pad tokens form one sequence of their own (the packed attention
    keeps it apart) in a group of their own with LoRA scale 0, and feed no loss: they change no real token's value
    and add exact zeros to every gradient;
  * LoRA groups up to a power of two: empty groups (no rows) after the real ones;
  * sequence boundaries (cu_seqlens) up to a power of two: empty sequences at the end;
  * the longest sequence up to a power of two (the attention's grid; an upper bound is all it needs), unless every
    sequence has one length and no pad is needed: then the key holds that length and the body runs the attention's
    dense path (workers/kernels/packed_attention.py, `uniform_attention`).
Per bucket (`GraphKey`) one `BodyGraph` holds static inputs (tokens, positions, cu_seqlens, the routing's offsets,
per-row scales and slot ids, the gathered dense banks and their fp32 gradient buffer) and the two graphs: forward
body -> last hidden state, backward hidden-state gradient -> the banks' gradients (the LoRA layers' backward adds into
the static buffer, as in eager). The LM head and the losses stay eager (few launches). The LoRA op reads ranks and scales only on the
device here (`MicrobatchBanks(single=False)`): one group's Python rank and scale would otherwise be baked into the
graph. Several groups take grouped_mm; one group plain matmuls over r_max with the per-row scale tensor.
An MoE's expert LoRA is not gathered (its banks are GBs per slot): it reads the master banks in place by the routing's
static slot ids, and its backward adds into their .grad inside the backward graph (lora/experts.py, `_BankStack`); its
routing (top-k experts, their sort and offsets, the chunks past grouped_mm's group limit) stays on the device.

`BodyGraphs` keeps up to `max_graphs` of them, all in one memory pool: a microbatch's forward and backward replay
before the next one's, so captures may share memory, and so may the static banks (one set per group count, shared by
every bucket of that count: the gradients fold out before the next microbatch loads). A bucket is captured the second
time it is seen (a one-off shape runs eagerly), and none once `max_graphs` are held (no eviction: a capture costs
about three eager steps, so a workload of many shapes must not capture again and again; the buckets seen first are
the common ones). Memory bounds them too: a graph keeps its activations in the pool for good, memory the eager path can
no longer use, so a bucket is captured only if the eager path keeps room for a full microbatch after it
(`capture_fits`; on an 80 GB H100 the graphs of a benchmark's first four buckets had taken 45 GiB, and the next
eager LM head failed to allocate). Captures use thread-local capture mode, so another thread's CUDA work (the adapter store's copies) does
not break them.

Semantics: what the eager packed microbatch computes, up to summation order (the padded rows change the matmuls'
shapes): tests/gpu/test_body_graphs_cuda.py compares losses, logprobs and gradients with the eager engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.workers.lora.context import LoraContext
from loraplex.workers.lora.experts import bank_gradients_discarded
from loraplex.workers.lora.fused import MicrobatchBanks
from loraplex.workers.lora.routing import Routing, to_device

TOKEN_BUCKET = 256
# A capture's pool keeps what the forward holds for its backward; the backward's own temporaries come on top.
BACKWARD_HEADROOM = 1.25

log = logging.getLogger(__name__)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class GraphKey:
    tokens: int  # padded token count
    groups: int  # LoRA groups (real + pad + empty)
    boundaries: int  # len(cu_seqlens)
    max_length: int  # the attention's bound on a sequence's length
    elementwise: bool  # the fused norm / activation kernels on while captured
    shared_inputs: bool = True  # sibling LoRA layers as one node while captured (lora/siblings.py)
    uniform: bool = False  # every sequence is max_length long, no pad (the attention's dense path)


@dataclass(frozen=True)
class PaddedMicrobatch:
    key: GraphKey
    pad_tokens: int  # appended after the real tokens
    cu_seqlens: list[int]  # len key.boundaries
    slots: list[int]
    ranks: list[int]
    scales: list[float]
    group_rows: list[int]


def pad_microbatch(
    lengths: Sequence[int],
    slots: Sequence[int],
    ranks: Sequence[int],
    scales: Sequence[float],
    group_rows: Sequence[int],
    elementwise: bool,
    token_bucket: int = TOKEN_BUCKET,
    shared_inputs: bool = True,
) -> PaddedMicrobatch:
    """The bucketed layout of a packed microbatch (sequence `lengths` in order; its LoRA groups as Routing.build takes
    them). See the module doc."""
    n = sum(lengths)
    if n != sum(group_rows):
        raise ValueError(f"the groups cover {sum(group_rows)} rows, the sequences {n}")
    tokens = -(-n // token_bucket) * token_bucket
    pad = tokens - n
    seq_lengths = [*lengths, pad] if pad else list(lengths)
    slots, ranks, scales, rows = list(slots), list(ranks), list(scales), list(group_rows)
    if pad:  # the pad sequence's own group: LoRA scale 0, the last real slot (its gradient there is exactly zero)
        slots, ranks, scales, rows = [*slots, slots[-1]], [*ranks, ranks[-1]], [*scales, 0.0], [*rows, pad]
    groups = _pow2(len(slots))
    extra = groups - len(slots)
    slots += [slots[-1]] * extra
    ranks += [ranks[-1]] * extra
    scales += [0.0] * extra
    rows += [0] * extra
    cu = [0]
    for length in seq_lengths:
        cu.append(cu[-1] + length)
    boundaries = _pow2(len(cu))
    cu += [tokens] * (boundaries - len(cu))
    uniform = not pad and len(set(lengths)) == 1
    max_length = lengths[0] if uniform else min(tokens, max(128, _pow2(max(seq_lengths))))
    key = GraphKey(tokens, groups, boundaries, max_length, bool(elementwise), bool(shared_inputs), uniform)
    return PaddedMicrobatch(key, pad, cu, slots, ranks, scales, rows)


def capture_fits(held: int, tokens: int, microbatch_tokens: int, free: int, margin: int) -> bool:
    """Whether to capture a bucket of `tokens` whose eager forward held `held` bytes for its backward, with `free` bytes
    free on the device: after the capture keeps about that much (with the backward's temporaries), the eager path must
    still have room for a full microbatch of `microbatch_tokens` (scaled from this bucket: small buckets over-estimate
    per token, which errs on the side of room) and `margin` more."""
    need = held * BACKWARD_HEADROOM
    eager = need * max(1.0, microbatch_tokens / max(tokens, 1))
    return free - need >= eager + margin


class BodyGraph:
    """One bucket's static buffers and its forward / backward graphs (see the module doc): built with its buffers,
    then `warm_up()` (eager, outside any capture), then `capture()`."""

    def __init__(
        self,
        key: GraphKey,
        run_body: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, bool], torch.Tensor],
        context: LoraContext,
        max_rank: int,
        device: torch.device,
        pool: Any,
        elementwise: Callable[[], Any],
        banks: MicrobatchBanks,
        stream: torch.cuda.Stream,
    ) -> None:
        self.key, self.pool, self.device = key, pool, device
        n = key.tokens
        # One stream (BodyGraphs') for the static buffers, the banks, the warm-up and both captures: autograd syncs a
        # backward with the streams its tensors were made on, and a wait on another (uncaptured) stream would break
        # the capture.
        self.stream = stream
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            self.tokens = torch.zeros(1, n, dtype=torch.int64, device=device)
            self.positions = torch.zeros(1, n, dtype=torch.int64, device=device)
            self.cu_seqlens = torch.full((key.boundaries,), n, dtype=torch.int32, device=device)
            self.cu_seqlens[0] = 0
            self.routing = Routing.build([0] * key.groups, [max_rank] * key.groups, [0.0] * key.groups,
                                         [n] + [0] * (key.groups - 1), device)  # fmt: skip
        self.banks = banks
        assert banks.trigger is not None and banks.compute.shape[0] == key.groups

        def forward() -> torch.Tensor:
            with context.use(self.routing, self.banks), torch.enable_grad(), elementwise():
                return run_body(self.tokens, self.positions, self.cu_seqlens, key.max_length, key.uniform)

        self._forward = forward

    def warm_up(self, rounds: int = 2) -> int:
        """Eager runs on the capture stream, so lazy initialisation, Triton compiles and cuBLAS workspaces stay out of
        the capture. They run on the static inputs' placeholders (slot 0, zero tokens): the dense banks' gradients go
        to the static buffer `load` zeroes, an MoE's expert banks' nowhere (`bank_gradients_discarded`). Returns the
        most bytes a forward held for its backward (what the capture's pool will keep)."""
        trigger = self.banks.trigger
        assert trigger is not None
        held = 0
        with torch.cuda.stream(self.stream), bank_gradients_discarded():
            for _ in range(rounds):
                before = torch.cuda.memory_allocated(self.device)
                out = self._forward()
                held = max(held, torch.cuda.memory_allocated(self.device) - before)
                torch.autograd.grad(out, trigger, torch.zeros_like(out), allow_unused=True)
            del out
        torch.cuda.synchronize(self.device)
        return held

    def capture(self) -> None:
        trigger = self.banks.trigger
        assert trigger is not None
        self.forward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=self.pool, stream=self.stream,
                              capture_error_mode="thread_local"):  # fmt: skip
            self.hidden = self._forward()
        with torch.cuda.stream(self.stream):
            self.grad_hidden = torch.zeros_like(self.hidden)
        self.backward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.backward_graph, pool=self.pool, stream=self.stream,
                              capture_error_mode="thread_local"):  # fmt: skip
            torch.autograd.grad(self.hidden, trigger, self.grad_hidden, allow_unused=True)
        torch.cuda.synchronize(self.device)
        self.hidden = self.hidden.detach()

    def load(
        self, tokens: torch.Tensor, positions: torch.Tensor, padded: PaddedMicrobatch, flat: torch.Tensor
    ) -> Routing:
        """Copy one microbatch into the static inputs (tokens / positions: host int64 [key.tokens], padded already;
        flat: the optimizer's fp32 [S, P] master banks). Returns the padded routing (its slot_ids fold the gradients)."""
        device = self.tokens.device
        routing = Routing.build(padded.slots, padded.ranks, padded.scales, padded.group_rows, device)
        host = torch.cat([tokens, positions, torch.tensor(padded.cu_seqlens, dtype=torch.int64)])
        staged = to_device(host, device)
        n = self.key.tokens
        self.tokens.view(-1).copy_(staged[:n])
        self.positions.view(-1).copy_(staged[n : 2 * n])
        self.cu_seqlens.copy_(staged[2 * n :])
        self.routing.offs.copy_(routing.offs)
        self.routing.row_scales.copy_(routing.row_scales)
        self.routing.slot_ids.copy_(routing.slot_ids)  # an MoE's expert LoRA reads the master banks by slot
        for group, slot in enumerate(padded.slots):  # row by row: no fp32 [G, P] temporary (4 GiB at 16 groups)
            self.banks.compute[group].copy_(flat[slot])
        assert self.banks.grads is not None
        self.banks.grads.zero_()
        return routing

    def run(self) -> torch.Tensor:
        """The last hidden state [key.tokens, H] of the loaded microbatch; its backward replays the backward graph."""
        assert self.banks.trigger is not None
        return _Replay.apply(self, self.banks.trigger)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, graph: BodyGraph, trigger: torch.Tensor) -> torch.Tensor:
        graph.forward_graph.replay()
        ctx.graph = graph
        return graph.hidden.view_as(graph.hidden)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        graph: BodyGraph = ctx.graph
        graph.grad_hidden.copy_(grad)
        graph.backward_graph.replay()
        return None, None


class BodyGraphs:
    """The captured buckets of one engine (see the module doc). `graph(padded)` returns the bucket's graph, capturing
    it on its second sighting when memory allows (`capture_fits`); None: run this microbatch eagerly.
    `microbatch_tokens`: the engine's microbatch cap (what the eager path must keep room for); `margin`: bytes kept
    free beyond that (default: 5% of the device, at least 2 GiB)."""

    def __init__(
        self,
        run_body: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, bool], torch.Tensor],
        context: LoraContext,
        width: int,
        dtype: torch.dtype,
        max_rank: int,
        device: torch.device,
        elementwise: Callable[[], Any],
        max_graphs: int = 16,
        capture_on_sighting: int = 2,
        microbatch_tokens: int = 4096,
        margin: int | None = None,
    ) -> None:
        self.run_body, self.context = run_body, context
        self.width, self.dtype, self.max_rank, self.device = width, dtype, max_rank, device
        self.elementwise = elementwise
        self.max_graphs, self.capture_on_sighting = max_graphs, capture_on_sighting
        self.microbatch_tokens = microbatch_tokens
        total = torch.cuda.get_device_properties(device).total_memory
        self.margin = max(2 << 30, total // 20) if margin is None else margin
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # every graph's (see BodyGraph)
        self.graphs: dict[GraphKey, BodyGraph] = {}
        self.banks: dict[int, MicrobatchBanks] = {}  # per group count, shared by the buckets of that count
        self.sightings: dict[GraphKey, int] = {}
        self.declined: set[GraphKey] = set()  # warmed up, then not captured: no room (they run eagerly)
        # The fewest tokens of a declined bucket: larger ones would hold more, so they are not even warmed up (each
        # warm-up is two eager steps). Graphs only ever add memory, so this only stays true.
        self.no_room_tokens: int | None = None
        self.captures = 0
        self.replays = 0
        self.memory_bytes = 0  # what the captures and their static buffers reserved on the device

    def graph(self, padded: PaddedMicrobatch) -> BodyGraph | None:
        key = padded.key
        found = self.graphs.get(key)
        if found is not None:
            self.replays += 1
            return found
        if len(self.graphs) >= self.max_graphs or key in self.declined:
            return None
        if self.no_room_tokens is not None and key.tokens >= self.no_room_tokens:
            return None
        self.sightings[key] = self.sightings.get(key, 0) + 1
        if self.sightings[key] < self.capture_on_sighting:
            return None
        torch.cuda.empty_cache()  # the eager path's cached blocks back to the device: the capture's pool takes its own
        before = torch.cuda.memory_reserved(self.device)
        new_banks = key.groups not in self.banks
        made = BodyGraph(
            key, self.run_body, self.context, self.max_rank, self.device, self.pool, self.elementwise,
            self._banks(key.groups), self.stream,
        )  # fmt: skip
        held = made.warm_up()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(self.device)[0]
        if not capture_fits(held, key.tokens, self.microbatch_tokens, free, self.margin):
            self.declined.add(key)
            self.no_room_tokens = min(key.tokens, self.no_room_tokens or key.tokens)
            if new_banks:
                del self.banks[key.groups]
            log.info("CUDA graph for %s not captured: its forward held %.2f GiB, %.2f GiB free on the device, and the "
                     "eager path keeps room for a %d-token microbatch and %.2f GiB; it runs eagerly", key, held / 2**30,
                     free / 2**30, self.microbatch_tokens, self.margin / 2**30)  # fmt: skip
            return None
        made.capture()
        self.memory_bytes += torch.cuda.memory_reserved(self.device) - before
        self.graphs[key] = made
        self.captures += 1
        self.replays += 1
        return made

    def _banks(self, groups: int) -> MicrobatchBanks:
        """The static banks of `groups` groups: bf16 weights and their fp32 gradients, for graphs only (the device's
        rank and scale: `single=False`)."""
        banks = self.banks.get(groups)
        if banks is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                banks = self.banks[groups] = MicrobatchBanks(
                    torch.zeros(groups, self.width, dtype=self.dtype, device=self.device),
                    torch.zeros(groups, self.width, dtype=torch.float32, device=self.device),
                    grouped=True,
                    single=False,
                )
        return banks

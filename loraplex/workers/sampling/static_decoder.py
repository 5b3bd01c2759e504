"""The native sampler's decode step: one token per row through the engine's model, on a static KV cache, with every
row's own adapter, replayed as one CUDA graph on the GPU (the same code runs eagerly on the CPU).

Why not the model's own forward with a DynamicCache: a decode step is launch-bound (a 4B model at 32 rows moves ~8 GB
of weights, ~2 ms on an H200, while the Python of one HF forward took ~80 ms). A graph needs static shapes and
addresses, so this module runs the decoder layers' own submodules (norms, projections, rotary embedding, MLP
activation) over buffers allocated once:

  * KV cache per layer [B, kv_heads, T, D]. Row b's cached tokens sit in columns [0, positions[b]); a step writes the
    new key/value at column positions[b] (scatter) and attends to columns <= positions[b] (a mask built in the graph
    from `positions`). Rows never move: a finished row's index is handed to the next sample, whose prompt KV is
    written over columns [0, L). Columns past a row's position are never read.
  * LoRA per row without contiguous groups: for the G adapters of the call, every LoRA point (the inputs that several
    projections share: q/k/v, gate/up; then o and down alone) holds A_cat [in, n * G * r] (each module's G A
    matrices side by side) and per module B_cat [G * r, out]; a step computes h = x @ A_cat once, multiplies it by
    the row mask [B, G * r] (row b: alpha_g / r_g on its adapter's block, 0 elsewhere; all 0 for a base row) and adds
    each module's h_block @ B_cat into the base output (addmm). Row b's delta is exactly ((x_b @ A_g) * c_g) @ B_g:
    the other blocks of h_b are zeros and contribute exact zeros (the slot banks' rank padding is zero as well).

Paged mode (`paged=True`, off by default): K/V live in a `PagedKvCache` instead of the dense per-row cache, each row
in the blocks of its block table (a `BlockAllocator` sized for every row at full width, plus one scratch block that
rows without a sample write to). A prompt's KV is written once into the blocks of a holder row (`prompt_slots`: the
sampler's prefill writes it there) and
every sample of it forks the holder's blocks (`set_row(..., prompt=key)`), so num_samples rows share one copy of the
prompt until each writes its first token (copy-on-write of a shared partial block). Before a step the host appends
each live row's position (`append`; copying a block where it says) and copies the block tables [rows, blocks per row]
to the device when a row gained a block; the step itself computes every row's write slot and length from its position
and attends with `paged_attention` (on CUDA a Triton kernel reading each row's own blocks), so it has static shapes and
is captured as a CUDA graph like the dense one.

Kernels: on CUDA where triton is, the RMSNorms, rotary embedding and silu gate run as the Triton kernels of
workers/kernels/triton_elementwise.py (one launch each instead of ~7, 10 and 2 small ones: the decode step at a few
hundred rows is made of such launches as much as of weight reads); elsewhere the model's own modules.

Semantics per step (plain torch, what `step` returns): fp32 logits [B, V] of the model with row b's adapter at
position positions[b] given the row's cache, i.e. what the model's own forward with that adapter gives for the same
token after the same prefix (tests compare it with transformers + PEFT generate). Supported: decoder layers shaped as
Llama / Qwen2 / Qwen3 (input_layernorm, self_attn with q/k/v/o projections and optional q_norm / k_norm, rotary
embedding, post_attention_layernorm, gated MLP), full attention.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loraplex.errors import EngineError
from loraplex.workers.engine.engine import Engine
from loraplex.workers.engine.stacked_weights import stacked_weight
from loraplex.workers.kernels.lora_expand import masked_expand, masked_expand_reference
from loraplex.workers.lora.routing import to_device
from loraplex.workers.lora.slot_bank import SlotBankLinear
from loraplex.workers.sampling.kv_blocks import BlockAllocator
from loraplex.workers.sampling.moe_decode import MoeDecodeMlp, check_moe_block, is_moe_block, mlp_linears
from loraplex.workers.sampling.paged_kv import PagedKvCache, paged_attention, slots_for

ATTENTION_INPUT = ("q_proj", "k_proj", "v_proj")
BLOCK_TOKENS = 16  # positions per block of the paged cache
MLP_INPUT = ("gate_proj", "up_proj")


def check_decodable(engine: Engine) -> None:
    """EngineError unless every decoder layer has the structure this decoder runs."""
    body: Any = engine.body
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(body, name):
            raise EngineError(f"the native sampler needs a Llama/Qwen-style decoder; this model has no {name!r}")
    for layer in body.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [getattr(attn, n, None) for n in (*ATTENTION_INPUT, "o_proj")]
        if mlp is not None and is_moe_block(mlp):
            check_moe_block(mlp)  # its routed experts run in moe_decode.py
        else:
            parts += [getattr(mlp, n, None) for n in (*MLP_INPUT, "down_proj")]
        if any(p is None for p in parts) or not hasattr(layer, "post_attention_layernorm"):
            raise EngineError("the native sampler needs decoder layers with q/k/v/o projections and a gated MLP")


def _fused_kernels(engine: Engine) -> Any:
    """The Triton RMSNorm, silu-gate and rotary kernels (workers/kernels/triton_elementwise.py) for the decode step on
    CUDA where triton is and every layer has what they compute (RMSNorms, a silu-gated dense MLP or an MoE block,
    whose experts moe_decode.py runs, rotary over the whole head dim a power of two); None elsewhere: the model's own
    modules (the reference the kernels are tested against)."""
    from loraplex.workers.kernels import fused_elementwise

    body: Any = engine.body
    dim = int(body.layers[0].self_attn.head_dim)
    norms = [body.norm] + [n for layer in body.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms += [getattr(layer.self_attn, n) for layer in body.layers for n in ("q_norm", "k_norm")
              if hasattr(layer.self_attn, n)]  # fmt: skip
    usable = (
        engine.device.type == "cuda"
        and fused_elementwise.available()
        and all(fused_elementwise.is_rms_norm(n) for n in norms)
        and all(is_moe_block(layer.mlp) or fused_elementwise.is_silu_gated_mlp(layer.mlp) for layer in body.layers)
        and dim & (dim - 1) == 0
        and float(getattr(engine.model.config, "partial_rotary_factor", 1.0) or 1.0) == 1.0
    )
    if not usable:
        return None
    from loraplex.workers.kernels import triton_elementwise

    return triton_elementwise


def _apply_rotary(attn: nn.Module) -> Any:
    """The layer's own modeling module's apply_rotary_pos_emb (each model family keeps its own copy)."""
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


@dataclass
class _LoraPoint:
    """Projections that read one input: their base Linears, and (with adapters) A_cat and B. stacked: the bases'
    weights as one [sum of out, in] buffer (engine/stacked_weights.py), so the base runs as one product whose column
    blocks are the outputs; None: one product per base. The LoRA expand adds into that product's columns
    (kernels/lora_expand.py: one kernel for the mask and every projection's expand)."""

    bases: list[nn.Module]
    wrapped: list[SlotBankLinear | None]  # None: not a LoRA target, the base alone
    stacked: torch.Tensor | None = None
    widths: tuple[int, ...] = ()  # each base's out width: the stacked product's column blocks
    a_cat: torch.Tensor | None = None  # [in, n_wrapped * G * r]: the wrapped projections' A blocks, in order
    b: torch.Tensor | None = None  # [G * r, sum of widths]: each wrapped projection's B in its columns (0 elsewhere)
    b_cats: list[torch.Tensor | None] | None = None  # per module its columns of `b` (None where not wrapped)
    segments: tuple[tuple[int, int], ...] = ()  # per wrapped projection its columns (lo, hi) of the outputs
    bounds: torch.Tensor | None = None  # `segments` on the device, for the kernel
    kernel: bool = False  # the expand as the Triton kernel where it runs (else the plain-torch reference)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
        full: torch.Tensor | None = None  # every output as one [rows, sum of widths] product
        if self.stacked is not None:
            full = F.linear(x, self.stacked)
            outs = list(full.split(self.widths, dim=1))  # column blocks: strided views
        else:
            outs = [base(x) for base in self.bases]
            full = outs[0] if len(outs) == 1 else None
        if self.a_cat is None or mask is None or self.b is None or self.b_cats is None:
            return outs
        h = x @ self.a_cat
        if full is not None:
            masked_expand(full, h, mask, self.b, self.segments, self.bounds, kernel=self.kernel)
            return outs
        width = mask.shape[1]  # separate outputs: each projection's expand on its own
        wrapped = [(out, b) for out, b in zip(outs, self.b_cats, strict=True) if b is not None]
        for k, (out, b_cat) in enumerate(wrapped):
            masked_expand_reference(out, h[:, k * width : (k + 1) * width], mask, b_cat, [(0, out.shape[1])])
        return outs


class StaticDecoder:
    """Decode buffers for `rows` rows, `width` cached positions and `slots` (the call's adapters' bank slots, in
    group order; empty: base model only). Reusable across `generate` calls with the same shape: `load` copies new
    adapters' weights into the same buffers (a captured graph keeps reading them). paged: keep K/V in a paged cache
    (see the module docstring) instead of the dense one."""

    def __init__(
        self,
        engine: Engine,
        rows: int,
        width: int,
        groups: int,
        paged: bool = False,
        block_tokens: int = BLOCK_TOKENS,
        fused: bool = True,
        num_blocks: int | None = None,
        expand_kernel: bool = False,
    ) -> None:
        check_decodable(engine)
        self.expand_kernel = expand_kernel  # the LoRA expand's Triton kernel on CUDA (else the plain-torch path)
        self.engine = engine
        self.rows, self.width, self.groups, self.paged = rows, width, groups, paged
        body: Any = engine.body
        self.body = body
        config: Any = engine.model.config
        device, dtype = engine.device, engine.compute_dtype
        self.rank = engine.max_rank
        attn0 = body.layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        self.kv_heads = int(config.num_key_value_heads)
        self.heads = int(config.num_attention_heads)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.blocks: BlockAllocator | None = None
        self.cache: PagedKvCache | None = None
        self.live_rows: set[int] = set()  # paged: rows holding a sample (their blocks are in `blocks`)
        self.adapter_rows: set[int] = set()  # rows whose sample has an adapter: none, and a step skips the LoRA path
        if paged:
            # num_blocks None: the worst case, every row reaching `width` positions, one prompt holder whose samples
            # all ended waiting for rows, and each row's own copy of its shared partial prompt block (else the
            # caller's budget, and admission waits for blocks). The extra last block is the scratch of rows without a
            # sample.
            per_row = -(-width // block_tokens)
            num_blocks = (rows + 1) * per_row + rows if num_blocks is None else num_blocks
            self.blocks = BlockAllocator(num_blocks, block_tokens)
            self.cache = PagedKvCache(
                len(body.layers), num_blocks + 1, block_tokens, self.kv_heads, self.head_dim, dtype, device
            )
            self.scratch = num_blocks
        else:
            self.keys = [
                torch.zeros(rows, self.kv_heads, width, self.head_dim, dtype=dtype, device=device) for _ in body.layers
            ]
            self.values = [torch.zeros_like(k) for k in self.keys]
        # Paged: every row's block table, [rows, blocks per row at full width]; the device copy a captured step reads,
        # and its host mirror, written as rows gain blocks and copied over before a step when it changed. A row
        # without a sample points at the scratch block.
        per_row_blocks = -(-width // block_tokens) if paged else 1
        self.table_host = np.zeros((rows, per_row_blocks), dtype=np.int32)  # numpy: written outside inference_mode too
        if paged:
            self.table_host[:, 0] = self.scratch
        self.tables = torch.from_numpy(self.table_host).to(device)
        self.tables_changed = False
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.columns = torch.arange(width, device=device)
        self.mask = torch.zeros(rows, groups * self.rank, dtype=torch.float32, device=device) if groups else None
        self.points: list[tuple[_LoraPoint, _LoraPoint, _LoraPoint, _LoraPoint]] = []
        for layer in body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            gate_up, down = mlp_linears(mlp)  # an MoE block: its shared expert's (or none)
            self.points.append(
                (
                    self._point([getattr(attn, n) for n in ATTENTION_INPUT]),
                    self._point([attn.o_proj]),
                    self._point(gate_up),
                    self._point(down),
                )
            )
        # MoE layers' MLP (routed experts with expert LoRA, then the shared expert on the points above); None: dense.
        self.moe = [
            MoeDecodeMlp(layer.mlp, p[2], p[3], groups, self.rank, dtype, device) if is_moe_block(layer.mlp) else None
            for layer, p in zip(body.layers, self.points, strict=True)
        ]
        self.rotary = [_apply_rotary(layer.self_attn) for layer in body.layers]
        self.head_weight = cast(torch.Tensor, engine.head.weight)
        self.fused = _fused_kernels(engine) if fused else None
        # Captured steps per (row bucket, LoRA path on): the step runs rows [0, bucket) only, and skips the LoRA side
        # path while no live row has an adapter. torch.cuda.CUDAGraph and its logits.
        self.graphs: dict[tuple[int, bool], tuple[Any, torch.Tensor]] = {}
        self.use_graphs = False  # set by `enable_graphs` (CUDA): a bucket's graph is captured at its first step
        self.pool: Any = None  # the graphs' shared memory pool (they never replay at once)

    def _point(self, modules: Sequence[nn.Module]) -> _LoraPoint:
        wrapped = [m if isinstance(m, SlotBankLinear) else None for m in modules]
        bases = [m.base if isinstance(m, SlotBankLinear) else m for m in modules]
        widths = tuple(int(cast(nn.Linear, b).out_features) for b in bases)
        point = _LoraPoint(bases, wrapped, stacked=stacked_weight(bases), widths=widths, kernel=self.expand_kernel)
        if self.groups and any(w is not None for w in wrapped):
            engine, g, r = self.engine, self.groups, self.rank
            n = sum(w is not None for w in wrapped)
            first = next(w for w in wrapped if w is not None)
            point.a_cat = torch.zeros(first.in_features, n * g * r, dtype=engine.compute_dtype, device=engine.device)
            point.b = torch.zeros(g * r, sum(widths), dtype=engine.compute_dtype, device=engine.device)
            starts = [sum(widths[:i]) for i in range(len(widths))]
            point.b_cats = [
                None if w is None else point.b[:, lo : lo + width]
                for w, lo, width in zip(wrapped, starts, widths, strict=True)
            ]
            point.segments = tuple(
                (lo, lo + width) for w, lo, width in zip(wrapped, starts, widths, strict=True) if w is not None
            )
            point.bounds = torch.tensor(point.segments, dtype=torch.int32, device=engine.device)
        return point

    # ---- per call ----------------------------------------------------------------------------------------------------
    def load(self, slots: Sequence[int]) -> None:
        """Copy the adapters in these bank slots (group order) into the LoRA buffers: the weights this call samples
        from, frozen for the call whatever trains meanwhile."""
        if len(slots) != self.groups:
            raise ValueError(f"this decoder holds {self.groups} adapters, got {len(slots)} slots")
        if not slots:
            return
        for group, slot in enumerate(slots):
            self.load_group(group, slot)
        if self.mask is not None:
            self.mask.zero_()

    def free(self) -> None:
        """Drop the cache and the captured graphs (a decoder replaced by a wider one); it decodes nothing after."""
        self.graphs.clear()
        self.keys, self.values, self.cache, self.pool = [], [], None, None

    def load_group(self, group: int, slot: int) -> None:
        """Copy the adapter in bank slot `slot` into LoRA group `group` of the buffers (the other groups unchanged:
        rows of other adapters keep decoding); a row's mask entries are set by `set_row`."""
        if not 0 <= group < self.groups:
            raise ValueError(f"this decoder holds {self.groups} adapters, not group {group}")
        self.engine.optimizer.adopt_views()
        r = self.rank
        for layer_points in self.points:
            for point in layer_points:
                if point.a_cat is None or point.b_cats is None:
                    continue
                block = 0
                for w, b_cat in zip(point.wrapped, point.b_cats, strict=True):
                    if w is None or b_cat is None:
                        continue
                    start = (block * self.groups + group) * r
                    point.a_cat[:, start : start + r].copy_(w.lora_A.detach()[slot])
                    b_cat[group * r : (group + 1) * r].copy_(w.lora_B.detach()[slot])
                    block += 1
        for moe in self.moe:
            if moe is not None:
                moe.load_group(group, slot)

    def prompt_slots(self, key: Any, prompt: Sequence[int]) -> torch.Tensor:
        """Paged: blocks for a prompt held by holder row `key`, for its samples to fork (`set_row(..., prompt=key)`);
        returns the cache slot of each prompt position (int64 [L] on the device), where the caller writes the prompt's
        K/V (the sampler's packed prefill writes them there layer by layer). `drop_prompt(key)` once every sample has
        forked."""
        if self.blocks is None:
            raise ValueError("only a paged decoder holds prompts")
        if len(prompt) >= self.width:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit {self.width} cached positions")
        self.blocks.admit(("prompt", key), prompt, 0)
        table = torch.tensor(self.blocks.table(("prompt", key)), dtype=torch.int64, device=self.engine.device)
        positions = torch.arange(len(prompt), device=self.engine.device)
        return slots_for(table.expand(len(prompt), -1), positions, self.blocks.block_tokens)

    def drop_prompt(self, key: Any) -> None:
        """Paged: the holder row of `key` ends (its blocks stay with the samples that forked them)."""
        if self.blocks is not None:
            self.blocks.free(("prompt", key))

    def end_row(self, row: int) -> None:
        """Row `row`'s sample ended: paged, its blocks go back (dense: nothing to do, the row is simply reused)."""
        if self.blocks is not None and row in self.live_rows:
            self.live_rows.discard(row)
            self.blocks.free(row)
            self.table_host[row, 0] = self.scratch
            self.tables_changed = True
        self.adapter_rows.discard(row)

    def set_row(
        self,
        row: int,
        group: int | None,
        scale: float,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        prompt: Any = None,
        max_new: int = 0,
    ) -> None:
        """Row `row` now holds a new sample of group `group` (None: the base model). Dense: with this prompt KV (per
        layer [kv_heads, L, D]); its next step feeds position L. Paged: the row forks holder `prompt`
        (`prompt_slots`) instead, allowed `max_new` more positions; its next step feeds the prompt's length."""
        if self.blocks is not None:
            if prompt is None:
                raise ValueError("a paged decoder's row forks a held prompt: pass prompt=")
            self.end_row(row)
            self.blocks.fork(("prompt", prompt), row, max_new)
            self.live_rows.add(row)
            table = self.blocks.table(row)
            self.table_host[row, : len(table)] = table
            self.tables_changed = True
        else:
            if kv is None:
                raise ValueError("a dense decoder's row takes its prompt KV: pass kv=")
            length = int(kv[0][0].shape[-2])
            if length >= self.width:
                raise ValueError(f"a prompt of {length} tokens does not fit {self.width} cached positions")
            for layer, (k, v) in enumerate(kv):
                self.keys[layer][row, :, :length] = k
                self.values[layer][row, :, :length] = v
        self.adapter_rows.discard(row)
        if self.mask is not None:
            self.mask[row].zero_()
            if group is not None:
                self.mask[row, group * self.rank : (group + 1) * self.rank] = scale
                self.adapter_rows.add(row)

    # ---- one step ----------------------------------------------------------------------------------------------------
    def _norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None:
            return cast(torch.Tensor, module(x))
        return cast(torch.Tensor, self.fused.rms_norm(x, module.weight, module.variance_epsilon))

    def _rope(self, layer: int, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        """q [B, Hq, D], k [B, Hkv, D], cos/sin [B, D] -> rotated (q, k), the model's own rotary maths."""
        if self.fused is not None:
            return self.fused.rope(q, k, cos, sin)
        qr, kr = self.rotary[layer](q.unsqueeze(2), k.unsqueeze(2), cos[:, None], sin[:, None])
        return qr[:, :, 0], kr[:, :, 0]

    def _forward(self, rows: int, lora: bool = True) -> torch.Tensor:
        """The step for rows [0, rows) of the buffers; lora False: the base model alone (no row has an adapter)."""
        body, heads, kv_heads, dim = self.body, self.heads, self.kv_heads, self.head_dim
        mask = None if self.mask is None or not lora else self.mask[:rows]
        positions, tables = self.positions[:rows], self.tables[:rows]
        hidden = body.embed_tokens(self.tokens[:rows])  # [B, H]
        pos = positions.view(rows, 1)
        cos, sin = body.rotary_emb(hidden[:, None], pos)
        cos, sin = cos.view(rows, -1), sin.view(rows, -1)
        if self.cache is not None:
            # rows without a sample sit at position 0 of the scratch block (their tables' first column)
            bt = self.cache.block_tokens
            slots = tables.gather(1, pos // bt).view(rows).long() * bt + positions % bt
            lengths = positions + 1
        else:
            visible = (self.columns[None, :] <= pos).view(rows, 1, 1, self.width)
            write = pos.view(rows, 1, 1, 1).expand(rows, kv_heads, 1, dim)
        for i, layer in enumerate(body.layers):
            attn_in, o_point, mlp_in, down_point = self.points[i]
            attn, mlp = layer.self_attn, layer.mlp
            x = self._norm(layer.input_layernorm, hidden)
            q, k, v = attn_in(x, mask)
            q, k, v = q.view(rows, heads, dim), k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim)
            if hasattr(attn, "q_norm"):
                q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
            q, k = self._rope(i, q, k, cos, sin)
            if self.cache is not None:
                self.cache.write(i, slots, k, v)
                paged = paged_attention(q, self.cache.k[i], self.cache.v[i], tables, lengths, scale=attn.scaling)
                attended = paged.reshape(rows, heads * dim)
            else:
                keys, values = self.keys[i][:rows], self.values[i][:rows]
                keys.scatter_(2, write, k[:, :, None])
                values.scatter_(2, write, v[:, :, None])
                out = F.scaled_dot_product_attention(
                    q[:, :, None], keys, values, attn_mask=visible, scale=attn.scaling, enable_gqa=True
                )
                attended = out.reshape(rows, heads * dim)
            (o,) = o_point(attended, mask)
            hidden = hidden + o
            x = self._norm(layer.post_attention_layernorm, hidden)
            moe = self.moe[i]
            if moe is not None:
                hidden = hidden + moe(x, mask)
                continue
            gate, up = mlp_in(x, mask)
            act = mlp.act_fn(gate) * up if self.fused is None else self.fused.silu_mul(gate, up)
            (down,) = down_point(act, mask)
            hidden = hidden + down
        return F.linear(self._norm(body.norm, hidden), self.head_weight).float()

    def enable_graphs(self) -> None:
        """On CUDA: replay each row bucket's step as a CUDA graph from now on, captured at the bucket's first step."""
        self.use_graphs = self.engine.device.type == "cuda"

    def bucket(self, rows: int) -> int:
        """The rows a step over rows [0, rows) runs: with graphs the next power of two from 8, at most the decoder's
        rows (one graph per bucket; rows past the live ones are idle: they write and read the scratch block, or their
        own dense row, and their logits are ignored); eagerly exactly `rows`."""
        if not self.use_graphs:
            return rows
        return min(self.rows, max(8, 1 << (max(rows, 1) - 1).bit_length()))

    def _capture(self, rows: int, lora: bool) -> tuple[Any, torch.Tensor]:
        """Record the step of rows [0, rows) as one graph (after two warm-up runs on a side stream, as torch's docs
        ask). The warm-ups run the very step about to be replayed (its inputs are in place: a step writes each row's
        new K/V before attending, so running it again writes the same values)."""
        device = self.engine.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(rows, lora)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local (as the training graphs): the pool's background writers copy adapter rows to host on their own
        # stream meanwhile (PinnedStaging.to_host), and in the default global mode their event waits invalidate this
        # capture and fail themselves (tests/gpu/test_sampler_cuda.py)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._forward(rows, lora)
        self.graphs[rows, lora] = (graph, logits)
        return graph, logits

    def step(self, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """fp32 logits [len(tokens), V] for one token per row of rows [0, len(tokens)) (rows without a sample feed
        anything; ignore their logits). The returned tensor is overwritten by the next step."""
        device = self.engine.device
        count, n = len(tokens), self.bucket(len(tokens))
        tokens = [*tokens, *[0] * (n - len(tokens))]
        positions = [*positions, *[0] * (n - len(positions))]
        if self.blocks is not None:
            live = self.live_rows
            positions = [p if r in live else 0 for r, p in enumerate(positions)]  # the scratch block's position 0
            self._page(positions)
        self.tokens[:n].copy_(to_device(torch.tensor(tokens, dtype=torch.int64), device))
        self.positions[:n].copy_(to_device(torch.tensor(positions, dtype=torch.int64), device))
        lora = bool(self.adapter_rows)
        if not self.use_graphs:
            logits = self._forward(n, lora)
        else:
            graph, logits = self.graphs.get((n, lora)) or self._capture(n, lora)
            graph.replay()
        return logits[:count]

    def _page(self, positions: Sequence[int]) -> None:
        """Paged: give each live row its next position (copying a shared block first where the allocator says) and
        bring the device's block tables up to date; the step computes the write slots and lengths from the positions.
        Rows without a sample must feed position 0 (they write to and attend to the scratch block)."""
        assert self.blocks is not None and self.cache is not None
        blocks, bt = self.blocks, self.blocks.block_tokens
        copies = []
        for row in self.live_rows:
            position = positions[row]
            if blocks.length(row) != position:
                raise ValueError(f"row {row} feeds position {position} but holds {blocks.length(row)}")
            cow = blocks.append(row)
            if cow is not None:
                copies.append(cow)
            if cow is not None or position % bt == 0:  # the row's last block is new: its table changed
                self.table_host[row, position // bt] = blocks.slot(row, position) // bt
                self.tables_changed = True
        if copies:
            device = self.engine.device
            src = torch.tensor([c.src for c in copies], dtype=torch.int64, device=device)
            dst = torch.tensor([c.dst for c in copies], dtype=torch.int64, device=device)
            self.cache.copy_blocks(src, dst)
        if self.tables_changed:
            self.tables.copy_(torch.from_numpy(self.table_host))
            self.tables_changed = False


class PromptWriter:
    """What the sampler's packed prefill passes as the body's `past_key_values` (a paged decoder's prompts): each
    attention layer's `update` stores the chunk's keys and values ([1, kv_heads, N, D], after the norm and rotary
    embedding) at their cache slots and hands them back unchanged, so the layer attends over the chunk alone (its
    prompts start at position 0). history: a long prompt's next piece, the cache slots of every position of the prompt
    up to the piece's end; the layer then gets all those keys and values back (the earlier pieces' from the cache),
    and the packed attention's continuation path attends over them."""

    def __init__(self, decoder: StaticDecoder, slots: torch.Tensor, history: torch.Tensor | None = None) -> None:
        self.decoder = decoder
        self.slots = slots  # [N]
        self.history = history  # [Lk] or None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        cache = self.decoder.cache
        assert cache is not None
        cache.write(layer_idx, self.slots, keys[0].transpose(0, 1), values[0].transpose(0, 1))
        if self.history is None:
            return keys, values
        k, v = cache.k[layer_idx], cache.v[layer_idx]
        k_all = k.view(-1, *k.shape[2:]).index_select(0, self.history)  # [Lk, kv_heads, D]
        v_all = v.view(-1, *v.shape[2:]).index_select(0, self.history)
        return k_all.transpose(0, 1).unsqueeze(0), v_all.transpose(0, 1).unsqueeze(0)

    # What transformers' mask builders read from a cache: models without a per-layer-type mask mapping (Qwen3-MoE)
    # build a causal mask even for a packed row, which the packed attention ignores (it attends within cu_seqlens).
    # The chunk has no past: it starts at offset 0 and its keys are its own tokens.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, q_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return q_length, 0

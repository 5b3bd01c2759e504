"""Attention over packed rows: one [1, N] token stream holding S sequences back to back, no padding.

The engine's packed microbatch (workers/engine/engine.py, layout in `batching.packed_layout`) concatenates its sequences into
one row; RoPE positions restart at 0 for each sequence, and the sequences' boundaries travel as `cu_seqlens` (int32
[S+1], cumulative lengths from 0 to N) and the longest length. They reach every attention call through the body's
forward: transformers (5.x) passes the model forward's **kwargs down to each attention function, under the names of its
flash-attention varlen path (`cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q`, `max_length_k`), which
`packed_forward_kwargs` fills.

Semantics, in plain torch (`packed_attention_reference`, also the CPU path): for each sequence i with rows [s_i, e_i),
out[s_i:e_i] = causal scaled-dot-product attention of q[s_i:e_i] over k[s_i:e_i], v[s_i:e_i]; query head h reads key /
value head h // (H / H_kv) (grouped-query heads). No token sees another sequence. Equal to the padded layout's
attention for each sequence's real tokens (right padding: causal attention keeps a real token blind to the pads after it).

Where every sequence of the row has one length L (`packed_forward_kwargs(..., uniform=True)`; the engine's saturated
microbatches, 8 x 512), the row is S x L: `uniform_attention` views q / k / v as [S, H, L, D] (no copy) and runs one
dense causal F.scaled_dot_product_attention, the kernel the frozen base's padded batch gets (cuDNN on Hopper), which
takes the grouped-query heads without summing dk / dv over each group afterwards.

Kernels (`packed_attention`): CUDA in bf16/fp16 with `torch.nn.attention.varlen.varlen_attn` (flash varlen; causal is
window_size=(-1, 0); grouped-query heads passed as they are, with `enable_gqa` where that torch asks for it: torch
2.11 has no such flag and passes them on); anything else (CPU, fp32, a torch without varlen_attn) the
reference loop.

`install_packed_attention(model)` registers the function with transformers' AttentionInterface (and sdpa's mask
function under the same name with AttentionMaskInterface) and switches the model to it. A call without `cu_seq_lens_q`
(the sampler's prefill, workers/sampling/sampler.py; anything else using the model) is handed to transformers' own sdpa
function with its arguments unchanged, and gets sdpa's masks: exactly what the model computed before. The packed
forward passes the mask mapping itself, every entry None (`packed_forward_kwargs`), so transformers builds no [N, N]
mask and does not run its packed-sequence detection on the restarting position ids (a device-to-host sync)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ATTENTION = "loraplex_packed"  # the attention implementation's name in transformers' registries
UNIFORM = "loraplex_uniform"  # the forward kwarg saying every packed sequence is max_length long
FALLBACK_ATTENTION = "sdpa"  # what a call without cu_seqlens runs (the implementation the model had before)


# ---- the kernels ---------------------------------------------------------------------------------------------------
def packed_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Sequence[int], scale: float | None = None
) -> torch.Tensor:
    """q [T, H, D], k / v [T, H_kv, D] (H a multiple of H_kv), cu_seqlens the S+1 cumulative offsets (host ints) ->
    [T, H, D]: one causal F.scaled_dot_product_attention per sequence (see the module doc). `scale`: None = 1/sqrt(D)."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L, D]
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


@cache
def _varlen() -> tuple[Any, bool] | None:
    """(varlen_attn, whether it takes enable_gqa), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_available(t: torch.Tensor) -> bool:
    """Whether `packed_attention` runs `t` (a query [T, H, D]) through varlen_attn: CUDA, bf16 or fp16, a head size
    flash attention takes (a multiple of 8, at most 256), a torch that has it."""
    half = t.dtype in (torch.bfloat16, torch.float16)
    return t.is_cuda and half and t.shape[-1] % 8 == 0 and t.shape[-1] <= 256 and _varlen() is not None


def packed_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_length: int,
    scale: float | None = None,
) -> torch.Tensor:
    """`packed_attention_reference` through torch.nn.attention.varlen.varlen_attn (CUDA, bf16/fp16): cu_seqlens int32
    [S+1] on q's device, max_length the longest sequence (a host int)."""
    found = _varlen()
    if found is None:
        raise RuntimeError("this torch has no torch.nn.attention.varlen.varlen_attn")
    varlen_attn, has_gqa = found
    # Grouped-query heads go to flash-attention as they are (its varlen kernels read kv head h // group for query
    # head h, and the backward sums dk/dv over the group). Newer torches ask for enable_gqa before they pass them on;
    # torch 2.11 has no such flag and passes them straight through (GPU test: test_packed_attention_cuda's GQA cases).
    extra: dict[str, Any] = {"enable_gqa": True} if has_gqa and k.shape[1] != q.shape[1] else {}
    q, k, v = (t.contiguous() for t in (q, k, v))
    return varlen_attn(
        q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, scale=scale, window_size=(-1, 0), **extra
    )


def packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_length: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence (module doc): varlen_attn where `varlen_available`, else the loop."""
    if varlen_available(q):
        return packed_attention_varlen(q, k, v, cu_seqlens, max_length, scale)
    return packed_attention_reference(q, k, v, [int(x) for x in cu_seqlens.tolist()], scale)


def uniform_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, scale: float | None = None
) -> torch.Tensor:
    """`packed_attention_reference` where every sequence is `length` long (q [N, H, D], k / v [N, H_kv, D], any
    strides -> [N, H, D]), through one dense causal SDPA over the S = N / length sequences as a batch."""
    n, heads, dim = q.shape
    if n % length:
        raise ValueError(f"{n} packed rows are not sequences of {length}")
    qs, ks, vs = (t.unflatten(0, (n // length, length)).transpose(1, 2) for t in (q, k, v))  # [S, heads, L, D] views
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=heads != k.shape[1])
    return out.transpose(1, 2).reshape(n, heads, dim)


def continuation_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, block: int | None = None
) -> torch.Tensor:
    """One sequence's next piece: q [Lq, H, D] the piece's last Lq positions, k / v [Lk, H_kv, D] every position up to
    the piece's end (Lk >= Lq; the earlier ones from a cache) -> [Lq, H, D], query t seeing keys 0 .. Lk - Lq + t (causal
    aligned to the bottom right: what the whole sequence's causal attention gives its last Lq rows). Plain
    F.scaled_dot_product_attention with an explicit mask, `block` queries at a time (default: as many as keep a
    block's scores, heads x queries x keys, at 2^27 values, should SDPA fall back to its math kernel) so the mask and
    the scores stay small; only a prompt longer than the sampler's prefill chunk takes this path."""
    lq, lk = q.shape[0], k.shape[0]
    block = block or max(16, (1 << 27) // max(1, q.shape[1] * lk))
    if lk < lq:
        raise ValueError(f"a continuation has at least as many keys as queries (got {lk} keys, {lq} queries)")
    gqa = q.shape[1] != k.shape[1]
    ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (k, v))  # [1, H_kv, Lk, D]
    columns = torch.arange(lk, device=q.device)
    outs = []
    for start in range(0, lq, block):
        rows = torch.arange(start, min(start + block, lq), device=q.device) + (lk - lq)
        mask = columns[None, :] <= rows[:, None]
        qs = q[start : start + block].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


# ---- transformers' attention interface -----------------------------------------------------------------------------
def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An AttentionInterface function. query [1, H, N, D], key / value [1, H_kv, N, D] (after RoPE) -> ([1, N, H, D],
    None), as transformers' sdpa function returns them. With `cu_seq_lens_q` in kwargs: packed attention (module doc);
    without: transformers' sdpa function, every argument passed on unchanged."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[FALLBACK_ATTENTION](module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    if kwargs.get("sliding_window") is not None or float(kwargs.get("dropout") or 0.0) != 0.0:
        raise ValueError("packed attention supports neither a sliding window nor attention dropout")
    # [N, heads, D] views. squeeze, not [0]: indexing's backward writes each gradient into a new zero-filled
    # [1, heads, N, D] (an allocation, a fill and a copy per tensor and layer, in the heads-first layout).
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))
    scale = kwargs.get("scaling")
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and (cu_k.data_ptr() != cu.data_ptr() or cu_k.shape != cu.shape):
        # One sequence's next piece over its earlier positions (the sampler's prefill of a long prompt, its cache
        # handing back every key so far): cu_seq_lens_q = [0, Lq], cu_seq_lens_k = [0, Lk].
        if cu.numel() != 2 or cu_k.numel() != 2:
            raise ValueError("packed attention over keys other than the queries' takes one sequence")
        return continuation_attention(q, k, v, scale).unsqueeze(0), None
    max_length = kwargs.get("max_length_q")
    max_length = int(max_length) if max_length is not None else int((cu[1:] - cu[:-1]).max())
    if kwargs.get(UNIFORM):
        return uniform_attention(q, k, v, max_length, scale).unsqueeze(0), None
    # attention_mask: None from the engine's packed forward; a mask transformers built (a model that takes no prepared
    # mask mapping) describes the same block-causal pattern, which cu_seqlens already gives.
    return packed_attention(q, k, v, cu, max_length, scale).unsqueeze(0), None


@cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS[FALLBACK_ATTENTION])


def install_packed_attention(model: nn.Module) -> None:
    """Switch a transformers model from sdpa to the packed attention (idempotent). ValueError for a model whose
    attention is not sdpa: a call without cu_seqlens falls back to sdpa, so it would change what that model computes."""
    _register()
    config: Any = model.config
    current = getattr(config, "_attn_implementation", None)
    if current == PACKED_ATTENTION:
        return
    if current != FALLBACK_ATTENTION:
        raise ValueError(
            f"the engine's packed attention replaces sdpa; this model's attention implementation is {current!r} "
            "(load it with attn_implementation='sdpa')"
        )
    model.set_attn_implementation(PACKED_ATTENTION)  # type: ignore[operator]


def packed_forward_kwargs(
    config: Any, cu_seqlens: torch.Tensor, max_length: int, uniform: bool = False
) -> dict[str, Any]:
    """What the body's forward takes for a packed row: the boundaries under transformers' flash-varlen names, and the
    attention mask mapping given directly (None for each of the config's layer types) where the model takes one
    (Qwen2/Qwen3: `layer_types`), so transformers neither builds a mask nor inspects the position ids. `uniform`:
    every sequence is `max_length` long (the dense path, `uniform_attention`)."""
    kwargs: dict[str, Any] = {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }
    if uniform:
        kwargs[UNIFORM] = True
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kwargs["attention_mask"] = dict.fromkeys(layer_types)
    return kwargs

"""Packed attention and the packed engine on CUDA (bf16): torch.nn.attention.varlen.varlen_attn, and the dense path for
rows of one length, against the per-sequence causal SDPA loop (the plain-torch reference), forward and backward, at Qwen3-4B's heads (32 q / 8 kv,
head dim 128) and the tiny preset's; and a packed engine step against the padded one.

Tolerance: bf16's, stated relative to the bf16 reference. Both bf16 paths are measured against the same computation in
fp64 (the SDPA loop on fp64 copies of the same inputs); the varlen error must stay within 2x the bf16 SDPA loop's error
+ 1e-3 (outputs) and 2x + 1e-3 of the largest |gradient| (q, k, v gradients). The engine: the packed bf16 engine's
logprobs and LoRA gradients within 2x the padded bf16 engine's error against an fp32 oracle (+ 1e-3), as
test_lora_grouped_cuda checks grouped_mm.

Run on the GPU machine: `python -m pytest -q -m gpu tests/gpu/test_packed_attention_cuda.py -s` (-s prints the errors)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loraplex.models.presets import build_from_config, qwen3_config
from loraplex.workers.engine.batching import packed_layout
from loraplex.workers.engine.build import build_engine
from loraplex.workers.engine.config import EngineConfig
from loraplex.workers.engine.engine import Engine
from loraplex.workers.kernels import packed_attention as pa
from tests.helpers.calls import CallCount
from tests.helpers.datums import with_datums
from tests.helpers.gpu import CUDA, add_four_adapters, flat_logprobs, random_data

RAGGED = [37, 900, 128, 2048, 64, 511, 300, 108, 1, 17]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "lengths"),
    [(32, 8, 128, [512] * 8), (32, 8, 128, RAGGED), (4, 2, 16, RAGGED), (16, 16, 64, [5, 300, 1, 77])],
    ids=["qwen3-4b-8x512", "qwen3-4b-ragged", "tiny-ragged", "mha-ragged"],
)
def test_varlen_equals_the_per_sequence_sdpa_reference_in_bf16(
    heads: int, kv_heads: int, dim: int, lengths: list[int]
) -> None:
    g = torch.Generator(device="cuda").manual_seed(heads + dim + len(lengths))
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, dim, device=CUDA, generator=g) for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(n, heads, dim, device=CUDA, generator=g)
    lay = packed_layout(lengths)
    cu = lay.cu_seqlens.to(CUDA)
    scale = dim**-0.5
    q16, k16, v16 = (t.bfloat16().requires_grad_() for t in (q, k, v))
    assert pa.varlen_available(q16), "varlen_attn is not used on this GPU: the engine would run the SDPA loop"

    def run(fn: Any, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        x = (
            [t.detach().to(dtype).requires_grad_() for t in (q16, k16, v16)]
            if dtype != torch.bfloat16
            else [q16, k16, v16]
        )
        out = fn(*x)
        return (out, *torch.autograd.grad(out, x, grad.to(dtype)))

    exact = run(lambda a, b, c: pa.packed_attention_reference(a, b, c, lay.cu_seqlens.tolist(), scale), torch.float64)
    loop = run(lambda a, b, c: pa.packed_attention_reference(a, b, c, lay.cu_seqlens.tolist(), scale), torch.bfloat16)
    varlen = run(lambda a, b, c: pa.packed_attention_varlen(a, b, c, cu, lay.max_length, scale), torch.bfloat16)
    assert varlen[0].dtype == torch.bfloat16 and varlen[0].shape == (n, heads, dim)
    for name, want, lo, va in zip(("out", "dq", "dk", "dv"), exact, loop, varlen, strict=True):
        size = float(want.detach().abs().max())
        err_loop, err_varlen = _max_err(lo, want), _max_err(va, want)
        print(f"{name}: max |bf16 - fp64| SDPA loop {err_loop:.3g}, varlen {err_varlen:.3g} (max |value| {size:.3g})")
        assert err_varlen <= 2 * err_loop + 1e-3 * max(1.0, size), name
    print(f"varlen vs SDPA loop (both bf16), out: {_max_err(varlen[0], loop[0]):.3g}")


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "lengths"), [(32, 8, 128, [512] * 8), (4, 2, 16, [300] * 3)])
def test_the_dense_path_for_uniform_rows_equals_the_reference_in_bf16(
    heads: int, kv_heads: int, dim: int, lengths: list[int]
) -> None:
    """uniform_attention (one dense causal SDPA, whatever backend torch picks) held to the varlen test's rule."""
    g = torch.Generator(device="cuda").manual_seed(heads + dim)
    n, length = sum(lengths), lengths[0]
    q, k, v = (torch.randn(n, h, dim, device=CUDA, generator=g) for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(n, heads, dim, device=CUDA, generator=g)
    cu = packed_layout(lengths).cu_seqlens.tolist()
    scale = dim**-0.5

    def run(fn: Any, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*x)
        return (out, *torch.autograd.grad(out, x, grad.to(dtype)))

    exact = run(lambda a, b, c: pa.packed_attention_reference(a, b, c, cu, scale), torch.float64)
    loop = run(lambda a, b, c: pa.packed_attention_reference(a, b, c, cu, scale), torch.bfloat16)
    dense = run(
        lambda a, b, c: pa.uniform_attention(a, b, c, length, scale),
        torch.bfloat16,
    )
    for name, want, lo, de in zip(("out", "dq", "dk", "dv"), exact, loop, dense, strict=True):
        size = float(want.detach().abs().max())
        err_loop, err_dense = _max_err(lo, want), _max_err(de, want)
        print(f"{name}: max |bf16 - fp64| SDPA loop {err_loop:.3g}, dense {err_dense:.3g} (max |value| {size:.3g})")
        assert err_dense <= 2 * err_loop + 1e-3 * max(1.0, size), name


def _small_qwen3(dtype: torch.dtype) -> torch.nn.Module:
    """A 2-layer Qwen3 with Qwen3-4B's head size (128) and grouped-query heads (4 q / 2 kv), seeded init."""
    shape = dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    return build_from_config(qwen3_config(shape), dtype, CUDA)


def _engine(dtype: torch.dtype, packed: bool) -> Engine:
    e = build_engine(_small_qwen3(dtype), EngineConfig(num_slots=6, max_rank=16, microbatch_tokens=512, packed=packed))
    return add_four_adapters(e)


def test_packed_engine_step_equals_padded_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 adapters, ragged datums (1-400 tokens, several microbatches of 512 tokens), 2 steps with AdamW: the packed
    bf16 engine (varlen_attn) is as close to the fp32 oracle as the padded bf16 engine."""
    varlen = CallCount(monkeypatch, pa, "packed_attention_varlen")
    oracle, padded, packed = (
        _engine(torch.float32, False),
        _engine(torch.bfloat16, False),
        _engine(torch.bfloat16, True),
    )
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        items = []
        for m in "abcd":
            lengths = torch.randint(1, 400, (3,), generator=g).tolist()
            items.append((m, [d for n in lengths for d in random_data(g, 1, n)], "cross_entropy", None, False))
        outs = [e.forward_backward([e.prepare(*with_datums(it)) for it in items]) for e in (oracle, padded, packed)]
        lp_oracle, lp_padded, lp_packed = (flat_logprobs(o) for o in outs)
        err_padded, err_packed = _max_err(lp_padded, lp_oracle), _max_err(lp_packed, lp_oracle)
        print(f"step {step}: max |logprob - fp32 oracle|: padded bf16 {err_padded:.3g}, packed bf16 {err_packed:.3g}")
        assert err_packed <= 2 * err_padded + 1e-3
        for m in "abcd":
            want = oracle.adapter_grads(m)
            for name, (ga, gb) in want.items():
                size = max(float(ga.abs().max()), float(gb.abs().max()), 1e-6)
                got_pad, got_pack = padded.adapter_grads(m)[name], packed.adapter_grads(m)[name]
                e_pad = max(_max_err(x, w) for x, w in zip(got_pad, (ga, gb), strict=True)) / size
                e_pack = max(_max_err(x, w) for x, w in zip(got_pack, (ga, gb), strict=True)) / size
                assert e_pack <= 2 * e_pad + 1e-3, (
                    f"{m} {name}: relative gradient error packed {e_pack:.3g}, padded {e_pad:.3g}"
                )
        for e in (oracle, padded, packed):
            assert all("metrics" in r for r in e.optim_step([(m, {"learning_rate": 1e-3}) for m in "abcd"]))
    assert varlen.calls > 0  # the packed engine's attention ran through varlen_attn


@pytest.mark.parametrize(("lq", "lk"), [(512, 2048), (1000, 1000), (3, 4099)])
def test_continuation_attention_on_cuda_equals_the_whole_sequences_last_rows(lq: int, lk: int) -> None:
    """The sampler's long-prompt pieces on CUDA in bf16 (Qwen3-4B heads: 32 query, 8 key/value, 128 wide): within bf16
    rounding of the whole sequence's causal attention (fp32) at the piece's positions."""
    g = torch.Generator(device="cuda").manual_seed(lq + lk)
    q, k, v = (torch.randn(lk, h, 128, device=CUDA, generator=g) for h in (32, 8, 8))
    scale = 128**-0.5
    whole = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    got = pa.continuation_attention(*(t.bfloat16() for t in (q[lk - lq :], k, v)), scale)
    assert (got.float() - whole[lk - lq :]).abs().max().item() < 3e-2

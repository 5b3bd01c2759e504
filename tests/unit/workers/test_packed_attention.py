"""workers/kernels/packed_attention.py and the packed layout (workers/engine/batching.py): the per-sequence loop equals dense
block-causal attention (grouped-query heads included, gradients too), the varlen path's argument mapping (with a
stand-in varlen_attn: the real one is CUDA-only, tests/gpu/test_packed_attention_cuda.py), the AttentionInterface
function, and a model switched to it: without cu_seqlens bit-identical to sdpa, packed equal to each sequence alone."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from loraplex.models import load_base_model
from loraplex.workers.engine.batching import SeqRef, packed_layout, split_microbatches
from loraplex.workers.kernels import packed_attention as pa
from tests.helpers.calls import CallCount


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + block-causal mask) v over the whole packed row, in fp64, kv heads repeated."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(q.shape[0])
    allowed = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def random_qkv(lengths: list[int], heads: int, kv_heads: int, dim: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return [torch.randn(n, h, dim, generator=g).requires_grad_() for h in (heads, kv_heads, kv_heads)]


def test_packed_layout_restarts_positions_and_offsets_per_sequence() -> None:
    lay = packed_layout([3, 1, 4])
    assert lay.positions.tolist() == [0, 1, 2, 0, 0, 1, 2, 3] and lay.positions.dtype == torch.int64
    assert lay.cu_seqlens.tolist() == [0, 3, 4, 8] and lay.cu_seqlens.dtype == torch.int32
    assert lay.max_length == 4 and lay.num_tokens == 8 and not lay.uniform
    assert packed_layout([5, 5, 5]).uniform and packed_layout([7]).uniform
    for bad in ([], [2, 0]):
        with pytest.raises(ValueError):
            packed_layout(bad)


def test_split_cuts_packed_microbatches_by_real_tokens_and_padded_ones_by_count_times_longest() -> None:
    seqs = [SeqRef(0, j, n) for j, n in enumerate([3, 40, 3, 3, 60, 2])]

    def lengths(mbs: list[list[SeqRef]]) -> list[list[int]]:
        return [[s.length for s in mb] for mb in mbs]

    assert lengths(split_microbatches(seqs, 48)) == [[3, 40, 3], [3], [60], [2]]  # 60 > 48: alone
    assert lengths(split_microbatches(seqs, 48, packed=False)) == [[3], [40], [3, 3], [60], [2]]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 6), (8, 1)])
def test_reference_loop_equals_dense_block_causal_attention_with_gradients(heads: int, kv_heads: int) -> None:
    lengths = [5, 1, 17, 9, 2]
    q, k, v = random_qkv(lengths, heads, kv_heads, 16, seed=heads)
    scale = 0.3
    cu = packed_layout(lengths).cu_seqlens
    got = pa.packed_attention(q, k, v, cu, max(lengths), scale)  # CPU: the reference loop
    want = dense_reference(q, k, v, lengths, scale)
    assert (got.double() - want).abs().max().item() < 1e-5
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(9))
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad.double())
    for g1, g2 in zip(got_grads, want_grads, strict=True):
        assert (g1.double() - g2).abs().max().item() < 1e-5
    # Default scale: 1/sqrt(D), as SDPA's.
    plain = pa.packed_attention_reference(q, k, v, cu.tolist())
    assert (plain.double() - dense_reference(q, k, v, lengths, 1 / math.sqrt(16))).abs().max().item() < 1e-5


@pytest.mark.parametrize("has_gqa", [False, True], ids=["torch-2.11-no-enable_gqa", "enable_gqa"])
def test_varlen_path_passes_causal_window_scale_and_heads(monkeypatch: pytest.MonkeyPatch, has_gqa: bool) -> None:
    """The varlen call as torch 2.11 (no enable_gqa: the kv heads passed as they are, as flash-attention takes them)
    and torch >= 2.13 (enable_gqa) take it, through a stand-in that checks the arguments and computes the reference
    (flash's grouped heads: query head h reads kv head h // group)."""
    calls: list[dict[str, Any]] = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), **kw):  # type: ignore[no-untyped-def]
        calls.append(
            {"window": window_size, "kv_heads": k.shape[1], "max": (max_q, max_k), "gqa": kw.get("enable_gqa")}
        )
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and q.is_contiguous() and k.is_contiguous()
        assert ("enable_gqa" in kw) == has_gqa
        return pa.packed_attention_reference(q, k, v, cu_q.tolist(), scale)

    monkeypatch.setattr(pa, "_varlen", lambda: (fake_varlen, has_gqa))
    lengths = [4, 11, 6]
    q, k, v = random_qkv(lengths, 8, 2, 16, seed=3)
    got = pa.packed_attention_varlen(q, k, v, packed_layout(lengths).cu_seqlens, 11, 0.25)
    assert calls == [{"window": (-1, 0), "kv_heads": 2, "max": (11, 11), "gqa": has_gqa or None}]
    assert (got.double() - dense_reference(q, k, v, lengths, 0.25)).abs().max().item() < 1e-5


@pytest.mark.parametrize(("heads", "kv_heads", "lengths"), [(4, 2, [6] * 5), (6, 6, [13] * 2), (8, 1, [9])])
def test_uniform_rows_through_one_dense_sdpa_equal_block_causal_attention_with_gradients(
    heads: int, kv_heads: int, lengths: list[int]
) -> None:
    q, k, v = random_qkv(lengths, heads, kv_heads, 16, seed=heads + len(lengths))
    got = pa.uniform_attention(q, k, v, lengths[0], 0.3)
    want = dense_reference(q, k, v, lengths, 0.3)
    assert got.shape == q.shape and (got.double() - want).abs().max().item() < 1e-5
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(2))
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad.double())
    for g1, g2 in zip(got_grads, want_grads, strict=True):
        assert (g1.double() - g2).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="not sequences of"):
        pa.uniform_attention(q, k, v, sum(lengths) + 1)


def test_the_interface_hands_q_k_v_on_as_views_whose_backward_allocates_nothing() -> None:
    """q, k, v as transformers hands them ([1, heads, N, D] views of [1, N, heads, D]) reach the kernel through views
    only: no aten::select (indexing [0]), whose backward writes each gradient into a new zero-filled [1, heads, N, D].
    (The dense path: on the CPU the ragged path's reference loop indexes per sequence itself.)"""
    lengths = [16] * 4
    lay = packed_layout(lengths)
    q, k, v = (t.unsqueeze(0).transpose(1, 2) for t in random_qkv(lengths, 8, 2, 16, seed=7))
    kwargs = pa.packed_forward_kwargs(object(), lay.cu_seqlens, lay.max_length, lay.uniform)
    out, _ = pa.packed_attention_forward(_Module(), q, k, v, None, scaling=0.25, **kwargs)
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    names = {type(node).__name__ for node in seen}
    assert "SqueezeBackward1" in names and not any(name.startswith("Select") for name in names), names


def test_varlen_is_used_only_on_cuda_in_half_precision() -> None:
    assert not pa.varlen_available(torch.zeros(1, 1, 16, dtype=torch.bfloat16))  # CPU
    assert not pa.varlen_available(torch.zeros(1, 1, 16))


class _Module(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def test_interface_function_reads_the_flash_varlen_kwargs() -> None:
    lengths = [7, 3, 12]
    q, k, v = random_qkv(lengths, 4, 2, 16, seed=5)
    cu = packed_layout(lengths).cu_seqlens
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, N, D] as transformers has them
    out, weights = pa.packed_attention_forward(
        _Module(), query, key, value, None, dropout=0.0, scaling=0.2, sliding_window=None,
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12,
    )  # fmt: skip
    assert weights is None and out.shape == (1, sum(lengths), 4, 16)
    assert (out[0].double() - dense_reference(q, k, v, lengths, 0.2)).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="sliding window"):
        pa.packed_attention_forward(_Module(), query, key, value, None, sliding_window=4, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="takes one sequence"):  # other keys than the queries: one sequence only
        pa.packed_attention_forward(_Module(), query, key, value, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone() + 0)
    n = query.shape[2]  # one sequence's last 3 positions over all its n keys: the continuation path
    out, _ = pa.packed_attention_forward(
        _Module(), query[:, :, n - 3 :], key, value, None, scaling=0.2,
        cu_seq_lens_q=torch.tensor([0, 3], dtype=torch.int32), cu_seq_lens_k=torch.tensor([0, n], dtype=torch.int32),
    )  # fmt: skip
    assert (out[0].double() - dense_reference(q, k, v, [n], 0.2)[n - 3 :]).abs().max().item() < 1e-5


@pytest.fixture(scope="module")
def models(tiny_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny model twice: as loaded (sdpa), and switched to the packed attention."""
    sdpa, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    packed, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    assert sdpa.config._attn_implementation == "sdpa"
    pa.install_packed_attention(packed)
    pa.install_packed_attention(packed)  # idempotent
    assert packed.config._attn_implementation == pa.PACKED_ATTENTION
    return sdpa.eval(), packed.eval()


def test_without_cu_seqlens_the_model_computes_exactly_what_sdpa_did(models: tuple[Any, Any]) -> None:
    """Plain, padded with a 2-D mask, packed position ids without cu_seqlens (transformers' own block mask), and a
    prefill into a DynamicCache then one decode step (the sampler's path): bit-identical to the sdpa model."""
    sdpa, packed = models
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.int64)
    mask[1, 7:] = 0
    mask[2, :3] = 0  # left padding too
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            assert torch.equal(sdpa(input_ids=ids, **kwargs).logits, packed(input_ids=ids, **kwargs).logits)
        assert torch.equal(
            sdpa(input_ids=ids[:1], position_ids=positions).logits,
            packed(input_ids=ids[:1], position_ids=positions).logits,
        )
        outs = []
        for model in (sdpa, packed):
            cache = DynamicCache(config=model.config)
            body = model.get_decoder()
            first = body(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
            step = body(input_ids=ids[:, :1], past_key_values=cache, use_cache=True).last_hidden_state
            outs.append((first, step))
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize("lengths", [[9, 1, 23, 4], [12] * 3], ids=["ragged", "uniform"])
def test_a_packed_forward_equals_each_sequence_alone(
    models: tuple[Any, Any], lengths: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uniform rows reach the dense path through transformers' forward kwargs (once per layer)."""
    sdpa, packed = models
    dense = CallCount(monkeypatch, pa, "uniform_attention")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=g) for n in lengths]
    lay = packed_layout(lengths)
    with torch.no_grad():
        hidden = packed.get_decoder()(
            input_ids=torch.cat(seqs).view(1, -1), position_ids=lay.positions.view(1, -1), use_cache=False,
            **pa.packed_forward_kwargs(packed.config, lay.cu_seqlens, lay.max_length, lay.uniform),
        ).last_hidden_state[0]  # fmt: skip
        alone = torch.cat([sdpa.get_decoder()(input_ids=s.view(1, -1)).last_hidden_state[0] for s in seqs])
    assert (hidden - alone).abs().max().item() < 1e-5
    assert dense.calls == (packed.config.num_hidden_layers if lay.uniform else 0)


def test_only_an_sdpa_model_is_switched(tiny_dir: Path) -> None:
    model, _ = load_base_model(str(tiny_dir), tiny_dir.parent)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="eager"):
        pa.install_packed_attention(model)


@pytest.mark.parametrize(("lq", "lk", "block"), [(5, 5, None), (7, 19, 3), (1, 40, None), (16, 16, 4)])
def test_continuation_attention_equals_the_whole_sequences_last_rows(lq: int, lk: int, block: int | None) -> None:
    """A piece's queries over every key up to its end (earlier positions from a cache) give the rows the whole
    sequence's causal attention gives those positions (fp64 dense reference, grouped-query heads), in query blocks."""
    q_all, k, v = (t.detach() for t in random_qkv([lk], 4, 2, 8, seed=lk + lq))
    scale = 1 / math.sqrt(8)
    whole = dense_reference(q_all, k, v, [lk], scale)
    got = pa.continuation_attention(q_all[lk - lq :], k, v, scale, block=block)
    assert torch.allclose(got.double(), whole[lk - lq :], atol=1e-5)
    with pytest.raises(ValueError, match="at least as many keys"):
        pa.continuation_attention(q_all, k[:2], v[:2], scale)

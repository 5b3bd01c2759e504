"""The paged KV cache's tensors and attention (workers/sampling/paged_kv.py), fp32 on the CPU: decode steps written
through the allocator's block tables and attended by the paged reference and the batched path equal
F.scaled_dot_product_attention over a dense per-row cache; rows forked from a shared prompt (copy-on-write included)
and rows sharing a published prefix equal the same rows computed without sharing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.workers.sampling.kv_blocks import BlockAllocator
from loraplex.workers.sampling.paged_kv import (
    PagedKvCache,
    block_table_tensor,
    paged_attention,
    paged_attention_gathered,
    paged_attention_reference,
    slots_for,
)

LAYERS, KV_HEADS, Q_HEADS, DIM, BLOCK = 2, 2, 6, 8, 4


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One decode query q [Hq, D] over a dense row cache k/v [n, Hkv, D] (all n positions are its causal prefix)."""
    group = Q_HEADS // KV_HEADS
    kk = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    vv = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    return F.scaled_dot_product_attention(q[None, :, None, :], kk, vv)[0, :, 0, :]


class Run:
    """Rows decoded on one allocator + cache; each row's dense K/V history kept beside to compare with."""

    def __init__(self, num_blocks: int = 64) -> None:
        self.alloc = BlockAllocator(num_blocks, BLOCK)
        self.cache = PagedKvCache(LAYERS, num_blocks, BLOCK, KV_HEADS, DIM)
        self.dense: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # per layer: [n, Hkv, D] k and v

    def prefill(self, row: str, prompt: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], ns: str = "") -> int:
        cached = self.alloc.admit(row, prompt, max_new=16, namespace=ns)
        slots = torch.tensor([self.alloc.slot(row, p) for p in range(cached, len(prompt))])
        for layer, (k, v) in enumerate(kv):
            self.cache.write(layer, slots, k[cached:], v[cached:])
        self.dense[row] = [(k.clone(), v.clone()) for k, v in kv]
        return cached

    def fork(self, parent: str, child: str) -> None:
        self.alloc.fork(parent, child, max_new=16)
        self.dense[child] = [(k.clone(), v.clone()) for k, v in self.dense[parent]]

    def step(self, rows: list[str], new_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append one token to every row: copy-on-write first, then one batched write per layer through slots."""
        cows = [c for c in (self.alloc.append(r) for r in rows) if c is not None]
        if cows:
            self.cache.copy_blocks(torch.tensor([c.src for c in cows]), torch.tensor([c.dst for c in cows]))
        tables = block_table_tensor([self.alloc.table(r) for r in rows])
        positions = torch.tensor([self.alloc.length(r) - 1 for r in rows])
        slots = slots_for(tables, positions, BLOCK)
        assert slots.tolist() == [self.alloc.slot(r, self.alloc.length(r) - 1) for r in rows]
        for layer, (k, v) in enumerate(new_kv):
            self.cache.write(layer, slots, k, v)
            for i, r in enumerate(rows):
                dk, dv = self.dense[r][layer]
                self.dense[r][layer] = (torch.cat([dk, k[i : i + 1]]), torch.cat([dv, v[i : i + 1]]))

    def attend(self, rows: list[str], q: torch.Tensor, layer: int) -> torch.Tensor:
        """The paged reference, checked against the batched path and the dense SDPA; returns the reference."""
        tables = [self.alloc.table(r) for r in rows]
        lengths = [self.alloc.length(r) for r in rows]
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        ref = paged_attention_reference(q, k_cache, v_cache, tables, lengths)
        table_t, lengths_t = block_table_tensor(tables), torch.tensor(lengths)
        batched = paged_attention_gathered(q, k_cache, v_cache, table_t, lengths_t)
        torch.testing.assert_close(batched, ref, rtol=1e-5, atol=1e-6)
        # what the decoder calls: the gathered form here on the CPU (the kernel on CUDA, tests/gpu)
        torch.testing.assert_close(paged_attention(q, k_cache, v_cache, table_t, lengths_t), ref, rtol=1e-5, atol=1e-6)
        for i, r in enumerate(rows):
            dk, dv = self.dense[r][layer]
            assert dk.shape[0] == lengths[i]
            torch.testing.assert_close(ref[i], dense_attention(q[i], dk, dv), rtol=1e-5, atol=1e-6)
        return ref


def kv(n: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(n, KV_HEADS, DIM, generator=gen), torch.randn(n, KV_HEADS, DIM, generator=gen)) for _ in range(LAYERS)]  # fmt: skip


def decode(run: Run, rows: list[str], steps: int, gen: torch.Generator) -> list[torch.Tensor]:
    """`steps` decode steps of `rows`; the attention outputs of every step and layer."""
    outs = []
    for _ in range(steps):
        run.step(rows, kv(len(rows), gen))
        for layer in range(LAYERS):
            outs.append(run.attend(rows, torch.randn(len(rows), Q_HEADS, DIM, generator=gen), layer))
    return outs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_of_different_lengths_equal_the_dense_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    run = Run()
    rows = {"a": 1, "b": 4, "c": 7, "d": 13}  # prompt lengths around block edges
    for row, n in rows.items():
        run.prefill(row, list(range(100 * n, 100 * n + n)), kv(n, gen))
    decode(run, list(rows), steps=9, gen=gen)
    for row in rows:
        run.alloc.free(row)
    assert run.alloc.free_blocks == 64


def test_forked_rows_equal_the_same_rows_without_sharing() -> None:
    """A prompt of 11 tokens (a partial last block) forked into 4 samples: the blocks are shared, each row copies the
    partial block on its first write, and every output equals 4 rows with their own copy of the prompt."""
    prompt_kv = kv(11, torch.Generator().manual_seed(5))
    shared, alone = Run(), Run()
    shared.prefill("s0", list(range(11)), prompt_kv)
    for i in range(1, 4):
        shared.fork("s0", f"s{i}")
        alone.prefill(f"s{i}", list(range(11)), prompt_kv)
    alone.prefill("s0", list(range(11)), prompt_kv)
    assert shared.alloc.free_blocks == 64 - 3 and alone.alloc.free_blocks == 64 - 12
    rows = ["s0", "s1", "s2", "s3"]
    out_shared = decode(shared, rows, steps=7, gen=torch.Generator().manual_seed(6))
    out_alone = decode(alone, rows, steps=7, gen=torch.Generator().manual_seed(6))
    for a, b in zip(out_shared, out_alone, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert shared.alloc.refcount(shared.alloc.table("s0")[0]) == 4  # the full prompt blocks stay shared
    assert shared.alloc.free_blocks == 64 - (2 + 4 * 3)  # 18 tokens a row: 2 shared blocks + 3 of its own
    for row in rows:
        shared.alloc.free(row)
    assert shared.alloc.free_blocks == 64


def test_a_published_prefix_is_prefilled_once_and_equals_its_own_prefill() -> None:
    gen = torch.Generator().manual_seed(7)
    prompt, prompt_kv = list(range(10)), kv(10, gen)
    run = Run()
    run.prefill("first", prompt, prompt_kv, ns="adapter")
    run.alloc.publish("first")
    # the second request's prefill writes only the tokens past the shared blocks: give it garbage for the shared ones
    junk = [(torch.cat([torch.full_like(k[:8], 1e3), k[8:]]), torch.cat([torch.full_like(v[:8], 1e3), v[8:]])) for k, v in prompt_kv]  # fmt: skip
    assert run.prefill("second", prompt, junk, ns="adapter") == 8
    run.dense["second"] = [(k.clone(), v.clone()) for k, v in prompt_kv]
    assert run.alloc.table("second")[:2] == run.alloc.table("first")[:2]
    decode(run, ["first", "second"], steps=6, gen=gen)
    # another adapter's identical prompt shares nothing
    assert run.prefill("other", prompt, prompt_kv, ns="other-adapter") == 0


def test_heads_that_do_not_group_are_refused() -> None:
    cache = PagedKvCache(1, 4, BLOCK, KV_HEADS, DIM)
    with pytest.raises(ValueError, match="kv heads"):
        paged_attention_reference(torch.zeros(1, 5, DIM), cache.k[0], cache.v[0], [[0]], [1])

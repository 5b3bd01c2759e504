"""The paged KV cache's block allocator (workers/sampling/kv_blocks.py), pure Python: sharing by fork and by the prefix
index, copy-on-write of a shared partial block, reservation (a row admitted always finishes; refusal is a
CapacityError), blocks back after every row ends; and random admit/publish/fork/append/free sequences (hypothesis)
checked against the invariants and against a shadow cache the test writes through the allocator's slots."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.errors import CapacityError, InvalidRequestError
from loraplex.workers.sampling.kv_blocks import BlockAllocator, CopyOnWrite, KvBlocksExhausted


def check_invariants(alloc: BlockAllocator) -> None:
    """Counts equal the tables' holders, free blocks are unheld, nothing lost, the hold recomputed from scratch."""
    holders: Counter[int] = Counter(b for row in alloc.rows() for b in alloc.table(row))
    free = set(alloc._free)
    assert len(free) == len(alloc._free)
    for b in range(alloc.num_blocks):
        assert alloc.refcount(b) >= 0
        assert alloc.refcount(b) == holders[b]
        assert (b in free) == (holders[b] == 0)
    committed, partial_shared = 0, set()
    for row in alloc.rows():
        r = alloc._rows[row]
        assert len(r.table) == -(-r.length // alloc.block_tokens)
        assert len(set(r.table)) == len(r.table)
        committed += -(-(r.length + r.remaining) // alloc.block_tokens) - len(r.table)
        if r.length % alloc.block_tokens and alloc.refcount(r.table[-1]) > 1:
            partial_shared.add(r.table[-1])
    committed += sum(alloc.refcount(b) - 1 for b in partial_shared)
    assert alloc.committed == committed
    assert alloc.available >= 0
    assert set(alloc._index.values()) <= set(range(alloc.num_blocks)) - free


def test_fork_shares_then_copies_the_partial_block_on_write() -> None:
    alloc = BlockAllocator(num_blocks=8, block_tokens=4)
    assert alloc.admit("p", [1, 2, 3, 4, 5, 6], max_new=3) == 0
    assert alloc.table("p") == [0, 1]
    alloc.fork("p", "c", max_new=3)
    assert alloc.table("c") == [0, 1] and alloc.refcount(0) == alloc.refcount(1) == 2
    assert alloc.append("c") == CopyOnWrite(src=1, dst=2)
    assert alloc.table("c") == [0, 2] and alloc.refcount(1) == 1
    assert alloc.append("p") is None  # the last holder writes in place
    assert alloc.slot("p", 6) == 1 * 4 + 2 and alloc.slot("c", 6) == 2 * 4 + 2
    assert alloc.append("c") is None and alloc.append("c") is None  # its own block, then a fresh one
    assert len(alloc.table("c")) == 3 and alloc.length("c") == 9
    check_invariants(alloc)
    alloc.free("p")
    alloc.free("c")
    assert alloc.free_blocks == 8 and alloc.committed == 0


def test_the_prefix_index_shares_published_full_blocks_and_keeps_the_last_token_to_compute() -> None:
    alloc = BlockAllocator(num_blocks=16, block_tokens=4)
    prompt = list(range(10))  # two full blocks and two tokens
    alloc.admit("a", prompt, max_new=2, namespace="adapter-1")
    assert alloc.prefix_hit(prompt, "adapter-1") == 0  # not yet written: never shared before publish
    alloc.publish("a")
    assert alloc.prefix_hit(prompt, "adapter-1") == 8
    assert alloc.prefix_hit(prompt, "adapter-2") == 0  # another adapter's k/v differ
    assert alloc.prefix_hit(prompt[:8], "adapter-1") == 4  # the prompt's last token is always computed
    assert alloc.prefix_hit([*prompt[:4], 99, *prompt[5:]], "adapter-1") == 4
    assert alloc.admit("b", prompt, max_new=2, namespace="adapter-1") == 8
    assert alloc.table("b")[:2] == alloc.table("a")[:2] and alloc.table("b")[2] != alloc.table("a")[2]
    check_invariants(alloc)
    alloc.free("a")
    assert alloc.prefix_hit(prompt, "adapter-1") == 8  # b still holds them
    alloc.free("b")
    assert alloc.prefix_hit(prompt, "adapter-1") == 0 and alloc._index == {}
    assert alloc.free_blocks == 16


def test_admission_holds_the_worst_case_and_refuses_with_a_capacity_error() -> None:
    alloc = BlockAllocator(num_blocks=4, block_tokens=4)
    assert alloc.can_admit(prompt_len=5, max_new=3)  # 2 blocks
    alloc.admit("a", [1] * 5, max_new=3)
    assert alloc.free_blocks == 2 and alloc.available == 2
    assert alloc.can_admit(5, 3) and not alloc.can_admit(5, 4)
    with pytest.raises(KvBlocksExhausted) as err:
        alloc.admit("b", [2] * 5, max_new=4)
    assert isinstance(err.value, CapacityError) and "available" in str(err.value)
    assert "b" not in alloc.rows()
    # a fork of a 5-token row shares one full block and will copy the partial one: 2 blocks for 3 more tokens
    assert alloc.blocks_needed(5, 3, shared=5) == 1 and alloc.blocks_needed(5, 4, shared=5) == 2
    alloc.fork("a", "c", max_new=4)
    assert alloc.available == 0 and not alloc.can_admit(1, 0)
    with pytest.raises(KvBlocksExhausted):
        alloc.fork("a", "d", max_new=0)  # even a fork without new tokens holds the copy of the partial block
    for _ in range(4):
        alloc.append("c")
    for _ in range(3):
        alloc.append("a")
    with pytest.raises(InvalidRequestError):
        alloc.append("a")
    check_invariants(alloc)
    alloc.free("a")
    alloc.free("c")
    assert alloc.free_blocks == 4 and alloc.available == 4


def test_rows_that_end_early_give_their_hold_back() -> None:
    alloc = BlockAllocator(num_blocks=7, block_tokens=2)
    alloc.admit("a", [1, 2, 3], max_new=5)  # 4 blocks; the fork shares one and may take 3
    alloc.fork("a", "b", max_new=5)
    assert alloc.available == 0
    alloc.free("b")
    check_invariants(alloc)
    alloc.append("a")
    alloc.free("a")
    assert alloc.free_blocks == alloc.available == 7


ops = st.lists(
    # appends and forks weighted up so that shared partial blocks get written (copy-on-write) often
    st.tuples(
        st.sampled_from(["admit", "publish", "fork", "fork", "append", "append", "append", "free"]),
        st.integers(0, 10**6),
    ),
    min_size=20,
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 5), st.integers(4, 40))
def test_random_sequences_keep_counts_conserved_and_rows_reading_their_own_tokens(
    sequence: list[tuple[str, int]], block_tokens: int, num_blocks: int
) -> None:
    alloc = BlockAllocator(num_blocks, block_tokens)
    cache: list[object] = [None] * (num_blocks * block_tokens)  # the caller's tensors, one tag per slot
    tokens: dict[int, list[object]] = {}  # what each live row wrote, position by position
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9], [8] * 11, [1, 2]]
    next_row = 0

    def write(row: int, position: int, tag: object) -> None:
        cache[alloc.slot(row, position)] = tag

    for op, pick in sequence:
        live = alloc.rows()
        if op == "admit":
            prompt, max_new = prompts[pick % len(prompts)], pick % 7
            ns = pick % 2
            hit = alloc.prefix_hit(prompt, ns)
            if not alloc.can_admit(len(prompt), max_new, shared=hit):
                with pytest.raises(KvBlocksExhausted):
                    alloc.admit(next_row, prompt, max_new, ns)
                continue
            assert alloc.admit(next_row, prompt, max_new, ns) == hit
            # the cached prefix reads as this namespace's prompt; prefill writes the rest
            tokens[next_row] = [("p", ns, tuple(prompt[: i + 1])) for i in range(len(prompt))]
            for p in range(hit):
                assert cache[alloc.slot(next_row, p)] == tokens[next_row][p]
            for p in range(hit, len(prompt)):
                write(next_row, p, tokens[next_row][p])
            next_row += 1
        elif not live:
            continue
        elif op == "publish":
            alloc.publish(live[pick % len(live)])
        elif op == "fork":
            parent, max_new = live[pick % len(live)], pick % 5
            need = alloc.blocks_needed(alloc.length(parent), max_new, alloc.length(parent))
            if need > alloc.available:
                with pytest.raises(KvBlocksExhausted):
                    alloc.fork(parent, next_row, max_new)
                continue
            alloc.fork(parent, next_row, max_new)
            tokens[next_row] = list(tokens[parent])
            next_row += 1
        elif op == "append":
            row = live[pick % len(live)]
            if alloc._rows[row].remaining == 0:
                continue
            cow = alloc.append(row)
            if cow is not None:
                for o in range(block_tokens):
                    cache[cow.dst * block_tokens + o] = cache[cow.src * block_tokens + o]
            tag = ("g", row, alloc.length(row))
            tokens[row].append(tag)
            write(row, alloc.length(row) - 1, tag)
        elif op == "free":
            row = live[pick % len(live)]
            alloc.free(row)
            del tokens[row]
        check_invariants(alloc)
        for row in alloc.rows():
            assert [cache[alloc.slot(row, p)] for p in range(alloc.length(row))] == tokens[row]
    for row in alloc.rows():
        alloc.free(row)
    assert alloc.free_blocks == alloc.available == num_blocks
    assert alloc._index == {} and alloc.committed == 0

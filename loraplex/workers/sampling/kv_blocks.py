"""The block allocator of a paged KV cache: which cache blocks each decoding row owns, pure Python (no torch).

The cache is a pool of `num_blocks` fixed-size blocks of `block_tokens` positions each; a row's KV lives in the blocks
of its block table, position p at slot `table[p // block_tokens] * block_tokens + p % block_tokens`. Blocks are
reference-counted so rows share what they have in common:

  * `fork(parent, child, max_new)`: the child shares every block of the parent (a sample's num_samples rows share the
    prompt, whose prefill ran once). The first row to write into a shared, partially filled last block gets its own
    copy: `append` returns `CopyOnWrite(src, dst)` and the caller copies the block's tensors before writing.
  * the prefix index: identical prompts across requests share their full prompt blocks. A row's full prompt blocks
    enter the index by `publish` once its prefill has written them (never at admission: their KV does not exist yet);
    `admit` takes the longest chain of published blocks of the same namespace (the adapter: LoRA changes k and v) and
    the caller prefills only the rest. A hit always leaves the prompt's last token to compute, whose logits start the
    decode. A full block is never written again, so sharing one needs no copy.

Admission reserves the worst case, so a row once admitted always finishes: `committed` counts the blocks the live rows
may still take (each row's blocks up to prompt + max_new, plus one copy per extra holder of a shared partial block),
`can_admit` / `admit` / `fork` refuse with `KvBlocksExhausted` (a CapacityError) unless the free blocks cover it, and
`append` never fails for want of blocks. `free(row)` returns blocks whose count reaches 0; when every row has ended,
`free_blocks == num_blocks` again and the index is empty (an index entry lives only as long as its block).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from loraplex.errors import CapacityError, InvalidRequestError


class KvBlocksExhausted(CapacityError):
    """The paged KV cache has too few free blocks for this row's worst case; retry once rows have ended."""


@dataclass(frozen=True)
class CopyOnWrite:
    """Copy block `src`'s K/V (every layer) into block `dst` before writing the row's new token into `dst`."""

    src: int
    dst: int


@dataclass
class _Row:
    table: list[int]
    length: int  # positions written (or allocated for the prompt's prefill)
    remaining: int  # tokens this row may still append
    namespace: Hashable
    prompt: tuple[int, ...] = ()
    published: int = 0  # leading blocks of `table` already in the prefix index
    keys: list[tuple[Hashable, int, tuple[int, ...]]] = field(default_factory=list)


def _blocks(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def first_sample_blocks(prompt_len: int, max_new: int, block_tokens: int) -> int:
    """The blocks a job's first sample may take with nothing shared yet: its prompt's holder, plus what its fork may
    add (the copy of a shared partial block and the blocks of its new tokens). A job needing more than a cache holds can
    never run there."""
    return _blocks(prompt_len, block_tokens) + _blocks(prompt_len + max_new, block_tokens) - prompt_len // block_tokens


class BlockAllocator:
    """Block tables, reference counts, the prefix index and the reservation of a paged KV cache."""

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1 or block_tokens < 1:
            raise InvalidRequestError("a paged KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._rows: dict[Hashable, _Row] = {}
        # (namespace, previous block in the chain or -1, this block's tokens) -> block id. Keying by the previous block
        # keeps a key O(block_tokens) yet equal to keying by the whole prefix: a row holding a block holds its chain.
        self._index: dict[tuple[Hashable, int, tuple[int, ...]], int] = {}
        self._key_of: dict[int, tuple[Hashable, int, tuple[int, ...]]] = {}
        self.committed = 0  # blocks the live rows may still take (see the module's docstring)

    # ---- queries ---------------------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def available(self) -> int:
        """Free blocks no live row may still claim: what a new row can have."""
        return len(self._free) - self.committed

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def table(self, row: Hashable) -> list[int]:
        return list(self._rows[row].table)

    def length(self, row: Hashable) -> int:
        return self._rows[row].length

    def rows(self) -> list[Hashable]:
        return list(self._rows)

    def slot(self, row: Hashable, position: int) -> int:
        """The cache slot (block_id * block_tokens + offset) holding `row`'s position."""
        r = self._rows[row]
        if not 0 <= position < r.length:
            raise InvalidRequestError(f"position {position} is outside row {row!r}'s {r.length} positions")
        return r.table[position // self.block_tokens] * self.block_tokens + position % self.block_tokens

    def prefix_hit(self, prompt: Sequence[int], namespace: Hashable = None) -> int:
        """How many leading tokens of `prompt` are already in published blocks (a multiple of block_tokens, at most
        len(prompt) - 1): pass it as can_admit's `shared`."""
        return len(self._lookup(tuple(prompt), namespace)) * self.block_tokens

    def blocks_needed(self, prompt_len: int, max_new: int, shared: int = 0) -> int:
        """New blocks a row of `prompt_len` + `max_new` tokens may take when its first `shared` tokens sit in blocks
        it shares (a prefix hit, or a fork's parent length): a shared partial block counts, since it will be copied."""
        return _blocks(prompt_len + max_new, self.block_tokens) - min(shared, prompt_len) // self.block_tokens

    def can_admit(self, prompt_len: int, max_new: int, shared: int = 0) -> bool:
        """Whether a row can start now and is sure to finish (every block it may take is held for it)."""
        return self.blocks_needed(prompt_len, max_new, shared) <= self.available

    # ---- row life --------------------------------------------------------------------------------------------------
    def admit(self, row: Hashable, prompt: Sequence[int], max_new: int, namespace: Hashable = None) -> int:
        """Start `row`: share the published blocks of its prompt's longest cached prefix, allocate blocks for the rest
        of the prompt, hold its worst case. Returns how many prompt tokens are cached (the caller prefills
        positions [returned, len(prompt)) into `slot(row, p)`). KvBlocksExhausted when it cannot be sure to finish."""
        prompt_t = tuple(prompt)
        if row in self._rows:
            raise InvalidRequestError(f"row {row!r} is already live")
        if not prompt_t or max_new < 0:
            raise InvalidRequestError("a row needs a non-empty prompt and max_new >= 0")
        hit = self._lookup(prompt_t, namespace)
        need = self.blocks_needed(len(prompt_t), max_new, len(hit) * self.block_tokens)
        self._require(need, row)
        own = [self._take() for _ in range(_blocks(len(prompt_t), self.block_tokens) - len(hit))]
        for b in hit:
            self._refs[b] += 1
        self._rows[row] = _Row(hit + own, len(prompt_t), max_new, namespace, prompt_t, published=len(hit))
        self.committed += need - len(own)
        return len(hit) * self.block_tokens

    def publish(self, row: Hashable) -> None:
        """Enter `row`'s full prompt blocks into the prefix index; call once its prefill has written their KV. A
        prefix already indexed (another row published it first) keeps the first row's blocks."""
        r = self._rows[row]
        prev = r.table[r.published - 1] if r.published else -1
        for i in range(r.published, len(r.prompt) // self.block_tokens):
            key = (r.namespace, prev, r.prompt[i * self.block_tokens : (i + 1) * self.block_tokens])
            block = r.table[i]
            if key in self._index:
                break  # this row's block duplicates an indexed one; the chain continues from the indexed block only
            self._index[key] = block
            self._key_of[block] = key
            prev = block
        r.published = len(r.prompt) // self.block_tokens

    def fork(self, parent: Hashable, child: Hashable, max_new: int) -> None:
        """Start `child` as a copy of `parent` so far (sharing all its blocks), allowed `max_new` more tokens."""
        p = self._rows[parent]
        if child in self._rows:
            raise InvalidRequestError(f"row {child!r} is already live")
        if max_new < 0:
            raise InvalidRequestError("max_new must be >= 0")
        need = self.blocks_needed(p.length, max_new, p.length)
        self._require(need, child)
        for b in p.table:
            self._refs[b] += 1
        self._rows[child] = _Row(list(p.table), p.length, max_new, p.namespace, p.prompt, p.published)
        self.committed += need

    def append(self, row: Hashable) -> CopyOnWrite | None:
        """Give `row` its next position (then `slot(row, length(row) - 1)` is where its new K/V go): a fresh block when
        the last is full, a private copy of the last block when it is shared (returned: copy it first), else nothing.
        Never fails for want of blocks (admission held them)."""
        r = self._rows[row]
        if r.remaining <= 0:
            raise InvalidRequestError(f"row {row!r} has used its max_new tokens")
        offset = r.length % self.block_tokens
        cow = None
        if offset == 0:
            r.table.append(self._take())
        elif self._refs[r.table[-1]] > 1:
            src, dst = r.table[-1], self._take()
            self._refs[src] -= 1
            r.table[-1] = dst
            cow = CopyOnWrite(src, dst)
        r.length += 1
        r.remaining -= 1
        if offset == 0 or cow is not None:
            self.committed -= 1
        return cow

    def free(self, row: Hashable) -> None:
        """End `row`: its blocks whose count reaches 0 go back (leaving the prefix index), its unused hold ends."""
        r = self._rows.pop(row)
        still = _blocks(r.length + r.remaining, self.block_tokens) - _blocks(r.length, self.block_tokens)
        if r.length % self.block_tokens and self._refs[r.table[-1]] > 1:
            still += 1  # the copy this row would have made of its shared partial last block
        self.committed -= still
        for b in reversed(r.table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                key = self._key_of.pop(b, None)
                if key is not None:
                    del self._index[key]
                self._free.append(b)

    # ---- internals -------------------------------------------------------------------------------------------------
    def _lookup(self, prompt: tuple[int, ...], namespace: Hashable) -> list[int]:
        hit: list[int] = []
        prev, bt = -1, self.block_tokens
        for i in range((len(prompt) - 1) // bt):
            block = self._index.get((namespace, prev, prompt[i * bt : (i + 1) * bt]))
            if block is None:
                break
            hit.append(block)
            prev = block
        return hit

    def _require(self, need: int, row: Hashable) -> None:
        if need > self.available:
            raise KvBlocksExhausted(
                f"row {row!r} may need {need} KV blocks of {self.block_tokens} tokens; {self.available} of "
                f"{self.num_blocks} are available ({self.free_blocks} free, {self.committed} held for live rows)"
            )

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

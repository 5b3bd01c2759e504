"""How the native sampler picks each row's next token from its logits: greedy, or one draw after temperature, top-k
and top-p. This docstring is the specification; `choose_tokens_reference` restates it row by row in plain torch.

Per row, z = fp32 logits [V], T = temperature, k = top_k (-1 or >= V: off), p = top_p, u = the row's uniform draw:

    reported logprob  = log_softmax(z)[token]        # the raw policy's logprob (before T, k, p), as RL losses compare
    T == 0 (greedy):    token = argmax(z)           # the first index of the maximum
    plain (k off and p == 1): no sort. In vocabulary order,
                        w = softmax(z / T) (torch's, fp32); cdf = cumsum(w) in fp64
                        token = the first i with cdf[i] > min(u * cdf[-1], the fp64 just below cdf[-1])
    truncated (k on or p < 1): in the order of z descending, ties by vocabulary index (a stable sort),
                        s = z in that order; w = exp((s - s[0]) / T) for rank < k, 0 beyond
                        cdf = cumsum(w) in fp64; a rank is kept while the mass before it is < p * cdf[-1]
                        (the smallest prefix holding p of the top-k mass; the first rank is always kept)
                        token = the inverse CDF over the kept ranks at u, as above, mapped back to its vocabulary id
    top-k logprobs (when a row asks n): its n largest log_softmax(z) (ties by vocabulary index), with their ids

So top_k = 1 is greedy, and a draw follows softmax(z / T) restricted to the kept tokens and renormalised. The cdf is
fp64 because a long tail of small probabilities added to an fp32 running sum near 1 rounds to nothing: that mass
would never be drawn (a vocabulary of 150k tokens at 1e-8 each is 0.15% of the draws). Tokens whose w underflows to
0 (z more than ~87 T below the maximum) are never drawn. Plain rows at T == 1 that ask no top-k logprobs report
z[token] - max(z) + log(w[argmax z]) (from the softmax they drew from: no second pass that writes the vocabulary),
log_softmax's value to fp32 rounding.

Which path a row takes depends on its own (T, k, p) only, and every operation is row-wise, so a row's token never
depends on the other rows of the batch. How a path computes is free as long as it gives the specification's token:
rows with k <= TOPK_LIMIT select their candidates with torch.topk on keys that order (z descending, index ascending)
exactly, wider truncated rows sort, plain rows never sort. (On the CPU a row's exp may round one ulp differently
with its place in the batch, through vectorized or scalar code: a token can change only when u lands within that
rounding of a CDF boundary.)

Draws: counter-based, on the device. The row of sample s of a job seeded `seed` draws, for its t-th sampled token
(t = 0, 1, ...; the number of tokens it sampled before),

    key = mix64(mix64(seed mod 2^64) + (s + 1) * GAMMA)         # its stream, `stream_key`: once per row, on the host
    u   = (mix64(key + (t + 1) * GAMMA) >> 11) / 2^53          # in [0, 1), 53 bits: `draw_uniforms`, all rows at once

with all sums and products mod 2^64, mix64 SplitMix64's finalizer and GAMMA its increment (the golden ratio), i.e.
the (t+1)-th output of SplitMix64 started at `key`. `draw_uniforms` computes it with int64 tensor ops (wrapping
products, masked arithmetic shifts for the logical ones), so the same (seed, s, t) gives the same u on the CPU and on
CUDA; `uniform` is the same function in Python integers. A sliced or resumed run draws exactly what an unsliced one
does (t is the row's token count), and no per-row generator is called on the host.

One host copy per step: `Choices.to_host` brings tokens, logprobs and top-k logprobs back in one transfer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from loraplex.errors import InvalidRequestError

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / the golden ratio, odd
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
TOPK_LIMIT = 1024  # truncated rows with top_k up to this select with torch.topk; wider ones (or top-p alone) sort


# ---- the draws -------------------------------------------------------------------------------------------------------
def mix64(z: int) -> int:
    """SplitMix64's finalizer on a 64-bit integer (Python ints: the specification of `_mix64_tensor`)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, sample_index: int) -> int:
    """The draw stream of one sample of a job: a 64-bit key (as a signed int64, to travel in a tensor)."""
    return as_int64(mix64(mix64(seed) + (sample_index + 1) * GAMMA))


def uniform(seed: int, sample_index: int, t: int) -> float:
    """The row's uniform for its t-th sampled token, in Python integers (what `draw_uniforms` computes)."""
    h = mix64(stream_key(seed, sample_index) + (t + 1) * GAMMA)
    return (h >> 11) * 2.0**-53


def as_int64(x: int) -> int:
    """x mod 2^64 as a signed 64-bit integer (two's complement)."""
    return ((x & MASK64) ^ (1 << 63)) - (1 << 63)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: mask the copied sign bits)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * as_int64(_MIX1)  # int64 products wrap mod 2^64 on the CPU and CUDA (tested)
    z = (z ^ _shr(z, 27)) * as_int64(_MIX2)
    return z ^ _shr(z, 31)


def stream_keys(seeds: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """`stream_key` for int64 tensors of seeds (mod 2^64, signed) and sample indices."""
    return _mix64_tensor(_mix64_tensor(seeds) + (samples + 1) * as_int64(GAMMA))


def draw_uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """fp64 uniforms in [0, 1) for int64 stream keys and token counts t (same shape, any device)."""
    h = _mix64_tensor(keys + (steps + 1) * as_int64(GAMMA))
    return _shr(h, 11).to(torch.float64) * 2.0**-53


# ---- the choice ------------------------------------------------------------------------------------------------------
class Choices(NamedTuple):
    """One step's choice, on the logits' device."""

    tokens: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor  # fp32 [B]: z[token] - logsumexp(z)
    top_ids: torch.Tensor  # int64 [B, K], K the most any row asked (0 columns when none did); row b's first
    top_logprobs: torch.Tensor  # fp32 [B, K]                  top_counts[b] entries are its answer
    top_counts: tuple[int, ...]  # how many of the K each row asked for

    def to_host(self) -> HostChoices:
        """Everything in one device-to-host copy (ids as fp64: exact below 2^53)."""
        columns = [self.tokens[:, None].double(), self.logprobs[:, None].double()]
        if self.top_ids.shape[1]:
            columns += [self.top_ids.double(), self.top_logprobs.double()]
        rows = torch.cat(columns, dim=1).cpu().tolist()
        k_max = self.top_ids.shape[1]
        top: list[list[tuple[int, float]] | None] = [
            [(int(r[2 + i]), r[2 + k_max + i]) for i in range(n)] if n else None
            for r, n in zip(rows, self.top_counts, strict=True)
        ]
        return HostChoices(tokens=[int(r[0]) for r in rows], logprobs=[r[1] for r in rows], top=top)


@dataclass
class HostChoices:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]] | None]  # per row its top-k (token_id, logprob), or None when it asked none


@dataclass
class _Plan:
    """Which rows take which path (host lists, ascending): decided by each row's own parameters."""

    greedy: list[int]
    plain: list[int]
    topk: list[int]  # truncated, top_k <= TOPK_LIMIT
    sort: list[int]  # truncated, wider
    full: list[int]  # rows whose log_softmax is computed (all but plain rows at T == 1 asking no top-k logprobs)
    top: list[int]  # rows asking for top-k logprobs (a subset of full)
    top_in_full: list[int]  # their places in full
    k_eff: list[int]  # top_k with "off" as V


def _plan(
    vocab: int,
    temperatures: Sequence[float],
    top_ks: Sequence[int],
    top_ps: Sequence[float],
    top_counts: Sequence[int],
    drawn: Sequence[bool],
) -> _Plan:
    plan = _Plan([], [], [], [], [], [], [], [])
    for b, (t, k, p, n, has_draw) in enumerate(zip(temperatures, top_ks, top_ps, top_counts, drawn, strict=True)):
        if not (isinstance(t, int | float) and 0 <= t < math.inf):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or k >= 1):
            raise InvalidRequestError(f"top_k must be -1 (off) or a positive integer, got {k!r}")
        if not (isinstance(p, int | float) and 0 < p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p!r}")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= vocab:
            raise InvalidRequestError(f"top-k logprobs must be an integer in [0, {vocab}], got {n!r}")
        k_eff = vocab if k < 0 or k >= vocab else k
        plan.k_eff.append(k_eff)
        if n:
            plan.top.append(b)
            plan.top_in_full.append(len(plan.full))
        if n or t != 1 or k_eff < vocab or p < 1:
            plan.full.append(b)
        if t == 0:
            plan.greedy.append(b)
            continue
        if not has_draw:
            raise InvalidRequestError("every sampled row (temperature > 0) needs a draw")
        if k_eff >= vocab and p >= 1:
            plan.plain.append(b)
        else:
            (plan.topk if k_eff <= TOPK_LIMIT else plan.sort).append(b)
    return plan


def choose_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ks: Sequence[int],
    top_ps: Sequence[float],
    uniforms: Sequence[float | None] | torch.Tensor | None = None,
    *,
    streams: Sequence[int | None] | None = None,
    steps: Sequence[int] | None = None,
    topk_logprobs: Sequence[int] | None = None,
) -> Choices:
    """The specification's token per row (the module docstring), all rows at once. logits: fp32 [B, V] on any device;
    per row its temperature (0 = greedy), top_k (-1 = off), top_p, and its draw: either `streams` (`stream_key`,
    None for a greedy row) with `steps` (the row's t), drawn on the device, or `uniforms` given (fp64 [B] tensor, or
    floats with None for greedy rows). topk_logprobs: per row how many top-k logprobs to return (default none)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise InvalidRequestError(f"logits must be fp32 [rows, vocab], got {logits.dtype} {list(logits.shape)}")
    rows, vocab = logits.shape
    counts = [0] * rows if topk_logprobs is None else list(topk_logprobs)
    if (uniforms is None) == (streams is None):
        raise InvalidRequestError("give each row's draw either as uniforms or as streams with steps")
    if streams is not None and (steps is None or len(steps) != len(streams)):
        raise InvalidRequestError("streams need one step count per row")
    draws: Sequence[object] | torch.Tensor = streams if streams is not None else uniforms  # type: ignore[assignment]
    if any(len(x) != rows for x in (temperatures, top_ks, top_ps, counts, draws)):
        raise InvalidRequestError(f"every per-row list must have {rows} entries (the logits' rows)")
    drawn = [True] * rows if isinstance(draws, torch.Tensor) else [d is not None for d in draws]
    plan = _plan(vocab, temperatures, top_ks, top_ps, counts, drawn)
    device = logits.device

    # One host-to-device transfer of everything per row: int64 columns, fp64 ones carried as their bits.
    index_lists = [plan.greedy, plain := plan.plain, plan.topk, plan.sort, plan.full, plan.top, plan.top_in_full]
    ints = [as_int64(s) if s is not None else 0 for s in streams] if streams is not None else [0] * rows
    ints += list(steps) if steps is not None else [0] * rows
    ints += plan.k_eff
    for idx in index_lists:
        ints += idx
    floats = [float(t) for t in temperatures] + [float(p) for p in top_ps]
    given_uniforms = uniforms is not None and not isinstance(uniforms, torch.Tensor)
    if given_uniforms:
        floats += [float(u) if u is not None else 0.0 for u in uniforms]  # type: ignore[union-attr]
    host = torch.cat(
        [torch.tensor(ints, dtype=torch.int64), torch.tensor(floats, dtype=torch.float64).view(torch.int64)]
    )
    if device.type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True)
    cuts = [rows, rows, rows] + [len(idx) for idx in index_lists] + [rows, rows] + ([rows] if given_uniforms else [])
    parts = list(torch.split(packed, cuts))
    keys, counts_t, k_eff = parts[0:3]
    g_idx, p_idx, k_idx, s_idx, f_idx, t_idx, t_in_f = parts[3:10]
    temps = parts[10].view(torch.float64).float()  # fp32 temperatures, as the logits
    ps = parts[11].view(torch.float64)
    if isinstance(uniforms, torch.Tensor):
        u = uniforms.to(device=device, dtype=torch.float64)
    elif given_uniforms:
        u = parts[12].view(torch.float64)
    else:
        u = draw_uniforms(keys, counts_t)

    def take(idx_list: list[int], idx: torch.Tensor) -> torch.Tensor:
        return logits if len(idx_list) == rows else logits.index_select(0, idx)

    tokens = torch.zeros(rows, dtype=torch.int64, device=device)
    logprobs = torch.zeros(rows, dtype=torch.float32, device=device)
    if plan.greedy:
        tokens[g_idx] = take(plan.greedy, g_idx).argmax(dim=-1)
    if plain:
        z = take(plain, p_idx)
        scaled = z / temps[p_idx, None] if any(temperatures[b] != 1 for b in plain) else z  # / 1 is exact
        w = torch.softmax(scaled, dim=-1)  # one fused pass: max, exp, sum, divide
        cdf = w.cumsum(dim=-1, dtype=torch.float64)
        picked = _inverse_cdf(cdf, cdf[:, -1], u[p_idx])
        del cdf
        tokens[p_idx] = picked
        # T == 1: log_softmax(z)[token] = z[token] - max(z) + log(w[argmax]), precise even where w[token] is
        # subnormal (w[argmax] >= 1 / V); the other rows get theirs below.
        top, arg = z.max(dim=-1, keepdim=True)
        logprobs[p_idx] = (z.gather(1, picked[:, None]) - top + w.gather(1, arg).log())[:, 0]
        del w
    for sub, sub_idx in ((plan.topk, k_idx), (plan.sort, s_idx)):
        if not sub:
            continue
        z = take(sub, sub_idx)
        if sub is plan.topk:
            vals, ids = _top_by_key(z, max(plan.k_eff[b] for b in sub))
        else:
            vals, ids = z.sort(dim=-1, descending=True, stable=True)
        tokens[sub_idx] = _draw_sorted(vals, ids, temps[sub_idx], k_eff[sub_idx], ps[sub_idx], u[sub_idx])
    k_max = max(counts, default=0)
    top_ids = torch.zeros(rows, k_max, dtype=torch.int64, device=device)
    top_lps = torch.zeros(rows, k_max, dtype=torch.float32, device=device)
    if plan.full:
        log_probs = torch.log_softmax(take(plan.full, f_idx), dim=-1)
        logprobs[f_idx] = log_probs.gather(1, tokens[f_idx, None])[:, 0]
        if plan.top:
            asked = log_probs if len(plan.top) == len(plan.full) else log_probs.index_select(0, t_in_f)
            top_lps[t_idx], top_ids[t_idx] = _top_by_key(asked, k_max)
    return Choices(tokens, logprobs, top_ids, top_lps, tuple(counts))


def _inverse_cdf(cdf: torch.Tensor, total: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the first index with cdf > u * total (fp64 [R, W], [R], [R]); the target is kept strictly below total,
    so the index's own weight is > 0 (cdf rises there)."""
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0]


def _draw_sorted(
    vals: torch.Tensor, ids: torch.Tensor, temps: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """The truncated rows' draw over candidates sorted by (z descending, index ascending): vals fp32 [R, W], their
    vocabulary ids [R, W], per row T (fp32), k (<= W), p and u (fp64)."""
    w = (vals - vals[:, :1]).div_(temps[:, None]).exp_()
    rank = torch.arange(vals.shape[1], device=vals.device)
    w.masked_fill_(rank[None, :] >= ks[:, None], 0.0)
    cdf = w.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    kept = ((cdf - w) < ps[:, None] * total).sum(dim=-1)  # a prefix: the mass before a rank only grows
    kept_total = cdf.gather(1, (kept - 1)[:, None])[:, 0]
    pos = _inverse_cdf(cdf, kept_total, u)
    return ids.gather(1, pos[:, None])[:, 0]


def _top_by_key(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of fp32 z [R, V] ordered by (value descending, index ascending), exactly: one int64
    key per entry (the fp32 bits made order-preserving, then the reversed index), so ties never depend on topk's
    algorithm. Returns (values fp32 [R, k], ids int64 [R, k])."""
    bits = (z + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0, equal as in a sort
    bits ^= (bits >> 31) & 0x7FFFFFFF  # negative floats: larger magnitude, smaller key (int32 keeps it cheap)
    reverse_index = (1 << 32) - 1 - torch.arange(z.shape[1], device=z.device, dtype=torch.int64)
    keys = torch.add(reverse_index, bits.to(torch.int64), alpha=1 << 32)  # fits int64: |bits| <= 2^31
    top = keys.topk(k, dim=-1, largest=True, sorted=True).values
    ids = (1 << 32) - 1 - (top & 0xFFFFFFFF)
    return z.gather(1, ids), ids


# ---- the specification, row by row -----------------------------------------------------------------------------------
def choose_tokens_reference(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ks: Sequence[int],
    top_ps: Sequence[float],
    uniforms: Sequence[float | None],
    topk_logprobs: Sequence[int] | None = None,
) -> Choices:
    """The module docstring's definition, one row at a time, truncated rows through a full stable sort."""
    rows, vocab = logits.shape
    counts = [0] * rows if topk_logprobs is None else list(topk_logprobs)
    k_max = max(counts, default=0)
    tokens, logprobs = [], []
    top_ids = torch.zeros(rows, k_max, dtype=torch.int64)
    top_lps = torch.zeros(rows, k_max, dtype=torch.float32)
    for b in range(rows):
        z = logits[b].detach().cpu()
        temp, k, p, u = temperatures[b], top_ks[b], top_ps[b], uniforms[b]
        k = vocab if k < 0 or k >= vocab else k
        t32 = torch.tensor(float(temp), dtype=torch.float32)
        if temp == 0:
            token = int(torch.nonzero(z == z.max())[0, 0])
        else:
            assert u is not None
            if k >= vocab and p >= 1:
                w = torch.softmax(z / t32, dim=0)
                order = torch.arange(vocab)
            else:
                s, order = z.sort(descending=True, stable=True)
                w = ((s - s[0]) / t32).exp()
                w[k:] = 0.0
            cdf = w.cumsum(0, dtype=torch.float64)
            total = cdf[-1]
            kept = int(((cdf - w) < p * total).sum())
            kept_total = cdf[kept - 1]
            below = torch.nextafter(kept_total, torch.tensor(0.0, dtype=torch.float64))
            target = torch.minimum(torch.tensor(u, dtype=torch.float64) * kept_total, below)
            token = int(order[int((cdf[:kept] <= target).sum())])
        log_probs = torch.log_softmax(z, 0)
        tokens.append(token)
        logprobs.append(float(log_probs[token]))
        if counts[b]:
            s, order = log_probs.sort(descending=True, stable=True)
            top_ids[b, : counts[b]] = order[: counts[b]]
            top_lps[b, : counts[b]] = s[: counts[b]]
    return Choices(
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(logprobs, dtype=torch.float32),
        top_ids,
        top_lps,
        tuple(counts),
    )


# ---- prompt logprobs -------------------------------------------------------------------------------------------------
def top_logprobs(logprobs: torch.Tensor, ks: Sequence[int]) -> list[list[tuple[int, float]] | None]:
    """Per row the ks[row] most likely (token_id, logprob), sorted by logprob descending; None where ks[row] == 0.
    logprobs: fp32 [B, V]. One topk over the batch, one host copy."""
    k_max = min(max(ks, default=0), logprobs.shape[-1])
    if k_max <= 0:
        return [None] * len(ks)
    values, ids = torch.topk(logprobs, k_max, dim=-1, largest=True, sorted=True)
    values_l, ids_l = values.cpu().tolist(), ids.cpu().tolist()
    return [list(zip(ids_l[b][:k], values_l[b][:k], strict=True)) if k > 0 else None for b, k in enumerate(ks)]

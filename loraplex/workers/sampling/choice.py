"""How the native sampler picks a token from a row's logits: greedy, or temperature -> top-k -> top-p -> one draw.

Semantics per row (fp32 logits z over the vocabulary):

    logprobs = log_softmax(z)                                  # what is reported: the raw policy's logprob
    temperature == 0:  token = argmax(z)                       # greedy (first index of the max)
    else:
        p      = softmax(z / temperature), sorted descending (stable: ties keep vocabulary order)
        keep   = rank < top_k                                  # top_k = -1: every token
        p_k    = p * keep / sum(p * keep)                      # renormalised over the top-k
        keep  &= cumsum(p_k) - p_k < top_p                     # smallest prefix with mass >= top_p (first kept)
        token  = inverse CDF of p * keep at u * sum(p * keep)  # u ~ U[0, 1) from the row's own generator

The draw u comes from the row's own CPU `torch.Generator`, seeded from (seed, sample index): one draw per sampled token,
so a row's tokens do not depend on what else is in the batch (every other operation is row-wise). top_k = 1 keeps only
the argmax, so it equals greedy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch


def row_seed(seed: int, sample_index: int) -> int:
    """A 63-bit generator seed from (job seed, sample index): different samples of one job draw independently."""
    digest = hashlib.blake2b(f"{int(seed)}/{int(sample_index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def row_generator(seed: int, sample_index: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(row_seed(seed, sample_index))


def draw_uniform(generator: torch.Generator) -> float:
    """One U[0, 1) draw (float64) from the row's generator."""
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def choose_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ks: Sequence[int],
    top_ps: Sequence[float],
    uniforms: Sequence[float | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: fp32 [B, V] on any device; per row its temperature (0 = greedy), top_k (-1 = off), top_p and draw (None
    for a greedy row). Returns (tokens int64 [B], log_softmax(logits) fp32 [B, V]) on the logits' device."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, t in enumerate(temperatures) if t > 0]
    if not sampled:
        return tokens, logprobs
    device = logits.device
    vocab = logits.shape[-1]
    idx = torch.tensor(sampled, dtype=torch.int64, device=device)
    temps = torch.tensor([float(temperatures[i]) for i in sampled], dtype=torch.float32, device=device)
    ks = torch.tensor([vocab if top_ks[i] < 0 else min(int(top_ks[i]), vocab) for i in sampled], device=device)
    ps = torch.tensor([float(top_ps[i]) for i in sampled], dtype=torch.float32, device=device)
    draws = [uniforms[i] for i in sampled]
    if any(u is None for u in draws):
        raise ValueError("every sampled row needs a uniform draw")
    us = torch.tensor(draws, dtype=torch.float32, device=device)

    scaled = logits.index_select(0, idx) / temps[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    keep = torch.arange(vocab, device=device)[None, :] < ks[:, None]
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    renorm = kept / kept.sum(dim=-1, keepdim=True)
    keep &= (renorm.cumsum(dim=-1) - renorm) < ps[:, None]
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = kept.cumsum(dim=-1)
    target = (us * cdf[:, -1]).unsqueeze(1)
    pos = torch.searchsorted(cdf, target, right=True)
    pos = torch.minimum(pos, (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0))
    tokens = tokens.index_copy(0, idx, order.gather(1, pos).squeeze(1))
    return tokens, logprobs


def top_logprobs(logprobs: torch.Tensor, ks: Sequence[int]) -> list[list[tuple[int, float]] | None]:
    """Per row the ks[row] most likely (token_id, logprob), sorted by logprob descending; None where ks[row] == 0.
    logprobs: fp32 [B, V]. One topk over the batch, one host copy."""
    k_max = min(max(ks, default=0), logprobs.shape[-1])
    if k_max <= 0:
        return [None] * len(ks)
    values, ids = torch.topk(logprobs, k_max, dim=-1, largest=True, sorted=True)
    values_l, ids_l = values.cpu().tolist(), ids.cpu().tolist()
    return [list(zip(ids_l[b][:k], values_l[b][:k], strict=True)) if k > 0 else None for b, k in enumerate(ks)]

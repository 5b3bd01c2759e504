"""The plain-torch reference LoRA op: the oracle every fused path (grouped_mm, Triton, ...) is tested against."""

from __future__ import annotations

import torch

from loraplex.workers.lora.routing import Routing


def lora_delta_single(x: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor, routing: Routing) -> torch.Tensor:
    """One adapter owns every row: a plain matmul on its slot, no grouping.

    Semantics: delta = ((x @ A[s][:, :r]) * scale) @ B[s][:r]."""
    slot, rank, scale = routing.slots[0], routing.ranks[0], routing.scales[0]
    a = a_bank[slot, :, :rank].to(x.dtype)
    b = b_bank[slot, :rank, :].to(x.dtype)
    return ((x @ a) * scale) @ b


def lora_delta_reference(x: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor, routing: Routing) -> torch.Tensor:
    """LoRA delta for a mixed-adapter microbatch, as a Python loop over adapter groups.

    x: [N, in] (flattened batch*seq rows), a_bank: [S, in, r_max], b_bank: [S, r_max, out] (fp32 masters; cast to
    x.dtype for compute). Group g owns rows [starts[g], ends[g]) and has slot s_g, rank r_g, scale c_g = alpha_g / r_g:

        for g in range(G):
            rows = slice(starts[g], ends[g])
            delta[rows] = ((x[rows] @ A[s_g][:, :r_g]) * c_g) @ B[s_g][:r_g]

    Only the real-rank slices enter the graph, so the zero padding beyond r_g gets exactly zero gradient. Rows must be
    covered by the groups (ends[-1] == N)."""
    if routing.num_rows != x.shape[0]:
        raise ValueError(f"routing covers {routing.num_rows} rows but the layer sees {x.shape[0]}")
    if routing.num_groups == 1:
        return lora_delta_single(x, a_bank, b_bank, routing)
    pieces = []
    for start, end, slot, rank, scale in zip(
        routing.starts, routing.ends, routing.slots, routing.ranks, routing.scales, strict=True
    ):
        a = a_bank[slot, :, :rank].to(x.dtype)
        b = b_bank[slot, :rank, :].to(x.dtype)
        pieces.append(((x[start:end] @ a) * scale) @ b)
    return torch.cat(pieces, dim=0)

"""The frozen base weights of layers that read one input (q/k/v, gate/up), laid out one after another in one buffer.

Each layer keeps its own weight parameter, a view of its rows of the buffer, so every existing path reads it as
before; a caller that wants all the layers' outputs at once (the sampler's decode step) reads the whole buffer
(`stacked_weight`) and runs ONE matmul instead of one per layer. At a few hundred decode rows the separate k and v
products are too narrow to fill the GPU (a [256, 2560] x [2560, 1024] product is 16 output tiles of 128 x 128 on 132
SMs), and every product is one more kernel in each of the 36 layers of a decode step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


def stack_base_weights(linears: Sequence[nn.Linear]) -> bool:
    """Re-lay out the weights of `linears` (one input width, no bias, one dtype and device, frozen) as consecutive row
    blocks of one new buffer, in this order; each layer's weight becomes a frozen Parameter viewing its block (the old
    storage is freed). Returns False (and changes nothing) where the layers do not qualify."""
    weights = [layer.weight for layer in linears]
    if len(weights) < 2 or any(layer.bias is not None for layer in linears):
        return False
    first = weights[0]
    if any(w.requires_grad or w.dim() != 2 for w in weights):
        return False
    if any(w.shape[1] != first.shape[1] or w.dtype != first.dtype or w.device != first.device for w in weights):
        return False
    if stacked_weight(list(linears)) is not None:
        return True
    with torch.no_grad():
        buffer = torch.cat([w.detach() for w in weights], dim=0)
    start = 0
    for layer, w in zip(linears, weights, strict=True):
        rows = w.shape[0]
        layer.weight = nn.Parameter(buffer[start : start + rows], requires_grad=False)
        start += rows
    return True


def stack_all(groups: Iterable[Sequence[nn.Linear]]) -> int:
    """`stack_base_weights` for each group of layers; returns how many groups were stacked."""
    return sum(stack_base_weights(group) for group in groups)


def stacked_weight(modules: Sequence[nn.Module]) -> torch.Tensor | None:
    """The [sum of out, in] weight whose consecutive row blocks are these Linears' weights (one storage, no gaps, in
    this order), as a view; None where they are not laid out so (then run them one by one)."""
    linears = [m for m in modules if isinstance(m, nn.Linear)]
    if len(linears) < 2 or len(linears) != len(modules) or any(m.bias is not None for m in linears):
        return None
    weights = [m.weight for m in linears]
    first = weights[0]
    if any(not w.is_contiguous() or w.dim() != 2 or w.shape[1] != first.shape[1] for w in weights):
        return None
    if any(w.dtype != first.dtype or w.device != first.device for w in weights):
        return None
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for w in weights:
        if w.untyped_storage().data_ptr() != storage or w.storage_offset() != offset:
            return None
        offset += w.numel()
    rows = sum(w.shape[0] for w in weights)
    return first.detach().as_strided((rows, first.shape[1]), first.stride())

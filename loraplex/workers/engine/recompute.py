"""Activation recomputation per decoder layer, switched per microbatch.

A layer's forward under `torch.utils.checkpoint` (non-reentrant) keeps only its input; its backward runs the forward
again. That trades ~a third more compute for activations of one layer instead of all of them, which is what lets one
long sequence train (the longest single sequence one GPU trains is measured in benchmarks/RESULTS.md). It costs at
ordinary sizes, so the engine turns it on only for microbatches above a token count (`RecomputePolicy`).

The recomputed forward runs inside the same LoRA context (the engine's backward happens inside `context.use`), so it
reads the same routing and banks; its gradients are the plain forward's (tests/unit/workers/test_recompute.py).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch.utils.checkpoint
from torch import nn

from loraplex.runtime.thread_switch import ThreadSwitch

_state = ThreadSwitch()


@dataclass(frozen=True)
class RecomputePolicy:
    """mode "auto": recompute the layers of microbatches of more than `above_tokens` tokens; "always"; "never"."""

    mode: str = "auto"
    above_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "always", "never"):
            raise ValueError(f"activation recomputation mode must be auto, always or never, not {self.mode!r}")
        if self.above_tokens < 1:
            raise ValueError("above_tokens must be positive")

    def wants(self, tokens: int) -> bool:
        return self.mode == "always" or (self.mode == "auto" and tokens > self.above_tokens)


def recomputing(on: bool) -> AbstractContextManager[None]:
    """Recompute the wrapped layers' forwards in the backward inside this block when `on`."""
    return _state.set(on)


def wrap_layers(layers: Sequence[nn.Module]) -> None:
    """Give each layer a forward that runs under torch.utils.checkpoint inside `recomputing(True)` (and when grads
    are on), its own forward otherwise."""
    for layer in layers:
        eager = layer.forward

        def forward(self: nn.Module, *args: Any, _eager: Any = eager, **kwargs: Any) -> Any:
            if _state.on and torch.is_grad_enabled():
                return torch.utils.checkpoint.checkpoint(_eager, *args, use_reentrant=False, **kwargs)
            return _eager(*args, **kwargs)

        layer.forward = types.MethodType(forward, layer)

"""The decoder's elementwise work fused by torch.compile on CUDA (issue 14): RMSNorm and the gated MLP's silu(gate) * up.

HF's Qwen3 / Llama / Qwen2 RMSNorm is seven kernels forward (cast to fp32, square, mean, add eps, rsqrt, multiply, cast
back, weight) and more backward, over every token of every layer, four norms a layer with Qwen3's q/k norms; the MLP's
activation is two more. On the H200 these memory-bound kernels took about as much device time as the matmuls' half
(benchmarks/RESULTS.md, the 8x512 profile) and thousands of launches. Compiled, each is one fused kernel forward and
one or two backward, with the same maths: fp32 statistics, the result cast back before the weight multiplies, as HF's.

Only inside the engine's training microbatches (`active()`): the modules keep their eager forward everywhere else (the
sampler's CUDA-graph decode captures the eager kernels; PEFT comparisons run HF's code). The eager forward is the
plain-torch reference; tests/gpu/test_fused_elementwise.py compares them. Shapes vary with every microbatch, so the
functions are compiled with dynamic shapes (one compile per function, counted in the benchmark).
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_state = threading.local()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: fp32 statistics, cast back to the input dtype, then times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@contextlib.contextmanager
def active() -> Iterator[None]:
    """The fused forwards on for the calls inside (the engine's training microbatch)."""
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


def _on() -> bool:
    return bool(getattr(_state, "on", False))


def is_rms_norm(m: nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and isinstance(m.weight, torch.Tensor)


def is_silu_gated_mlp(m: nn.Module) -> bool:
    act = getattr(m, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return silu and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))


def install(model: nn.Module, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None) -> int:
    """Give every RMSNorm and silu-gated MLP of `model` a forward that runs the fused function while `active()`, the
    module's own forward otherwise. compile_fn: how to compile (default torch.compile with dynamic shapes; tests pass
    the identity to check the dispatch on CPU). Returns the number of modules changed."""
    compile_fn = compile_fn or (lambda f: torch.compile(f, dynamic=True, fullgraph=True))
    norm, gated = compile_fn(rms_norm), compile_fn(silu_mul)
    changed = 0
    for m in model.modules():
        eager = m.forward
        if is_rms_norm(m):

            def norm_forward(self: nn.Module, x: torch.Tensor, _eager: Any = eager) -> torch.Tensor:
                return norm(x, self.weight, self.variance_epsilon) if _on() else _eager(x)

            m.forward = types.MethodType(norm_forward, m)
            changed += 1
        elif is_silu_gated_mlp(m):

            def mlp_forward(self: Any, x: torch.Tensor, _eager: Any = eager) -> torch.Tensor:
                if not _on():
                    return _eager(x)
                return self.down_proj(gated(self.gate_proj(x), self.up_proj(x)))

            m.forward = types.MethodType(mlp_forward, m)
            changed += 1
    return changed

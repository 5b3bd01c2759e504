"""The decoder's RMSNorms and gated-MLP activations as fused kernels in the engine's training microbatches (issue 14,
item 3): workers/triton_elementwise.py on CUDA where triton is.

HF's RMSNorm is about seven kernels forward and more backward over every token of every layer (four norms a layer with
Qwen3's q/k norms), the MLP's activation two more: memory-bound work that took a large share of the H200's device time
in the 8x512 profile (benchmarks/RESULTS.md), plus thousands of launches on a host-bound step. (torch.compile of the
same two functions was measured slower: dynamo's per-call guards on that host-bound step, and its recompile limit under
FSDP; RESULTS.md, session 7.)

Only inside the engine's training microbatches (`active()`): the modules keep their eager forward everywhere else (the
sampler's CUDA-graph decode captures the eager kernels; PEFT comparisons run HF's code). The eager forward is the
plain-torch reference; tests/gpu/test_fused_elementwise_cuda.py compares them. Not measured on the H200 yet, so the
engine leaves it off unless asked (`Engine(fused_elementwise=True)`; `bench_engine.py --elementwise on,off`).
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
    """HF's RMSNorm: fp32 statistics, cast back to the input dtype, then times the weight (plain torch)."""
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


def available() -> bool:
    """Triton kernels can run here (the GPU image has triton; the CPU venv does not)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def install(model: nn.Module, kernels: tuple[Callable[..., Any], Callable[..., Any]] | None = None) -> int:
    """Give every RMSNorm (frozen weight) and silu-gated MLP of `model` a forward that runs the fused kernel while
    `active()`, the module's own forward otherwise. kernels: (rms_norm, silu_mul) to use (default the Triton ones;
    tests pass this module's plain-torch ones to check the dispatch on CPU). Returns the number of modules changed."""
    if kernels is None:
        from loraplex.workers import triton_elementwise

        kernels = (triton_elementwise.rms_norm, triton_elementwise.silu_mul)
    norm, gated = kernels
    changed = 0
    for m in model.modules():
        eager = m.forward
        if is_rms_norm(m) and not m.weight.requires_grad:

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

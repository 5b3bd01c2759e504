"""The decoder's RMSNorms and gated-MLP activations as fused kernels in the engine's training microbatches:
workers/kernels/triton_elementwise.py on CUDA where triton is.

HF's RMSNorm is about seven kernels forward and more backward over every token of every layer (four norms a layer with
Qwen3's q/k norms), the MLP's activation two more: memory-bound work that took a large share of the H200's device time
in the 8x512 profile (benchmarks/RESULTS.md), plus thousands of launches on a host-bound step. (torch.compile of the
same two functions was measured slower: dynamo's per-call guards on that host-bound step, and its recompile limit under
FSDP; RESULTS.md, 2026-12-01, H200.)

Only inside the engine's training microbatches (`active()`): the modules keep their eager forward everywhere else (the
sampler's CUDA-graph decode captures the eager kernels; PEFT comparisons run HF's code). The eager forward is the
plain-torch reference; tests/gpu/test_fused_elementwise_cuda.py compares them. Not measured on the H200 yet, so the
engine leaves it off unless asked (`EngineConfig(fused_elementwise=True)`; `bench_engine.py --elementwise on,off`).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.runtime.thread_switch import ThreadSwitch

_state = ThreadSwitch()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: fp32 statistics, cast back to the input dtype, then times the weight (plain torch)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's apply_rotary_pos_emb for q, k [tokens, heads, D] and cos, sin [tokens, D] (plain torch, HF's own ops)."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def active() -> AbstractContextManager[None]:
    """The fused forwards on for the calls inside (the engine's training microbatch)."""
    return _state.set()


def _on() -> bool:
    return _state.on


def is_rms_norm(m: nn.Module) -> bool:
    return (
        type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and isinstance(m.weight, torch.Tensor)
    )


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


Kernels = tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]


def _rope_dispatch(eager: Callable[..., Any], fused: Callable[..., Any]) -> Callable[..., Any]:
    """An apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) that runs `fused` while `active()` on HF's layout
    (q, k [B, heads, T, D] views of [B, T, heads, D]; cos, sin [B or 1, T, D] covering the whole head dim), `eager` else."""

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        usable = (
            _on()
            and unsqueeze_dim == 1
            and q.dim() == k.dim() == 4
            and cos.dim() == sin.dim() == 3
            and cos.shape[-1] == q.shape[-1]
            and cos.shape[0] in (1, q.shape[0])
            and cos.shape[1] == q.shape[2]
        )
        if not usable:
            return cast(tuple[torch.Tensor, torch.Tensor], eager(q, k, cos, sin, *args, **kwargs))
        b, _, t, d = q.shape
        cos, sin = cos.expand(b, t, d).reshape(b * t, d), sin.expand(b, t, d).reshape(b * t, d)  # shared positions
        qe, ke = fused(q.transpose(1, 2).reshape(b * t, -1, d), k.transpose(1, 2).reshape(b * t, -1, d), cos, sin)
        return qe.view(b, t, -1, d).transpose(1, 2), ke.view(b, t, -1, d).transpose(1, 2)

    apply_rotary_pos_emb.eager = eager  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _install_rope(module: nn.Module, fused: Callable[..., Any]) -> bool:
    """Point the modeling module of `module` (an attention class calling its module's apply_rotary_pos_emb) at the
    dispatching version (wrapping the module's own function again when installed before: the latest kernels win).
    Returns whether the module's attention will use it."""
    modeling = sys.modules.get(type(module).__module__)
    current = getattr(modeling, "apply_rotary_pos_emb", None)
    if modeling is None or not callable(current):
        return False
    eager = getattr(current, "eager", current)
    modeling.apply_rotary_pos_emb = _rope_dispatch(eager, fused)  # type: ignore[attr-defined]
    return True


def install(model: nn.Module, kernels: Kernels | None = None) -> int:
    """Give every RMSNorm (frozen weight) and silu-gated MLP of `model` a forward that runs the fused kernel while
    `active()`, the module's own forward otherwise, and point the rotary embedding of its attention's modeling module
    at a dispatching version (the eager function outside `active()`, and for every call of another model's).
    kernels: (rms_norm, silu_mul, rope) to use (default the Triton ones; tests pass this module's plain-torch ones to
    check the dispatch on CPU). Returns the number of modules changed."""
    if kernels is None:
        from loraplex.workers.kernels import triton_elementwise

        kernels = (triton_elementwise.rms_norm, triton_elementwise.silu_mul, triton_elementwise.rope)
    norm, gated, rotary = kernels
    changed = 0
    for m in model.modules():
        if all(hasattr(m, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and _install_rope(m, rotary):
            changed += 1
            continue
        eager = getattr(m, "_loraplex_eager_forward", m.forward)  # installed before: wrap the module's own forward
        if is_rms_norm(m) and not m.weight.requires_grad:

            def norm_forward(self: nn.Module, x: torch.Tensor, _eager: Any = eager) -> torch.Tensor:
                return norm(x, self.weight, self.variance_epsilon) if _on() else _eager(x)

            m.forward = types.MethodType(norm_forward, m)
            m._loraplex_eager_forward = eager  # type: ignore[assignment]
            changed += 1
        elif is_silu_gated_mlp(m):

            def mlp_forward(self: Any, x: torch.Tensor, _eager: Any = eager) -> torch.Tensor:
                if not _on():
                    return _eager(x)
                return self.down_proj(gated(self.gate_proj(x), self.up_proj(x)))

            m.forward = types.MethodType(mlp_forward, m)
            m._loraplex_eager_forward = eager  # type: ignore[assignment]
            changed += 1
    return changed

"""Expert LoRA in PEFT's format (issue 15): PEFT's `target_parameters` LoRA on transformers' fused expert parameters.

PEFT (0.17+) puts one LoRA on each targeted 3-D parameter: for `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]
(the experts' (out, in) matrices), `lora_A.weight` [r' E, in] whose rows e r' .. (e+1) r' are expert e's A, and
`lora_B.weight` [out, r' E] whose column j E + e is column j of expert e's B (its reshape to [out, r', E]); expert e's
delta is scaling * B_e A_e, scaling = alpha' / r'. Two parameters of one module nest: the inner wrapper (its keys under
`<experts>.base_layer.`) holds gate_up_proj, the outer (under `<experts>.`) down_proj, as PEFT's sorted matching wraps
them (tests/unit/test_export_moe.py loads the files with PEFT and compares outputs).

Our adapters have separate gate and up LoRA (checkpoint layout: A [E, r, in], B [E, out, r] per projection), which
is exactly one fused gate_up LoRA of rank 2r: A'_e = [A_gate_e; A_up_e], B'_e = [[B_gate_e, 0], [0, B_up_e]] (the
gate's rows of gate_up_proj first, as the experts' forward chunks them), with alpha' = 2 alpha so that the scaling is
the same alpha / r (PEFT's rank_pattern / alpha_pattern say so). down_proj maps one to one (rank r). A projection the
adapter does not train contributes zeros.
"""

from __future__ import annotations

import torch

from loraplex.workers.state.checkpoint import PEFT_PREFIX, CheckpointState

GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def expert_modules(state: CheckpointState) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's expert projections by experts module: {<experts>: {leaf: (A [E, r, in], B [E, out, r])}}."""
    found: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, (a, b) in state.weights.items():
        if a.dim() == 3:
            experts, _, leaf = name.rpartition(".")
            found.setdefault(experts, {})[leaf] = (a, b)
    return found


def _peft_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert A [E, r, in], B [E, out, r] -> PEFT's lora_A [r E, in] (expert-major), lora_B [out, r E] (rank-major)."""
    experts, rank, n_in = a.shape
    return a.reshape(experts * rank, n_in).contiguous(), b.permute(1, 2, 0).reshape(
        b.shape[1], rank * experts
    ).contiguous()


def moe_tensors(state: CheckpointState) -> dict[str, torch.Tensor]:
    """PEFT's tensors for the adapter's expert projections (module doc)."""
    tensors: dict[str, torch.Tensor] = {}
    for experts, parts in expert_modules(state).items():
        gate_up = "gate_proj" in parts or "up_proj" in parts
        if gate_up:
            like_a, like_b = parts.get("gate_proj", parts.get("up_proj"))  # type: ignore[misc]
            e, r, n_in = like_a.shape
            inter = like_b.shape[1]
            a = torch.zeros(e, 2 * r, n_in)
            b = torch.zeros(e, 2 * inter, 2 * r)
            if "gate_proj" in parts:
                a[:, :r], b[:, :inter, :r] = parts["gate_proj"]
            if "up_proj" in parts:
                a[:, r:], b[:, inter:, r:] = parts["up_proj"]
            inner = f"{experts}.base_layer" if "down_proj" in parts else experts
            peft_a, peft_b = _peft_pair(a, b)
            tensors[f"{PEFT_PREFIX}{inner}.lora_A.weight"], tensors[f"{PEFT_PREFIX}{inner}.lora_B.weight"] = (
                peft_a,
                peft_b,
            )
        if "down_proj" in parts:
            peft_a, peft_b = _peft_pair(*parts["down_proj"])
            tensors[f"{PEFT_PREFIX}{experts}.lora_A.weight"], tensors[f"{PEFT_PREFIX}{experts}.lora_B.weight"] = (
                peft_a,
                peft_b,
            )
    return tensors


def moe_config(state: CheckpointState) -> dict[str, object]:
    """adapter_config.json's additions: target_parameters, and the fused gate_up's rank 2r / alpha 2 alpha."""
    leaves = {leaf for parts in expert_modules(state).values() for leaf in parts}
    targets = ([GATE_UP] if leaves & {"gate_proj", "up_proj"} else []) + ([DOWN] if "down_proj" in leaves else [])
    alpha = 2 * float(state.alpha)
    fused = {GATE_UP: 2 * int(state.rank)} if GATE_UP in targets else {}
    return {
        "target_parameters": sorted(targets),
        "rank_pattern": fused,
        "alpha_pattern": {GATE_UP: int(alpha) if alpha.is_integer() else alpha} if fused else {},
    }

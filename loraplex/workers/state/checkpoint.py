"""The checkpoint format: an adapter's weights (and Adam state) as versioned safetensors + JSON, written and verified
here; copied out of and into engine slots by checkpoint_state.py. Also the checkpoint name rule.

One checkpoint is one directory:

    adapter_model.safetensors  the weights, in PEFT's names and layout (so the file alone loads into PEFT):
                               base_model.model.<module>.lora_A.weight [r, in], base_model.model.<module>.lora_B.weight
                               [out, r]; its safetensors header's __metadata__ also carries "loraplex" (JSON: format
                               version, kind, model id, base model, signature, hparams, step), covered by its sha256.
    optimizer.safetensors      only with optimizer state: base_model.model.<module>.lora_A.exp_avg / .lora_A.exp_avg_sq
                               [r, in] and .lora_B.exp_avg / .lora_B.exp_avg_sq [out, r] (AdamW's moments).
    checkpoint.json            the manifest: format, format_version, kind ("state" | "sampler"), model_id, base_model,
                               signature {max_rank, target_modules, modules}, hparams {rank, alpha, seed}, step (the Adam
                               step count), user_metadata, created_at, files {name: {size, sha256}}, and manifest_sha256
                               (sha256 of the manifest's canonical JSON without that field).

An MoE's expert projection (`<experts>.gate_proj` / `.up_proj` / `.down_proj`, workers/lora/expert_bank.py) is stored
under the same names with one matrix per expert: lora_A [E, r, in], lora_B [E, out, r] (our layout; the PEFT export
converts it to PEFT's target_parameters LoRA of the fused experts: service/peft_export.py).

Only the real-rank parts are stored (the zero padding up to the pool's r_max is not), all fp32. Gradients are never
stored: like Tinker's save_state, a checkpoint holds weights + optimizer state; unconsumed gradients are dropped.

Writing is atomic as a whole (fsutil.write_folder_atomic): every file goes into a temporary sibling directory, is
fsynced, and the directory is then swapped into place, so a failure at any point (disk full, a crash) leaves the
previous checkpoint of that name intact and no temporary directory behind.

Reading verifies everything before returning anything: the format version, the manifest's own hash, every file's size
and sha256, the header embedded in the weights file against the manifest, and every tensor's name, dtype and shape
against the hparams. Anything off is an InvalidRequestError saying what (these hashes detect corruption and careless
edits; they are not a signature against a deliberate forger who rewrites every hash).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from loraplex.errors import InvalidRequestError

# The folder's format (file names, manifest digest, verified reads) is torch-free; importable from here too.
from loraplex.protocol.checkpoint_files import CHECKPOINT_FORMAT_VERSION as CHECKPOINT_FORMAT_VERSION
from loraplex.protocol.checkpoint_files import FORMAT_NAME as FORMAT_NAME
from loraplex.protocol.checkpoint_files import MANIFEST_FILE as MANIFEST_FILE
from loraplex.protocol.checkpoint_files import OPTIMIZER_FILE as OPTIMIZER_FILE
from loraplex.protocol.checkpoint_files import PEFT_PREFIX as PEFT_PREFIX
from loraplex.protocol.checkpoint_files import WEIGHTS_FILE as WEIGHTS_FILE
from loraplex.protocol.checkpoint_files import manifest_digest, manifest_field, read_folder

# The name rule lives in the torch-free checkpoint_paths (the gateway checks names too); importable from here too.
from loraplex.protocol.checkpoint_paths import SAVED_KINDS
from loraplex.protocol.checkpoint_paths import validate_checkpoint_name as validate_checkpoint_name
from loraplex.runtime.fsutil import write_folder_atomic

KINDS = tuple(str(k) for k in SAVED_KINDS)  # as plain strings: they appear in error messages
MOMENT_NAMES = ("lora_A.exp_avg", "lora_A.exp_avg_sq", "lora_B.exp_avg", "lora_B.exp_avg_sq")

Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])
Moments = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # module -> (m_A, v_A, m_B, v_B)


@dataclass
class CheckpointState:
    """One adapter's checkpointable state, fp32 CPU tensors in PEFT's layout (A [r, in], B [out, r])."""

    model_id: str
    rank: int
    alpha: float
    seed: int
    step: int  # the adapter's Adam step count when saved (restored only together with the optimizer state)
    base_model: str
    target_modules: tuple[str, ...]  # leaf names (q_proj, ...)
    modules: tuple[str, ...]  # full module names, in the pool's bank order
    max_rank_hint: int  # r_max of the pool it was saved from (informational: any pool with r_max >= rank loads it)
    weights: Weights
    optimizer: Moments | None = None  # same shapes as the weights: (exp_avg_A, exp_avg_sq_A, exp_avg_B, exp_avg_sq_B)
    kind: str = "state"  # "state" (save_state) | "sampler" (save_weights_for_sampler: weights only)
    user_metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointFiles:
    """What write_checkpoint wrote: every file (checkpoint.json included) with its size and sha256."""

    directory: Path
    files: dict[str, tuple[int, str]]
    total_size: int
    sha256: str  # of checkpoint.json as written (it names every other file's sha256)


# ---- files -------------------------------------------------------------------------------------------------------------
def write_checkpoint(state: CheckpointState, directory: Path) -> CheckpointFiles:
    """Write `state` as a checkpoint directory (see the module docstring), atomically: a failure leaves whatever was at
    `directory` before untouched. OSError (ENOSPC, EFBIG, ...) propagates as is."""
    validate_state(state)
    directory = Path(directory)
    if os.path.lexists(directory) and (not directory.is_dir() or directory.is_symlink()):
        raise InvalidRequestError(f"{directory} exists and is not a checkpoint directory")
    header = _header(state)
    blobs: dict[str, bytes] = {WEIGHTS_FILE: weights_file_bytes(state, header)}
    if state.optimizer is not None:
        tensors: dict[str, torch.Tensor] = {}
        for name in state.modules:
            for key, t in zip(MOMENT_NAMES, state.optimizer[name], strict=True):
                tensors[f"{PEFT_PREFIX}{name}.{key}"] = _own(t)
        blobs[OPTIMIZER_FILE] = safetensors.torch.save(tensors, metadata={"format": "pt"})
    files = {name: (len(data), hashlib.sha256(data).hexdigest()) for name, data in blobs.items()}
    manifest: dict[str, Any] = {
        **header,
        "user_metadata": state.user_metadata,
        "created_at": datetime.now(UTC).isoformat(timespec="microseconds"),
        "files": {name: {"size": size, "sha256": digest} for name, (size, digest) in files.items()},
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    manifest_bytes = (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
    blobs[MANIFEST_FILE] = manifest_bytes  # written last
    files[MANIFEST_FILE] = (len(manifest_bytes), hashlib.sha256(manifest_bytes).hexdigest())
    write_folder_atomic(directory, blobs)
    return CheckpointFiles(
        directory=directory,
        files=files,
        total_size=sum(size for size, _ in files.values()),
        sha256=files[MANIFEST_FILE][1],
    )


def read_checkpoint(directory: Path) -> CheckpointState:
    """Read and verify a checkpoint directory. NotFoundError when there is none; InvalidRequestError when any file is
    missing, truncated, tampered with or inconsistent (nothing is returned then)."""
    manifest, blobs = read_folder(directory)
    kind = manifest["kind"]

    signature = manifest_field(manifest, "signature", dict)
    hparams = manifest_field(manifest, "hparams", dict)
    modules = tuple(manifest_field(signature, "modules", list))
    if not all(isinstance(m, str) for m in modules):
        raise InvalidRequestError(f"{MANIFEST_FILE}: signature.modules must be names")
    user_metadata = manifest.get("user_metadata", {})
    if not isinstance(user_metadata, dict):
        raise InvalidRequestError(f"{MANIFEST_FILE}: user_metadata must be an object")
    weights_t = _load_tensors(blobs[WEIGHTS_FILE], WEIGHTS_FILE)
    weights = {
        name: (
            _take(weights_t, f"{PEFT_PREFIX}{name}.lora_A.weight"),
            _take(weights_t, f"{PEFT_PREFIX}{name}.lora_B.weight"),
        )
        for name in modules
    }
    _no_leftovers(weights_t, WEIGHTS_FILE)
    moments: Moments | None = None
    if OPTIMIZER_FILE in blobs:
        opt_t = _load_tensors(blobs[OPTIMIZER_FILE], OPTIMIZER_FILE)
        moments = {
            name: tuple(_take(opt_t, f"{PEFT_PREFIX}{name}.{key}") for key in MOMENT_NAMES)  # type: ignore[misc]
            for name in modules
        }
        _no_leftovers(opt_t, OPTIMIZER_FILE)
    state = CheckpointState(
        model_id=manifest_field(manifest, "model_id", str),
        rank=manifest_field(hparams, "rank", int),
        alpha=float(manifest_field(hparams, "alpha", (int, float))),
        seed=manifest_field(hparams, "seed", int),
        step=manifest_field(manifest, "step", int),
        base_model=manifest_field(manifest, "base_model", str),
        target_modules=tuple(manifest_field(signature, "target_modules", list)),
        modules=modules,
        max_rank_hint=manifest_field(signature, "max_rank", int),
        weights=weights,
        optimizer=moments,
        kind=kind,
        user_metadata=user_metadata,
    )
    validate_state(state)  # shapes vs hparams, module names, finite hparams
    return state


def weights_file_bytes(state: CheckpointState, header: Mapping[str, Any] | None = None) -> bytes:
    """adapter_model.safetensors's bytes: PEFT key names and layout, fp32; the loraplex header in its metadata."""
    return tensors_file_bytes(peft_tensors(state), header)


def peft_tensors(state: CheckpointState, only: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors by PEFT key name (these modules; default all), each with its own storage."""
    return {
        f"{PEFT_PREFIX}{name}.lora_{part}.weight": _own(t)
        for name in (state.modules if only is None else only)
        for part, t in zip("AB", state.weights[name], strict=True)
    }


def tensors_file_bytes(tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any] | None = None) -> bytes:
    """A safetensors file's bytes (metadata format pt, and the loraplex header when given)."""
    metadata = {"format": "pt"}
    if header is not None:
        metadata["loraplex"] = json.dumps(header, sort_keys=True, allow_nan=False)
    return _metadata_sorted(safetensors.torch.save(dict(tensors), metadata=metadata))


def _metadata_sorted(data: bytes) -> bytes:
    """The same file with its metadata's keys in sorted order. safetensors writes them in the order of a Rust HashMap,
    which is seeded per process, so the same weights saved by two processes (a save, and the same save rebuilt by a
    restarted pool) would differ in their header bytes alone; sorted, equal weights give equal files."""
    (length,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + length]
    header = json.loads(raw, object_pairs_hook=dict)
    if "__metadata__" not in header:
        return data
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > length:  # another spelling than safetensors' (never seen): keep its bytes
        return data
    return data[:8] + text.ljust(length, b" ") + data[8 + length :]


# ---- helpers -----------------------------------------------------------------------------------------------------------


def _header(state: CheckpointState) -> dict[str, Any]:
    return {
        "format": FORMAT_NAME,
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "kind": state.kind,
        "model_id": state.model_id,
        "base_model": state.base_model,
        "signature": {
            "max_rank": int(state.max_rank_hint),
            "target_modules": list(state.target_modules),
            "modules": list(state.modules),
        },
        "hparams": {"rank": int(state.rank), "alpha": float(state.alpha), "seed": int(state.seed)},
        "step": int(state.step),
    }


def validate_state(state: CheckpointState) -> None:
    """Internal consistency: hparams in range, kind, modules named and unique, tensors fp32-able with the right shapes."""

    def bad(msg: str) -> InvalidRequestError:
        return InvalidRequestError(f"checkpoint state invalid: {msg}")

    if state.kind not in KINDS:
        raise bad(f"kind must be one of {KINDS}, got {state.kind!r}")
    if not isinstance(state.model_id, str) or not isinstance(state.base_model, str):
        raise bad("model_id and base_model must be strings")
    for name in ("rank", "seed", "step", "max_rank_hint"):
        value = getattr(state, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(f"{name} must be an integer, got {value!r}")
    if state.rank < 1 or state.step < 0 or state.rank > state.max_rank_hint:
        raise bad(f"rank {state.rank} (max {state.max_rank_hint}) and step {state.step} out of range")
    if isinstance(state.alpha, bool) or not isinstance(state.alpha, int | float):
        raise bad(f"alpha must be a number, got {state.alpha!r}")
    if not math.isfinite(state.alpha) or state.alpha <= 0:
        raise bad(f"alpha must be positive and finite, got {state.alpha!r}")
    if state.kind == "sampler" and state.optimizer is not None:
        raise bad("a sampler checkpoint holds weights only")
    if not isinstance(state.user_metadata, dict):
        raise bad("user_metadata must be a dict")
    try:
        json.dumps(state.user_metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise bad(f"user_metadata must be plain JSON ({exc})") from None
    modules = state.modules
    if not modules or len(set(modules)) != len(modules) or not all(isinstance(m, str) and m for m in modules):
        raise bad("modules must be distinct, non-empty names")
    targets = state.target_modules
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise bad("target_modules must be non-empty names")
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    if leaves != set(targets):
        raise bad(f"modules' leaf names {sorted(leaves)} do not match target_modules {sorted(set(targets))}")
    if set(state.weights) != set(modules):
        raise bad("weights must cover exactly the modules")
    if state.optimizer is not None and set(state.optimizer) != set(modules):
        raise bad("optimizer state must cover exactly the modules")
    for name in modules:
        a, b = state.weights[name]
        fits = _is_matrix(a) and _is_matrix(b) and a.shape[:-2] == b.shape[:-2]  # an expert projection: [E, ...] both
        if not fits or a.shape[-2] != state.rank or b.shape[-1] != state.rank:
            raise bad(f"{name}: A must be [(experts,) rank={state.rank}, in] and B [(experts,) out, rank], got "
                      f"{tuple(getattr(a, 'shape', ()))}, {tuple(getattr(b, 'shape', ()))}")  # fmt: skip
        if state.optimizer is not None:
            for key, t, like in zip(MOMENT_NAMES, state.optimizer[name], (a, a, b, b), strict=True):
                if not _is_matrix(t) or t.shape != like.shape:
                    raise bad(f"{name}.{key} must be shaped like its weight {tuple(like.shape)}")


def _is_matrix(t: object) -> bool:
    """A LoRA factor: a matrix, or a stack of one per expert (an MoE's expert projection), nothing empty."""
    return isinstance(t, torch.Tensor) and t.dim() in (2, 3) and t.is_floating_point() and min(t.shape) > 0


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous fp32 CPU tensor with its own storage (safetensors refuses shared storage)."""
    return t.detach().to("cpu", torch.float32).clone(memory_format=torch.contiguous_format)


def _load_tensors(data: bytes, name: str) -> dict[str, torch.Tensor]:
    try:
        tensors = safetensors.torch.load(data)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise InvalidRequestError(f"{name} is not a valid safetensors file ({exc})") from None
    for key, t in tensors.items():
        if t.dtype != torch.float32:
            raise InvalidRequestError(f"{name}: {key} is {t.dtype}, expected float32")
    return tensors


def _take(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return tensors.pop(key)
    except KeyError:
        raise InvalidRequestError(f"checkpoint tensor {key} is missing") from None


def _no_leftovers(tensors: dict[str, torch.Tensor], name: str) -> None:
    if tensors:
        raise InvalidRequestError(f"{name} holds unexpected tensors, e.g. {sorted(tensors)[:3]}")

"""A checkpoint folder's format, torch-free: its file names, the manifest's digest, and reading a file the manifest
lists with its size and sha256 verified. The torch side that writes and loads the tensors (workers/state/checkpoint.py,
whose module doc describes every field) and the numpy PEFT export (service/peft_export.py) both read folders through
these, so a folder is accepted or refused by the same rules on either side. Stdlib only."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.protocol.checkpoint_paths import SAVED_KINDS

CHECKPOINT_FORMAT_VERSION = 1
FORMAT_NAME = "loraplex-checkpoint"
MANIFEST_FILE = "checkpoint.json"
WEIGHTS_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
# The fields of the header embedded in the weights file's safetensors metadata, checked equal to the manifest's.
HEADER_KEYS = ("format", "format_version", "kind", "model_id", "base_model", "signature", "hparams", "step")
MAX_MANIFEST_BYTES = 64 << 20
PEFT_PREFIX = "base_model.model."  # the tensor names' prefix, PEFT's own


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON, its own digest field left out."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    try:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{MANIFEST_FILE}: values are not plain JSON") from None
    return hashlib.sha256(canonical.encode()).hexdigest()


def manifest_field(obj: Mapping[str, Any], name: str, types: type | tuple[type, ...]) -> Any:
    """The manifest's field `name`, of one of `types` (a bool never passes for a number)."""
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, types):
        raise InvalidRequestError(f"{MANIFEST_FILE}: field {name!r} missing or of the wrong type ({value!r})")
    return value


def read_capped(path: Path, limit: int) -> bytes:
    """The file's bytes, refused past `limit` without reading further."""
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise InvalidRequestError(f"{path.name} is larger than {limit} bytes")
    return data


def read_verified(directory: Path, name: str, entry: object) -> bytes:
    """The bytes of the file `name` the manifest lists as `entry` ({size, sha256}), hashed and returned from one read."""
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("size"), int)
        or not isinstance(entry.get("sha256"), str)
    ):
        raise InvalidRequestError(f"{MANIFEST_FILE}: bad entry for {name}")
    path = directory / name
    if not path.is_file():
        raise InvalidRequestError(f"checkpoint file {name} is missing")
    size = path.stat().st_size
    if size != entry["size"]:
        raise InvalidRequestError(
            f"checkpoint file {name} is {size} bytes, expected {entry['size']} (truncated or modified)"
        )
    data = read_capped(path, entry["size"])
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise InvalidRequestError(f"checkpoint file {name} is corrupted or tampered with (sha256 mismatch)")
    return data


def embedded_header(data: bytes) -> dict[str, Any]:
    """The loraplex header from a safetensors file's __metadata__ (the format: u64 LE header size, JSON header)."""
    try:
        size = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        header = json.loads(meta["loraplex"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise InvalidRequestError(f"{WEIGHTS_FILE} carries no readable loraplex header") from None
    if not isinstance(header, dict):
        raise InvalidRequestError(f"{WEIGHTS_FILE}'s loraplex header is not an object")
    return header


def read_folder(directory: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A checkpoint folder's manifest and the bytes of every file it lists, each verified: the format and its version,
    the manifest's own digest, the kind, the listed files (the weights, and the optimizer state for a state checkpoint
    only) with their sizes and sha256, and the header embedded in the weights equal to the manifest's. NotFoundError
    when there is no checkpoint; InvalidRequestError naming what is wrong otherwise."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_FILE
    if not directory.is_dir() or not manifest_path.is_file():
        raise NotFoundError(f"no checkpoint at {directory} ({MANIFEST_FILE} missing)")
    try:
        manifest = json.loads(read_capped(manifest_path, MAX_MANIFEST_BYTES))
    except (UnicodeDecodeError, ValueError):
        raise InvalidRequestError(f"{MANIFEST_FILE} is not valid JSON (truncated or corrupted)") from None
    if not isinstance(manifest, dict):
        raise InvalidRequestError(f"{MANIFEST_FILE} is not a JSON object")
    if manifest.get("format") != FORMAT_NAME:
        raise InvalidRequestError(f"{MANIFEST_FILE} is not a loraplex checkpoint manifest")
    version = manifest.get("format_version")
    if version != CHECKPOINT_FORMAT_VERSION:
        raise InvalidRequestError(
            f"checkpoint format version {version!r} is not supported (this build reads {CHECKPOINT_FORMAT_VERSION})"
        )
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise InvalidRequestError(f"{MANIFEST_FILE} was modified after it was written (manifest hash mismatch)")
    kind = manifest_field(manifest, "kind", str)
    if kind not in {str(k) for k in SAVED_KINDS}:
        raise InvalidRequestError(f"{MANIFEST_FILE}: unknown kind {kind!r}")
    files = manifest_field(manifest, "files", dict)
    if WEIGHTS_FILE not in files:
        raise InvalidRequestError(f"{MANIFEST_FILE} lists no {WEIGHTS_FILE}")
    unknown = set(files) - {WEIGHTS_FILE, OPTIMIZER_FILE}
    if unknown:
        raise InvalidRequestError(f"{MANIFEST_FILE} lists unexpected files {sorted(unknown)}")
    if kind == "sampler" and OPTIMIZER_FILE in files:
        raise InvalidRequestError("a sampler checkpoint must not carry optimizer state")
    blobs = {name: read_verified(directory, name, files[name]) for name in sorted(files)}
    header = embedded_header(blobs[WEIGHTS_FILE])
    differs = sorted(k for k in set(header) | set(HEADER_KEYS) if header.get(k) != manifest.get(k))
    if differs:
        raise InvalidRequestError(f"{MANIFEST_FILE} disagrees with {WEIGHTS_FILE} on {differs} (edited?)")
    return manifest, blobs

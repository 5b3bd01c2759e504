"""The spill file: a SlotImage (slot_images.py) on disk, for adapters the adapter store moves past its host-memory
budget.

One safetensors file: a single F32 tensor "rows" [4, P] (the image's weights, gradients, exp_avg and exp_avg_sq
rows, zero padding included) and string metadata: format, version, model_id, rank, alpha, seed, step (the Adam step
count), signature (JSON: max_rank, modules, width), so a restarted pool can tell whether a file fits its layout, and
target_modules (JSON: the adapter's subset of the pool's target modules, or null for all; absent in older files = null).
Files are written atomically (`fsutil.atomic_write`) and read straight into a caller's (pinned) buffer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from loraplex.errors import InvalidRequestError
from loraplex.runtime.fsutil import atomic_write
from loraplex.workers.state.slot_images import PoolSignature, SlotImage

SPILL_FORMAT = "loraplex-adapter-spill"
SPILL_VERSION = "1"
SPILL_SUFFIX = ".safetensors"


def write_spill(path: Path, image: SlotImage, extra: Mapping[str, str] | None = None) -> str:
    """Write atomically (a reader or a restart sees the old file or the whole new one). Streams the rows straight from
    the (pinned) buffer: no extra copy in memory. `extra`: more string metadata (durable snapshots add theirs).
    Returns the sha256 (hex) of the whole file."""
    rows = image.rows
    sig = image.signature
    metadata = {
        "format": SPILL_FORMAT,
        "version": SPILL_VERSION,
        "model_id": image.model_id,
        "rank": str(image.rank),
        "alpha": repr(float(image.alpha)),
        "seed": str(image.seed),
        "step": str(image.step),
        "signature": json.dumps({"max_rank": sig.max_rank, "modules": list(sig.modules), "width": sig.width}),
        "target_modules": json.dumps(None if image.target_modules is None else list(image.target_modules)),
        **(extra or {}),
    }
    nbytes = rows.numel() * rows.element_size()
    header = {
        "__metadata__": metadata,
        "rows": {"dtype": "F32", "shape": list(rows.shape), "data_offsets": [0, nbytes]},
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    digest = hashlib.sha256()
    with atomic_write(path) as f:
        for chunk in (len(raw).to_bytes(8, "little"), raw, memoryview(cast(Any, rows.contiguous().numpy())).cast("B")):
            f.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


def read_raw_metadata(path: Path) -> dict[str, str]:
    """The file's string metadata as written (the spill fields and any `extra`)."""
    with open(path, "rb") as f:
        header, _ = _read_header(f)
    return dict(header.get("__metadata__") or {})


def read_spill_metadata(path: Path) -> dict:
    """The file's model_id, rank, alpha, seed, step and signature; ValueError (or OSError, KeyError) when it is not a
    spill file of this format."""
    with open(path, "rb") as f:
        header, _ = _read_header(f)
    return _parse_metadata(header)


def read_spill(path: Path, out: torch.Tensor) -> SlotImage:
    """Read a spill file's rows straight into `out` [4, P] (e.g. a pinned buffer); checks the layout and length."""
    with open(path, "rb") as f:
        header, start = _read_header(f)
        meta = _parse_metadata(header)
        info = header["rows"]
        begin, end = info["data_offsets"]
        if info["dtype"] != "F32" or list(info["shape"]) != list(out.shape) or end - begin != out.numel() * 4:
            raise InvalidRequestError(f"spill file {path.name} does not fit this pool's layout")
        f.seek(start + begin)
        view = memoryview(cast(Any, out.numpy())).cast("B")
        if f.readinto(view) != len(view):
            raise InvalidRequestError(f"spill file {path.name} is truncated")
    return SlotImage(
        meta["model_id"],
        meta["rank"],
        meta["alpha"],
        meta["seed"],
        meta["step"],
        meta["signature"],
        out,
        meta["target_modules"],
    )


def _read_header(f: BinaryIO) -> tuple[dict, int]:
    size = int.from_bytes(f.read(8), "little")
    if not 0 < size < 1 << 24:
        raise ValueError("not a safetensors file")
    return json.loads(f.read(size)), 8 + size


def _parse_metadata(header: dict) -> dict:
    meta = header.get("__metadata__") or {}
    if meta.get("format") != SPILL_FORMAT or meta.get("version") != SPILL_VERSION:
        raise ValueError(f"not a {SPILL_FORMAT} v{SPILL_VERSION} file")
    sig = json.loads(meta["signature"])
    targets = json.loads(meta.get("target_modules", "null"))
    return {
        "model_id": meta["model_id"],
        "rank": int(meta["rank"]),
        "alpha": float(meta["alpha"]),
        "seed": int(meta["seed"]),
        "step": int(meta["step"]),
        "signature": PoolSignature(int(sig["max_rank"]), tuple(sig["modules"]), int(sig["width"])),
        "target_modules": None if targets is None else tuple(str(t) for t in targets),
    }

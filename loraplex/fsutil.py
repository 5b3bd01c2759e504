"""Filesystem durability helpers shared by the blob store, the checkpoint writer and the adapter store's spill files.
Stdlib only, so the worker modules can use it on the GPU image."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by path (a folder's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

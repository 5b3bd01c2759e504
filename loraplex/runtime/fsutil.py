"""Durable, atomic writes: one file (`atomic_write`, `write_bytes_atomic`) or one whole folder (`write_folder_atomic`),
so a reader (or a restart after a crash) sees the old version or the whole new one, never a torn write. Used by the
blob store, checkpoints, the adapter store's spill files and PEFT exports.

The pattern: write into a hidden temporary sibling (".<name>.tmp-*") in the same folder, fsync it, rename it into
place, fsync the folder (the rename itself becomes durable). A failure at any point removes the temporary and leaves
what was there before. Stdlib only, so the worker modules can use it on the GPU image.

Modes: what these write holds tenants' weights and data, so files are owner-only (0600) and the folders they make
owner-only (0700, `private_dirs`), whatever the process's umask.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dirs(path: str | os.PathLike[str]) -> Path:
    """`path` and its missing parents made owner-only (0700; `mkdir -p` would give the missing parents the umask's
    mode). Folders that exist already are left as they are. Returns `path`."""
    path = Path(path)
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:  # another process made it meanwhile
            continue
        os.chmod(folder, PRIVATE_DIR_MODE)  # mkdir's mode passes through the umask
    return path


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by path (a folder's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_write(path: str | os.PathLike[str], *, mode: int | None = None) -> Iterator[BinaryIO]:
    """A binary file to write `path` through: when the block ends, the temporary is fsynced and os.replace'd onto
    `path`, then the folder is fsynced. An exception in the block (or while finishing) removes the temporary and leaves
    `path` as it was. mode: the file's permissions (default: owner-only, as mkstemp makes it). The folder must exist."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None) -> None:
    """`data` as the file `path`, atomically (see `atomic_write`)."""
    with atomic_write(path, mode=mode) as handle:
        handle.write(data)


def write_folder_atomic(
    directory: str | os.PathLike[str], files: Mapping[str, bytes], *, mode: int = PRIVATE_DIR_MODE
) -> None:
    """`files` ({file name: bytes}, written in order) as the folder `directory`, all or nothing: into a temporary
    sibling (every file fsynced, then the folder), swapped into place (renameat2(RENAME_EXCHANGE) where the kernel has
    it, else two renames, the old folder put back if the second fails), the previous folder removed after. mode: the
    folder's permissions (default owner-only, its files 0600; missing parents are made owner-only).
    NotADirectoryError when `directory` exists and is not a folder (or is a symlink); other OSErrors propagate as is."""
    directory = Path(directory)
    parent = private_dirs(directory.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=parent))
    try:
        os.chmod(tmp, mode)
        for name, data in files.items():
            if "/" in name or name in ("", ".", ".."):
                raise ValueError(f"bad file name {name!r}")
            _write_new_file(tmp / name, data)
        fsync_path(tmp)
        if os.path.lexists(directory):
            if not directory.is_dir() or directory.is_symlink():
                raise NotADirectoryError(errno.ENOTDIR, "exists and is not a folder", str(directory))
            if _exchange(tmp, directory):  # atomic: `directory` is now the new one, `tmp` the old one
                fsync_path(parent)
                return  # the finally removes the old one
            old = parent / f".{directory.name}.old-{uuid.uuid4().hex[:12]}"
            os.rename(directory, old)
            try:
                os.rename(tmp, directory)
            except BaseException:
                os.rename(old, directory)
                raise
            fsync_path(parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, directory)
            fsync_path(parent)
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _write_new_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "wb") as handle:
        view = memoryview(data)
        while view:  # write() may be partial; a hard failure (ENOSPC, EFBIG) raises OSError
            written = handle.write(view)
            view = view[written:]
        handle.flush()
        os.fsync(handle.fileno())


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where the OS or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))

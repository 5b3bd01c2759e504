"""Checkpoint files on a local (or shared) filesystem, addressed by relative keys like "tenant/model/state/step-10".

Writes are atomic (`fsutil.atomic_write`: a hidden temp file in the destination folder, fsynced, then `os.replace`d
into place), so a reader sees the old file or the whole new one, never a torn write. Keys are checked so no key can
reach outside the root."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO, NamedTuple
from urllib.parse import unquote, urlparse

from loraplex.errors import InvalidRequestError, NotFoundError
from loraplex.fsutil import atomic_write

_KEY_CHARS = re.compile(r"^[A-Za-z0-9_.\-/]+$")
_CHUNK = 1 << 20


class StoredBlob(NamedTuple):
    uri: str
    size: int
    sha256: str


class BlobStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """The file a valid key maps to (it may not exist yet)."""
        _check_key(key)
        path = (self.root / key).resolve()
        # Catches symlinks inside the root that point out of it.
        if not path.is_relative_to(self.root):
            raise InvalidRequestError(f"blob key {key!r} escapes the store")
        return path

    def uri(self, key: str) -> str:
        return self.path(key).as_uri()

    def key_for_uri(self, uri: str) -> str:
        """Inverse of `uri`: the key of a file:// URI inside this store."""
        parsed = urlparse(uri)
        if parsed.scheme != "file":
            raise InvalidRequestError(f"not a file:// blob URI: {uri!r}")
        path = Path(unquote(parsed.path))
        if not path.is_relative_to(self.root):
            raise InvalidRequestError(f"blob URI {uri!r} is outside the store")
        key = path.relative_to(self.root).as_posix()
        self.path(key)
        return key

    def put_bytes(self, key: str, data: bytes) -> StoredBlob:
        return self._write(self.path(key), [data])

    def put_file(self, key: str, source: str | os.PathLike[str]) -> StoredBlob:
        path = self.path(key)
        with open(source, "rb") as src:
            return self._write(path, iter(lambda: src.read(_CHUNK), b""))

    def _write(self, path: Path, chunks: Iterable[bytes]) -> StoredBlob:
        path.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        with atomic_write(path) as out:
            for chunk in chunks:
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
        return StoredBlob(path.as_uri(), size, digest.hexdigest())

    def open(self, key: str, sha256: str | None = None) -> BinaryIO:
        """Open for reading; with `sha256`, the whole file is verified first (InvalidRequestError on mismatch)."""
        path = self._existing(key)
        if sha256 is not None:
            _, digest = _hash_file(path)
            _check_digest(key, digest, sha256)
        return open(path, "rb")

    def get_bytes(self, key: str, sha256: str | None = None) -> bytes:
        data = self._existing(key).read_bytes()
        if sha256 is not None:
            _check_digest(key, hashlib.sha256(data).hexdigest(), sha256)
        return data

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> bool:
        """Remove the blob; returns False when it was already gone (deletes are retried by cleanup jobs)."""
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def _existing(self, key: str) -> Path:
        path = self.path(key)
        if not path.is_file():
            raise NotFoundError(f"blob {key!r} not found")
        return path


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not key or not _KEY_CHARS.fullmatch(key):
        raise InvalidRequestError(f"invalid blob key {key!r}: use A-Z a-z 0-9 _ . - /")
    if key.startswith("/") or key.endswith("/"):
        raise InvalidRequestError(f"invalid blob key {key!r}: must be relative and name a file")
    # Empty, "." and ".." segments could escape or alias; names starting with "." are reserved for temp files.
    if any(not part or part.startswith(".") for part in key.split("/")):
        raise InvalidRequestError(f"invalid blob key {key!r}: no empty, '.', '..' or hidden segments")


def _check_digest(key: str, actual: str, expected: str) -> None:
    if actual != expected.lower():
        raise InvalidRequestError(f"blob {key!r} is corrupt: sha256 {actual} != expected {expected}")


def _hash_file(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()

"""BlobStore: atomic writes, hash checks, and keys that cannot leave the root."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from loraplex import errors
from loraplex.storage.blobs import BlobStore


def test_put_and_get_bytes(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    data = b"weights" * 1000
    uri, size, digest = store.put_bytes("t1/m1/state/step-1.safetensors", data)
    assert size == len(data) and digest == hashlib.sha256(data).hexdigest()
    assert uri == (tmp_path / "blobs" / "t1/m1/state/step-1.safetensors").resolve().as_uri()
    assert store.get_bytes("t1/m1/state/step-1.safetensors", sha256=digest) == data
    assert store.key_for_uri(uri) == "t1/m1/state/step-1.safetensors"
    with store.open("t1/m1/state/step-1.safetensors", sha256=digest) as f:
        assert f.read() == data


def test_put_file_copies_and_hashes(tmp_path: Path) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(3 << 20))  # spans several copy chunks
    store = BlobStore(tmp_path / "blobs")
    _, size, digest = store.put_file("a/b.bin", source)
    assert (size, digest) == (source.stat().st_size, hashlib.sha256(source.read_bytes()).hexdigest())
    assert store.get_bytes("a/b.bin") == source.read_bytes()


def test_overwrite_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    store.put_bytes("k/x", b"old")
    with store.open("k/x") as reader:  # a reader holding the old file keeps seeing all of it
        store.put_bytes("k/x", b"new contents")
        assert reader.read() == b"old"
    assert store.get_bytes("k/x") == b"new contents"
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == ["x"]


def test_failed_write_keeps_the_old_blob(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    store.put_bytes("k/x", b"old")

    def broken() -> object:
        yield b"partial"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store._write(store.path("k/x"), broken())  # type: ignore[arg-type]
    assert store.get_bytes("k/x") == b"old"
    assert [p.name for p in (tmp_path / "k").iterdir()] == ["x"]


def test_hash_mismatch_is_rejected(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    _, _, digest = store.put_bytes("k", b"good")
    (tmp_path / "k").write_bytes(b"evil")  # corrupted behind the store's back
    with pytest.raises(errors.InvalidRequestError, match="corrupt"):
        store.get_bytes("k", sha256=digest)
    with pytest.raises(errors.InvalidRequestError, match="corrupt"):
        store.open("k", sha256=digest)


@pytest.mark.parametrize(
    "key",
    [
        "",
        "/etc/passwd",
        "../escape",
        "a/../../escape",
        "a/./b",
        "a//b",
        "a/",
        ".hidden",
        "a/.tmp",
        "a\\b",
        "a b",
        "ü",
        "a:b",
    ],
)
def test_path_tricks_are_rejected(tmp_path: Path, key: str) -> None:
    store = BlobStore(tmp_path / "root")
    with pytest.raises(errors.InvalidRequestError):
        store.put_bytes(key, b"x")
    assert not (tmp_path / "escape").exists()


def test_symlink_out_of_the_root_is_rejected(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    store = BlobStore(tmp_path / "root")
    (tmp_path / "root" / "link").symlink_to(outside)
    with pytest.raises(errors.InvalidRequestError):
        store.put_bytes("link/x", b"x")
    assert list(outside.iterdir()) == []
    with pytest.raises(errors.InvalidRequestError):
        store.key_for_uri(outside.as_uri() + "/x")


def test_delete_and_missing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    store.put_bytes("k", b"x")
    assert store.exists("k") and store.delete("k")
    assert not store.exists("k") and not store.delete("k")
    with pytest.raises(errors.NotFoundError):
        store.get_bytes("k")

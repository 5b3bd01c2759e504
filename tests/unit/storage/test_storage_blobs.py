"""BlobStore: keys map to files under the root and back, cannot leave the root, and delete is idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex import errors
from loraplex.storage.blobs import BlobStore


def test_keys_map_to_files_under_the_root_and_back(tmp_path: Path) -> None:
    store = BlobStore(tmp_path / "blobs")
    path = store.path("t1/m1/state/step-1")
    assert path == (tmp_path / "blobs" / "t1/m1/state/step-1").resolve()
    assert store.key_for_uri(store.uri("t1/m1/state/step-1")) == "t1/m1/state/step-1"


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
        store.path(key)
    assert not (tmp_path / "escape").exists()


def test_symlink_out_of_the_root_is_rejected(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    store = BlobStore(tmp_path / "root")
    (tmp_path / "root" / "link").symlink_to(outside)
    with pytest.raises(errors.InvalidRequestError):
        store.path("link/x")
    assert list(outside.iterdir()) == []
    with pytest.raises(errors.InvalidRequestError):
        store.key_for_uri(outside.as_uri() + "/x")


def test_delete_and_missing(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    store.path("k").write_bytes(b"x")
    assert store.delete("k")
    assert not store.path("k").exists() and not store.delete("k")

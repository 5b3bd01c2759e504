"""fsutil's atomic writes (used by checkpoints, spills, exports): a reader sees the old file or the whole new one, a
failed write leaves the old file, and no temporary file stays behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.runtime.fsutil import atomic_write, write_bytes_atomic


def test_overwrite_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "x"
    write_bytes_atomic(target, b"old")
    with open(target, "rb") as reader:  # a reader holding the old file keeps seeing all of it
        write_bytes_atomic(target, b"new contents")
        assert reader.read() == b"old"
    assert target.read_bytes() == b"new contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "x"
    write_bytes_atomic(target, b"old")
    with pytest.raises(OSError, match="disk full"), atomic_write(target) as out:
        out.write(b"partial")
        raise OSError("disk full")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["x"]

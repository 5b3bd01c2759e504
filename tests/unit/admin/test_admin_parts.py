"""The admin's pure parts and its account rules: scrypt hashes (salted, verified, a malformed hash never matches),
the lockout count (SQLite), and the SVG charts (labels escaped, empty data drawn as a note)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.admin import charts
from loraplex.admin.passwords import check_new_password, hash_password, verify_password
from loraplex.errors import ConflictError, InvalidRequestError
from loraplex.storage.db import make_db_engine, migrate, session_factory
from loraplex.storage.repositories import AdminRepository, unit_of_work


def test_passwords_are_salted_scrypt_hashes() -> None:
    a, b = hash_password("correct horse battery"), hash_password("correct horse battery")
    assert a != b and a.startswith("scrypt$") and "correct" not in a
    assert verify_password("correct horse battery", a) and not verify_password("correct horse batterY", a)
    for broken in ("", "scrypt$1$2", "bcrypt$x$y$z$a$b", a.replace("scrypt", "md5"), "scrypt$x$8$1$AA==$AA=="):
        assert not verify_password("correct horse battery", broken)
    with pytest.raises(ValueError):
        check_new_password("short")


def test_the_lockout_counts_failures_in_a_row(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    migrate(url)
    sessions = session_factory(make_db_engine(url))
    with unit_of_work(sessions) as db:
        repo = AdminRepository(db)
        account = repo.create("ops", hash_password("a long enough password"))
        with pytest.raises(ConflictError):
            repo.create("ops", hash_password("another long password"))
        with pytest.raises(InvalidRequestError):
            repo.create("not a name!", hash_password("another long password"))
        repo.login_failed(account, max_failures=3, lockout_seconds=60)
        repo.login_succeeded(account)  # a success resets the count
        for _ in range(2):
            repo.login_failed(account, max_failures=3, lockout_seconds=60)
        assert not repo.locked(account)
        repo.login_failed(account, max_failures=3, lockout_seconds=60)
        assert repo.locked(account)
        repo.unlock("ops")
        assert not repo.locked(account)
        version = account.session_version
        repo.set_password("ops", hash_password("a brand new password"))
        assert account.session_version == version + 1  # earlier sessions end


def test_charts_escape_labels_and_draw_empty_data_as_a_note() -> None:
    svg = charts.bars([("<script>x</script>", 3.0), ("b", 1.0)], of=[4.0, 4.0])
    assert "<script>" not in svg and "&lt;script&gt;" in svg and svg.count('class="bar"') == 2
    assert "3 / 4" in svg
    lines = charts.lines({"t&1": [(-60.0, 2.0), (0.0, 4.0)], "empty": []}, x_span=120, y_unit="tokens/s")
    assert lines.count("<polyline") == 1 and "t&amp;1" in lines
    assert "no data yet" in charts.bars([]) and "no data yet" in charts.lines({}, x_span=10, y_unit="x")

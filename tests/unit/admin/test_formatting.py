"""How the admin writes values (admin/formatting.py): times to the second in UTC, binary sizes, long ids cut with the
whole id in the title, and everything escaped."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from loraplex.admin.formatting import format_count, format_seconds, format_size, format_time, short_id


def test_times_are_utc_to_the_second() -> None:
    at = datetime(2026, 12, 9, 14, 3, 7, 654321, tzinfo=UTC)
    assert format_time(at) == "2026-12-09 14:03:07"
    assert format_time(at.astimezone(timezone(timedelta(hours=2)))) == "2026-12-09 14:03:07"
    assert format_time(None) == ""


def test_sizes_are_binary_units() -> None:
    assert [format_size(n) for n in (0, 812, 1536, 14_889_779, 3 * 2**30, None)] == [
        "0 bytes", "812 bytes", "1.5 KiB", "14.2 MiB", "3.0 GiB", ""]  # fmt: skip


def test_counts_and_durations_read_easily() -> None:
    assert format_count(12345678) == "12,345,678"
    assert [format_seconds(s) for s in (0.0421, 3.5, 42.0, 125.0, 3720.0)] == [
        "0.0421 s", "3.5 s", "42 s", "2 min 5 s", "1 h 2 min"]  # fmt: skip


def test_long_ids_are_cut_with_the_whole_id_on_hover_and_escaped() -> None:
    model_id = "4f1c9a52e0b14d0c9a3b7e11d2f0c6aa"
    cell = str(short_id(model_id))
    assert f'title="{model_id}"' in cell and ">4f1c9a52e0b1…<" in cell
    assert "title" not in str(short_id("short"))
    assert "<b>" not in str(short_id('<b>"x"</b>' * 3)) and "&lt;b&gt;" in str(short_id('<b>"x"</b>' * 3))

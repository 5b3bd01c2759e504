"""How the admin writes values: times to the second in UTC, sizes in KiB/MiB/GiB, long ids cut with the whole id on
hover, durations rounded. Pure functions (markup is escaped here), unit-tested without a browser."""

from __future__ import annotations

from datetime import UTC, datetime

from markupsafe import Markup, escape

SHORT_ID = 12  # characters of an id shown in a list; the whole id is in the cell's title and on its details page
_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_time(value: datetime | None) -> str:
    """`2026-12-09 14:03:07` (UTC, to the second); empty for none."""
    if value is None:
        return ""
    if value.tzinfo is not None:
        value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%d %H:%M:%S")


def format_size(size: int | None) -> str:
    """`812 bytes`, `1.5 KiB`, `14.2 MiB`, `3.0 GiB`."""
    if size is None:
        return ""
    value, unit = float(size), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} bytes" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def format_count(value: int | None) -> str:
    """`12,345,678`."""
    return "" if value is None else f"{value:,}"


def format_seconds(value: float | None) -> str:
    """`0.042 s`, `3.5 s`, `2 min 5 s`, `1 h 2 min`."""
    if value is None:
        return ""
    if value < 10:
        return f"{value:.3g} s"
    if value < 60:
        return f"{value:.0f} s"
    minutes, seconds = divmod(round(value), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def short_id(value: str | None, keep: int = SHORT_ID) -> Markup:
    """A long id cut to `keep` characters and an ellipsis, the whole id in its title (shown on hover)."""
    if value is None:
        return Markup("")
    if len(value) <= keep + 1:
        return Markup('<span class="text-monospace">{}</span>').format(value)
    return Markup('<span class="text-monospace" title="{}">{}…</span>').format(value, value[:keep])


def link(href: str, text: str | Markup, title: str | None = None) -> Markup:
    if title:
        return Markup('<a href="{}" title="{}">{}</a>').format(href, title, text)
    return Markup('<a href="{}">{}</a>').format(href, text)


def badge(text: str, tone: str, title: str | None = None) -> Markup:
    """A coloured label; `tone` one of BADGE_TONES."""
    tone = tone if tone in BADGE_TONES else "secondary"
    return Markup('<span class="badge bg-{}-lt" title="{}">{}</span>').format(tone, title or "", text)


BADGE_TONES = ("green", "red", "orange", "secondary", "blue")


def escaped(value: object) -> Markup:
    return escape(str(value))

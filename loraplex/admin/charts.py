"""Server-side SVG charts for the dashboard (pure: data in, markup out; nothing is fetched by the browser).

`bars` draws labelled horizontal bars; `lines` one polyline per series over the last seconds; `time_lines` series over
a clock range, with a legend whose entries toggle their line; `small_multiples` one small chart per series (no line
hides another); `stacked_columns` one stacked column per item (a request's queue wait, then its compute). Every label is escaped; empty data draws a "no data" note instead of an empty frame."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from html import escape

PALETTE = ("#206bc4", "#d63939", "#2fb344", "#f76707", "#ae3ec9", "#0ca678", "#4263eb", "#f59f00")
DASHES = ("none", "6 3", "2 2", "8 3 2 3")  # after the palette's colours, lines differ by dash too
WIDTH = 520


def _svg(height: int, width: int = WIDTH) -> str:
    """The opening tag: scales to its card's width (the viewBox keeps the drawing's proportions)."""
    return f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="100%" role="img">'


def _empty(height: int, text: str = "no data yet") -> str:
    return (f'{_svg(height)}'
            f'<text x="10" y="{height // 2}" fill="#888" font-size="13">{escape(text)}</text></svg>')  # fmt: skip


def _fmt(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    if value >= 1e4:
        return f"{value / 1e3:.0f}k"
    return f"{value:.0f}" if value == int(value) else f"{value:.2f}"


def bars(items: Sequence[tuple[str, float]], *, of: Sequence[float] | None = None) -> str:
    """One bar per (label, value); `of`: a maximum per bar (e.g. a pool's slots), drawn as the bar's frame."""
    if not items:
        return _empty(40)
    row, label_w, right = 24, 200, 80
    height = row * len(items) + 8
    top = max([v for _, v in items] + list(of or []) + [1e-9])
    span = WIDTH - label_w - right
    parts = [_svg(height)]
    for i, (label, value) in enumerate(items):
        y = 4 + i * row
        parts.append(f'<text x="0" y="{y + 15}" font-size="12">{escape(label[:30])}</text>')
        if of is not None:
            parts.append(f'<rect x="{label_w}" y="{y + 2}" width="{span * of[i] / top:.1f}" height="{row - 8}" '
                         f'fill="none" stroke="#bbb"/>')  # fmt: skip
        parts.append(f'<rect class="bar" x="{label_w}" y="{y + 2}" width="{span * value / top:.1f}" '
                     f'height="{row - 8}" fill="{PALETTE[i % len(PALETTE)]}"/>')  # fmt: skip
        shown = _fmt(value) + (f" / {_fmt(of[i])}" if of is not None else "")
        parts.append(f'<text x="{WIDTH - right + 6}" y="{y + 15}" font-size="12">{shown}</text>')
    parts.append("</svg>")
    return "".join(parts)


def lines(series: Mapping[str, Sequence[tuple[float, float]]], *, x_span: float, y_unit: str) -> str:
    """Series of (seconds before now (<= 0), value); the x axis runs from -x_span to 0."""
    drawn = {name: pts for name, pts in series.items() if pts}
    height, left, bottom, top_pad = 220, 48, 28, 10  # the plot's right edge stays 10 inside the frame
    if not drawn:
        return _empty(height)
    legend_h = 16 * ((len(drawn) + 2) // 3)
    plot_h = height - bottom - top_pad
    y_max = max(v for pts in drawn.values() for _, v in pts) or 1.0
    span = WIDTH - left - 10

    def xy(t: float, v: float) -> tuple[float, float]:
        return left + span * (1 + t / x_span), top_pad + plot_h * (1 - v / y_max)

    parts = [_svg(height + legend_h),
             f'<line x1="{left}" y1="{top_pad + plot_h}" x2="{WIDTH - 10}" y2="{top_pad + plot_h}" stroke="#999"/>',
             f'<line x1="{left}" y1="{top_pad}" x2="{left}" y2="{top_pad + plot_h}" stroke="#999"/>',
             f'<text x="2" y="{top_pad + 10}" font-size="11">{_fmt(y_max)}</text>',
             f'<text x="2" y="{top_pad + plot_h}" font-size="11">0</text>',
             f'<text x="{left}" y="{height - 8}" font-size="11">-{_fmt(x_span)} s</text>',
             f'<text x="{WIDTH - 40}" y="{height - 8}" font-size="11">now</text>',
             f'<text x="{left + 6}" y="{top_pad + 10}" font-size="11" fill="#666">{escape(y_unit)}</text>']  # fmt: skip
    for i, (name, pts) in enumerate(sorted(drawn.items())):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(t, v) for t, v in sorted(pts)))
        parts.append(f'<polyline class="series" fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        lx, ly = left + (i % 3) * 160, height + 12 + 16 * (i // 3)
        parts.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{lx + 14}" y="{ly}" font-size="12">{escape(name[:20])}</text>')  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def clock(t: float) -> str:
    """Unix seconds as a UTC time of day (HH:MM:SS)."""
    return time.strftime("%H:%M:%S", time.gmtime(t))


def seconds_label(value: float) -> str:
    """A duration for people: 850 us, 12.3 ms, 1.50 s."""
    if value < 1e-3:
        return f"{value * 1e6:.0f} us"
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def time_lines(series: Mapping[str, Sequence[tuple[float, float]]], *, start: float, end: float, y_unit: str,
               height: int = 200, seconds: bool = False, x_label: Callable[[float], str] = clock,
               width: int = WIDTH) -> str:  # fmt: skip
    """Series of (unix seconds, value) over [start, end], each in its own colour and dash, with a legend whose entries
    toggle their line (the page's script: `data-series`). A series of few points also draws its points, so a job of a
    few seconds is a visible mark, not a hairline. seconds: values are durations (labels in us/ms/s); x_label: how an x
    value reads (a clock time by default)."""
    drawn = {name: pts for name, pts in series.items() if pts}
    left, bottom, top_pad, right = 56, 26, 10, 10
    if not drawn:
        return _empty(60, "no data in this range")
    per_row = 3
    legend_h = 18 * ((len(drawn) + per_row - 1) // per_row)
    plot_h = height - bottom - top_pad
    y_max = max(v for pts in drawn.values() for _, v in pts) or 1.0
    span = width - left - right
    width_s = max(end - start, 1e-9)
    label = seconds_label if seconds else _fmt

    def xy(t: float, v: float) -> tuple[float, float]:
        return left + span * (t - start) / width_s, top_pad + plot_h * (1 - v / y_max)

    parts = [_svg(height + legend_h, width),
             f'<line x1="{left}" y1="{top_pad + plot_h}" x2="{width - right}" y2="{top_pad + plot_h}" stroke="#999"/>',
             f'<line x1="{left}" y1="{top_pad}" x2="{left}" y2="{top_pad + plot_h}" stroke="#999"/>',
             f'<line x1="{left}" y1="{top_pad + plot_h / 2}" x2="{width - right}" y2="{top_pad + plot_h / 2}" '
             f'stroke="#eee"/>',
             f'<text x="2" y="{top_pad + 10}" font-size="11">{escape(label(y_max))}</text>',
             f'<text x="2" y="{top_pad + plot_h / 2 + 4}" font-size="11">{escape(label(y_max / 2))}</text>',
             f'<text x="2" y="{top_pad + plot_h}" font-size="11">0</text>',
             f'<text x="{left}" y="{height - 8}" font-size="11">{x_label(start)}</text>',
             f'<text x="{left + span / 2 - 24}" y="{height - 8}" font-size="11">{x_label(start + width_s / 2)}</text>',
             f'<text x="{width - right - 48}" y="{height - 8}" font-size="11">{x_label(end)}</text>',
             f'<text x="{left + 6}" y="{top_pad + 10}" font-size="11" fill="#666">{escape(y_unit)}</text>']  # fmt: skip
    for i, (name, pts) in enumerate(sorted(drawn.items())):
        color, dash = PALETTE[i % len(PALETTE)], DASHES[(i // len(PALETTE)) % len(DASHES)]
        coords = [xy(t, v) for t, v in sorted(pts)]
        key = escape(name, quote=True)
        parts.append(f'<g class="series-group" data-series="{key}">')
        parts.append(f'<polyline class="series" fill="none" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}" '
                     f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in coords)}"><title>{key}</title></polyline>')  # fmt: skip
        if len(coords) <= 40:
            parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in coords)
        parts.append("</g>")
        lx, ly = left + (i % per_row) * 155, height + 12 + 18 * (i // per_row)
        parts.append(f'<g class="legend-item" data-series="{key}" style="cursor:pointer">'
                     f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{lx + 14}" y="{ly}" font-size="12">{escape(name[:22])}</text></g>')  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def small_multiples(series: Mapping[str, Sequence[tuple[float, float]]], *, start: float, end: float, y_unit: str,
                    note: Mapping[str, str] | None = None, links: Mapping[str, str] | None = None,
                    x_label: Callable[[float], str] = clock, own_x: bool = False) -> str:  # fmt: skip
    """One small chart per series (own y scale, shared time axis), so no line hides another: a grid of cards titled
    by the series' name, with `note` beside the title and `links` on it. own_x: each chart spans its own x values
    (e.g. steps) instead of [start, end]."""
    drawn = {name: pts for name, pts in series.items() if pts}
    if not drawn:
        return _empty(40, "no data in this range")
    cells = []
    for name, pts in sorted(drawn.items()):
        title = escape(name)
        if links and name in links:
            title = f'<a href="{escape(links[name], quote=True)}">{title}</a>'
        extra = f' <span class="text-muted">{escape(note[name])}</span>' if note and name in note else ""
        lo, hi = (min(p[0] for p in pts), max(p[0] for p in pts)) if own_x else (start, end)
        chart = time_lines({name: pts}, start=lo, end=hi if hi > lo else lo + 1, y_unit=y_unit, height=130,
                           x_label=x_label, width=300)  # fmt: skip
        chart = chart.replace('<g class="legend-item"', '<g class="legend-item" display="none"', 1)
        cells.append(f'<div class="multiple"><div class="small fw-bold">{title}{extra}</div>{chart}</div>')
    return '<div class="multiples">' + "".join(cells) + "</div>"


def stacked_columns(rows: Sequence[tuple[str, Sequence[tuple[str, float]]]], *, y_unit: str, height: int = 180) -> str:
    """One column per row (e.g. a request), stacked from its parts (e.g. queue wait, then compute), same colours per part
    across columns, a legend of the parts."""
    if not rows:
        return _empty(40)
    left, bottom, top_pad = 56, 20, 10
    plot_h = height - bottom - top_pad
    y_max = max(sum(v for _, v in parts) for _, parts in rows) or 1.0
    span = WIDTH - left - 10
    col = span / len(rows)
    parts_order = list(dict.fromkeys(name for _, parts in rows for name, _ in parts))
    out = [_svg(height + 20),
           f'<line x1="{left}" y1="{top_pad + plot_h}" x2="{WIDTH - 10}" y2="{top_pad + plot_h}" stroke="#999"/>',
           f'<text x="2" y="{top_pad + 10}" font-size="11">{escape(seconds_label(y_max))}</text>',
           f'<text x="2" y="{top_pad + plot_h}" font-size="11">0</text>',
           f'<text x="{left + 6}" y="{top_pad + 10}" font-size="11" fill="#666">{escape(y_unit)}</text>']  # fmt: skip
    for i, (label, parts) in enumerate(rows):
        y = float(top_pad + plot_h)
        for name, value in parts:
            h = plot_h * value / y_max
            y -= h
            color = PALETTE[parts_order.index(name) % len(PALETTE)]
            out.append(f'<rect class="bar" x="{left + i * col:.1f}" y="{y:.1f}" width="{max(col - 1, 0.5):.1f}" '
                       f'height="{h:.1f}" fill="{color}"><title>{escape(label)}: {escape(name)} '
                       f'{escape(seconds_label(value))}</title></rect>')  # fmt: skip
    for j, name in enumerate(parts_order):
        lx = left + j * 150
        out.append(f'<rect x="{lx}" y="{height + 2}" width="10" height="10" fill="{PALETTE[j % len(PALETTE)]}"/>'
                   f'<text x="{lx + 14}" y="{height + 11}" font-size="12">{escape(name)}</text>')  # fmt: skip
    out.append("</svg>")
    return "".join(out)

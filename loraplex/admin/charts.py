"""Server-side SVG charts for the dashboard (pure: data in, markup out; nothing is fetched by the browser).

`bars` draws labelled horizontal bars; `lines` draws one polyline per series over a shared time axis, with a
legend. Every label is escaped; empty data draws a "no data" note instead of an empty frame."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

PALETTE = ("#206bc4", "#d63939", "#2fb344", "#f76707", "#ae3ec9", "#0ca678", "#4263eb", "#f59f00")
WIDTH = 520


def _svg(height: int) -> str:
    """The opening tag: scales to its card's width (the viewBox keeps the drawing's proportions)."""
    return f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="100%" role="img">'


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

"""A small SVG line plot written by hand (no plotting library is installed): one polyline per series, axes with
five ticks each, a legend. Enough for a sweep's eval loss per step; any browser shows it."""

from __future__ import annotations

from xml.sax.saxutils import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 220, 40, 50  # margins; the legend sits in the right one


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def line_plot(series: dict[str, list[tuple[float, float]]], title: str, x_label: str, y_label: str) -> str:
    points = [p for values in series.values() for p in values]
    xs, ys = [p[0] for p in points] or [0.0, 1.0], [p[1] for p in points] or [0.0, 1.0]
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    if x_hi == x_lo:
        x_hi = x_lo + 1
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def sy(y: float) -> float:
        return TOP + (y_hi - y) / (y_hi - y_lo) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{LEFT + plot_w / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>',
    ]
    x_ticks = _ticks(x_lo, x_hi)
    if all(float(x).is_integer() for x in xs):  # steps: whole-number ticks, not 13.5
        x_ticks = sorted({float(round(x)) for x in x_ticks})
    for x in x_ticks:
        out.append(
            f'<line x1="{sx(x):.1f}" y1="{TOP + plot_h}" x2="{sx(x):.1f}" y2="{TOP + plot_h + 5}" stroke="#333"/>'
        )
        out.append(f'<text x="{sx(x):.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{x:g}</text>')
    for y in _ticks(y_lo, y_hi):
        out.append(f'<line x1="{LEFT - 5}" y1="{sy(y):.1f}" x2="{LEFT + plot_w}" y2="{sy(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 8}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.4g}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text x="16" y="{TOP + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {TOP + plot_h / 2})">{escape(y_label)}</text>')  # fmt: skip
    for i, (label, values) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(values))
        if len(values) > 1:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}"/>')
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>' for x, y in values]
        ly = TOP + 10 + 18 * i
        out.append(f'<line x1="{WIDTH - RIGHT + 15}" y1="{ly}" x2="{WIDTH - RIGHT + 35}" y2="{ly}" stroke="{color}" '
                   'stroke-width="3"/>')  # fmt: skip
        out.append(f'<text x="{WIDTH - RIGHT + 40}" y="{ly + 4}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"

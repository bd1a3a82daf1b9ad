"""A labelled scatter plot as a small standalone SVG (the README shows it; no plotting dependency for one chart)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape


def line_plot(points: Sequence[tuple[float, float]], labels: Sequence[str], *, title: str, x_label: str,
              y_label: str, width: int = 560, height: int = 360) -> str:
    left, right, top, bottom = 70, 20, 40, 50
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(0.0, min(xs)), max(xs) * 1.05 or 1.0
    y0, y1 = min(ys) * 0.95, max(ys) * 1.05
    if y1 == y0:
        y1 = y0 + 1.0

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def py(y: float) -> float:
        return height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
           f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">{escape(x_label)}</text>',
           f'<text x="16" y="{(top + height - bottom) / 2}" text-anchor="middle" '
           f'transform="rotate(-90 16 {(top + height - bottom) / 2})">{escape(y_label)}</text>']
    for i in range(5):  # ticks
        xv, yv = x0 + (x1 - x0) * i / 4, y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{px(xv)}" y="{height - bottom + 16}" text-anchor="middle">{xv:.2f}</text>')
        out.append(f'<text x="{left - 6}" y="{py(yv) + 4}" text-anchor="end">{yv:.2f}</text>')
    order = sorted(range(len(points)), key=lambda i: xs[i])
    path = " ".join(f"{px(xs[i]):.1f},{py(ys[i]):.1f}" for i in order)
    out.append(f'<polyline points="{path}" fill="none" stroke="#4477aa" stroke-width="1.5"/>')
    for (x, y), label in zip(points, labels, strict=True):
        out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="4" fill="#cc3311"/>')
        out.append(f'<text x="{px(x) + 6:.1f}" y="{py(y) - 6:.1f}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"

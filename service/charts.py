"""Histograms as inline SVG, drawn on the server.

Hand-written rather than a charting library: the pages must work air-gapped with no build
step and no CDN, a stacked bar chart with one marker line is about sixty lines, and SVG
made here needs no script (the pages' Content-Security-Policy allows none inline). Every
text in the picture goes through ``markupsafe.escape``; numbers are formatted here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

__all__ = ["Series", "histogram_svg", "reliability_svg"]

_W, _H = 640, 230
_LEFT, _RIGHT, _TOP, _BOTTOM = 52, 16, 18, 40


@dataclass(frozen=True)
class Series:
    """One stacked layer of bars: a name for the legend, a count per bin and a fill colour."""

    name: str
    counts: Sequence[int]
    colour: str


def _x(value: float, lo: float, hi: float) -> float:
    span = hi - lo or 1.0
    return _LEFT + (value - lo) / span * (_W - _LEFT - _RIGHT)


def _y(count: float, top: float) -> float:
    return _TOP + (1 - count / (top or 1)) * (_H - _TOP - _BOTTOM)


def histogram_svg(edges: Sequence[float], series: Sequence[Series], title: str, x_label: str,
                  marker: float | None = None, marker_label: str = "") -> Markup:
    """A stacked histogram over ``edges`` (len = bins + 1) with an optional vertical marker
    line at ``marker`` (e.g. beta); returns markup safe to place in a page."""
    lo, hi = float(edges[0]), float(edges[-1])
    totals = [sum(s.counts[i] for s in series) for i in range(len(edges) - 1)]
    top = max(totals, default=0) or 1
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {_W} {_H}" class="chart" role="img" '
             f'aria-label="{escape(title)}"><title>{escape(title)}</title>']
    base = _y(0, top)
    parts.append(f'<line x1="{_LEFT}" y1="{base:.1f}" x2="{_W - _RIGHT}" y2="{base:.1f}" stroke="#888"/>')
    for i in range(len(edges) - 1):
        x0, x1 = _x(float(edges[i]), lo, hi), _x(float(edges[i + 1]), lo, hi)
        stacked = 0
        for s in series:
            count = int(s.counts[i])
            if count:
                y_top, y_bottom = _y(stacked + count, top), _y(stacked, top)
                parts.append(f'<rect x="{x0 + 0.5:.1f}" y="{y_top:.1f}" width="{max(x1 - x0 - 1, 0.5):.1f}" '
                             f'height="{y_bottom - y_top:.1f}" fill="{escape(s.colour)}"><title>{escape(s.name)}: {count} '
                             f'in [{float(edges[i]):.3f}, {float(edges[i + 1]):.3f})</title></rect>')
                stacked += count
    for k in range(5):  # x ticks
        value = lo + (hi - lo) * k / 4
        x = _x(value, lo, hi)
        parts.append(f'<line x1="{x:.1f}" y1="{base:.1f}" x2="{x:.1f}" y2="{base + 4:.1f}" stroke="#888"/>'
                     f'<text x="{x:.1f}" y="{base + 16:.1f}" text-anchor="middle" font-size="11" fill="#444">{value:.2f}</text>')
    parts.append(f'<text x="{_LEFT - 6}" y="{_TOP + 8}" text-anchor="end" font-size="11" fill="#444">{top}</text>'
                 f'<text x="{_LEFT - 6}" y="{_TOP + 21}" text-anchor="end" font-size="11" fill="#444">pairs</text>'
                 f'<text x="{(_LEFT + _W - _RIGHT) / 2:.0f}" y="{_H - 6}" text-anchor="middle" font-size="12" fill="#222">'
                 f'{escape(x_label)}</text>')
    legend_x = _W - _RIGHT - 130
    for j, s in enumerate(series):
        y = _TOP + 4 + 15 * j
        parts.append(f'<rect x="{legend_x}" y="{y}" width="10" height="10" fill="{escape(s.colour)}"/>'
                     f'<text x="{legend_x + 14}" y="{y + 9}" font-size="11" fill="#222">{escape(s.name)}</text>')
    if marker is not None and lo <= marker <= hi:
        x = _x(marker, lo, hi)
        parts.append(f'<line x1="{x:.1f}" y1="{_TOP:.1f}" x2="{x:.1f}" y2="{base:.1f}" stroke="#1f4e9c" stroke-width="2" '
                     f'stroke-dasharray="5 3"/><text x="{x + 4:.1f}" y="{_TOP + 10:.1f}" font-size="12" fill="#1f4e9c">'
                     f'{escape(marker_label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def reliability_svg(rows: Sequence[dict[str, object]], title: str = "Reliability of p_clean against the labels") -> Markup:
    """A reliability diagram: per bin of ``p_clean`` with labels, the share labelled clean
    (with its interval) against the mean ``p_clean``; the diagonal is perfect calibration.
    ``rows``: ``pairclean.audit.stats.reliability``'s output."""
    size, pad = 300, 40
    inner = size - 2 * pad

    def at(v: float) -> float:
        return pad + v * inner

    def up(v: float) -> float:
        return size - pad - v * inner

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {size} {size}" class="chart reliability" role="img" '
             f'aria-label="{escape(title)}"><title>{escape(title)}</title>',
             f'<rect x="{pad}" y="{pad}" width="{inner}" height="{inner}" fill="#fff" stroke="#888"/>',
             f'<line x1="{at(0)}" y1="{up(0)}" x2="{at(1)}" y2="{up(1)}" stroke="#aaa" stroke-dasharray="4 3"/>']
    for k in range(0, 11, 5):
        v = k / 10
        parts.append(f'<text x="{at(v):.1f}" y="{size - pad + 16}" text-anchor="middle" font-size="11" fill="#444">{v:.1f}</text>'
                     f'<text x="{pad - 6}" y="{up(v) + 4:.1f}" text-anchor="end" font-size="11" fill="#444">{v:.1f}</text>')
    parts.append(f'<text x="{size / 2}" y="{size - 6}" text-anchor="middle" font-size="12" fill="#222">p_clean (model)</text>'
                 f'<text x="12" y="{size / 2}" text-anchor="middle" font-size="12" fill="#222" '
                 f'transform="rotate(-90 12 {size / 2})">labelled clean</text>')
    for row in rows:
        if not row.get("labels"):
            continue
        x, y = float(row["predicted"]), float(row["observed"])  # type: ignore[arg-type]
        lo, hi = float(row["lower"]), float(row["upper"])  # type: ignore[arg-type]
        r = min(3 + int(row["labels"]) ** 0.5, 10)  # type: ignore[operator]
        parts.append(f'<line x1="{at(x):.1f}" y1="{up(lo):.1f}" x2="{at(x):.1f}" y2="{up(hi):.1f}" stroke="#1f4e9c"/>'
                     f'<circle cx="{at(x):.1f}" cy="{up(y):.1f}" r="{r:.1f}" fill="#1f4e9c" fill-opacity="0.8">'
                     f'<title>{int(row["labels"])} labels: p_clean {x:.2f}, clean {y:.2f} [{lo:.2f}, {hi:.2f}]</title></circle>')  # type: ignore[call-overload]
    parts.append("</svg>")
    return Markup("".join(parts))

"""Inline SVG drawn by hand: line charts and the staleness swimlane. No plotting library, no
external assets, every piece of text escaped (labels can come from model output)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from agentrl.view.format import esc

# Viridis anchors: ordered (old -> new weights reads dark -> light) and legible for colour-blind readers.
_VIRIDIS = ["#440154", "#46327e", "#365c8d", "#277f8e", "#1fa187", "#4ac16d", "#a0da39", "#fde725"]


def version_color(version: int, lo: int, hi: int) -> str:
    """Colour of a weight version on a scale from the oldest (lo) to the newest (hi) shown."""
    t = 0.0 if hi <= lo else (version - lo) / (hi - lo)
    t = min(max(t, 0.0), 1.0) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    a, b = _VIRIDIS[i], _VIRIDIS[i + 1]
    f = t - i
    rgb = [round(int(a[k : k + 2], 16) * (1 - f) + int(b[k : k + 2], 16) * f) for k in (1, 3, 5)]
    return "#" + "".join(f"{c:02x}" for c in rgb)


def ink_on(color: str) -> str:
    """Black or white, whichever reads better on the "#rrggbb" background."""
    r, g, b = (int(color[k : k + 2], 16) for k in (1, 3, 5))
    return "#111" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#fff"


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, v = [], start
    while v <= hi + step * 1e-9:
        if v >= lo - step * 1e-9:
            ticks.append(round(v, 10))
        v += step
    return ticks


def _fmt_tick(v: float) -> str:
    if abs(v) >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]
    color: str
    dashed: bool = False
    marker: bool = True


@dataclass
class Chart:
    title: str
    series: list[Series]
    x_label: str = "optimizer step"
    y_label: str = ""
    y_min: float | None = None
    y_max: float | None = None
    width: int = 600
    height: int = 260
    margin: tuple[int, int, int, int] = field(default=(46, 14, 42, 54))  # top, right, bottom, left


def line_chart(c: Chart) -> str:
    top, right, bottom, left = c.margin
    pw, ph = c.width - left - right, c.height - top - bottom
    pts = [p for s in c.series for p in s.points if p[1] is not None and math.isfinite(p[1])]
    out = [
        (
            f'<svg class="chart" viewBox="0 0 {c.width} {c.height}" width="100%" '
            f'role="img" aria-label="{esc(c.title)}">'
        ),
        f'<text x="{left}" y="16" class="ctitle">{esc(c.title)}</text>',
    ]
    if not pts:
        out.append(
            f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>'
            f'<text x="{left + pw / 2}" y="{top + ph / 2}" class="empty" text-anchor="middle">no data yet</text>'
            "</svg>"
        )
        return "".join(out)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo = c.y_min if c.y_min is not None else min(ys)
    y_hi = c.y_max if c.y_max is not None else max(ys)
    if y_hi == y_lo:
        y_lo, y_hi = y_lo - 1, y_hi + 1
    if c.y_min is None and y_lo > 0 and y_lo < 0.3 * y_hi:
        y_lo = 0.0  # anchor near-zero data at zero so small values do not look like large swings

    def sx(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y_lo) / (y_hi - y_lo) * ph

    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>')
    for t in nice_ticks(y_lo, y_hi):
        y = sy(t)
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_fmt_tick(t)}</text>'
        )
    for t in nice_ticks(x_lo, x_hi, 8):
        x = sx(t)
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" class="axis"/>'
            f'<text x="{x:.1f}" y="{top + ph + 16}" class="tick" text-anchor="middle">{_fmt_tick(t)}</text>'
        )
    out.append(
        f'<text x="{left + pw / 2}" y="{c.height - 6}" class="alabel" text-anchor="middle">'
        f"{esc(c.x_label)}</text>"
    )
    out.append(
        f'<text transform="translate(13 {top + ph / 2}) rotate(-90)" class="alabel" text-anchor="middle">'
        f"{esc(c.y_label)}</text>"
    )
    lx = left
    for s in c.series:  # legend, one line under the title
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        out.append(
            f'<line x1="{lx}" x2="{lx + 18}" y1="30" y2="30" stroke="{s.color}" stroke-width="2.5"{dash}/>'
            f'<text x="{lx + 22}" y="34" class="legend">{esc(s.name)}</text>'
        )
        lx += 6.5 * len(s.name) + 40
    for s in c.series:
        good = [(x, y) for x, y in s.points if y is not None and math.isfinite(y)]
        if not good:
            continue
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>')
        if s.marker and len(good) <= 150:
            for x, y in good:
                out.append(
                    f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{s.color}">'
                    f"<title>{esc(s.name)}: {_fmt_tick(x)} \u2192 {y:.4g}</title></circle>"
                )
    out.append("</svg>")
    return "".join(out)


@dataclass
class Lane:
    label: str
    tooltip: str
    outcome_class: str  # CSS class of the outcome (scored, failed, infra, ...)
    turns: list[list[int]] | None  # per turn, the versions that produced it; None when not recorded
    versions: list[int]  # all versions of the episode (the fallback)
    num_turns: int


def swimlane(
    lanes: list[Lane], lo: int, hi: int, *, cell: int = 22, lane_h: int = 14, label_w: int = 250
) -> str:
    """One row per episode, one cell per turn, coloured by the weight version that produced it.
    Lanes without per-turn versions show the episode's versions as hatched stripes over all turns."""
    max_turns = max([max(len(la.turns or []), la.num_turns, 1) for la in lanes] or [1])
    steps = min(hi - lo + 1, 12)
    width = max(label_w + max_turns * cell + 90, label_w + steps * 34 + 10)
    height = 30 + len(lanes) * (lane_h + 3) + 40
    out = [
        (
            f'<svg class="lanes" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
            'aria-label="staleness swimlane">'
        ),
        (
            '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" stroke="#fff" stroke-width="2" '
            'stroke-opacity="0.55"/></pattern></defs>'
        ),
    ]
    for t in range(max_turns):
        if max_turns <= 40 or t % 5 == 0:
            out.append(
                f'<text x="{label_w + t * cell + cell / 2}" y="20" class="tick" text-anchor="middle">{t + 1}</text>'
            )
    out.append(f'<text x="{label_w - 8}" y="20" class="tick" text-anchor="end">turn \u2192</text>')
    for i, la in enumerate(lanes):
        y = 28 + i * (lane_h + 3)
        out.append(
            f"<g><title>{esc(la.tooltip)}</title>"
            f'<text x="{label_w - 8}" y="{y + lane_h - 3}" class="lanelabel {esc(la.outcome_class)}" '
            f'text-anchor="end">{esc(la.label)}</text>'
        )
        if la.turns is not None:
            for t, vs in enumerate(la.turns):
                vs = sorted(vs) or [lo]
                w = (cell - 2) / len(vs)
                for j, v in enumerate(vs):
                    out.append(
                        f'<rect x="{label_w + t * cell + j * w:.1f}" y="{y}" width="{w:.1f}" height="{lane_h}" '
                        f'fill="{version_color(v, lo, hi)}"><title>turn {t + 1}: version {v}</title></rect>'
                    )
        else:
            n = max(la.num_turns, 1)
            vs = la.versions or []
            w = (n * cell - 2) / max(len(vs), 1)
            for j, v in enumerate(vs):
                out.append(
                    f'<rect x="{label_w + j * w:.1f}" y="{y}" width="{w:.1f}" height="{lane_h}" '
                    f'fill="{version_color(v, lo, hi)}"><title>version {v} (per-turn versions not recorded)'
                    "</title></rect>"
                )
            if vs:
                out.append(
                    f'<rect x="{label_w}" y="{y}" width="{n * cell - 2}" height="{lane_h}" fill="url(#hatch)"/>'
                )
            else:
                out.append(
                    f'<text x="{label_w + 4}" y="{y + lane_h - 3}" class="tick">no sampled tokens</text>'
                )
        span = (max(la.versions) - min(la.versions)) if la.versions else 0
        end = label_w + max(len(la.turns or []), la.num_turns, 1) * cell + 6
        out.append(
            f'<text x="{end}" y="{y + lane_h - 3}" class="tick">{"spans " + str(span) if span else ""}</text></g>'
        )
    # colour legend: oldest to newest version shown
    ly = height - 22
    out.append(f'<text x="{label_w - 8}" y="{ly + 12}" class="tick" text-anchor="end">weight version</text>')
    for k in range(steps):
        v = lo + round(k * (hi - lo) / max(steps - 1, 1))
        out.append(
            f'<rect x="{label_w + k * 34}" y="{ly}" width="32" height="14" fill="{version_color(v, lo, hi)}"/>'
            f'<text x="{label_w + k * 34 + 16}" y="{ly + 11}" class="legendnum" text-anchor="middle">{v}</text>'
        )
    out.append("</svg>")
    return "".join(out)

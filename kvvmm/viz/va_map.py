"""The VA map: an arena's reservation, one horizontal band per allocation or KV buffer.

Across each band's reserved span: backed (one bar per handle), unbacked, granularity padding,
slack VA beyond the cursor, the cursor, and for an owner the slot-0 page, prefix and final
marks. Drawn with a few traces, one per category, never a shape per mapping: plotly's
``add_shape`` in a loop is quadratic. Past :data:`HEATMAP_THRESHOLD` mappings the bars give way
to a heatmap of backed fractions, which the browser draws at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from kvvmm.errors import ArgumentError
from kvvmm.snapshot import ArenaSnapshot, OwnerSnapshot
from kvvmm.units import fmt_bytes, fmt_range
from kvvmm.viz._common import Snapshot, _arena_of, _array, _unit

__all__ = ["HEATMAP_THRESHOLD", "VA_MAP_TRACES", "va_map"]

HEATMAP_THRESHOLD = 10_000

#: Trace names of :func:`va_map`, in drawing order (the lab updates them in place by index).
VA_MAP_TRACES = ("backed", "unbacked", "padding", "slack", "cursor", "slot-0 page", "prefix",
                 "final")

_COLORS = {
    "backed": ("#2f9e44", "#69db7c"),  # alternating shades show handle boundaries
    "unbacked": "#dee2e6",
    "padding": "#ffe8cc",
    "slack": "#f8f9fa",
    "cursor": "#e8590c",
    "slot-0 page": "#1c7ed6",
    "prefix": "#7048e8",
    "final": "#c2255c",
}



@dataclass(frozen=True, slots=True)
class _Row:
    name: str
    offset: int
    size_bytes: int  # aligned span (the allocation)
    span_bytes: int  # logical bytes (requested / reserved tensor span)
    backed_bytes: int
    page0_bytes: int | None = None
    prefix_bytes: int | None = None
    final_bytes: int | None = None


def _rows(snapshot: Snapshot) -> list[_Row]:
    if isinstance(snapshot, OwnerSnapshot):
        return [_Row(b.name, b.offset, b.aligned_bytes, b.reserved_span_bytes, b.backed_bytes,
                     b.page0_bytes, b.prefix_bytes, b.final_bytes) for b in snapshot.buffers]
    return [_Row(a.name, a.offset, a.size_bytes, min(a.requested_bytes, a.size_bytes),
                 a.backed_bytes) for a in snapshot.allocations]


def va_map(
    snapshot: ArenaSnapshot | OwnerSnapshot,
    *,
    heatmap: bool | None = None,
    title: str | None = None,
    bins: int = 800,
) -> go.Figure:
    """Draw an arena's VA: one band per allocation (or KV buffer) across its reserved span.

    x is the offset from the arena base in the unit named on the axis (``layout.meta``
    holds ``unit_bytes``: multiply back to get bytes); rows are allocations in VA order, plus
    a ``slack`` row for reserved VA beyond the cursor. Traces, always in this order
    (:data:`VA_MAP_TRACES`): ``backed`` (one bar per handle, shades alternating),
    ``unbacked`` (inside the logical span), ``padding`` (unbacked VA past the span, up to the
    granularity), ``slack``, ``cursor``, then for an :class:`~kvvmm.owner.OwnerSnapshot` the
    marks ``slot-0 page``, ``prefix`` and ``final`` at the end of each span. Hovering gives
    each piece's absolute ``[start, end)`` and size.

    Args:
        snapshot: ``arena.snapshot()`` or ``owner.snapshot()``.
        heatmap: draw backed fractions as a heatmap instead of bars; default: only past
            :data:`HEATMAP_THRESHOLD` mappings (the first trace is then a ``go.Heatmap``).
        title: figure title; default names the arena, its driver and what is backed.
        bins: heatmap columns across the reservation.
    Returns:
        A ``plotly.graph_objects.Figure``.
    Raises:
        ArgumentError: ``snapshot`` is not a snapshot.
    """
    arena = _arena_of(snapshot)
    rows = _rows(snapshot)
    unit, unit_name = _unit(arena.reserved_bytes)
    slack = arena.reserved_bytes - arena.cursor_bytes
    names = [r.name for r in rows]
    slack_row = len(rows)
    if slack > 0 or not rows:
        names.append("slack")
    n_rows = len(names)
    base = arena.base
    use_heatmap = len(arena.mappings) > HEATMAP_THRESHOLD if heatmap is None else heatmap

    def rng(start: int, end: int) -> str:
        return f"{fmt_range(base + start, base + end)}<br>{fmt_bytes(end - start)}"

    row_of = {r.name: i for i, r in enumerate(rows)}
    traces: list[Any] = []
    if use_heatmap:
        traces.append(_heatmap(arena, rows, n_rows, unit, unit_name, bins))
    else:
        # One bar per handle: y, base (start) and x (length) in axis units.
        # Numeric colours on a two-step scale, and arrays rather than lists: plotly
        # validates a list of colour strings one regex at a time (0.4 s for 10k bars).
        ms = arena.mappings
        dark, light = _COLORS["backed"]
        traces.append(go.Bar(
            name="backed", orientation="h", width=0.8,
            y=_array([row_of[m.allocation] for m in ms]),
            base=_array([m.offset / unit for m in ms]),
            x=_array([m.size_bytes / unit for m in ms]),
            marker={"color": _array([m.handle_id % 2 for m in ms]), "cmin": 0, "cmax": 1,
                    "colorscale": [[0, dark], [1, light]], "line_width": 0},
            hovertext=_array([f"{m.allocation}: handle #{m.handle_id}<br>"
                              f"{rng(m.offset, m.end)}" for m in ms], text=True),
            hovertemplate="%{hovertext}<extra>backed</extra>",
        ))
    # Unbacked inside the span, then padding past it: each row's unbacked tail in two parts.
    unb: list[tuple[int, int, int, str]] = []
    pad: list[tuple[int, int, int, str]] = []
    for i, r in enumerate(rows):
        lo = r.offset + r.backed_bytes
        span_end, end = r.offset + r.span_bytes, r.offset + r.size_bytes
        if lo < span_end:
            unb.append((i, lo, span_end, r.name))
        if max(lo, span_end) < end:
            pad.append((i, max(lo, span_end), end, r.name))
    if slack > 0:
        slack_pieces = [(slack_row, arena.cursor_bytes, arena.reserved_bytes, "slack")]
    elif not rows:
        slack_pieces = [(slack_row, 0, arena.reserved_bytes, "slack")]
    else:
        slack_pieces = []
    for label, pieces in (("unbacked", unb), ("padding", pad), ("slack", slack_pieces)):
        if use_heatmap and label != "slack":
            pieces = []  # the heatmap shows them
        traces.append(go.Bar(
            name=label, orientation="h", width=0.8 if label != "slack" else 0.5,
            y=[p[0] for p in pieces], base=[p[1] / unit for p in pieces],
            x=[(p[2] - p[1]) / unit for p in pieces],
            marker={"color": _COLORS[label], "line_width": 0.5, "line_color": "#adb5bd"},
            hovertext=[f"{p[3]}: {label}<br>{rng(p[1], p[2])}" for p in pieces],
            hovertemplate=f"%{{hovertext}}<extra>{label}</extra>",
            showlegend=bool(pieces),
        ))
    c = arena.cursor_bytes
    traces.append(go.Scatter(
        name="cursor", mode="lines", x=[c / unit, c / unit], y=[-0.5, n_rows - 0.5],
        line={"color": _COLORS["cursor"], "width": 2, "dash": "dash"},
        hovertext=[f"cursor at offset {fmt_bytes(c)} ({base + c:#x})"] * 2,
        hovertemplate="%{hovertext}<extra>cursor</extra>",
    ))
    for label, attr, symbol in (("slot-0 page", "page0_bytes", "triangle-down"),
                                ("prefix", "prefix_bytes", "line-ns-open"),
                                ("final", "final_bytes", "diamond")):
        marks = [(i, r.offset, getattr(r, attr)) for i, r in enumerate(rows)
                 if getattr(r, attr) is not None]
        traces.append(go.Scatter(
            name=label, mode="markers", y=[m[0] for m in marks],
            x=[(m[1] + m[2]) / unit for m in marks],
            marker={"symbol": symbol, "size": 11 if n_rows <= 16 else 6, "color": _COLORS[label],
                    "line": {"width": 2, "color": _COLORS[label]}},
            hovertext=[f"{rows[m[0]].name}: {label} span<br>{rng(m[1], m[1] + m[2])}"
                       for m in marks],
            hovertemplate=f"%{{hovertext}}<extra>{label}</extra>",
            showlegend=bool(marks),
        ))
    fig = go.Figure(data=traces)
    if title is None:
        state = " (closed)" if arena.closed else ""
        title = (f"{arena.name}{state}: {fmt_bytes(arena.backed_bytes)} backed of "
                 f"{fmt_bytes(arena.reserved_bytes)} reserved, {len(arena.mappings)} handles "
                 f"({arena.driver}, {arena.device_name})")
    fig.update_layout(
        title={"text": title, "font": {"size": 14}},
        barmode="overlay",
        height=max(260, min(1600, (26 if n_rows <= 16 else 16) * n_rows + 150)),
        margin={"l": 10, "r": 10, "t": 50, "b": 40},
        xaxis={"title": {"text": f"offset from arena base ({unit_name}); base {base:#x}"},
               "range": [0, arena.reserved_bytes / unit], "zeroline": False},
        yaxis={"tickvals": list(range(n_rows)), "ticktext": names, "autorange": "reversed",
               "range": None, "showgrid": False},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1},
        plot_bgcolor="white",
        meta={"kvvmm": "va_map", "unit_bytes": unit, "base": base,
              "mode": "heatmap" if use_heatmap else "bars"},
    )
    return fig


def _heatmap(arena: ArenaSnapshot, rows: Sequence[_Row], n_rows: int, unit: int,
             unit_name: str, bins: int) -> go.Heatmap:
    """Backed fraction per (row, column) cell; None outside the row's allocation."""
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ArgumentError("bins", bins, "an int >= 1")
    total = arena.reserved_bytes
    width = max(arena.granularity, -(-total // bins))
    ncols = -(-total // width)
    z: list[list[float | None]] = []
    counts: list[list[int]] = []
    starts_by_alloc: dict[str, list[int]] = {}
    for m in arena.mappings:
        starts_by_alloc.setdefault(m.allocation, []).append(m.offset)
    for r in rows:
        line: list[float | None] = [None] * ncols
        cnt = [0] * ncols
        lo, end, backed_end = r.offset, r.offset + r.size_bytes, r.offset + r.backed_bytes
        for col in range(lo // width, -(-end // width)):
            c0, c1 = col * width, min((col + 1) * width, total)
            a0, a1 = max(c0, lo), min(c1, end)
            if a1 <= a0:
                continue
            line[col] = max(0, min(a1, backed_end) - a0) / (a1 - a0)
        for s in starts_by_alloc.get(r.name, ()):
            cnt[s // width] += 1
        z.append(line)
        counts.append(cnt)
    z += [[None] * ncols for _ in range(n_rows - len(rows))]
    counts += [[0] * ncols for _ in range(n_rows - len(rows))]
    return go.Heatmap(
        name="backed", z=_array(z, floats=True),
        customdata=_array(counts),
        x=_array([(col + 0.5) * width / unit for col in range(ncols)]), y=list(range(n_rows)),
        zmin=0, zmax=1, colorscale=[[0, _COLORS["unbacked"]], [1, _COLORS["backed"][1]]],
        colorbar={"title": {"text": "backed"}, "tickformat": ".0%", "len": 0.6},
        hovertemplate=(f"offset %{{x:.4g}} {unit_name} ± {fmt_bytes(width // 2)}<br>"
                       "backed %{z:.0%}<br>%{customdata} handles start here<extra></extra>"),
        xgap=0, ygap=2,
    )

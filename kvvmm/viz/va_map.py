"""The VA map: an arena's reservation, drawn so that 1 or 1,000 buffers both read.

Three views, picked by size (or asked for):

- ``bars`` (up to ``max_rows`` rows and :data:`HEATMAP_THRESHOLD` mappings): one band per
  allocation or KV buffer, one bar per handle (shades alternate at handle boundaries), then
  unbacked, granularity padding, slack, the cursor and, for an owner, the slot-0 page, prefix
  and final marks. Each row's label ends with its backed fraction.
- ``heatmap`` (more rows, or more mappings): one thin row per buffer, every row drawn from its
  own start (so 160 buffers of one shape line up instead of making a diagonal of slivers),
  coloured by backed fraction; rows grouped (K / V / latent pools from names like ``k0``,
  ``v0``, ``kv0``, or ``group_by=``), one label per group, and a side panel of each group's
  backed against reserved bytes. This is what PyTorch's memory_viz does on big snapshots:
  summarise, then let the reader drill down.
- ``buffer`` (``buffer="k3"``): the drill-down, one buffer's handles as bars.

Drawn with a few traces, one per category, never a shape per mapping: plotly's ``add_shape``
in a loop is quadratic. Every name that reaches hover text or a label is HTML-escaped (plotly
renders a subset of HTML there, and buffer names are user strings).
"""

from __future__ import annotations

import dataclasses
import html
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from kvvmm.checks import int_arg
from kvvmm.errors import ArgumentError
from kvvmm.snapshot import ArenaSnapshot, MappingInfo, OwnerSnapshot
from kvvmm.units import fmt_bytes, fmt_range
from kvvmm.viz._common import (
    Snapshot,
    _arena_of,
    _array,
    _count,
    _legend_rows,
    _text_px,
    _unit,
)

__all__ = ["HEATMAP_THRESHOLD", "MAX_ROWS", "VA_MAP_GROUP_TRACES", "VA_MAP_TRACES", "va_map"]

#: Past this many mappings the per-handle bars give way to the heatmap (the browser draws a
#: heatmap at once, and a bar per handle stops being visible long before this).
HEATMAP_THRESHOLD = 10_000

#: Rows drawn as labelled bands; past it, the heatmap view (a label per row stops fitting).
MAX_ROWS = 40

#: Trace names of :func:`va_map`, in drawing order: every view starts with these, in this
#: order (a view without a category leaves its trace empty), so the lab can update them in
#: place by index. In the heatmap view ``backed`` is the ``go.Heatmap``.
VA_MAP_TRACES = ("backed", "unbacked", "padding", "slack", "cursor", "slot-0 page", "prefix",
                 "final")

#: Traces the heatmap view adds after :data:`VA_MAP_TRACES`: the per-group summary panel.
VA_MAP_GROUP_TRACES = ("group reserved", "group backed")

_COLORS = {
    "backed": ("#2b8a3e", "#69db7c"),  # alternating shades show handle boundaries
    "unbacked": "#dee2e6",
    "padding": "#ffd8a8",
    "slack": "#f8f9fa",
    "cursor": "#e8590c",
    "slot-0 page": "#1c7ed6",
    "prefix": "#7048e8",
    "final": "#c2255c",
}

_VIEWS = ("auto", "bars", "heatmap")
_GROUP_BY = ("auto", "kind", "layer", "none")
_NAME = re.compile(r"^(.*?)(\d+)$")


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
    #: backed ``[start, end)`` pieces (row-relative) when backing has holes; None: a prefix
    #: of ``backed_bytes``
    pieces: tuple[tuple[int, int], ...] | None = None


def _with_holes(rows: list[_Row], arena: ArenaSnapshot) -> list[_Row]:
    """Rows whose backing is not a prefix get their backed pieces (from the mappings)."""
    prefix = {a.name: a.prefix_bytes for a in arena.allocations}
    holed = {n for n, p in prefix.items()
             if p != next(a.backed_bytes for a in arena.allocations if a.name == n)}
    if not holed:
        return rows
    pieces: dict[str, list[tuple[int, int]]] = {}
    for m in arena.mappings:
        if m.allocation in holed:
            got = pieces.setdefault(m.allocation, [])
            if got and got[-1][1] == m.offset:
                got[-1] = (got[-1][0], m.end)
            else:
                got.append((m.offset, m.end))
    return [dataclasses.replace(r, pieces=tuple((s - r.offset, e - r.offset)
                                                for s, e in pieces.get(r.name, ())))
            if r.name in holed else r for r in rows]


def _unbacked(r: _Row) -> list[tuple[int, int]]:
    """Unbacked ``[start, end)`` pieces of a row (row-relative), in order."""
    if r.pieces is None:
        return [(r.backed_bytes, r.size_bytes)] if r.backed_bytes < r.size_bytes else []
    out, pos = [], 0
    for s, e in r.pieces:
        if s > pos:
            out.append((pos, s))
        pos = e
    return out + ([(pos, r.size_bytes)] if pos < r.size_bytes else [])


def _rows(snapshot: Snapshot) -> list[_Row]:
    if isinstance(snapshot, OwnerSnapshot):
        return [_Row(b.name, b.offset, b.aligned_bytes, b.reserved_span_bytes, b.backed_bytes,
                     b.page0_bytes, b.prefix_bytes, b.final_bytes) for b in snapshot.buffers]
    return [_Row(a.name, a.offset, a.size_bytes, min(a.requested_bytes, a.size_bytes),
                 a.backed_bytes) for a in snapshot.allocations]


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _group_key(group_by: object) -> Callable[[str], str]:
    """Row name -> group name. ``kind``: the name without its trailing number (``k12`` -> ``k``);
    ``layer``: the trailing number (``k12`` -> ``layer 12``); ``none``: one group."""
    if callable(group_by):
        return lambda name: str(group_by(name))
    if group_by in ("auto", "kind"):
        def kind(name: str) -> str:
            m = _NAME.match(name)
            return (m.group(1) or name) if m else name
        return kind
    if group_by == "layer":
        def layer(name: str) -> str:
            m = _NAME.match(name)
            return f"layer {m.group(2)}" if m else name
        return layer
    if group_by == "none":
        return lambda name: "all"
    raise ArgumentError("group_by", group_by,
                        f"one of {list(_GROUP_BY)} or a function of a buffer name")


@dataclass(frozen=True, slots=True)
class _Group:
    name: str
    rows: tuple[int, ...]  # indices into the ordered rows

    def label(self, rows: Sequence[_Row]) -> str:
        first, last = rows[self.rows[0]].name, rows[self.rows[-1]].name
        names = first if first == last else f"{first}–{last}"
        return html.escape(names)


def _grouped(rows: list[_Row], group_by: object) -> tuple[list[_Row], list[_Group]]:
    """Rows ordered by group (first appearance in VA order), then VA order; and the groups."""
    key = _group_key(group_by)
    order: dict[str, list[_Row]] = {}
    for r in rows:
        order.setdefault(key(r.name), []).append(r)
    out: list[_Row] = []
    groups: list[_Group] = []
    for name, members in order.items():
        groups.append(_Group(name, tuple(range(len(out), len(out) + len(members)))))
        out.extend(members)
    return out, groups


def va_map(
    snapshot: ArenaSnapshot | OwnerSnapshot,
    *,
    view: str = "auto",
    buffer: str | None = None,
    group_by: str | Callable[[str], str] = "auto",
    heatmap: bool | None = None,
    max_rows: int = MAX_ROWS,
    align: str = "auto",
    title: str | None = None,
    bins: int = 200,
) -> go.Figure:
    """Draw an arena's VA: backed against unbacked, per allocation or KV buffer.

    ``layout.meta`` says what was drawn: ``mode`` (``"bars"``, ``"heatmap"`` or
    ``"buffer"``), ``align`` (``"arena"``: x is the offset from the arena base; ``"start"``:
    x is the offset inside each row's own allocation), ``unit_bytes`` (x times it is bytes),
    ``base``, ``rows`` (row names, top first) and, in the heatmap, ``groups``. Hover always
    gives absolute ``[start, end)`` and sizes (in a heatmap of more than 50,000 cells, the
    row, offset and backed fraction only).

    Traces start with :data:`VA_MAP_TRACES` in every view; the heatmap adds
    :data:`VA_MAP_GROUP_TRACES`.

    Args:
        snapshot: ``arena.snapshot()`` or ``owner.snapshot()``.
        view: ``"auto"`` (bars up to ``max_rows`` rows and :data:`HEATMAP_THRESHOLD`
            mappings, else the heatmap), ``"bars"`` or ``"heatmap"``.
        buffer: draw only this allocation or buffer, one bar per handle (the drill-down).
        group_by: how rows group: ``"auto"``/``"kind"`` (the name without its trailing
            number: ``k``, ``v``, ``kv``), ``"layer"`` (its trailing number), ``"none"``, or a
            function of a row name returning its group.
        heatmap: the older switch: ``True`` is ``view="heatmap"``, ``False`` ``view="bars"``.
        max_rows: the most rows drawn as labelled bands in the auto view, >= 1.
        align: bars view: ``"arena"`` (x from the arena base: the true layout, with slack and
            cursor), ``"start"`` (each row from its own start) or ``"auto"`` (arena up to 4
            rows).
        title: figure title (plain text, escaped); default names the arena and what is backed.
        bins: heatmap columns across a row, >= 1.
    Returns:
        A ``plotly.graph_objects.Figure`` (autosized: it fills its cell's width).
    Raises:
        ArgumentError: ``snapshot`` is not a snapshot, ``buffer`` is not one of its rows, or
            ``view``, ``align``, ``group_by``, ``max_rows`` or ``bins`` is not one of the
            values above.
    """
    arena = _arena_of(snapshot)
    view = _checked_view(view, heatmap, max_rows, bins, align)
    rows = _with_holes(_rows(snapshot), arena)
    if buffer is not None:
        return _bars(snapshot, arena, _buffer_row(rows, buffer), [], title, mode="buffer",
                     align="start")
    rows, groups = _grouped(rows, group_by)
    if view == "auto":
        big = len(rows) > max_rows or len(arena.mappings) > HEATMAP_THRESHOLD
        view = "heatmap" if big else "bars"
    if view == "heatmap":
        return _heatmap(snapshot, arena, rows, groups, title, bins)
    # A handful of rows: the true layout (offsets from the arena base). More rows: each from
    # its own start, else every band is a sliver of the width (a diagonal).
    if align == "auto":
        align = "arena" if len(rows) <= 4 else "start"
    return _bars(snapshot, arena, rows, groups, title, mode="bars", align=align)


def _checked_view(view: str, heatmap: bool | None, max_rows: int, bins: int,
                  align: str) -> str:
    """:func:`va_map`'s options checked; the view asked for (``heatmap``, the older switch,
    read into it)."""
    if view not in _VIEWS:
        raise ArgumentError("view", view, f"one of {list(_VIEWS)}")
    for name, value in (("max_rows", max_rows), ("bins", bins)):
        int_arg(name, value, lo=1, limit="an int >= 1")
    if align not in ("auto", "arena", "start"):
        raise ArgumentError("align", align, "one of ['auto', 'arena', 'start']")
    if heatmap is not None and view == "auto":
        return "heatmap" if heatmap else "bars"
    return view


def _buffer_row(rows: list[_Row], buffer: str) -> list[_Row]:
    """The one row named ``buffer`` (the drill-down), or an error naming a few there are."""
    chosen = [r for r in rows if r.name == buffer]
    if not chosen:
        raise ArgumentError("buffer", buffer, f"one of {[r.name for r in rows][:8]}"
                            + (" ..." if len(rows) > 8 else ""))
    return chosen


def _default_title(arena: ArenaSnapshot, what: str | None = None) -> tuple[str, str]:
    state = " (closed)" if arena.closed else ""
    head = html.escape(what if what is not None else f"{arena.name}{state}")
    pool = (f"; {fmt_bytes(arena.pool_bytes)} held by the pool" if arena.pool_bytes else "")
    if arena.asleep_bytes:  # Arena.sleep: nothing is backed, the ranges wait for wake()
        pool += (f"; asleep: {fmt_bytes(arena.asleep_bytes)} in "
                 f"{_count(len(arena.asleep_mappings), 'mapping')} to wake at the same VA")
    return (f"{head}: {fmt_bytes(arena.backed_bytes)} backed of "
            f"{fmt_bytes(arena.reserved_bytes)} reserved "
            f"({_pct(arena.backed_bytes, arena.reserved_bytes)}), "
            f"{_count(len(arena.mappings), 'handle')}{pool}",
            f"{html.escape(arena.driver)}, {html.escape(arena.device_name)}, "
            f"granularity {fmt_bytes(arena.granularity)}, base {arena.base:#x}")


#: Pixels above the plot for the title and its subtitle (the title alone: less), and below
#: it for the x tick labels and axis title; the legend (and the heatmap's colour bar) get a
#: band of their own under that, so nothing drawn at the top can run into the title.
_TOP_PX, _TOP_PLAIN_PX, _AXIS_PX, _ROW_PX = 70, 44, 54, 22


def _layout(fig: go.Figure, titles: tuple[str, str], plot_px: int, meta: dict[str, Any], *,
            band_px: int, right_px: int = 10) -> None:
    """Title and subtitle at the top left, alone on their lines; ``plot_px`` of plot; the
    axis, then a ``band_px`` band at the bottom for the legend (left) and colour bar."""
    title, subtitle = titles
    top = _TOP_PX if subtitle else _TOP_PLAIN_PX
    bottom = _AXIS_PX + band_px
    meta = {**meta, "plot_px": plot_px}
    fig.update_layout(
        # A subtitle rather than a second line after <br>: plotly anchors a title's first
        # line only, so a two-line title at the top was clipped.
        title={"text": title, "subtitle": {"text": subtitle, "font": {"size": 11}},
               "font": {"size": 14}, "x": 0.01, "xanchor": "left", "xref": "container",
               "y": 1, "yanchor": "top", "yref": "container", "pad": {"t": 12},
               "automargin": False},
        autosize=True, height=top + plot_px + bottom,
        margin={"l": 10, "r": max(right_px, 20), "t": top, "b": bottom, "autoexpand": True},
        legend={"orientation": "h", "xref": "container", "yref": "container", "x": 0.005,
                "xanchor": "left", "y": 0, "yanchor": "bottom", "font": {"size": 11},
                "valign": "middle"},
        plot_bgcolor="white", meta=meta,
    )


def _band_px(fig: go.Figure) -> int:
    """The legend band: one row per line its shown entries wrap to at the narrowest cell."""
    names = [str(t.name) for t in fig.data if t.showlegend is not False and t.name]
    return _ROW_PX * _legend_rows(names) + 4 if names else 0


def _rng(base: int, start: int, end: int) -> str:
    """An absolute ``[start, end)`` and its size, for a hover."""
    return f"{fmt_range(base + start, base + end)}<br>{fmt_bytes(end - start)}"


@dataclass(frozen=True, slots=True)
class _BarFrame:
    """Where the bars view draws: each row's band and x origin, the axis unit."""

    base: int  #: the arena's base address
    row_of: dict[str, int]  #: row name -> its band
    origin: dict[str, int]  #: row name -> the offset its x is measured from
    unit: int  #: bytes per x unit
    n_rows: int  #: bands, slack's included


def _backed_trace(f: _BarFrame, ms: Sequence[MappingInfo]) -> go.Bar:
    """One bar per handle, alternate handles in two greens."""
    esc = {name: html.escape(name) for name in f.row_of}
    dark, light = _COLORS["backed"]
    # Numeric colours on a two-step scale, and arrays rather than lists: plotly validates a
    # list of colour strings one regex at a time (docs/MEASUREMENTS.md §11).
    return go.Bar(
        name="backed", orientation="h", width=0.8,
        y=_array([f.row_of[m.allocation] for m in ms]),
        base=_array([(m.offset - f.origin[m.allocation]) / f.unit for m in ms]),
        x=_array([m.size_bytes / f.unit for m in ms]),
        marker={"color": _array([m.handle_id % 2 for m in ms]), "cmin": 0, "cmax": 1,
                "colorscale": [[0, dark], [1, light]], "line_width": 0},
        hovertext=_array([f"{esc[m.allocation]}: handle #{m.handle_id}<br>"
                          f"{_rng(f.base, m.offset, m.end)}" for m in ms], text=True),
        hovertemplate="%{hovertext}<extra>backed</extra>",
        showlegend=True,
    )


def _unbacked_traces(f: _BarFrame, rows: list[_Row], arena: ArenaSnapshot,
                     show_slack: bool) -> list[go.Bar]:
    """Unbacked inside each row's span, padding past it, and the slack past the cursor."""
    unb: list[tuple[int, int, int, str]] = []
    pad: list[tuple[int, int, int, str]] = []
    for i, r in enumerate(rows):  # holes too: every unbacked piece, split at the span's end
        span_end = r.offset + r.span_bytes
        for s0, e0 in _unbacked(r):
            lo, end = r.offset + s0, r.offset + e0
            if lo < span_end:
                unb.append((i, lo, min(end, span_end), r.name))
            if max(lo, span_end) < end:
                pad.append((i, max(lo, span_end), end, r.name))
    slack_pieces: list[tuple[int, int, int, str]] = []
    if show_slack:
        slack_pieces = [(len(rows), arena.cursor_bytes if rows else 0, arena.reserved_bytes,
                         "slack")]
    return [go.Bar(
        name=label, orientation="h", width=0.8 if label != "slack" else 0.5,
        y=[p[0] for p in pieces],
        base=[(p[1] - f.origin.get(p[3], 0)) / f.unit for p in pieces],
        x=[(p[2] - p[1]) / f.unit for p in pieces],
        marker={"color": _COLORS[label], "line_width": 0.5, "line_color": "#adb5bd"},
        hovertext=[f"{html.escape(p[3])}: {label}<br>{_rng(f.base, p[1], p[2])}"
                   for p in pieces],
        hovertemplate=f"%{{hovertext}}<extra>{label}</extra>",
        showlegend=bool(pieces),
    ) for label, pieces in (("unbacked", unb), ("padding", pad), ("slack", slack_pieces))]


def _cursor_trace(f: _BarFrame, arena: ArenaSnapshot, show: bool) -> go.Scatter:
    """The cursor as a dashed line across every band (empty when not shown)."""
    c = arena.cursor_bytes
    cursor_x = [c / f.unit, c / f.unit] if show else []
    return go.Scatter(
        name="cursor", mode="lines", x=cursor_x, y=[-0.5, f.n_rows - 0.5] if cursor_x else [],
        line={"color": _COLORS["cursor"], "width": 2, "dash": "dash"},
        hovertext=[f"cursor at offset {fmt_bytes(c)} ({f.base + c:#x})"] * len(cursor_x),
        hovertemplate="%{hovertext}<extra>cursor</extra>", showlegend=bool(cursor_x),
    )


def _mark_traces(f: _BarFrame, rows: list[_Row]) -> list[go.Scatter]:
    """Each row's slot-0 page, prefix and final spans, as marks at their ends."""
    traces = []
    for label, attr, symbol in (("slot-0 page", "page0_bytes", "triangle-down"),
                                ("prefix", "prefix_bytes", "line-ns-open"),
                                ("final", "final_bytes", "diamond")):
        marks = [(i, r.offset, getattr(r, attr)) for i, r in enumerate(rows)
                 if getattr(r, attr) is not None]
        traces.append(go.Scatter(
            name=label, mode="markers", y=[m[0] for m in marks],
            x=[(m[1] - f.origin[rows[m[0]].name] + m[2]) / f.unit for m in marks],
            marker={"symbol": symbol, "size": 11 if f.n_rows <= 16 else 7,
                    "color": _COLORS[label], "line": {"width": 2, "color": _COLORS[label]}},
            hovertext=[f"{html.escape(rows[m[0]].name)}: {label} span<br>"
                       f"{_rng(f.base, m[1], m[1] + m[2])}" for m in marks],
            cliponaxis=False,  # a mark at either end of the axis is drawn whole
            hovertemplate=f"%{{hovertext}}<extra>{label}</extra>",
            showlegend=bool(marks),
        ))
    return traces


def _bars_title(title: str | None, mode: str, rows: list[_Row], arena: ArenaSnapshot,
                handles: int) -> tuple[str, str]:
    """The given title, the drilled-down buffer's, or the arena's."""
    if title is not None:
        return (html.escape(title), "")
    if mode != "buffer":
        return _default_title(arena)
    r, base = rows[0], arena.base
    return (f"{html.escape(r.name)} in {html.escape(arena.name)}: "
            f"{fmt_bytes(r.backed_bytes)} backed of {fmt_bytes(r.size_bytes)} "
            f"({_pct(r.backed_bytes, r.size_bytes)}) in {_count(handles, 'handle')}",
            f"{fmt_range(base + r.offset, base + r.offset + r.size_bytes)}")


def _bars(snapshot: Snapshot, arena: ArenaSnapshot, rows: list[_Row], groups: list[_Group],
          title: str | None, *, mode: str, align: str) -> go.Figure:
    """One band per row, one bar per handle (the ``bars`` and ``buffer`` views)."""
    base = arena.base
    row_of = {r.name: i for i, r in enumerate(rows)}
    if align == "arena":
        span = arena.reserved_bytes
    else:
        span = max((r.size_bytes for r in rows), default=arena.reserved_bytes)
    unit, unit_name = _unit(span)
    slack = arena.reserved_bytes - arena.cursor_bytes
    names = [f"{html.escape(r.name)}  <b>{_pct(r.backed_bytes, r.size_bytes)}</b>"
             for r in rows]
    show_slack = align == "arena" and mode == "bars" and (slack > 0 or not rows)
    if show_slack:
        names.append("slack")
    n_rows = len(names)
    f = _BarFrame(base, row_of, {r.name: (0 if align == "arena" else r.offset) for r in rows},
                  unit, n_rows)
    ms: Sequence[MappingInfo] = (arena.mappings if mode == "bars" and align == "arena"
                                 else [m for m in arena.mappings if m.allocation in row_of])
    fig = go.Figure(data=[_backed_trace(f, ms), *_unbacked_traces(f, rows, arena, show_slack),
                          _cursor_trace(f, arena, align == "arena" and mode == "bars"),
                          *_mark_traces(f, rows)])
    x_title = (f"offset from arena base ({unit_name}); base {base:#x}" if align == "arena"
               else f"offset inside each {'buffer' if mode == 'bars' else 'allocation'} "
                    f"({unit_name})")
    # Separators between groups: a line per boundary, set at once (not add_shape in a loop).
    shapes = [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y",
               "y0": g.rows[0] - 0.5, "y1": g.rows[0] - 0.5,
               "line": {"color": "#868e96", "width": 1}} for g in groups[1:]
              if any(len(h.rows) > 1 for h in groups)][:64]
    per_row = 34 if n_rows <= 4 else 26 if n_rows <= 16 else 18
    _layout(fig, _bars_title(title, mode, rows, arena, len(ms)),
            max(90, min(1250, per_row * n_rows + 28)),
            {"kvvmm": "va_map", "mode": mode, "align": align, "unit_bytes": unit,
             "base": base, "rows": [r.name for r in rows]}, band_px=_band_px(fig))
    fig.update_layout(
        barmode="overlay", shapes=shapes,
        xaxis={"title": {"text": x_title}, "range": [0, span / unit], "zeroline": False,
               "automargin": True},
        # Explicit ranges: the marks' padding would leave empty bands at the ends; tick
        # labels at the edges get margin from automargin.
        yaxis={"tickvals": list(range(n_rows)), "ticktext": names,
               "range": [n_rows - 0.5, -0.5], "showgrid": False, "automargin": True,
               "ticklabelstandoff": 10},  # clear of a mark drawn whole at offset 0
    )
    return fig


def _heat_row(r: _Row, c0s: Sequence[int], width: int) -> list[float | None]:
    """Backed fraction of each column of one row (drawn from its start); None past its end.

    Backing is a prefix, so a row is ones, one partial column, zeros, then gaps: built by
    list arithmetic, not a loop over cells (1000 rows x 200 columns stays cheap).
    """
    ncols = len(c0s)
    used = min(ncols, -(-r.size_bytes // width))
    if r.pieces is not None:  # holes: each column's share of the backed pieces
        cells: list[float | None] = []
        for c in range(used):
            c0, c1 = c * width, min((c + 1) * width, r.size_bytes)
            got = sum(max(0, min(e, c1) - max(s, c0)) for s, e in r.pieces)
            cells.append(got / (c1 - c0))
        return cells + [None] * (ncols - used)
    full = min(r.backed_bytes // width, used)
    line: list[float | None] = [1.0] * full
    if full < used:
        c0 = full * width
        c1 = min(c0 + width, r.size_bytes)
        line.append(max(0, min(r.backed_bytes, c1) - c0) / (c1 - c0))
        line += [0.0] * (used - full - 1)
    return line + [None] * (ncols - used)


def _heat_text(rows: list[_Row], c0s: Sequence[int], width: int, base: int) -> Any:
    """Per-cell hover (absolute ranges) while it stays cheap to build and send; else None."""
    if len(rows) * len(c0s) > 50_000:
        return None

    def cell(r: _Row, c0: int) -> str:
        if c0 >= r.size_bytes:
            return ""
        c1 = min(c0 + width, r.size_bytes)
        return (f"{html.escape(r.name)} {_pct(r.backed_bytes, r.size_bytes)} backed<br>"
                f"{fmt_range(base + r.offset + c0, base + r.offset + c1)}<br>"
                f"{fmt_bytes(c1 - c0)}")

    return _array([[cell(r, c0) for c0 in c0s] for r in rows], text=True)


def _heat_trace(rows: list[_Row], c0s: Sequence[int], width: int, unit: int, unit_name: str,
                base: int) -> go.Heatmap:
    """The map: each row's backed fraction per column, from its own start."""
    text = _heat_text(rows, c0s, width, base)
    return go.Heatmap(
        name="backed", z=_array([_heat_row(r, c0s, width) for r in rows], floats=True),
        x=_array([(c + width / 2) / unit for c in c0s]),
        y=list(range(len(rows))), zmin=0, zmax=1, text=text,
        colorscale=[[0, _COLORS["unbacked"]], [1, _COLORS["backed"][0]]],
        # Horizontal, in the band under the plot (right of the legend): never over the title.
        colorbar={"orientation": "h", "lenmode": "pixels", "len": 200, "thickness": 10,
                  "xref": "container", "x": 0.995, "xanchor": "right",
                  "yref": "container", "y": 0, "yanchor": "bottom", "ypad": 4, "xpad": 0,
                  "title": {"text": "cell backed", "side": "top", "font": {"size": 11}},
                  "tickvals": [0, 0.5, 1], "ticktext": ["unbacked", "50%", "backed"],
                  "tickfont": {"size": 11}},
        hovertemplate=("%{text}<br>cell backed %{z:.0%}<extra></extra>" if text is not None
                       else f"row %{{y}}<br>offset %{{x:.4g}} {unit_name}<br>"
                            "cell backed %{z:.0%}<extra></extra>"),
        xgap=0, ygap=1 if len(rows) <= 200 else 0, showscale=True,
    )


def _heat_marks(fig: go.Figure, rows: list[_Row], unit: int, base: int) -> None:
    """The rest of :data:`VA_MAP_TRACES`: the prefix and final marks (one small tick per
    row), and empty traces for the categories the heatmap has no place for, so every view
    keeps the same leading trace names."""
    n = len(rows)
    for label in VA_MAP_TRACES[1:]:
        attr = {"prefix": "prefix_bytes", "final": "final_bytes"}.get(label)
        marks = [(i, getattr(r, attr)) for i, r in enumerate(rows)
                 if attr is not None and getattr(r, attr) is not None]
        if label in ("unbacked", "padding", "slack"):
            fig.add_trace(go.Bar(name=label, x=[], y=[], showlegend=False), row=1, col=1)
            continue
        fig.add_trace(go.Scatter(
            name=label, mode="markers", x=[m[1] / unit for m in marks], y=[m[0] for m in marks],
            marker={"symbol": "line-ns-open", "size": max(3, min(9, 700 // max(n, 1))),
                    "color": _COLORS[label], "line": {"width": 2, "color": _COLORS[label]}},
            hovertext=[f"{html.escape(rows[i].name)}: {label} span<br>"
                       f"{fmt_range(base + rows[i].offset, base + rows[i].offset + b)}<br>"
                       f"{fmt_bytes(b)}" for i, b in marks],
            hovertemplate=f"%{{hovertext}}<extra>{label}</extra>", showlegend=bool(marks),
            cliponaxis=False,
        ), row=1, col=1)


@dataclass(frozen=True, slots=True)
class _Summary:
    """The heatmap's right panel: each group's reserved and backed bytes, and the slack."""

    labels: list[str]
    reserved: list[int]
    backed: list[int]
    slack: int  #: reserved past the cursor (its bar is the last; none when 0)


def _summary(rows: list[_Row], groups: list[_Group], arena: ArenaSnapshot) -> _Summary:
    labels = [f"{html.escape(g.name)} ({len(g.rows)})" for g in groups]
    reserved = [sum(rows[i].size_bytes for i in g.rows) for g in groups]
    backed = [sum(rows[i].backed_bytes for i in g.rows) for g in groups]
    slack = arena.reserved_bytes - arena.cursor_bytes
    if slack > 0:
        labels.append("slack")
        reserved.append(slack)
        backed.append(0)
    return _Summary(labels, reserved, backed, slack)


def _summary_traces(fig: go.Figure, sm: _Summary, gu: int, with_text: bool) -> None:
    """The summary's bars: reserved behind, backed over it with its fraction as text."""
    labels, reserved, backed = sm.labels, sm.reserved, sm.backed
    fig.add_trace(go.Bar(
        name="group reserved", orientation="h", y=labels, x=[v / gu for v in reserved],
        marker={"color": _COLORS["unbacked"], "line_width": 0.5, "line_color": "#adb5bd"},
        hovertext=[f"{lb}: {fmt_bytes(v)} reserved" for lb, v in zip(labels, reserved,
                                                                          strict=True)],
        hovertemplate="%{hovertext}<extra></extra>", showlegend=False, width=0.7,
    ), row=1, col=2)
    # Each bar's backed fraction as its text, inside its end when the bar is long enough
    # (white on green), else just past it: never over the group labels, which sit in a right
    # margin of their own. Only while every bar is tall enough for a line of text.
    long = [b >= 0.45 * max(reserved) for b in backed]
    fig.add_trace(go.Bar(
        name="group backed", orientation="h", y=labels, x=[v / gu for v in backed],
        marker={"color": _COLORS["backed"][0]}, width=0.7,
        text=[_pct(b, r) for b, r in zip(backed, reserved, strict=True)] if with_text else None,
        textposition=["inside" if lg else "outside" for lg in long], insidetextanchor="end",
        insidetextfont={"color": "white", "size": 11},
        outsidetextfont={"color": "#212529", "size": 11},
        constraintext="none", cliponaxis=False, textfont={"size": 11},
        hovertext=[f"{lb}: {fmt_bytes(b)} backed of {fmt_bytes(r)} ({_pct(b, r)})"
                   for lb, b, r in zip(labels, backed, reserved, strict=True)],
        hovertemplate="%{hovertext}<extra></extra>", showlegend=False,
    ), row=1, col=2)


def _group_ticks(rows: list[_Row], groups: list[_Group], plot_px: int
                 ) -> tuple[int, list[float], list[str]]:
    """One label per group on the map, thinned so labels stay >= ~14 px apart: the stride,
    the tick positions and texts (each group's name and backed fraction)."""
    stride = max(1, -(-14 * len(groups) // max(plot_px, 1)))
    shown = groups[::stride]

    def group_pct(g: _Group) -> str:
        return _pct(sum(rows[i].backed_bytes for i in g.rows),
                    sum(rows[i].size_bytes for i in g.rows))

    return (stride, [(g.rows[0] + g.rows[-1]) / 2 for g in shown],
            [f"{g.label(rows)}  <b>{group_pct(g)}</b>" for g in shown])


def _heatmap(snapshot: Snapshot, arena: ArenaSnapshot, rows: list[_Row],
             groups: list[_Group], title: str | None, bins: int) -> go.Figure:
    """Backed fraction per (row, column), rows from their own start; groups summarised."""
    from plotly.subplots import make_subplots

    base = arena.base
    span = max((r.size_bytes for r in rows), default=arena.reserved_bytes)
    unit, unit_name = _unit(span)
    width = max(1, -(-span // bins))
    c0s = [c * width for c in range(-(-span // width))]
    n = len(rows)
    # A gap between the panels wide enough for the last x tick of the map and the first of
    # the summary ("700" and "0" read "7000" at 2%).
    fig = make_subplots(rows=1, cols=2, column_widths=[0.76, 0.24], horizontal_spacing=0.055,
                        shared_yaxes=False)
    fig.add_trace(_heat_trace(rows, c0s, width, unit, unit_name, base), row=1, col=1)
    _heat_marks(fig, rows, unit, base)
    plot_px = max(238, min(978, 4 * n + 48)) if n > 60 else max(238, 9 * n + 48)
    stride, tickvals, ticktext = _group_ticks(rows, groups, plot_px)
    gu, gname = _unit(max((sum(rows[i].size_bytes for i in g.rows) for g in groups),
                          default=1))
    sm = _summary(rows, groups, arena)
    _summary_traces(fig, sm, gu, with_text=plot_px >= 16 * len(sm.labels))
    # The summary's labels: the same groups as the map's (thinned alike), and slack.
    right_ticks = [sm.labels[i] for i in range(0, len(groups), stride)]
    if sm.slack > 0:
        right_ticks.append("slack")
    right_px = 18 + int(max((_text_px(t, 12) for t in right_ticks), default=0))
    shapes = [{"type": "line", "xref": "x domain", "x0": 0, "x1": 1, "yref": "y",
               "y0": g.rows[0] - 0.5, "y1": g.rows[0] - 0.5,
               "line": {"color": "#495057", "width": 1}} for g in groups[1:]][:64]
    text_title = (html.escape(title), "") if title is not None else _default_title(arena)
    legend = [str(t.name) for t in fig.data if t.showlegend is not False and t.name
              and t.type != "heatmap"]
    # The band holds the legend (left) and the colour bar (right, about 240 px with its
    # labels): one row unless the legend would run into it at the narrowest cell.
    band = 44 if _legend_rows(legend, width_px=760 - 260) <= 1 else 44 + _ROW_PX
    _layout(fig, text_title, plot_px,
            {"kvvmm": "va_map", "mode": "heatmap", "align": "start", "unit_bytes": unit,
             "base": base, "rows": [r.name for r in rows], "groups": [g.name for g in groups],
             "column_bytes": width, "group_unit_bytes": gu}, band_px=band, right_px=right_px)
    fig.update_layout(shapes=shapes, barmode="overlay", showlegend=True)
    fig.update_xaxes(title_text=f"offset inside each buffer ({unit_name})",
                     range=[0, span / unit], automargin=True, row=1, col=1)
    fig.update_yaxes(tickvals=tickvals, ticktext=ticktext, range=[n - 0.5, -0.5],
                     showgrid=False, automargin=True, ticklabelstandoff=6, row=1, col=1)
    fig.update_xaxes(title_text=f"backed of reserved ({gname})", row=1, col=2, showgrid=True,
                     gridcolor="#f1f3f5", range=[0, 1.08 * max(sm.reserved, default=1) / gu],
                     automargin=True)
    fig.update_yaxes(autorange="reversed", side="right", automargin=True, row=1, col=2,
                     showticklabels=True, tickmode="array", tickvals=right_ticks,
                     ticktext=right_ticks, type="category", categoryorder="array",
                     categoryarray=sm.labels, tickfont={"size": 12})
    return fig

"""Pictures and text of kvvmm's state: plotly figures and plain-text summaries.

Pure functions over frozen data (snapshots, traces, tables); nothing here holds or changes a
driver. The figures:

- :func:`va_map`: an arena's VA, one horizontal band per allocation (or KV buffer) across its
  reserved span: backed (one bar per handle), unbacked, granularity padding, slack VA beyond the
  cursor, the cursor, and for an owner the slot-0 page, prefix and final marks.
- :func:`timeline`: backed bytes and driver calls over a trace.
- :func:`handle_sizes`: how many handles of each size.
- :func:`bandwidth_by_handle_size`: measured copy bandwidth by handle size (H200 by default).

Figures are drawn with a few traces, one per category, never a shape per mapping: plotly's
``add_shape`` in a loop is quadratic (83 s for 1000 shapes). Past :data:`HEATMAP_THRESHOLD`
mappings the bars give way to a heatmap of backed fractions, which the browser draws at once.

The text functions (:func:`describe`, :func:`describe_stats`) print what notebooks compare
under nbval: on the sim driver every figure in them is deterministic; absolute addresses
appear only as ``base 0x...`` so that a sanitizer can mask them on real drivers.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from kvvmm.arena import ArenaSnapshot
from kvvmm.driver.base import CALLS, DriverStats
from kvvmm.errors import ArgumentError
from kvvmm.owner import OwnerSnapshot
from kvvmm.trace import Trace
from kvvmm.units import GiB, KiB, MiB, fmt_bytes, fmt_range

__all__ = [
    "H200_BANDWIDTH",
    "HEATMAP_THRESHOLD",
    "BandwidthPoint",
    "BandwidthTable",
    "bandwidth_by_handle_size",
    "describe",
    "describe_stats",
    "handle_sizes",
    "predicted_bandwidth_tb_s",
    "timeline",
    "va_map",
]

#: Above this many mappings :func:`va_map` draws a heatmap instead of one bar per handle.
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

Snapshot = ArenaSnapshot | OwnerSnapshot


# -- shared helpers ----------------------------------------------------------------------


def _arena_of(snapshot: object) -> ArenaSnapshot:
    if isinstance(snapshot, OwnerSnapshot):
        return snapshot.arena
    if isinstance(snapshot, ArenaSnapshot):
        return snapshot
    raise ArgumentError("snapshot", type(snapshot).__name__,
                        "an ArenaSnapshot or OwnerSnapshot (from .snapshot())")


def _unit(nbytes: int) -> tuple[int, str]:
    """The axis unit for a span of ``nbytes``: the largest of GiB/MiB/KiB/B it holds 4 of."""
    for size, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= 4 * size:
            return size, name
    return 1, "B"


def _array(values: list[Any], *, text: bool = False, floats: bool = False) -> Any:
    """A numpy array when numpy is there (plotly validates it in one step), else the list.

    ``text``: an object array of strings; ``floats``: None becomes NaN (a gap in a heatmap).
    """
    try:
        import numpy as np
    except ImportError:  # plotly does not need numpy; lists work, only slower
        return values
    if text:
        return np.array(values, dtype=object)
    return np.array(values, dtype=float) if floats else np.asarray(values)


def _count(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to width: first left-aligned (names), the rest right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: Sequence[str]) -> str:
        cells = [r[0].ljust(widths[0])]
        cells += [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        return "  ".join(cells).rstrip()

    return [fmt(header), *(fmt(r) for r in rows)]


# -- va_map ------------------------------------------------------------------------------


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


# -- timeline ----------------------------------------------------------------------------


def timeline(trace: Trace, *, x: str = "time") -> go.Figure:
    """Backed bytes and driver calls over a trace, on one shared x axis.

    Top: bytes mapped (backed) after each call, as a step line, with arena operations
    marked. Bottom: each driver call's cost in µs (simulated on the sim driver, else wall
    time), one trace per call kind, failed calls as crosses.

    Args:
        trace: a :class:`~kvvmm.trace.Trace` (``TracingDriver.trace`` or ``Trace.load``).
        x: ``"time"`` (cumulative call cost in µs: simulated when the trace has any, else
            wall) or ``"seq"`` (event number).
    Returns:
        A two-row ``plotly.graph_objects.Figure``.
    Raises:
        ArgumentError: ``x`` is neither.
    """
    from plotly.subplots import make_subplots

    if x not in ("time", "seq"):
        raise ArgumentError("x", x, "'time' or 'seq'")
    simulated = any(e.sim_us for e in trace.events)
    clock = 0.0
    xs: list[float] = []
    backed: list[int] = []
    mapped = 0
    for e in trace.events:
        cost = e.sim_us if simulated else e.wall_us
        clock += cost
        xs.append(clock if x == "time" else float(e.seq))
        if e.error is None and e.op in ("map", "unmap"):
            size = int(e.args.get("size", 0))
            mapped += size if e.op == "map" else -size
        backed.append(mapped)
    peak = max(backed, default=0)
    unit, unit_name = _unit(max(peak, 1))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        row_heights=[0.55, 0.45])
    fig.add_trace(go.Scatter(name="backed", x=xs, y=[b / unit for b in backed],
                             mode="lines", line={"shape": "hv", "color": "#2f9e44"},
                             hovertemplate=f"%{{y:.4g}} {unit_name}<extra>backed</extra>"),
                  row=1, col=1)
    notes = [(i, e) for i, e in enumerate(trace.events) if e.op.startswith("arena.")]
    fig.add_trace(go.Scatter(
        name="arena ops", x=[xs[i] for i, _ in notes], y=[backed[i] / unit for i, _ in notes],
        mode="markers", marker={"symbol": "circle-open", "size": 8, "color": "#495057"},
        hovertext=[f"#{e.seq} {e.op} {_short_args(e.args)}" for _, e in notes],
        hovertemplate="%{hovertext}<extra></extra>"), row=1, col=1)
    cost_kind = "simulated µs" if simulated else "wall µs"
    for op in CALLS:
        evs = [(i, e) for i, e in enumerate(trace.events) if e.op == op and e.error is None]
        if not evs:
            continue
        fig.add_trace(go.Scatter(
            name=op, x=[xs[i] for i, _ in evs],
            y=[e.sim_us if simulated else e.wall_us for _, e in evs], mode="markers",
            marker={"size": 5},
            hovertext=[f"#{e.seq} {op}({_short_args(e.args)})" for _, e in evs],
            hovertemplate=f"%{{hovertext}}<br>%{{y:.3g}} {cost_kind}<extra></extra>"),
            row=2, col=1)
    failed = [(i, e) for i, e in enumerate(trace.events) if e.error is not None]
    fig.add_trace(go.Scatter(
        name="failed", x=[xs[i] for i, _ in failed],
        y=[e.sim_us if simulated else e.wall_us for _, e in failed], mode="markers",
        marker={"symbol": "x", "size": 9, "color": "#e03131"},
        hovertext=[f"#{e.seq} {e.op}({_short_args(e.args)}): {e.error}" for _, e in failed],
        hovertemplate="%{hovertext}<extra>failed</extra>", showlegend=bool(failed)),
        row=2, col=1)
    xtitle = f"cumulative {cost_kind}" if x == "time" else "event number"
    fig.update_xaxes(title_text=xtitle, row=2, col=1)
    fig.update_yaxes(title_text=f"backed ({unit_name})", row=1, col=1)
    fig.update_yaxes(title_text=cost_kind, type="log", row=2, col=1)
    n_calls = len(trace.driver_calls())
    fig.update_layout(
        title={"text": f"{n_calls} driver calls, peak {fmt_bytes(peak)} backed "
                       f"({trace.meta.get('driver', '?')}, {trace.meta.get('device_name', '?')})",
               "font": {"size": 14}},
        height=520, margin={"l": 10, "r": 10, "t": 50, "b": 40}, plot_bgcolor="white",
        meta={"kvvmm": "timeline", "unit_bytes": unit, "x": x, "simulated": simulated},
    )
    return fig


def _short_args(args: Mapping[str, Any]) -> str:
    out = []
    for k, v in args.items():
        if k in ("va", "base") and isinstance(v, int):
            out.append(f"{k}={v:#x}")
        elif k in ("size", "nbytes", "reserve_bytes", "keep_bytes") and isinstance(v, int):
            out.append(f"{k}={fmt_bytes(v)}")
        else:
            out.append(f"{k}={v}")
    return ", ".join(out)


# -- handle sizes ------------------------------------------------------------------------


def _sizes_of(source: object) -> list[int]:
    if isinstance(source, (ArenaSnapshot, OwnerSnapshot)):
        return [m.size_bytes for m in _arena_of(source).mappings]
    if isinstance(source, Iterable) and not isinstance(source, (str, bytes, Mapping)):
        sizes = list(source)
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
                raise ArgumentError("handle size", s, "an int > 0 (bytes)")
        return sizes
    raise ArgumentError("source", type(source).__name__,
                        "a snapshot or a list of handle sizes in bytes")


def handle_sizes(
    source: ArenaSnapshot | OwnerSnapshot | Sequence[int]
    | Mapping[str, ArenaSnapshot | OwnerSnapshot | Sequence[int]],
) -> go.Figure:
    """How many handles of each size: one bar per distinct size (sorted), per source.

    Args:
        source: a snapshot, a list of handle sizes in bytes, or a mapping of labels (policy
            names, say) to either; each label gets its own bar series.
    Returns:
        A ``plotly.graph_objects.Figure`` with one ``Bar`` per label (x: size, y: count).
    Raises:
        ArgumentError: a source is neither.
    """
    series = dict(source) if isinstance(source, Mapping) else {"handles": source}
    counted = {label: Counter(_sizes_of(s)) for label, s in series.items()}
    all_sizes = sorted({s for c in counted.values() for s in c})
    labels = [fmt_bytes(s) for s in all_sizes]
    fig = go.Figure()
    for label, cnt in counted.items():
        fig.add_trace(go.Bar(
            name=label, x=labels, y=[cnt.get(s, 0) for s in all_sizes],
            hovertext=[f"{label}: {cnt.get(s, 0)} handles of {fmt_bytes(s)} = "
                       f"{fmt_bytes(cnt.get(s, 0) * s)}" for s in all_sizes],
            hovertemplate="%{hovertext}<extra></extra>",
        ))
    total = sum(sum(c.values()) for c in counted.values())
    fig.update_layout(
        title={"text": f"handle sizes ({total} handles)", "font": {"size": 14}},
        barmode="group", height=360, plot_bgcolor="white",
        xaxis={"title": {"text": "handle size"}, "type": "category"},
        yaxis={"title": {"text": "handles"}},
        margin={"l": 10, "r": 10, "t": 50, "b": 40},
        meta={"kvvmm": "handle_sizes", "sizes": all_sizes},
    )
    return fig


# -- bandwidth ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BandwidthPoint:
    """Copy bandwidth of one tensor by how its memory was mapped."""

    label: str  #: the measurement's key (``"vmm_64MiB"``)
    handle_bytes: int | None  #: handle size; None for memory not from VMM handles
    interleaved: bool  #: handles created interleaved with other allocations' handles
    runs_tb_s: tuple[float, ...]  #: TB/s of each run

    @property
    def tb_s(self) -> float:
        """Mean of the runs, TB/s."""
        return sum(self.runs_tb_s) / len(self.runs_tb_s)


@dataclass(frozen=True, slots=True)
class BandwidthTable:
    """Bandwidth measurements of one device, with where they come from."""

    device: str
    tensor_bytes: int  #: size of the copied tensor
    points: tuple[BandwidthPoint, ...]
    source: str

    @classmethod
    def from_mapping(cls, data: Mapping[str, Sequence[float]], *, device: str, source: str,
                     tensor_bytes: int = GiB) -> BandwidthTable:
        """Read ``{"vmm_64MiB": [4.188, 4.19], "plain": [...], ...}`` (``device_bw.py``'s keys).

        ``vmm_<N>MiB`` and ``vmm_<N>MiB_interleaved`` are N-MiB handles, ``vmm_1handle`` one
        handle for the whole tensor; other keys (``plain``, ``expandable_segments:True``) are
        kept as reference points without a handle size.
        """
        points = []
        for key, runs in data.items():
            vals = tuple(float(v) for v in runs)
            if not vals:
                raise ArgumentError(f"runs of {key!r}", runs, "a non-empty list of TB/s")
            size: int | None = None
            inter = key.endswith("_interleaved")
            core = key.removesuffix("_interleaved")
            if core == "vmm_1handle":
                size = tensor_bytes
            elif core.startswith("vmm_") and core.endswith("MiB"):
                try:
                    size = int(core[4:-3]) * MiB
                except ValueError:
                    raise ArgumentError("key", key, "vmm_<N>MiB[_interleaved]") from None
            points.append(BandwidthPoint(key, size, inter, vals))
        return cls(device, tensor_bytes, tuple(points), source)

    def reference_tb_s(self, label: str = "plain") -> float | None:
        """Mean TB/s of a non-VMM reference (``"plain"``: cudaMalloc), None if absent."""
        ps = [p.tb_s for p in self.points if p.label.startswith(label)]
        return sum(ps) / len(ps) if ps else None


#: Copy bandwidth of a 1 GiB bf16 tensor on an H200, two runs each
#: (``shared/measurements/h200-bandwidth-by-handle-size.txt``, from ``device_bw.py``).
H200_BANDWIDTH = BandwidthTable.from_mapping(
    {
        "plain": [4.198, 4.175],
        "vmm_1handle": [4.22, 4.214],
        "vmm_512MiB": [4.209, 4.214],
        "vmm_64MiB": [4.188, 4.19],
        "vmm_8MiB": [4.077, 4.08],
        "vmm_2MiB": [3.607, 3.618],
        "vmm_2MiB_interleaved": [3.492, 3.491],
        "vmm_8MiB_interleaved": [4.009, 3.991],
        "plain_again": [4.193, 4.192],
        "expandable_segments:True": [3.943, 4.002],
        "expandable_segments:False": [4.2, 4.197],
    },
    device="NVIDIA H200",
    source="shared/measurements/h200-bandwidth-by-handle-size.txt (device_bw.py, 2026-11-29): "
           "copy bandwidth of a 1 GiB bf16 tensor by how its memory was mapped, TB/s",
)


def _curve(table: BandwidthTable, interleaved: bool) -> list[tuple[float, float]]:
    """(log2 handle bytes, TB/s) points, sorted; interleaved falls back to plain past its data."""
    plain = {p.handle_bytes: p.tb_s for p in table.points
             if p.handle_bytes is not None and not p.interleaved}
    pts = dict(plain)
    if interleaved:
        inter = {p.handle_bytes: p.tb_s for p in table.points
                 if p.handle_bytes is not None and p.interleaved}
        if inter:
            # Interleaving was measured only for small handles; beyond the largest measured
            # one the plain curve holds (the penalty shrinks with size: 8 MiB 4.08 vs 4.00).
            top = max(inter)
            pts = {s: v for s, v in plain.items() if s > top}
            pts.update(inter)
    if not pts:
        raise ArgumentError("table", table.device, "a table with vmm_<N>MiB points")
    return sorted((math.log2(s), v) for s, v in pts.items() if s is not None)


def predicted_bandwidth_tb_s(
    handle_bytes: Sequence[int], *, interleaved: bool = False,
    table: BandwidthTable | None = None,
) -> float:
    """Copy bandwidth predicted for a buffer backed by handles of the given sizes.

    Each handle's bytes are copied at the table's bandwidth for its size (piecewise linear
    in log2(size) between measured sizes, flat beyond them), so the buffer's time is the sum
    of ``bytes / bandwidth`` and its bandwidth the byte-weighted harmonic mean. An estimate
    from one device's measurements, not a measurement.

    Args:
        handle_bytes: handle sizes in bytes (all > 0).
        interleaved: use the interleaved curve (handles created in turn with other buffers'
            handles, as decode growth of many buffers does).
        table: the measurements (default :data:`H200_BANDWIDTH`).
    Returns:
        TB/s; 0.0 for no handles.
    Raises:
        ArgumentError: a size is not an int > 0.
    """
    table = H200_BANDWIDTH if table is None else table
    sizes = _sizes_of(list(handle_bytes))
    if not sizes:
        return 0.0
    curve = _curve(table, interleaved)
    xs = [p[0] for p in curve]

    def bw(size: int) -> float:
        x = math.log2(size)
        if x <= xs[0]:
            return curve[0][1]
        if x >= xs[-1]:
            return curve[-1][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(curve):
            if x0 <= x <= x1:
                return y0 + (x - x0) / (x1 - x0) * (y1 - y0)
        return curve[-1][1]  # unreachable: xs is sorted

    per_size = Counter(sizes)
    seconds = sum(n * s / bw(s) for s, n in per_size.items())
    return sum(sizes) / seconds


def bandwidth_by_handle_size(table: BandwidthTable | None = None) -> go.Figure:
    """Measured copy bandwidth by handle size, with cudaMalloc as the line to match.

    Args:
        table: the measurements (default :data:`H200_BANDWIDTH`, from the H200 run in
            ``shared/measurements/``).
    Returns:
        A ``plotly.graph_objects.Figure``: a bar per handle size (plain and interleaved
        series), error bars spanning the runs, dashed lines for the non-VMM references.
    """
    table = H200_BANDWIDTH if table is None else table
    fig = go.Figure()
    for inter, name, color in ((False, "VMM handles", "#2f9e44"),
                               (True, "interleaved with other buffers", "#f08c00")):
        ps = sorted((p for p in table.points if p.handle_bytes is not None
                     and p.interleaved == inter), key=lambda p: p.handle_bytes or 0)
        if not ps:
            continue
        fig.add_trace(go.Bar(
            name=name, x=[fmt_bytes(p.handle_bytes or 0) for p in ps], y=[p.tb_s for p in ps],
            marker={"color": color},
            error_y={"type": "data", "symmetric": False,
                     "array": [max(p.runs_tb_s) - p.tb_s for p in ps],
                     "arrayminus": [p.tb_s - min(p.runs_tb_s) for p in ps]},
            hovertext=[f"{p.label}: {p.tb_s:.3f} TB/s (runs {', '.join(map(str, p.runs_tb_s))})"
                       for p in ps],
            hovertemplate="%{hovertext}<extra></extra>",
        ))
    refs = [p for p in table.points if p.handle_bytes is None]
    order = sorted({fmt_bytes(p.handle_bytes) for p in table.points
                    if p.handle_bytes is not None},
                   key=lambda s: next(p.handle_bytes or 0 for p in table.points
                                      if p.handle_bytes is not None
                                      and fmt_bytes(p.handle_bytes) == s))
    for p, dash in zip(refs, ("dash", "dot", "dashdot", "longdash", "solid"), strict=False):
        fig.add_trace(go.Scatter(
            name=f"{p.label} {p.tb_s:.2f}", x=[order[0], order[-1]] if order else [0, 1],
            y=[p.tb_s, p.tb_s], mode="lines", line={"dash": dash, "width": 1},
            hovertemplate=f"{p.label}: {p.tb_s:.3f} TB/s<extra></extra>",
        ))
    lo = min((min(p.runs_tb_s) for p in table.points), default=0.0)
    hi = max((max(p.runs_tb_s) for p in table.points), default=1.0)
    fig.update_layout(
        title={"text": f"copy bandwidth of a {fmt_bytes(table.tensor_bytes)} tensor by handle "
                       f"size ({table.device})", "font": {"size": 14}},
        barmode="group", height=400, plot_bgcolor="white",
        xaxis={"title": {"text": "handle size"}, "type": "category",
               "categoryorder": "array", "categoryarray": order},
        yaxis={"title": {"text": "TB/s"}, "range": [lo - 0.3, hi + 0.1]},
        margin={"l": 10, "r": 10, "t": 50, "b": 40},
        meta={"kvvmm": "bandwidth_by_handle_size", "source": table.source},
    )
    return fig


# -- text --------------------------------------------------------------------------------


def describe(snapshot: ArenaSnapshot | OwnerSnapshot) -> str:
    """A multi-line text summary of an arena or owner snapshot, for people and for nbval.

    Offsets are from the arena base and identical on every driver; the one absolute
    address is the ``base 0x...`` on the second line.

    Args:
        snapshot: ``arena.snapshot()`` or ``owner.snapshot()``.
    Returns:
        Lines: what the arena is, its reserved / backed / slack VA, then one line per
        allocation (for an owner: per buffer, with its slot-0, prefix and final spans).
    Raises:
        ArgumentError: ``snapshot`` is not a snapshot.
    """
    a = _arena_of(snapshot)
    handles = Counter(m.allocation for m in a.mappings)
    out = []
    if isinstance(snapshot, OwnerSnapshot):
        final = "-" if snapshot.final_tokens is None else f"{snapshot.final_tokens:,}"
        out.append(f"owner {a.name!r}: {len(snapshot.buffers)} buffers, {snapshot.dtype}, "
                   f"page {snapshot.page_size} tokens, policy {snapshot.policy}")
        out.append(f"tokens: reserved {snapshot.reserved_tokens:,}, prefix "
                   f"{snapshot.prefix_tokens:,}, final {final}")
    state = ", closed" if a.closed else ""
    out.append(f"arena {a.name!r} on {a.driver} ({a.device_name}), granularity "
               f"{fmt_bytes(a.granularity)}{state}")
    pct = 100.0 * a.backed_bytes / a.reserved_bytes if a.reserved_bytes else 0.0
    out.append(f"reserved {fmt_bytes(a.reserved_bytes)} at base {a.base:#x}, cursor "
               f"{fmt_bytes(a.cursor_bytes)}, slack {fmt_bytes(a.slack_bytes)}")
    out.append(f"backed   {fmt_bytes(a.backed_bytes)} in {_count(len(a.mappings), 'handle')} "
               f"({pct:.1f}% of reserved), unbacked {fmt_bytes(a.unbacked_bytes)}")
    if isinstance(snapshot, OwnerSnapshot):
        header = ["buffer", "offsets", "span", "backed", "handles", "slot 0", "prefix", "final"]
        rows = [[b.name, fmt_range(b.offset, b.offset + b.aligned_bytes),
                 fmt_bytes(b.reserved_span_bytes), fmt_bytes(b.backed_bytes),
                 str(handles.get(b.name, 0)), fmt_bytes(b.page0_bytes),
                 fmt_bytes(b.prefix_bytes),
                 "-" if b.final_bytes is None else fmt_bytes(b.final_bytes)]
                for b in snapshot.buffers]
    else:
        header = ["allocation", "offsets", "size", "requested", "backed", "handles"]
        rows = [[x.name, fmt_range(x.offset, x.end), fmt_bytes(x.size_bytes),
                 fmt_bytes(x.requested_bytes), fmt_bytes(x.backed_bytes),
                 str(handles.get(x.name, 0))] for x in a.allocations]
    if rows:
        out += _table(header, rows)
    return "\n".join(out)


def describe_stats(stats: DriverStats) -> str:
    """One line on what a driver holds (``driver.stats()``); says ``clean`` when nothing.

    Args:
        stats: a :class:`~kvvmm.driver.base.DriverStats`.
    Returns:
        ``"1 reservation (40.0 MiB), 4 handles, 4 mappings (8.0 MiB), physical 8.0 MiB"``
        or ``"clean: no reservation, handle, mapping or memory held"``.
    """
    if not isinstance(stats, DriverStats):
        raise ArgumentError("stats", type(stats).__name__, "a DriverStats (driver.stats())")
    if stats.clean:
        return "clean: no reservation, handle, mapping or memory held"
    return (f"{_count(stats.reservations, 'reservation')} ({fmt_bytes(stats.reserved_bytes)}), "
            f"{_count(stats.handles, 'handle')}, {_count(stats.mappings, 'mapping')} "
            f"({fmt_bytes(stats.mapped_bytes)}), physical {fmt_bytes(stats.physical_bytes)}")

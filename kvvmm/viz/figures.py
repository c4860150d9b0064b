"""Figures over traces and measurements: the call timeline, handle sizes, bandwidth, growth.

Pure functions of frozen data (traces, snapshots, tables, results); each returns a plotly
figure and changes nothing.
"""

from __future__ import annotations

import html
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import plotly.graph_objects as go

from kvvmm.checks import int_arg
from kvvmm.driver.base import CALLS
from kvvmm.errors import ArgumentError, KvvmmError
from kvvmm.hardware import H200_BANDWIDTH, BandwidthTable, DeviceProfile
from kvvmm.hardware.bandwidth import BANDWIDTH_TARGET
from kvvmm.record.trace import Trace
from kvvmm.snapshot import ArenaSnapshot, OwnerSnapshot
from kvvmm.units import fmt_bytes
from kvvmm.viz._common import _arena_of, _count, _unit, profile_words

if TYPE_CHECKING:
    from kvvmm.growth import GrowthResult

__all__ = ["bandwidth_by_handle_size", "growth_figure", "handle_sizes", "timeline"]


def timeline(trace: Trace, *, x: str = "time",
             profile: str | DeviceProfile | None = None) -> go.Figure:
    """Backed bytes and driver calls over a trace, on one shared x axis.

    Top: bytes mapped (backed) after each call, as a step line, with arena operations
    marked. Bottom: each driver call's cost in µs (simulated on the sim driver, else wall
    time), one trace per call kind, failed calls as crosses.

    Args:
        trace: a :class:`~kvvmm.trace.Trace` (``TracingDriver.trace`` or ``Trace.load``).
        x: ``"time"`` (cumulative call cost in µs: simulated when the trace has any, else
            wall) or ``"seq"`` (event number).
        profile: the sim's profile (``driver.profile``): a simulated timeline names it (card
            and date) under its title, so the figure says what it predicts from.
    Returns:
        A two-row ``plotly.graph_objects.Figure``.
    Raises:
        ArgumentError: ``x`` is neither.
    """
    from plotly.subplots import make_subplots

    if x not in ("time", "seq"):
        raise ArgumentError("x", x, "'time' or 'seq'")
    simulated = any(e.sim_us for e in trace.events)
    xs, backed = _timeline_xy(trace, x, simulated)
    peak = max(backed, default=0)
    unit, unit_name = _unit(max(peak, 1))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        row_heights=[0.55, 0.45])
    _backed_traces(fig, trace, xs, [b / unit for b in backed], unit_name)
    cost_kind = "simulated µs" if simulated else "wall µs"
    _call_traces(fig, trace, xs, simulated, cost_kind)
    xtitle = f"cumulative {cost_kind}" if x == "time" else "event number"
    fig.update_xaxes(title_text=xtitle, row=2, col=1)
    fig.update_yaxes(title_text=f"backed ({unit_name})", row=1, col=1)
    # Decades only: plotly's default log ticks (2, 5 between decades) crowd a short axis.
    fig.update_yaxes(title_text=cost_kind, type="log", dtick=1, tickformat="~s", row=2, col=1)
    n_calls = len(trace.driver_calls())
    sub = f"<br><sub>{html.escape(_simulated_from(trace, profile))}</sub>" if simulated else ""
    fig.update_layout(
        title={"text": f"{_count(n_calls, 'driver call')}, peak {fmt_bytes(peak)} backed "
                       f"({trace.meta.get('driver', '?')}, {trace.meta.get('device_name', '?')})"
                       + sub,
               "font": {"size": 14}},
        height=520, autosize=True, margin={"l": 10, "r": 10, "t": 60, "b": 40},
        plot_bgcolor="white",
        meta={"kvvmm": "timeline", "unit_bytes": unit, "x": x, "simulated": simulated},
    )
    return fig


def _timeline_xy(trace: Trace, x: str, simulated: bool) -> tuple[list[float], list[int]]:
    """Each event's x (its cumulative cost, µs, or its number) and the bytes mapped after it."""
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
    return xs, backed


def _backed_traces(fig: go.Figure, trace: Trace, xs: list[float], ys: list[float],
                   unit_name: str) -> None:
    """The top row: backed bytes as a step line, and the arena operations on it."""
    fig.add_trace(go.Scatter(name="backed", x=xs, y=ys,
                             mode="lines", line={"shape": "hv", "color": "#2f9e44"},
                             hovertemplate=f"%{{y:.4g}} {unit_name}<extra>backed</extra>"),
                  row=1, col=1)
    # An arena operation sits at the last driver call before it (its calls come first).
    seqs = [e.seq for e in trace.events]
    notes = [(bisect_left(seqs, o.seq) - 1, o) for o in trace.ops]
    fig.add_trace(go.Scatter(
        name="arena ops", x=[xs[i] if i >= 0 else 0.0 for i, _ in notes],
        y=[ys[i] if i >= 0 else 0.0 for i, _ in notes],
        mode="markers", marker={"symbol": "circle-open", "size": 8, "color": "#495057"},
        hovertext=[f"#{o.seq} arena {o.arena} {o.op} {_short_args(o.args)}" for _, o in notes],
        hovertemplate="%{hovertext}<extra></extra>"), row=1, col=1)


def _call_traces(fig: go.Figure, trace: Trace, xs: list[float], simulated: bool,
                 cost_kind: str) -> None:
    """The bottom row: each call's cost, one trace per call kind, failed calls as crosses."""
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


def _sizes_of(source: object) -> list[int]:
    if isinstance(source, (ArenaSnapshot, OwnerSnapshot)):
        return [m.size_bytes for m in _arena_of(source).mappings]
    if isinstance(source, Iterable) and not isinstance(source, (str, bytes, Mapping)):
        sizes = list(source)
        for s in sizes:
            int_arg("handle size", s, lo=1, unit="bytes")
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
            name=html.escape(str(label)), x=labels, y=[cnt.get(s, 0) for s in all_sizes],
            hovertext=[f"{html.escape(str(label))}: {_count(cnt.get(s, 0), 'handle')} of "
                       f"{fmt_bytes(s)} = "
                       f"{fmt_bytes(cnt.get(s, 0) * s)}" for s in all_sizes],
            hovertemplate="%{hovertext}<extra></extra>",
        ))
    total = sum(sum(c.values()) for c in counted.values())
    fig.update_layout(
        title={"text": f"handle sizes ({_count(total, 'handle')})", "font": {"size": 14}},
        barmode="group", height=360, autosize=True, plot_bgcolor="white",
        xaxis={"title": {"text": "handle size"}, "type": "category"},
        yaxis={"title": {"text": "handles"}},
        margin={"l": 10, "r": 10, "t": 60, "b": 40},
        meta={"kvvmm": "handle_sizes", "sizes": all_sizes},
    )
    return fig


def bandwidth_by_handle_size(table: BandwidthTable | None = None) -> go.Figure:
    """Measured copy bandwidth by handle size, with cudaMalloc as the line to match.

    Args:
        table: the measurements (default :data:`~kvvmm.hardware.H200_BANDWIDTH`:
            docs/MEASUREMENTS.md §4).
    Returns:
        A ``plotly.graph_objects.Figure``: a bar per handle size (plain and interleaved
        series), error bars spanning the runs, dashed lines for the non-VMM references.
    """
    table = H200_BANDWIDTH if table is None else table
    ref = table.reference_tb_s("plain")
    fig = go.Figure(_handle_bars(table, ref))
    sizes = sorted({p.handle_bytes for p in table.points if p.handle_bytes is not None})
    order = list(dict.fromkeys(fmt_bytes(b) for b in sizes))  # the x axis, smallest first
    refs = [p for p in table.points if p.handle_bytes is None]
    for p, dash in zip(refs, ("dash", "dot", "dashdot", "longdash", "solid"), strict=False):
        fig.add_trace(go.Scatter(
            name=f"{p.label} {p.tb_s:.2f}", x=[order[0], order[-1]] if order else [0, 1],
            y=[p.tb_s, p.tb_s], mode="lines", line={"dash": dash, "width": 1},
            hovertemplate=f"{p.label}: {p.tb_s:.3f} TB/s<extra></extra>",
        ))
    hi = max((max(p.runs_tb_s) for p in table.points), default=1.0)
    ratio = " (bar labels: ratio to cudaMalloc)" if ref else ""
    fig.update_layout(
        title={"text": f"copy bandwidth of a {fmt_bytes(table.tensor_bytes)} tensor by handle "
                       f"size ({table.device})",
               "subtitle": {"text": f"from 0 TB/s{ratio}", "font": {"size": 11}},
               "font": {"size": 14}},
        barmode="group", height=420, autosize=True, plot_bgcolor="white",
        xaxis={"title": {"text": "handle size"}, "type": "category",
               "categoryorder": "array", "categoryarray": order},
        # From 0: a range starting at 3 TB/s made a 15% difference look like 2x.
        yaxis={"title": {"text": "TB/s"}, "range": [0, hi * 1.08], "rangemode": "tozero"},
        legend={"orientation": "h", "yanchor": "top", "y": -0.18, "x": 0},
        margin={"l": 10, "r": 10, "t": 70, "b": 40},
        meta={"kvvmm": "bandwidth_by_handle_size", "source": table.source},
    )
    return fig


def _handle_bars(table: BandwidthTable, ref: float | None) -> list[go.Bar]:
    """A bar per handle size, plain and interleaved series, error bars spanning the runs."""
    bars = []
    for inter, name, color in ((False, "VMM handles", "#2f9e44"),
                               (True, "interleaved with other buffers", "#f08c00")):
        ps = sorted((p for p in table.points if p.handle_bytes is not None
                     and p.interleaved == inter), key=lambda p: p.handle_bytes or 0)
        if not ps:
            continue
        bars.append(go.Bar(
            name=name, x=[fmt_bytes(p.handle_bytes or 0) for p in ps], y=[p.tb_s for p in ps],
            marker={"color": color},
            # Each bar says how it compares with cudaMalloc: with the axis from 0 the bars
            # look alike, and the ratio is the figure's point.
            text=[f"{p.tb_s / ref:.2f}×" if ref else f"{p.tb_s:.2f}" for p in ps],
            textposition="inside", insidetextanchor="end", textfont={"color": "white"},
            error_y={"type": "data", "symmetric": False,
                     "array": [max(p.runs_tb_s) - p.tb_s for p in ps],
                     "arrayminus": [p.tb_s - min(p.runs_tb_s) for p in ps]},
            hovertext=[f"{p.label}: {p.tb_s:.3f} TB/s (runs {', '.join(map(str, p.runs_tb_s))})"
                       for p in ps],
            hovertemplate="%{hovertext}<extra></extra>",
        ))
    return bars


def bandwidth_fit_figure(table: BandwidthTable | None = None) -> go.Figure:
    """Every measured run of the owner's copy after growth, by policy, and the fitted curve's
    prediction with its band, against cudaMalloc and the target line.

    Args:
        table: the measurements (default :data:`~kvvmm.hardware.H200_BANDWIDTH`).
    Returns:
        A ``plotly.graph_objects.Figure`` (empty of points when the table has no growth
        runs); ``layout.meta["points"]`` lists the copies drawn.
    """
    from kvvmm.hardware.bandwidth import growth_fit

    table = H200_BANDWIDTH if table is None else table
    fit = growth_fit(table)
    points = list(fit.points) if fit is not None else []
    names = [html.escape(p.label).replace("(", "<br>(").replace(", ", ",<br>")
             for p in points]
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        name="one run", mode="markers",
        x=[n for n, p in zip(names, points, strict=True) for _ in p.ratios],
        y=[r for p in points for r in p.ratios],
        marker={"size": 7, "color": "rgba(25, 113, 194, 0.45)", "line": {"width": 0}},
        hovertemplate="%{y:.4f}× cudaMalloc<extra>one run</extra>"))
    if fit is not None:
        bands = [fit.band(p.copied) for p in points]
        fig.add_trace(go.Scatter(
            name="fitted (band: the runs' lowest to highest, fitted)", mode="markers",
            x=names, y=[b.mid for b in bands],
            marker={"symbol": "diamond", "size": 12, "color": "#2b8a3e"},
            error_y={"type": "data", "symmetric": False, "color": "#2b8a3e",
                     "array": [b.high - b.mid for b in bands],
                     "arrayminus": [b.mid - b.low for b in bands]},
            hovertemplate="fitted %{y:.4f}×<extra></extra>"))
    ends = [names[0], names[-1]] if names else ["", ""]
    ref = table.reference_tb_s("plain")
    malloc = f"cudaMalloc ({ref:.2f} TB/s)" if ref else "cudaMalloc"
    fig.add_trace(go.Scatter(name=malloc, x=ends, y=[1.0, 1.0], mode="lines",
                             line={"dash": "dash", "color": "#e8590c"}))
    fig.add_trace(go.Scatter(name=f"target {BANDWIDTH_TARGET:g}×", x=ends,
                             y=[BANDWIDTH_TARGET] * 2, mode="lines",
                             line={"dash": "dot", "color": "#c92a2a", "width": 2}))
    fig.update_layout(
        title={"text": f"copy bandwidth after decode growth, measured and fitted "
                       f"({html.escape(table.device)})",
               # The workload in full, a clause a line: cut, it read "grown by 4096-t".
               "subtitle": {"text": html.escape(table.growth_workload).replace(
                                ", grown", ",<br>grown"), "font": {"size": 11}},
               "font": {"size": 14}},
        height=460, autosize=True, plot_bgcolor="white",
        xaxis={"type": "category", "tickfont": {"size": 10}},
        yaxis={"title": {"text": "× cudaMalloc"}, "gridcolor": "#e9ecef"},
        legend={"orientation": "h", "yanchor": "top", "y": -0.25, "x": 0},
        margin={"l": 10, "r": 10, "t": 95, "b": 40},
        meta={"kvvmm": "bandwidth_fit", "points": [p.label for p in points],
              "source": table.growth_source},
    )
    return fig


def growth_figure(results: Sequence[GrowthResult], *,
                  profile: str | DeviceProfile | None = None,
                  predicted: Sequence[GrowthResult] | None = None) -> go.Figure:
    """Backed vs needed bytes per step (left) and predicted bandwidth (right).

    The bytes axis takes its unit from the largest value (GiB for big pools, never "20k
    MiB"). The bandwidth panel gives each policy's predicted ratio to cudaMalloc with the
    band of the H200 runs the curve is fitted to (:func:`kvvmm.hardware.predicted_ratio`),
    against cudaMalloc and the target line (:data:`~kvvmm.hardware.bandwidth.BANDWIDTH_TARGET`);
    a policy that keeps the target is green.

    Args:
        results: :func:`kvvmm.growth.compare_policies` results (or any with the same fields).
        profile: the profile the sim's driver times come from: named in the title.
        predicted: on a real driver, the same growth on the sim: the title gives each
            policy's measured and predicted driver time side by side.
    Returns:
        A two-panel ``plotly.graph_objects.Figure``; ``layout.meta["unit_bytes"]`` is the
        bytes axis' unit.
    """
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.1,
                        subplot_titles=("backed while decoding",
                                        "copy bandwidth (× cudaMalloc)"))
    peak = max((max([*r.backed_by_step, *r.needed_by_step], default=0) for r in results),
               default=0)
    unit, unit_name = _unit(max(peak, 1))
    _growth_lines(fig, results, unit, unit_name)
    _ratio_panel(fig, results)
    fig.update_xaxes(title_text="tokens", row=1, col=1)
    fig.update_yaxes(title_text=f"backed ({unit_name})", rangemode="tozero", row=1, col=1)
    fig.update_layout(height=460, autosize=True, margin={"l": 10, "r": 10, "t": 60, "b": 40},
                      legend={"orientation": "h", "yanchor": "top", "y": -0.32, "x": 0},
                      plot_bgcolor="white", meta={"kvvmm": "growth", "unit_bytes": unit})
    title = _growth_title(results, profile, predicted)
    if title:
        fig.update_layout(title={"text": title, "font": {"size": 13}},
                          margin={"l": 10, "r": 10, "t": 90, "b": 40})
    return fig


def _growth_lines(fig: go.Figure, results: Sequence[GrowthResult], unit: int,
                  unit_name: str) -> None:
    """The left panel: what was needed, and each policy's backing, per step."""
    if results:
        r0 = results[0]
        fig.add_trace(go.Scatter(name="needed", x=list(r0.tokens),
                                 y=[n / unit for n in r0.needed_by_step], mode="lines",
                                 line={"color": "#495057", "dash": "dot"}), row=1, col=1)
    for r in results:
        fig.add_trace(go.Scatter(name=html.escape(r.policy), x=list(r.tokens),
                                 y=[b / unit for b in r.backed_by_step], mode="lines",
                                 line={"shape": "hv"},
                                 hovertemplate=f"%{{y:.4g}} {unit_name} at %{{x:,}} tokens"
                                               "<extra>%{fullData.name}</extra>"),
                      row=1, col=1)


def _ratio_panel(fig: go.Figure, results: Sequence[GrowthResult]) -> None:
    """The right panel: each policy's predicted ratio to cudaMalloc with its band, against
    cudaMalloc and the target line."""
    # Policy names are long ("Geometric(2, 256.0 MiB, min 8.0 MiB)"): one argument a line,
    # so the bars' labels stay horizontal and inside the figure at 1280 px.
    policies = [html.escape(r.policy).replace("(", "<br>(").replace(", ", ",<br>")
                for r in results]
    # Markers on a ratio axis, not bars from 0 TB/s: the question is whether a policy clears
    # a line 1% below cudaMalloc, which bars from 0 cannot show. Error bars: the band of the
    # H200 runs the curve is fitted to (one run may land anywhere in it).
    mids = [r.predicted_ratio.mid for r in results]
    fig.add_trace(go.Scatter(
        name="predicted", x=policies, y=mids, mode="markers+text", showlegend=False,
        text=[f"{m:.3f}×" for m in mids], textposition="middle right",
        textfont={"size": 11},
        marker={"size": 11, "color": ["#2f9e44" if m >= BANDWIDTH_TARGET else "#868e96"
                                      for m in mids]},
        error_y={"type": "data", "symmetric": False, "color": "#495057",
                 "array": [r.predicted_ratio.high - r.predicted_ratio.mid for r in results],
                 "arrayminus": [r.predicted_ratio.mid - r.predicted_ratio.low
                                for r in results]},
        hovertext=[f"{html.escape(r.policy)}: {r.predicted_ratio.mid:.3f}× "
                   f"(runs' band {r.predicted_ratio.low:.3f}-{r.predicted_ratio.high:.3f}), "
                   f"{r.predicted_tb_s:.2f} TB/s" for r in results],
        hovertemplate="%{hovertext}<extra></extra>"), row=1, col=2)
    xs = policies or [""]
    ends = [xs[0], xs[-1]]
    ref = H200_BANDWIDTH.reference_tb_s("plain")
    malloc = f"cudaMalloc ({ref:.2f} TB/s)" if ref is not None else "cudaMalloc"
    fig.add_trace(go.Scatter(name=malloc, x=ends, y=[1.0, 1.0], mode="lines",
                             line={"dash": "dash", "color": "#e8590c"}), row=1, col=2)
    fig.add_trace(go.Scatter(name=f"target {BANDWIDTH_TARGET:g}× cudaMalloc", x=ends,
                             y=[BANDWIDTH_TARGET] * 2, mode="lines",
                             line={"dash": "dot", "color": "#c92a2a", "width": 2}),
                  row=1, col=2)
    lo = min([BANDWIDTH_TARGET, *(r.predicted_ratio.low for r in results)])
    hi = max([1.0, *(r.predicted_ratio.high for r in results)])
    pad = (hi - lo) * 0.12
    fig.update_yaxes(title_text="× cudaMalloc (H200 runs, fitted)",
                     range=[lo - pad, hi + pad], row=1, col=2)
    # Room right of the last marker for its label (a category axis ends half a slot past it).
    fig.update_xaxes(tickangle=0, tickfont={"size": 10}, row=1, col=2,
                     range=[-0.5, max(1, len(results)) - 0.5 + 0.9])


def _simulated_from(trace: Trace, profile: str | DeviceProfile | None) -> str:
    """Whose costs a simulated timeline's µs are: ``profile``, else the one its trace
    recorded (``meta["profile"]``, a key: a profile read from a file is named, not read)."""
    key = profile if profile is not None else trace.meta.get("profile")
    if key is None:
        return "simulated µs; profile not recorded"
    try:
        return f"simulated µs from profile {profile_words(key)}"
    except (KvvmmError, OSError):
        return f"simulated µs from profile {key} (not shipped: pass it to name its costs)"


def _growth_title(results: Sequence[GrowthResult], profile: str | DeviceProfile | None,
                  predicted: Sequence[GrowthResult] | None) -> str:
    """Which profile the driver times are simulated with; measured next to predicted."""
    if profile is None:
        return ""
    label = html.escape(profile_words(profile))
    if predicted is not None:
        pairs = ", ".join(f"{html.escape(r.policy)} {r.wall_s * 1e3:.1f} / {p.sim_us / 1e3:.1f}"
                          for r, p in zip(results, predicted, strict=True))
        return (f"driver time, measured / predicted (ms): {pairs}"
                f"<br><sub>predicted with profile {label}</sub>")
    if any(r.sim_us for r in results):
        return f"<sub>driver times simulated with profile {label}</sub>"
    return ""

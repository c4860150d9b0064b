"""Figures and text over workload replays: memory over time, stalls, the summary table.

Pure functions of a :class:`~kvvmm.workload.run.WorkloadComparison`; each returns a plotly
figure or a string and changes nothing.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from kvvmm.errors import ArgumentError, KvvmmError
from kvvmm.hardware import DeviceProfile, provenance
from kvvmm.units import fmt_bytes
from kvvmm.viz._common import (
    TERMINAL_COLUMNS,
    Report,
    Table,
    _legend_rows,
    _text_px,
    _unit,
    strategy_style,
)

if TYPE_CHECKING:
    from kvvmm.workload.run import StrategyResult, WorkloadComparison

__all__ = ["TERMINAL_COLUMNS", "TRADE_AXES", "TradeAxis", "costs_line", "first_token_figure",
           "format_workload", "held_over_used", "stall_figure", "tradeoff_figure",
           "workload_figure", "workload_memory_figure", "workload_report"]


def _calls_clause(pause_scale: float | None, driver: str) -> str:
    """How warm the sim's calls were: what the lead line says after the driver."""
    if driver != "sim":
        return ""
    if pause_scale is None or pause_scale == 0:
        return ", calls as warm as back to back"
    if pause_scale == 1.0:
        return ", calls in real time (each pays the cold premium its pause gives)"
    return f", calls {pause_scale:g} s apart per serving second (cold premium's share)"


def costs_line(cmp: WorkloadComparison | None,
               profile: str | DeviceProfile | None = None) -> str:
    """Whose figures a replay's times are, for its report and figures: ``"simulated with
    costs: h200, measured on an H200; capacity: b200"``
    (:func:`kvvmm.hardware.provenance_label`); on a real driver, the times are that card's.

    Args:
        cmp: the replay ("" for None).
        profile: the profile it ran on; None: the one its setup names (a shipped key; a
            profile read from a file is named by its key only, so pass it).
    """
    if cmp is None:
        return ""
    try:
        prov = provenance(cmp.setup.gpu if profile is None else profile)
    except (KvvmmError, OSError):
        return (f"costs: not known (profile {cmp.setup.gpu!r} is not shipped: pass the "
                "profile); capacity: as the setup's pool")
    driver = cmp.results[0].driver if cmp.results else "sim"
    if driver != "sim":
        return f"driver times measured on the {driver} driver; capacity: {prov.capacity}"
    return f"simulated with {prov.label()}"


def _memory_table(results: Sequence[StrategyResult]) -> Table:
    rows = [[r.strategy, fmt_bytes(r.peak_backed_bytes), fmt_bytes(round(r.mean_backed_bytes)),
             fmt_bytes(round(r.mean_pool_bytes)), fmt_bytes(round(r.mean_used_bytes)),
             fmt_bytes(round(r.mean_waste_bytes)), fmt_bytes(round(r.mean_elastic_bytes))]
            for r in results]
    return Table("memory on one rank (mean: time-weighted)",
                 ("strategy", "peak backed", "mean backed", "mean pool", "mean used",
                  "mean waste", "elastic at best"), _rows(rows))


def _decode_table(results: Sequence[StrategyResult]) -> Table:
    rows = [[r.strategy, f"{r.decode_driver_s * 1e3:,.2f} ms",
             f"{r.stalled_steps:,} ({r.stalled_share:.2%})", f"{r.stalled_p50_s * 1e3:.2f} ms",
             f"{r.stalled_p99_s * 1e3:.2f} ms", f"{r.max_stall_s * 1e3:.2f} ms"]
            for r in results]
    return Table("the decode path: driver time, and the steps that waited on the driver",
                 ("strategy", "decode driver", "stalled steps", "p50 if stalled",
                  "p99 if stalled", "max stall"), _rows(rows))


def _rest_table(results: Sequence[StrategyResult]) -> Table:
    rows = [[r.strategy, f"{r.p99_stall_s * 1e6:.0f} us", f"{r.driver_calls:,}",
             f"{r.final_handles:,}", f"{r.summary()['bandwidth_factor']:.3f}x",
             f"{r.serving.completed:,}", f"{r.serving.rejected:,}", f"{r.serving.preemptions:,}"]
            for r in results]
    return Table("every step, driver calls, handles, bandwidth and serving",
                 ("strategy", "p99 step", "calls", "handles", "bandwidth", "done", "rejected",
                  "preempted"), _rows(rows))


def _ms(ms: float) -> str:
    return f"{ms:,.1f} ms" if ms < 10_000 else f"{ms / 1e3:,.1f} s"


def _waits_table(results: Sequence[StrategyResult]) -> Table:
    """What requests waited: time to first token, admissions put off, latency."""
    rows = []
    for r in results:
        w = r.wait_summary()
        rows.append([r.strategy, _ms(w["first_token_p50_ms"]), _ms(w["first_token_p99_ms"]),
                     _ms(w["first_token_max_ms"]),
                     f"{w['first_token_added_p99_ms']:,.1f} / {_ms(w['first_token_added_max_ms'])}",
                     f"{w['admissions_put_off']:,}",
                     f"{w['latency_p50_s']:,.2f} s", f"{w['latency_p99_s']:,.2f} s"])
    return Table("what requests waited: first token (arrival to end of prefill; added: by "
                 "memory), put off, latency",
                 ("strategy", "first token p50", "p99", "max", "added p99 / max", "put off",
                  "latency p50", "p99"), _rows(rows))


def _ranges_table(results: Sequence[StrategyResult]) -> Table | None:
    rows = []
    for r in results:
        g = r.ranges
        if g:
            later = g["deferred_admits"]
            rows.append([r.strategy, f"{later:,} of {g['admits']:,}",
                         f"{g['deferred_ms'] / later if later else 0.0:.1f} ms",
                         f"{g['deferred_max_ms']:.1f} ms",
                         f"{g['waited_admits']:,} ({g['admit_waited_ms']:.1f} ms)",
                         "inline" if g["inline"] else
                         f"{g['stalled_admits']:,} / {g['stalled_grows']:,}",
                         f"{g['split_admits']:,}"])
    if not rows:
        return None
    return Table("range strategies: admissions put off until mapped or spun for, commits a "
                 "step waited for",
                 ("strategy", "admitted later", "mean wait", "max wait", "spun for",
                  "waits: admit / grow", "split leases"), _rows(rows))


def _lead(cmp: WorkloadComparison) -> str:
    s, r0 = cmp.setup, cmp.results[0]
    return (f"{s.model} TP{s.tp} on {s.gpu}, one rank: {s.buffers} buffers, pool "
            f"{s.pool_tokens:,} tokens ({fmt_bytes(s.pool_tokens * s.page_bytes // s.page_size)}"
            f"), page {s.page_size}, slots {s.config.slot_order}-first; {s.requests:,} requests "
            f"over {r0.serving.end_s:,.0f} s simulated, {r0.serving.steps:,} steps; "
            f"driver {r0.driver}" + _calls_clause(s.pause_scale, r0.driver))


def workload_report(cmp: WorkloadComparison, *,
                    profile: str | DeviceProfile | None = None) -> Report:
    """The summary of a replay as tables, one row per strategy in each (no wall times:
    deterministic on the sim): printed, each line fits :data:`TERMINAL_COLUMNS`; in a
    notebook (and in :class:`~kvvmm.lab.WorkloadLab`) it shows as HTML tables that fit a
    cell at a 1280 px window. The lead says what ran and whose figures the times are
    (:func:`costs_line`; ``profile``: the profile it ran on, when read from a file).

    - memory: peak and time-weighted mean of what is backed, held by the pool, used by
      requests, backed but unused (waste), and what page-elastic backing needs at best;
    - the decode path: its driver time, and stalls two ways, as in ``kvvmm replay --json``
      (``stalled_share``, ``stalled_p50_us``, ``stalled_p99_us``): how many steps waited on
      the driver and what such a step waited (p50, p99, worst);
    - the rest: the p99 over every step (``p99_stall_us``: 0 while fewer than 1% of steps
      stall), driver calls, handles at the end, predicted bandwidth over ``cudaMalloc``'s,
      and the serving outcome (completed, rejected, preempted);
    - what requests waited: time to first token at p50, p99 and worst
      (``first_token_*_ms``), what memory added to it at p99 and worst
      (``first_token_added_*_ms``: an admission put off, its step's driver stall),
      admissions put off until their memory was mapped, and request latency at p50 and
      p99 (``latency_*_s``);
    - where a range strategy ran, its allocator: admissions put off until their lease was
      mapped (the engine admits them at a later boundary instead of the step waiting: the
      cost moves to their first token) and their wait, which call each stall waited for,
      and the leases split over several ranges.
    """
    if not cmp.results:
        return Report(lead=("no results",), tables=())
    res = cmp.results
    ranges = _ranges_table(res)
    return Report(lead=(_lead(cmp), costs_line(cmp, profile)), tables=(
        _memory_table(res), _decode_table(res), _rest_table(res), _waits_table(res),
        *((ranges,) if ranges is not None else ())))


def _rows(rows: list[list[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(r) for r in rows)


def format_workload(cmp: WorkloadComparison, *,
                    profile: str | DeviceProfile | None = None) -> str:
    """:func:`workload_report` as text: its tables, every line at most
    :data:`TERMINAL_COLUMNS` wide (what ``kvvmm replay`` prints)."""
    return workload_report(cmp, profile=profile).text()


def workload_memory_figure(cmp: WorkloadComparison | None, *, log: bool = True) -> go.Figure:
    """Backed bytes over time per strategy, with used and page-elastic-at-best lines.

    ``None`` gives the empty figure a panel shows before its first run.
    """
    results = () if cmp is None else cmp.results
    fig = go.Figure()
    peak = max((r.peak_backed_bytes for r in results), default=1)
    unit, name = _unit(max(peak, 1))
    if results:
        r0 = results[0]
        t = r0.timeline
        fig.add_trace(go.Scatter(name="used by requests", x=list(t.t_s),
                                 y=[u / unit for u in t.used_bytes], mode="lines",
                                 line={"color": "#495057", "width": 1}))
        fig.add_trace(go.Scatter(name="page-elastic at best (granules in use)", x=list(t.t_s),
                                 y=[u / unit for u in t.elastic_bytes], mode="lines",
                                 line={"color": "#868e96", "dash": "dot", "shape": "hv"}))
    # Wide solid lines first, thin dashed ones over them: a strategy that backs what another
    # backs (finalize and static, page-elastic with and without its pool) stays visible.
    # The legend keeps the results' order (legendrank), whatever the drawing order.
    order = sorted(range(len(results)), key=lambda i: strategy_style(results[i].strategy).layer)
    for i in order:
        r = results[i]
        t, sty = r.timeline, strategy_style(r.strategy)
        fig.add_trace(go.Scatter(name=f"backed: {html.escape(r.strategy)}", x=list(t.t_s),
                                 y=[b / unit for b in t.backed_bytes], mode="lines",
                                 line={"shape": "hv", "color": sty.color, "dash": sty.dash,
                                       "width": sty.width},
                                 legendrank=1000 + i,
                                 hovertemplate=f"%{{y:.4g}} {name} at %{{x:.1f}} s"
                                               "<extra>%{fullData.name}</extra>"))
    fig.update_xaxes(title_text="simulated time (s)")
    fig.update_yaxes(title_text=f"bytes on one rank ({name})", type="log" if log else "linear")
    fig.update_layout(title="KV memory over time", height=420, autosize=True,
                      margin={"l": 10, "r": 10, "t": 50, "b": 40}, plot_bgcolor="white",
                      legend={"orientation": "h", "yanchor": "top", "y": -0.2, "x": 0},
                      meta={"kvvmm": "workload-memory", "unit_bytes": unit})
    return fig


def _strips(cmp: WorkloadComparison | None, values: Callable[[StrategyResult], list[float]],
            name: Callable[[StrategyResult], str], points: str) -> list[go.Box]:
    """One box of points per strategy, in its colour: ``values`` in ms."""
    return [go.Box(name=name(r), y=values(r), boxpoints=points, jitter=0.4, pointpos=0,
                   marker={"color": strategy_style(r.strategy).color, "size": 5},
                   hovertemplate="%{y:.3f} ms<extra>%{fullData.name}</extra>")
            for r in (() if cmp is None else cmp.results)]


def stall_figure(cmp: WorkloadComparison | None, *,
                 profile: str | DeviceProfile | None = None) -> go.Figure:
    """Driver stall of each step that had one, per strategy (a strip of points, log scale;
    a uniform sample of them past a run's exact limit); the title names whose costs the
    times are (:func:`costs_line`)."""
    fig = go.Figure(_strips(cmp, lambda r: [x * 1e3 for x in sorted(r.serving.stalls.sample())],
                            lambda r: f"{html.escape(r.strategy)} ({r.stalled_share:.1%})",
                            "all"))
    fig.update_yaxes(title_text="driver time in one step (ms)", type="log")
    line = costs_line(cmp, profile)
    fig.update_layout(title="decode-path stalls: the steps that waited on the driver (their "
                            f"share in brackets; every other step: 0){_sub(line)}",
                      height=380, autosize=True, showlegend=False, plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": 70, "b": 40},
                      meta={"kvvmm": "workload-stalls", "costs": line})
    return fig


def first_token_figure(cmp: WorkloadComparison | None, *,
                       profile: str | DeviceProfile | None = None) -> go.Figure:
    """Every request's time to first token, per strategy (a box, its outliers as points;
    log scale; a uniform sample past a run's exact limit); the title names whose costs the
    times are."""
    fig = go.Figure(_strips(
        cmp, lambda r: [x * 1e3 for x in r.serving.first_token.sample()],
        lambda r: html.escape(r.strategy), "outliers"))
    fig.update_yaxes(title_text="time to first token (ms)", type="log")
    line = costs_line(cmp, profile)
    fig.update_layout(title=f"time to first token of every request{_sub(line)}",
                      height=380, autosize=True, showlegend=False, plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": 70, "b": 40},
                      meta={"kvvmm": "workload-first-token", "costs": line})
    return fig


def held_over_used(result: StrategyResult) -> float:
    """Memory a strategy held per byte its requests used
    (:attr:`~kvvmm.workload.run.StrategyResult.held_over_used`)."""
    return result.held_over_used


#: where a strategy with no decode-path driver time sits on the log axis (ms)
_NO_STALL_MS = 1e-3


def _padded_log_range(xs: Sequence[float], pad: float = 0.35) -> list[float] | None:
    """The x range (log10 ms) of points at ``xs`` with room either side for their labels:
    ``pad`` decades, less when the points lie close (first tokens within 10% of each
    other: a wide pad squeezed them onto one spot), a twentieth of a decade at least."""
    if not xs:
        return None
    lo, hi = math.log10(min(xs)), math.log10(max(xs))
    pad = min(pad, max(0.05, 0.5 * (hi - lo)))
    return [lo - pad, hi + pad]


def _log_y(y: float) -> float:
    return math.log10(y) if y > 0 and math.isfinite(y) else 0.0


#: The trade-off plot's size the labels are placed for (px): its cell in
#: :func:`workload_figure` at a 1280 px window, the smallest it is drawn.
_TRADE_PX = (480.0, 240.0)


def _label_place(text: str, x: float, y: float, side: str,
                 boxes: list[tuple[float, float, float, float]]
                 ) -> tuple[str, str, tuple[float, float, float, float]]:
    """Where a point's label goes: (textposition, line breaks that push it out, its box).

    ``x``, ``y``: the point as shares of the axes; ``boxes``: labels already placed, in
    the same shares. The first of above, below (leaning to ``side``, then to the other
    sides that stay on the plot), a line further above, further below, ... whose box
    overlaps none of them and stays on the plot; when every one overlaps, the nearest
    that stays on the plot.
    """
    w = _text_px(text, 12) / _TRADE_PX[0]
    line, gap = 15 / _TRADE_PX[1], 6 / _TRADE_PX[1]
    starts = {"left": x - w, "right": x, "center": x - w / 2}
    # the side asked for first; the others only where the label stays between the axes
    sides = [side, *(s for s in ("center", "right", "left")
                     if s != side and starts[s] >= -0.02 and starts[s] + w <= 1.02)]
    first: tuple[str, str, tuple[float, float, float, float]] | None = None
    for k in range(4):
        for vert in ("top", "bottom"):
            lo = y + gap + k * line if vert == "top" else y - gap - (k + 1) * line
            if lo < -0.03 or lo + line > 1.15:  # off the plot: under its x axis, over its top
                continue
            for sd in sides:
                box = (starts[sd], starts[sd] + w, lo, lo + line)
                tried = (f"{vert} {sd}", "<br>" * k, box)
                first = first or tried
                if not any(box[0] < b[1] and b[0] < box[1] and box[2] < b[3] and b[2] < box[3]
                           for b in boxes):
                    return tried
    x0 = starts[side]
    return first or (f"top {side}", "", (x0, x0 + w, y + gap, y + gap + line))


@dataclass(frozen=True, slots=True)
class TradeAxis:
    """What a trade-off panel puts on x against memory held: one figure per strategy, ms.

    Attributes:
        key: ``"decode"`` or ``"first-token"`` (:data:`TRADE_AXES`).
        title: the x axis's title.
        ms: a result's x, ms (0: none; drawn at the axis's left edge).
        hover: a result's hover lines (HTML) over its figures, ``held`` its held / used.
    """

    key: str
    title: str
    ms: Callable[[StrategyResult], float]
    hover: Callable[[StrategyResult], str]


def _decode_hover(r: StrategyResult) -> str:
    return (f"decode driver {r.decode_driver_s * 1e3:.3f} ms<br>held / used "
            f"{held_over_used(r):.3f}x<br>p99 step {r.p99_stall_s * 1e6:.0f} us, worst "
            f"{r.max_stall_s * 1e3:.2f} ms<br>{100 * r.stalled_share:.2f}% of steps stalled")


def _first_token_hover(r: StrategyResult) -> str:
    w = r.wait_summary()
    return (f"first token p99 {w['first_token_p99_ms']:.1f} ms<br>held / used "
            f"{held_over_used(r):.3f}x<br>p50 {w['first_token_p50_ms']:.1f} ms, worst "
            f"{w['first_token_max_ms']:.1f} ms<br>{w['admissions_put_off']:,} admissions "
            "put off until mapped")


#: The trade-off panels: memory held against decode stall, and against first-token delay.
TRADE_AXES: dict[str, TradeAxis] = {
    "decode": TradeAxis("decode", "decode-path driver time (ms, log)",
                        lambda r: r.decode_driver_s * 1e3, _decode_hover),
    "first-token": TradeAxis("first-token", "time to first token, p99 (ms, log)",
                             lambda r: float(r.wait_summary()["first_token_p99_ms"]),
                             _first_token_hover),
}


def _trade_traces(results: Sequence[StrategyResult], axis: TradeAxis
                  ) -> tuple[list[go.Scatter], list[float] | None]:
    """One labelled point per strategy at (``axis``'s x, held / used), and the x range.

    Labels that would overlap (static and finalize hold the same with no driver time;
    page-elastic and xl-page-elastic lie close): each goes above its point, else below,
    else a line further out, at the first place no earlier label takes.
    """
    x_range = _padded_log_range([max(axis.ms(r), _NO_STALL_MS) for r in results])
    span = x_range or [0.0, 1.0]
    ys = [_log_y(held_over_used(r)) for r in results]
    y_low = min(ys, default=0.0)
    y_span = max(max(ys, default=0.0) - y_low, 1.0)
    boxes: list[tuple[float, float, float, float]] = []  # labels placed: x0, x1, y0, y1
    traces = []
    # filled markers first, open ones over them (as the memory figure's lines)
    for r in sorted(results, key=lambda r: strategy_style(r.strategy).layer):
        ms = axis.ms(r)
        x, y = max(ms, _NO_STALL_MS), held_over_used(r)
        # a label leans away from the nearer edge, so none runs off the plot
        at = (math.log10(x) - span[0]) / (span[1] - span[0])
        side = "left" if at > 0.66 else "right" if at < 0.2 else "center"
        where, pad, box = _label_place(r.strategy, at, (_log_y(y) - y_low) / y_span, side,
                                       boxes)
        boxes.append(box)
        name = html.escape(r.strategy)
        sty = strategy_style(r.strategy)
        traces.append(go.Scatter(
            name=name, x=[x], y=[y], mode="markers+text",
            text=[name + pad if where.startswith("top") else pad + name], textposition=where,
            marker={"color": sty.color, "size": 14 if sty.layer == 0 else 11,
                    "symbol": sty.symbol, "line": {"width": 2, "color": sty.color}},
            customdata=[[ms, r.p99_stall_s * 1e6, r.max_stall_s * 1e3, 100 * r.stalled_share]],
            meta={"trade": axis.key}, hovertext=[axis.hover(r)],
            hovertemplate="%{hovertext}<extra>%{fullData.name}</extra>"))
    return traces, x_range


def _sub(line: str) -> str:
    return f"<br><sub>{html.escape(line)}</sub>" if line else ""


def tradeoff_figure(cmp: WorkloadComparison | None, *, against: str = "decode",
                    profile: str | DeviceProfile | None = None) -> go.Figure:
    """Memory held against decode stall (``against="decode"``) or against first-token
    delay (``"first-token"``): one point per strategy; :func:`workload_figure` puts the
    two side by side under the memory over time.

    x: the decode path's driver time over the run, or the p99 time to first token (ms,
    log; a strategy with none sits at the left edge, its hover says 0), y:
    :func:`held_over_used` (log: a static pool holds hundreds of times what is used, the
    elastic strategies a few tenths over 1). Bottom left is best. Hover gives the p99 and
    worst step and the share of steps that stalled, or the first token's p50 and worst and
    the admissions put off. The title names whose costs the times are (:func:`costs_line`).

    Raises:
        ArgumentError: ``against`` not a key of :data:`TRADE_AXES`.
    """
    if against not in TRADE_AXES:
        raise ArgumentError("against", against, f"one of {sorted(TRADE_AXES)}")
    axis = TRADE_AXES[against]
    traces, x_range = _trade_traces(() if cmp is None else cmp.results, axis)
    fig = go.Figure(traces)
    fig.add_hline(y=1.0, line={"color": "#adb5bd", "dash": "dot"})
    fig.update_xaxes(title_text=axis.title, type="log", range=x_range)
    fig.update_yaxes(title_text="memory held / used (backed + pool, log)", type="log")
    what = "decode stall" if against == "decode" else "first-token delay"
    line = costs_line(cmp, profile)
    fig.update_layout(title=f"memory held against {what} (bottom left is best){_sub(line)}",
                      height=380, autosize=True, showlegend=False, plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": 70, "b": 40},
                      meta={"kvvmm": "workload-tradeoff", "against": against, "costs": line})
    return fig


def _panels(cmp: WorkloadComparison | None) -> tuple[go.Figure, list[tuple[int, int, go.Figure]]]:
    """The memory figure, and the panels under it at their (row, col)."""
    return workload_memory_figure(cmp), [
        (2, 1, stall_figure(cmp)), (2, 2, tradeoff_figure(cmp)),
        (3, 1, first_token_figure(cmp)), (3, 2, tradeoff_figure(cmp, against="first-token"))]


def workload_figure(cmp: WorkloadComparison | None, *,
                    profile: str | DeviceProfile | None = None) -> go.Figure:
    """Memory over time across the top; under it, step stalls (left) and memory held against
    decode stall (right, :func:`tradeoff_figure`), then every request's time to first token
    (left) and memory held against first-token delay (right). The title names
    whose costs the times are (:func:`costs_line`; also ``layout.meta["costs"]``)."""
    from plotly.subplots import make_subplots

    mem, panels = _panels(cmp)
    fig = make_subplots(rows=3, cols=2, specs=[[{"colspan": 2}, None], [{}, {}], [{}, {}]],
                        row_heights=[0.4, 0.3, 0.3], vertical_spacing=0.1,
                        subplot_titles=("KV memory over time (one rank)",
                                        "decode-path stalls (steps with driver calls)",
                                        "memory held / used against decode driver time",
                                        "time to first token of every request",
                                        "memory held / used against first token (p99)"))
    for tr in mem.data:
        fig.add_trace(tr, row=1, col=1)
    fig.update_xaxes(title_text="simulated time (s)", row=1, col=1)
    fig.update_yaxes(title_text=mem.layout.yaxis.title.text, type="log", row=1, col=1)
    for row, col, panel in panels:
        for tr in panel.data:
            tr.showlegend = False
            fig.add_trace(tr, row=row, col=col)
        fig.update_xaxes(title_text=panel.layout.xaxis.title.text, type=panel.layout.xaxis.type,
                         range=panel.layout.xaxis.range, row=row, col=col)
        fig.update_yaxes(title_text=_SHORT_Y.get(panel.layout.meta["kvvmm"], ""), type="log",
                         row=row, col=col)
        if col == 2:
            fig.add_hline(y=1.0, line={"color": "#adb5bd", "dash": "dot"}, row=row, col=col)
    return _workload_layout(fig, mem, costs_line(cmp, profile))


#: The y titles of :func:`workload_figure`'s smaller panels.
_SHORT_Y = {"workload-stalls": "ms in one step", "workload-tradeoff": "held / used (log)",
            "workload-first-token": "first token (ms)"}


def _workload_layout(fig: go.Figure, mem: go.Figure, line: str) -> go.Figure:
    """The combined figure's legend, and its title: the costs line, small (a caller that
    sets a title of its own keeps the line: ``title + "<br>" + fig.layout.title.text``,
    as ``kvvmm replay`` does)."""
    # The legend sits above the plots, the title above the legend: the top margin makes
    # room for as many legend rows as the names take at a 1280 px cell.
    rows = _legend_rows([tr.name or "" for tr in mem.data])
    top = 50 + 22 * rows
    fig.update_layout(height=1100 + top, autosize=True, plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": top + 60, "b": 40},
                      title={"text": _sub(line).removeprefix("<br>"), "y": 1.0,
                             "yref": "container", "yanchor": "top", "pad": {"t": 12}},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.03, "x": 0},
                      meta={"kvvmm": "workload", "unit_bytes": mem.layout.meta["unit_bytes"],
                            "costs": line})
    return fig

"""Figures and text over workload replays: memory over time, stalls, the summary table.

Pure functions of a :class:`~kvvmm.workload.run.WorkloadComparison`; each returns a plotly
figure or a string and changes nothing.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

import plotly.graph_objects as go

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

__all__ = ["TERMINAL_COLUMNS", "format_workload", "held_over_used", "stall_figure",
           "tradeoff_figure", "workload_figure", "workload_memory_figure", "workload_report"]


def _calls_clause(pause_scale: float | None, driver: str) -> str:
    """How warm the sim's calls were: what the lead line says after the driver."""
    if driver != "sim":
        return ""
    if pause_scale is None or pause_scale == 0:
        return ", calls as warm as back to back"
    if pause_scale == 1.0:
        return ", calls in real time (each pays the cold premium its pause gives)"
    return f", calls {pause_scale:g} s apart per serving second (cold premium's share)"


def workload_report(cmp: WorkloadComparison) -> Report:
    """The summary of a replay as three tables, one row per strategy in each (no wall
    times: deterministic on the sim): printed, each line fits :data:`TERMINAL_COLUMNS`;
    in a notebook (and in :class:`~kvvmm.lab.WorkloadLab`) it shows as HTML tables that
    fit a cell at a 1280 px window.

    - memory: peak and time-weighted mean of what is backed, held by the pool, used by
      requests, backed but unused (waste), and what page-elastic backing needs at best;
    - the decode path: its driver time, and stalls two ways, as in ``kvvmm replay --json``
      (``stalled_share``, ``stalled_p50_us``, ``stalled_p99_us``): how many steps waited on
      the driver and what such a step waited (p50, p99, worst);
    - the rest: the p99 over every step (``p99_stall_us``: 0 while fewer than 1% of steps
      stall), driver calls, handles at the end, predicted bandwidth over ``cudaMalloc``'s,
      and the serving outcome (completed, rejected, preempted);
    - where a range strategy ran, its allocator: admissions put off until their lease was
      mapped (the engine admits them at a later boundary instead of the step waiting: the
      cost moves to their first token) and their wait, which call each stall waited for,
      and the leases split over several ranges.
    """
    s = cmp.setup
    if not cmp.results:
        return Report(lead=("no results",), tables=())
    r0 = cmp.results[0]
    memory = [[r.strategy, fmt_bytes(r.peak_backed_bytes), fmt_bytes(round(r.mean_backed_bytes)),
               fmt_bytes(round(r.mean_pool_bytes)), fmt_bytes(round(r.mean_used_bytes)),
               fmt_bytes(round(r.mean_waste_bytes)), fmt_bytes(round(r.mean_elastic_bytes))]
              for r in cmp.results]
    decode = [[r.strategy, f"{r.decode_driver_s * 1e3:,.2f} ms",
               f"{r.stalled_steps:,} ({r.stalled_share:.2%})", f"{r.stalled_p50_s * 1e3:.2f} ms",
               f"{r.stalled_p99_s * 1e3:.2f} ms", f"{r.max_stall_s * 1e3:.2f} ms"]
              for r in cmp.results]
    rest = [[r.strategy, f"{r.p99_stall_s * 1e6:.0f} us", f"{r.driver_calls:,}",
             f"{r.final_handles:,}", f"{r.summary()['bandwidth_factor']:.3f}x",
             f"{r.serving.completed:,}", f"{r.serving.rejected:,}", f"{r.serving.preemptions:,}"]
            for r in cmp.results]
    ranges = []
    for r in cmp.results:
        g = r.ranges
        if g:
            later = g["deferred_admits"]
            ranges.append([r.strategy, f"{later:,} of {g['admits']:,}",
                           f"{g['deferred_ms'] / later if later else 0.0:.1f} ms",
                           f"{g['deferred_max_ms']:.1f} ms",
                           "inline" if g["inline"] else
                           f"{g['stalled_admits']:,} / {g['stalled_grows']:,}",
                           f"{g['split_admits']:,}"])
    lead = (f"{s.model} TP{s.tp} on {s.gpu}, one rank: {s.buffers} buffers, pool "
            f"{s.pool_tokens:,} tokens ({fmt_bytes(s.pool_tokens * s.page_bytes // s.page_size)}), "
            f"page {s.page_size}, slots {s.config.slot_order}-first; {s.requests:,} requests "
            f"over {r0.serving.end_s:,.0f} s simulated, {r0.serving.steps:,} steps; "
            f"driver {r0.driver}" + _calls_clause(s.pause_scale, r0.driver),)
    return Report(lead=lead, tables=(
        Table("memory on one rank (mean: time-weighted)",
              ("strategy", "peak backed", "mean backed", "mean pool", "mean used",
               "mean waste", "elastic at best"), _rows(memory)),
        Table("the decode path: driver time, and the steps that waited on the driver",
              ("strategy", "decode driver", "stalled steps", "p50 if stalled",
               "p99 if stalled", "max stall"), _rows(decode)),
        Table("every step, driver calls, handles, bandwidth and serving",
              ("strategy", "p99 step", "calls", "handles", "bandwidth", "done", "rejected",
               "preempted"), _rows(rest)),
        *((Table("range strategies: admissions put off until mapped, commits a step waited for",
                 ("strategy", "admitted later", "mean wait", "max wait",
                  "waits: admit / grow", "split leases"), _rows(ranges)),) if ranges else ()),
    ))


def _rows(rows: list[list[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(r) for r in rows)


def format_workload(cmp: WorkloadComparison) -> str:
    """:func:`workload_report` as text: three tables, every line at most
    :data:`TERMINAL_COLUMNS` wide (what ``kvvmm replay`` prints)."""
    return workload_report(cmp).text()


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


def stall_figure(cmp: WorkloadComparison | None) -> go.Figure:
    """Driver stall of each step that had one, per strategy (a strip of points, log scale)."""
    results = () if cmp is None else cmp.results
    fig = go.Figure()
    for r in results:
        stalls = sorted(r.serving.stall_steps)
        fig.add_trace(go.Box(name=f"{html.escape(r.strategy)} ({r.stalled_share:.1%})",
                             y=[s * 1e3 for s in stalls],
                             boxpoints="all", jitter=0.4, pointpos=0,
                             marker={"color": strategy_style(r.strategy).color, "size": 5},
                             hovertemplate="%{y:.3f} ms<extra>%{fullData.name}</extra>"))
    fig.update_yaxes(title_text="driver time in one step (ms)", type="log")
    fig.update_layout(title="decode-path stalls: the steps that waited on the driver (their "
                            "share in brackets; every other step: 0)",
                      height=380, autosize=True, showlegend=False, plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": 50, "b": 40},
                      meta={"kvvmm": "workload-stalls"})
    return fig


def held_over_used(result: StrategyResult) -> float:
    """Memory a strategy held per byte its requests used
    (:attr:`~kvvmm.workload.run.StrategyResult.held_over_used`)."""
    return result.held_over_used


#: where a strategy with no decode-path driver time sits on the log axis (ms)
_NO_STALL_MS = 1e-3


def _padded_log_range(results: tuple[StrategyResult, ...] | list[StrategyResult],
                      pad: float = 0.35) -> list[float] | None:
    """The x range (log10 ms) with room either side for the points' labels."""
    xs = [max(r.decode_driver_s * 1e3, _NO_STALL_MS) for r in results]
    if not xs:
        return None
    return [math.log10(min(xs)) - pad, math.log10(max(xs)) + pad]


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
    the same shares. The first of above, below, a line further above, further below, ...
    whose box overlaps none of them and stays on the plot; when every one overlaps, the
    nearest that stays on the plot.
    """
    w = _text_px(text, 12) / _TRADE_PX[0]
    line, gap = 15 / _TRADE_PX[1], 6 / _TRADE_PX[1]
    x0 = {"left": x - w, "right": x, "center": x - w / 2}[side]
    first: tuple[str, str, tuple[float, float, float, float]] | None = None
    for k in range(4):
        for vert in ("top", "bottom"):
            lo = y + gap + k * line if vert == "top" else y - gap - (k + 1) * line
            box = (x0, x0 + w, lo, lo + line)
            tried = (f"{vert} {side}", "<br>" * k, box)
            if lo < -0.03 or lo + line > 1.15:  # off the plot: under its x axis, over its top
                continue
            first = first or tried
            if not any(box[0] < b[1] and b[0] < box[1] and box[2] < b[3] and b[2] < box[3]
                       for b in boxes):
                return tried
    return first or (f"top {side}", "", (x0, x0 + w, y + gap, y + gap + line))


def tradeoff_figure(cmp: WorkloadComparison | None) -> go.Figure:
    """Memory held against decode stall: one point per strategy.

    x: the decode path's driver time over the run (ms, log; a strategy with none sits at
    the left edge, its hover says 0), y: :func:`held_over_used` (log: a static pool holds
    hundreds of times what is used, the elastic strategies a few tenths over 1). Bottom left
    is best: little memory beyond what requests use, and a decode loop that never waits on
    the driver.
    Hover gives the p99 and worst step and the share of steps that stalled.
    """
    results = () if cmp is None else cmp.results
    fig = go.Figure()
    x_range = _padded_log_range(results)
    span = x_range or [0.0, 1.0]
    ys = [_log_y(held_over_used(r)) for r in results]
    y_low = min(ys, default=0.0)
    y_span = max(max(ys, default=0.0) - y_low, 1.0)
    boxes: list[tuple[float, float, float, float]] = []  # labels placed: x0, x1, y0, y1
    # filled markers first, open ones over them (as the memory figure's lines)
    for r in sorted(results, key=lambda r: strategy_style(r.strategy).layer):
        ms = r.decode_driver_s * 1e3
        x, y = max(ms, _NO_STALL_MS), held_over_used(r)
        # a label leans away from the nearer edge, so none runs off the plot
        at = (math.log10(x) - span[0]) / (span[1] - span[0])
        side = "left" if at > 0.66 else "right" if at < 0.2 else "center"
        # Labels that would overlap (static and finalize hold the same with no driver time;
        # page-elastic and xl-page-elastic lie close): each goes above its point, else
        # below, else a line further out, at the first place no earlier label takes.
        where, pad, box = _label_place(r.strategy, at, (_log_y(y) - y_low) / y_span, side,
                                       boxes)
        boxes.append(box)
        label = (html.escape(r.strategy) + pad if where.startswith("top")
                 else pad + html.escape(r.strategy))
        sty = strategy_style(r.strategy)
        fig.add_trace(go.Scatter(
            name=html.escape(r.strategy), x=[x], y=[y],
            mode="markers+text", text=[label], textposition=where,
            marker={"color": sty.color, "size": 14 if sty.layer == 0 else 11,
                    "symbol": sty.symbol, "line": {"width": 2, "color": sty.color}},
            customdata=[[ms, r.p99_stall_s * 1e6, r.max_stall_s * 1e3,
                         100 * r.stalled_share]],
            hovertemplate="decode driver %{customdata[0]:.3f} ms<br>held / used %{y:.3f}x<br>"
                          "p99 step %{customdata[1]:.0f} us, worst %{customdata[2]:.2f} ms<br>"
                          "%{customdata[3]:.2f}% of steps stalled<extra>%{fullData.name}</extra>"))
    fig.add_hline(y=1.0, line={"color": "#adb5bd", "dash": "dot"})
    fig.update_xaxes(title_text="decode-path driver time (ms, log)", type="log",
                     range=x_range)
    fig.update_yaxes(title_text="memory held / used (backed + pool, log)", type="log")
    fig.update_layout(title="memory held against decode stall (bottom left is best)",
                      height=380, autosize=True, showlegend=False, plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": 50, "b": 40},
                      meta={"kvvmm": "workload-tradeoff"})
    return fig


def workload_figure(cmp: WorkloadComparison | None) -> go.Figure:
    """Memory over time across the top; step stalls (left) and memory held against decode
    stall (right, :func:`tradeoff_figure`) below."""
    from plotly.subplots import make_subplots

    mem, stalls, trade = workload_memory_figure(cmp), stall_figure(cmp), tradeoff_figure(cmp)
    fig = make_subplots(rows=2, cols=2, specs=[[{"colspan": 2}, None], [{}, {}]],
                        row_heights=[0.55, 0.45], vertical_spacing=0.16,
                        subplot_titles=("KV memory over time (one rank)",
                                        "decode-path stalls (steps with driver calls)",
                                        "memory held / used against decode driver time"))
    for tr in mem.data:
        fig.add_trace(tr, row=1, col=1)
    for tr in stalls.data:
        tr.showlegend = False
        fig.add_trace(tr, row=2, col=1)
    for tr in trade.data:
        tr.showlegend = False
        fig.add_trace(tr, row=2, col=2)
    fig.add_hline(y=1.0, line={"color": "#adb5bd", "dash": "dot"}, row=2, col=2)
    fig.update_xaxes(title_text="simulated time (s)", row=1, col=1)
    fig.update_yaxes(title_text=mem.layout.yaxis.title.text, type="log", row=1, col=1)
    fig.update_yaxes(title_text="ms in one step", type="log", row=2, col=1)
    fig.update_xaxes(title_text="decode-path driver time (ms, log)", type="log", row=2, col=2,
                     range=trade.layout.xaxis.range)
    fig.update_yaxes(title_text="held / used (log)", type="log", row=2, col=2)
    # The legend sits above the plots, the title above the legend: the top margin makes
    # room for as many legend rows as the names take at a 1280 px cell (a title set later,
    # as kvvmm replay's is, was drawn over the legend's first row).
    rows = _legend_rows([tr.name or "" for tr in mem.data])
    top = 50 + 22 * rows
    fig.update_layout(height=800 + top, autosize=True, plot_bgcolor="white",
                      margin={"l": 10, "r": 10, "t": top + 40, "b": 40},
                      title={"y": 1.0, "yref": "container", "yanchor": "top",
                             "pad": {"t": 12}},
                      legend={"orientation": "h", "yanchor": "bottom", "y": 1.03, "x": 0},
                      meta={"kvvmm": "workload", "unit_bytes": mem.layout.meta["unit_bytes"]})
    return fig

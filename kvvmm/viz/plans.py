"""Figures over capacity plans (:func:`kvvmm.layout.plan` results) instead of printed tables.

- :func:`tokens_by_tp`: capacity in tokens per tensor-parallel degree, one series per model;
- :func:`waste_by_model`: what the granularity and the padded page cost, per model;
- :func:`handles_by_policy`: handles each growth policy creates, per plan.

Pure functions of frozen :class:`~kvvmm.layout.Plan` records; each returns a figure.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import plotly.graph_objects as go

from kvvmm.errors import ArgumentError
from kvvmm.layout.planner import Plan
from kvvmm.units import fmt_bytes
from kvvmm.viz._common import _count, _legend_rows, _unit

__all__ = ["handles_by_policy", "tokens_by_tp", "waste_by_model"]


def _plans(plans: Plan | Sequence[Plan]) -> list[Plan]:
    items = [plans] if isinstance(plans, Plan) else list(plans)
    if not items or not all(isinstance(p, Plan) for p in items):
        raise ArgumentError("plans", plans, "a Plan or a non-empty sequence of them "
                            "(from kvvmm.layout.plan)")
    return items


def _label(p: Plan, plans: Sequence[Plan], sep: str = "<br>") -> str:
    """The plan's name on an axis: its model, then (after ``sep``: a second line on an axis,
    so that long model names never need rotated, clipped labels) what differs between the
    plans."""
    parts = []
    if len({q.gpu for q in plans}) > 1:
        parts.append(p.gpu)
    if len({q.dtype for q in plans}) > 1:
        parts.append(p.dtype)
    if len({q.tp for q in plans}) > 1:
        parts.append(f"TP{p.tp}")
    rest = html.escape(" ".join(parts))
    return html.escape(p.model) + (f"{sep}{rest}" if rest else "")


#: Pixels below the plot for two lines of category labels (and an axis title).
_AXIS_PX = 58


def _layout(fig: go.Figure, title: str, subtitle: str, meta: dict[str, object],
            plot_px: int = 270) -> None:
    """Title and subtitle at the top, ``plot_px`` of plot, two-line x labels unrotated, and
    the legend in a band of its own at the bottom (rows for the narrowest cell)."""
    names = [str(t.name) for t in fig.data if t.showlegend is not False and t.name]
    shown = fig.layout.showlegend is not False and len(names) > 1
    band = 22 * _legend_rows(names) + 6 if shown else 0
    fig.update_layout(
        title={"text": title, "subtitle": {"text": subtitle, "font": {"size": 11}},
               "font": {"size": 14}, "x": 0.01, "xanchor": "left", "xref": "container",
               "y": 1, "yanchor": "top", "yref": "container", "pad": {"t": 12}},
        autosize=True, height=70 + plot_px + _AXIS_PX + band, plot_bgcolor="white",
        barmode="group",
        margin={"l": 10, "r": 20, "t": 70, "b": _AXIS_PX + band, "autoexpand": True},
        legend={"orientation": "h", "xref": "container", "yref": "container", "x": 0.005,
                "xanchor": "left", "y": 0, "yanchor": "bottom", "font": {"size": 11}},
        meta=meta,
    )
    fig.update_xaxes(tickangle=0, automargin=True, tickfont={"size": 11})
    fig.update_yaxes(automargin=True)


def _tokens(n: int) -> str:
    for size, suffix in ((1_000_000, "M"), (1_000, "k")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return str(n)


def tokens_by_tp(plans: Sequence[Plan]) -> go.Figure:
    """Capacity per rank in tokens, by tensor-parallel degree: one series per model and GPU.

    Args:
        plans: plans of one or more models at several ``tp`` (``plan(..., tp=t)`` for each t).
    Returns:
        A ``plotly.graph_objects.Figure``: x the TP degree (categories, in order), y tokens
        per rank (from 0); each bar labelled with its tokens and bytes per token.
    Raises:
        ArgumentError: ``plans`` is not a non-empty sequence of plans.
    """
    items = _plans(plans)
    tps = sorted({p.tp for p in items})
    series: dict[tuple[str, str, str], list[Plan]] = {}
    for p in items:
        series.setdefault((p.model, p.gpu, p.dtype), []).append(p)
    fig = go.Figure()
    for (model, gpu, dtype), ps in series.items():
        ps = sorted(ps, key=lambda q: q.tp)
        name = html.escape(model if len(series) == 1 or len({k[1] for k in series}) == 1
                           else f"{model} on {gpu}")
        fig.add_trace(go.Bar(
            name=name, x=[f"TP {p.tp}" for p in ps], y=[p.tokens for p in ps],
            text=[_tokens(p.tokens) for p in ps], textposition="outside", cliponaxis=False,
            hovertext=[f"{name} TP {p.tp} ({html.escape(dtype)}, {html.escape(p.gpu_name)})"
                       f"<br>{p.tokens:,} tokens per rank<br>{fmt_bytes(p.bytes_per_token)} "
                       f"per token per rank<br>VA {fmt_bytes(p.va_reserve_bytes)}"
                       for p in ps],
            hovertemplate="%{hovertext}<extra></extra>",
        ))
    gpus = sorted({p.gpu_name for p in items})
    _layout(fig, "KV capacity per rank by tensor-parallel degree",
            f"{html.escape(', '.join(gpus))}: TP shards the KV heads until tp = kv heads",
            {"kvvmm": "tokens_by_tp", "tp": tps})
    fig.update_layout(
        xaxis={"title": {"text": "tensor-parallel degree"}, "type": "category",
               "categoryorder": "array", "categoryarray": [f"TP {t}" for t in tps]},
        yaxis={"title": {"text": "tokens per rank"}, "rangemode": "tozero",
               "tickformat": "~s"},
        showlegend=len(series) > 1,
    )
    return fig


def waste_by_model(plans: Sequence[Plan]) -> go.Figure:
    """What the granularity and the padded page cost beyond the tokens, per plan.

    Args:
        plans: one plan per model (and GPU, dtype or TP: the axis labels say what differs).
    Returns:
        A ``plotly.graph_objects.Figure`` of stacked bars: ``granularity waste`` and
        ``padding`` per plan in one unit picked by magnitude (``layout.meta["unit_bytes"]``),
        each labelled with its share of what finalize backs.
    Raises:
        ArgumentError: ``plans`` is not a non-empty sequence of plans.
    """
    items = _plans(plans)
    labels = [_label(p, items) for p in items]
    flat = [_label(p, items, " ") for p in items]  # hover: one line
    peak = max(p.granularity_waste_bytes + p.padding_bytes for p in items)
    unit, unit_name = _unit(max(peak, 1))
    fig = go.Figure()
    for name, attr, color in (("granularity waste", "granularity_waste_bytes", "#f08c00"),
                              ("padding (the padded page)", "padding_bytes", "#ffd8a8")):
        values = [int(getattr(p, attr)) for p in items]
        fig.add_trace(go.Bar(
            name=name, x=labels, y=[v / unit for v in values], marker={"color": color},
            hovertext=[f"{lb}: {fmt_bytes(v)} {name}, {p.num_buffers} buffers, "
                       f"{fmt_bytes(p.final_backed_bytes)} backed after finalize"
                       for lb, v, p in zip(flat, values, items, strict=True)],
            hovertemplate="%{hovertext}<extra></extra>",
        ))
    fig.add_trace(go.Scatter(
        name="share of backed", x=labels,
        y=[(p.granularity_waste_bytes + p.padding_bytes) / unit for p in items],
        mode="text", showlegend=False, textposition="top center",
        text=[f"{100 * (p.granularity_waste_bytes + p.padding_bytes) / p.final_backed_bytes:.2f}%"
              if p.final_backed_bytes else "-" for p in items],
        hoverinfo="skip", cliponaxis=False,
    ))
    _layout(fig, "what the granularity and the padded page cost, per model",
            "bars: bytes beyond the tokens' own; labels: share of what finalize backs",
            {"kvvmm": "waste_by_model", "unit_bytes": unit})
    fig.update_layout(barmode="stack",
                      xaxis={"title": {"text": ""}, "type": "category"},
                      yaxis={"title": {"text": unit_name}, "rangemode": "tozero"})
    return fig


def handles_by_policy(plans: Plan | Sequence[Plan]) -> go.Figure:
    """Handles each growth policy creates while the pool grows and finalizes, per plan.

    Args:
        plans: a plan, or several (one group of bars each).
    Returns:
        A ``plotly.graph_objects.Figure``: one bar series per policy (in the plans' order),
        y handle counts (log scale, decades, when they span more than 100x).
    Raises:
        ArgumentError: ``plans`` is not a plan or a non-empty sequence of plans.
    """
    items = _plans(plans)
    labels = [_label(p, items) for p in items]
    policies: list[str] = []
    for p in items:
        policies += [h.policy for h in p.handles if h.policy not in policies]
    fig = go.Figure()
    counts: list[int] = []
    for pol in policies:
        hs = [next((h for h in p.handles if h.policy == pol), None) for p in items]
        counts += [h.handles for h in hs if h is not None]
        fig.add_trace(go.Bar(
            name=html.escape(pol), x=labels, y=[h.handles if h else None for h in hs],
            text=[f"{h.handles:,}" if h else "" for h in hs], textposition="outside",
            cliponaxis=False,
            hovertext=[f"{html.escape(pol)}: {_count(h.handles, 'handle')} of "
                       f"{fmt_bytes(h.min_handle_bytes)} to {fmt_bytes(h.max_handle_bytes)}, "
                       f"{fmt_bytes(h.backed_bytes)} backed" if h else "" for h in hs],
            hovertemplate="%{hovertext}<extra></extra>",
        ))
    lo, hi = min(counts, default=1), max(counts, default=1)
    log = hi > 100 * max(lo, 1)
    step = items[0].decode_step_tokens
    _layout(fig, "handles per growth policy",
            f"decode growth by {step:,}-token steps, then finalize; every buffer of the pool",
            {"kvvmm": "handles_by_policy", "policies": policies, "log": log})
    fig.update_layout(
        xaxis={"title": {"text": ""}, "type": "category"},
        yaxis=({"title": {"text": "handles (log)"}, "type": "log", "dtick": 1,
                "tickformat": "~s"} if log else
               {"title": {"text": "handles"}, "rangemode": "tozero"}),
    )
    return fig

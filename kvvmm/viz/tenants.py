"""Figures and text over tenants sharing one GPU: every tenant's backing on one chart.

Pure functions of :class:`~kvvmm.workload.tenants.TenantsRun` records; each returns a plotly
figure or a string and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from kvvmm.units import fmt_bytes

if TYPE_CHECKING:
    from kvvmm.workload.tenants import TenantsRun

__all__ = ["format_tenants", "tenants_figure"]

_COLORS = ("#1c7ed6", "#e8590c", "#2f9e44", "#ae3ec9", "#f08c00", "#0c8599", "#c2255c")
_GiB = float(1 << 30)


def tenants_figure(run: TenantsRun, *, title: str | None = None) -> go.Figure:
    """Every tenant's (and demand's) held bytes over time, stacked, with the budget line.

    Stacked, so the top edge is the sum the arbiter keeps under the budget; each value holds
    until the next sample (``hv`` steps).
    """
    fig = go.Figure()
    t = list(run.t_s)
    for i, name in enumerate(run.names):
        y = [row[i] / _GiB for row in run.held_bytes]
        fig.add_trace(go.Scatter(x=t, y=y, name=name, mode="lines", stackgroup="held",
                                 line={"shape": "hv", "width": 0.5,
                                       "color": _COLORS[i % len(_COLORS)]},
                                 hovertemplate=f"{name}: %{{y:.2f}} GiB at %{{x:.1f}} s"
                                               "<extra></extra>"))
    budget = run.rules.budget_bytes / _GiB
    end = t[-1] if t else 0.0
    fig.add_trace(go.Scatter(x=[0.0, end], y=[budget, budget], name="budget", mode="lines",
                             line={"color": "#212529", "dash": "dash", "width": 1.5}))
    fig.update_layout(title=title or f"backing of {len(run.names)} tenants, budget "
                      f"{fmt_bytes(run.rules.budget_bytes)}",
                      xaxis_title="simulated time (s)", yaxis_title="held (GiB)",
                      template="plotly_white", height=360, margin={"l": 60, "r": 20, "t": 50,
                                                                   "b": 45},
                      legend={"orientation": "h", "y": -0.25})
    return fig


def format_tenants(runs: Mapping[str, TenantsRun]) -> str:
    """One table of every run's tenants (rows of at most 100 characters), then the demands.

    Columns: requests served, rejected (refused or timed out in the queue), preempted, the
    share of steps that stalled on the driver and the p99 of those stalls, peak and mean
    backing. For range tenants, what each gave back by trimming its cache and reserve
    (and how long that took) and from requests, and what was trimmed for each demand.
    """
    head = ("run", "tenant", "served", "rejected", "preempted", "stalled", "p99 stalled",
            "peak", "mean")
    rows: list[tuple[str, ...]] = []
    for label, run in runs.items():
        for t in run.tenants:
            # "alone NAME" runs show as "alone": the tenant column names them
            rows.append((label.split(" ")[0], t.name, f"{t.served:,}", f"{t.rejected:,}",
                         f"{t.preempted:,}",
                         f"{t.stalled_share:.2%}", f"{t.stalled_p99_s * 1e3:.2f} ms",
                         fmt_bytes(t.peak_backed_bytes), fmt_bytes(round(t.mean_backed_bytes))))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) if i < 2 else h.rjust(w)
                       for i, (h, w) in enumerate(zip(head, widths, strict=True)))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    for label, run in runs.items():
        # what was given back, and how: said for range tenants (RangeBacking.give_back)
        ranges = any(t.strategy == "request-ranges+deferred" for t in run.tenants)
        for d in run.demands:
            got = (f"granted after {d.wait_s * 1e3:.1f} ms" if d.wait_s is not None
                   else "refused")
            lines.append(f"{label}: demand {d.name} of {fmt_bytes(d.nbytes)} at {d.at_s:g} s: "
                         f"{got}")
            if ranges:
                lines.append(f"  trimmed for it at once: {fmt_bytes(d.trim_bytes)} of cache "
                             f"and reserve in {d.trim_s * 1e3:.2f} ms of driver time;")
                lines.append(f"  from requests while it waited: {fmt_bytes(d.request_bytes)}")
        for t in run.tenants:  # what was given back to others, and how
            if t.strategy == "request-ranges+deferred":
                lines.append(f"{label}: {t.name} gave back {fmt_bytes(t.trim_bytes)} by "
                             f"trimming its cache and reserve,")
                lines.append(f"  {t.trims:,} trims, {t.trim_s * 1e3:.2f} ms of driver time "
                             f"(the longest {t.trim_max_s * 1e3:.2f} ms); "
                             f"{fmt_bytes(t.request_bytes)} from requests")
        if run.over_budget:
            lines.append(f"{label}: {run.over_budget} samples over the budget (a bug)")
    return "\n".join(lines)

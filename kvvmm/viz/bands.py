"""Bands in figures and tables: the simulated times' [low, mid, high] (kvvmm.workload.bands).

Pure functions of results and their bands; each returns a string or a figure, or adds error
bars to a figure it is given (:func:`add_decode_bands`), and changes nothing else.
"""

from __future__ import annotations

import datetime
import html
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from kvvmm.hardware import DeviceProfile, get_profile, provenance
from kvvmm.viz._common import _table

if TYPE_CHECKING:
    from kvvmm.growth import GrowthResult
    from kvvmm.workload.bands import Band
    from kvvmm.workload.run import WorkloadComparison

__all__ = ["BAND_COLUMNS", "add_decode_bands", "format_growth_bands", "format_workload_bands",
           "growth_band_figure", "profile_age_line"]

#: The workload figures the band table shows: (summary key, header, scale to the unit shown).
BAND_COLUMNS = (("startup_driver_ms", "startup ms", 1.0), ("decode_driver_ms", "decode ms", 1.0),
                ("p99_stall_us", "p99 step us", 1.0), ("max_stall_us", "max stall ms", 1e-3))
#: The widest a band table may be, in characters (a terminal, ``kvvmm replay``).
MAX_COLUMNS = 100


def _num(x: float) -> str:
    return f"{x:.1f}" if abs(x) < 1e4 else f"{x:.3g}"


def _cell(b: Band, scale: float = 1.0) -> str:
    lo, hi = b.low * scale, b.high * scale
    return _num(lo) if lo == hi else f"{_num(lo)}-{_num(hi)}"


def format_workload_bands(bands: Mapping[str, Mapping[str, Band]],
                          notes: Sequence[str] = ()) -> str:
    """One row per strategy: each timed figure's p10-p90 band (low-high), under a line
    saying what the band is; at most :data:`MAX_COLUMNS` characters wide."""
    head = ["band (p10-p90)", *(h for _, h, _ in BAND_COLUMNS)]
    rows = [[name[:24], *(_cell(figs[k], s) if k in figs else "-" for k, _, s in BAND_COLUMNS)]
            for name, figs in bands.items()]
    if not rows:
        return "no bands"
    lines = [*(n[:MAX_COLUMNS] for n in notes), *_table(head, rows)]
    return "\n".join(line[:MAX_COLUMNS] for line in lines)


def format_growth_bands(results: Sequence[GrowthResult], bands: Sequence[Band],
                        notes: Sequence[str] = ()) -> str:
    """Each policy's simulated growth time: the point and its p10-p90 band, ms."""
    rows = [[r.policy, f"{b.mid / 1e3:.1f} ms", f"{b.low / 1e3:.1f}-{b.high / 1e3:.1f} ms",
             f"{b.width:.0%}"] for r, b in zip(results, bands, strict=True)]
    if not rows:
        return "no bands"
    lines = [*notes, *_table(["policy", "driver time", "band (p10-p90)", "width"], rows)]
    return "\n".join(line[:MAX_COLUMNS] for line in lines)


def growth_band_figure(results: Sequence[GrowthResult], bands: Sequence[Band], *,
                       label: str = "") -> go.Figure:
    """Each policy's simulated growth time with its band as error bars (ms).

    Args:
        results, bands: :func:`kvvmm.growth.decode_growth`'s results and
            :func:`kvvmm.workload.bands.growth_bands` of them, in the same order.
        label: the profile, for the title.
    """
    names = [html.escape(r.policy).replace("(", "<br>(") for r in results]
    mids = [b.mid / 1e3 for b in bands]
    fig = go.Figure(go.Scatter(
        name="simulated driver time", x=names, y=mids, mode="markers+text",
        text=[f"{m:.1f} ms" for m in mids], textposition="middle right",
        marker={"size": 11, "color": "#1c7ed6"},
        error_y={"type": "data", "symmetric": False, "color": "#495057",
                 "array": [(b.high - b.mid) / 1e3 for b in bands],
                 "arrayminus": [(b.mid - b.low) / 1e3 for b in bands]},
        hovertext=[f"{html.escape(r.policy)}: {b.mid / 1e3:.1f} ms (p10-p90 "
                   f"{b.low / 1e3:.1f}-{b.high / 1e3:.1f} ms)"
                   for r, b in zip(results, bands, strict=True)],
        hovertemplate="%{hovertext}<extra></extra>"))
    title = "simulated growth time, with the profile's p10-p90 band"
    if label:
        title += f"<br><sub>{html.escape(label)}</sub>"
    fig.update_xaxes(type="category", tickfont={"size": 10},
                     range=[-0.5, max(1, len(results)) - 0.5 + 0.6])
    fig.update_yaxes(title_text="driver time (ms)", rangemode="tozero", gridcolor="#e9ecef")
    fig.update_layout(title={"text": title, "font": {"size": 13}}, height=340, autosize=True,
                      plot_bgcolor="white", showlegend=False,
                      margin={"l": 10, "r": 10, "t": 70, "b": 40},
                      meta={"kvvmm": "growth-bands"})
    return fig


def add_decode_bands(fig: go.Figure, cmp: WorkloadComparison,
                     bands: Mapping[str, Mapping[str, Band]]) -> go.Figure:
    """Horizontal error bars on each strategy's point of the memory-against-stall panel
    (:func:`kvvmm.viz.workload.tradeoff_figure`, also inside ``workload_figure``): its
    decode-path driver time's p10-p90 band. Returns ``fig``, changed in place."""
    names = {html.escape(r.strategy): r.strategy for r in cmp.results}
    for tr in fig.data:
        if getattr(tr, "mode", None) != "markers+text" or tr.name not in names:
            continue
        if (tr.meta or {}).get("trade", "decode") != "decode":  # a first-token panel's point
            continue
        b = bands.get(names[tr.name], {}).get("decode_driver_ms")
        if b is None or not tr.x:
            continue
        x = float(tr.x[0])
        tr.error_x = {"type": "data", "symmetric": False, "color": "#495057",
                      "array": [max(0.0, b.high - b.mid)],
                      "arrayminus": [max(0.0, min(b.mid - b.low, x * 0.999))]}
        tr.hovertemplate = (f"band p10-p90 {b.low:.3f}-{b.high:.3f} ms<br>"
                            + (tr.hovertemplate or ""))
    return fig


def profile_age_line(profile: str | DeviceProfile, today: datetime.date | None = None) -> str:
    """How old the call costs a profile predicts with are, whose they are, and the
    one-minute refresh for a GPU user.

    ``"profile b200: costs measured 2026-12-01, 2 days ago (costs: h200, measured on an
    H200; capacity: b200); on a GPU, refresh it in about a minute: kvvmm calibrate --quick
    --profile b200 --out b200-refreshed.json"`` (a profile with costs of its own:
    ``"profile h200: measured 2026-12-01, ..."``).
    """
    p = get_profile(profile)
    prov = provenance(p)
    name = p.path or p.key
    stem = os.path.splitext(os.path.basename(name))[0]
    fix = (f"on a GPU, refresh it in about a minute: kvvmm calibrate --quick --profile "
           f"{name} --out {stem}-refreshed.json")
    what = "costs measured" if prov.borrowed else "measured"
    whose = f"({prov.label()})"
    try:
        when = datetime.date.fromisoformat(prov.costs_date)
    except ValueError:
        return f"profile {p.key}: {what} on an unknown date {whose}; {fix}"
    days = ((today or datetime.date.today()) - when).days
    age = "today" if days == 0 else f"{days} day{'s' if days != 1 else ''} ago" \
        if days > 0 else "in the future (a wrong clock?)"
    return f"profile {p.key}: {what} {when.isoformat()}, {age} {whose}; {fix}"

"""Pictures and text of kvvmm's state: plotly figures and plain-text reports.

Pure functions over frozen data (snapshots, traces, tables, results); nothing here holds or
changes a driver.

- :mod:`~kvvmm.viz.va_map`: the VA map of an arena or owner;
- :mod:`~kvvmm.viz.figures`: call timeline, handle sizes, bandwidth by handle size, growth;
- :mod:`~kvvmm.viz.plans`: capacity plans as figures (tokens by TP, waste, handles);
- :mod:`~kvvmm.viz.text`: the text reports notebooks print and nbval compares;
- :mod:`~kvvmm.viz.workload`: replays' memory, stalls, first tokens and trade-offs, each
  naming whose call costs its times are (:func:`costs_line`);
- :mod:`~kvvmm.viz.export`: :func:`save_figure` to HTML, PNG, SVG or PDF.
"""

from __future__ import annotations

from kvvmm.viz.export import ExportError, save_figure
from kvvmm.viz.figures import (
    bandwidth_by_handle_size,
    bandwidth_fit_figure,
    growth_figure,
    handle_sizes,
    timeline,
)
from kvvmm.viz.plans import handles_by_policy, tokens_by_tp, waste_by_model
from kvvmm.viz.text import (
    describe,
    describe_descs,
    describe_stats,
    format_bandwidth_fit,
    format_growth,
    format_plan,
    growth_report,
)
from kvvmm.viz.va_map import (
    HEATMAP_THRESHOLD,
    MAX_ROWS,
    VA_MAP_GROUP_TRACES,
    VA_MAP_TRACES,
    va_map,
)
from kvvmm.viz.workload import (
    costs_line,
    first_token_figure,
    format_workload,
    held_over_used,
    stall_figure,
    tradeoff_figure,
    workload_figure,
    workload_memory_figure,
    workload_report,
)

__all__ = [
    "HEATMAP_THRESHOLD",
    "MAX_ROWS",
    "VA_MAP_GROUP_TRACES",
    "VA_MAP_TRACES",
    "ExportError",
    "bandwidth_by_handle_size",
    "bandwidth_fit_figure",
    "costs_line",
    "describe",
    "describe_descs",
    "describe_stats",
    "first_token_figure",
    "format_bandwidth_fit",
    "format_growth",
    "format_plan",
    "format_workload",
    "growth_figure",
    "growth_report",
    "handle_sizes",
    "handles_by_policy",
    "held_over_used",
    "save_figure",
    "stall_figure",
    "timeline",
    "tokens_by_tp",
    "tradeoff_figure",
    "va_map",
    "waste_by_model",
    "workload_figure",
    "workload_memory_figure",
    "workload_report",
]

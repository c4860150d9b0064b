"""Pictures and text of kvvmm's state: plotly figures and plain-text reports.

Pure functions over frozen data (snapshots, traces, tables, results); nothing here holds or
changes a driver.

- :mod:`~kvvmm.viz.va_map`: the VA map of an arena or owner;
- :mod:`~kvvmm.viz.figures`: call timeline, handle sizes, bandwidth by handle size, growth;
- :mod:`~kvvmm.viz.text`: the text reports notebooks print and nbval compares.
"""

from __future__ import annotations

from kvvmm.viz.figures import bandwidth_by_handle_size, growth_figure, handle_sizes, timeline
from kvvmm.viz.text import describe, describe_descs, describe_stats, format_growth, format_plan
from kvvmm.viz.va_map import HEATMAP_THRESHOLD, VA_MAP_TRACES, va_map

__all__ = [
    "HEATMAP_THRESHOLD",
    "VA_MAP_TRACES",
    "bandwidth_by_handle_size",
    "describe",
    "describe_descs",
    "describe_stats",
    "format_growth",
    "format_plan",
    "growth_figure",
    "handle_sizes",
    "timeline",
    "va_map",
]

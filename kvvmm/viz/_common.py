"""Helpers every figure and report of :mod:`kvvmm.viz` shares: axis units, arrays, tables."""

from __future__ import annotations

import html
import re
import textwrap
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvvmm.errors import ArgumentError
from kvvmm.hardware import DeviceProfile, profile_label, provenance_label
from kvvmm.snapshot import ArenaSnapshot, OwnerSnapshot
from kvvmm.units import GiB, KiB, MiB

Snapshot = ArenaSnapshot | OwnerSnapshot


def _arena_of(snapshot: object) -> ArenaSnapshot:
    if isinstance(snapshot, OwnerSnapshot):
        return snapshot.arena
    if isinstance(snapshot, ArenaSnapshot):
        return snapshot
    raise ArgumentError("snapshot", type(snapshot).__name__,
                        "an ArenaSnapshot or OwnerSnapshot (from .snapshot())")


def profile_words(profile: str | DeviceProfile) -> str:
    """How a simulated figure names what it predicts from: the profile, and whose costs
    and capacity (``"b200 (NVIDIA B200); costs: h200, measured on an H200;
    capacity: b200"``: :func:`kvvmm.hardware.provenance_label`)."""
    return f"{profile_label(profile)}; {provenance_label(profile)}"


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


_TAG = re.compile(r"<[^>]*>")

#: The narrowest figure a legend row is laid out for: a notebook cell in JupyterLab at a
#: 1280 px window with its file browser open (wider cells fit more entries on a row).
FIT_PX = 760


def _text_px(text: str, size: float = 11) -> float:
    """About how wide ``text`` draws (pixels) at font ``size``: tags dropped, entities as
    one character, 0.62 em per character (an over-estimate for plotly's sans-serif)."""
    plain = html.unescape(_TAG.sub("", text))
    return 0.62 * size * len(plain)


def _legend_rows(names: Sequence[str], width_px: float = FIT_PX, size: float = 11) -> int:
    """Rows a horizontal legend of ``names`` takes in ``width_px``: each entry is its symbol
    (about 40 px with padding) and its text; entries wrap at the width as plotly's do."""
    rows, used = (1 if names else 0), 0.0
    for name in names:
        w = 40 + _text_px(name, size)
        if used and used + w > width_px:
            rows, used = rows + 1, 0.0
        used += w
    return rows


#: The widest line a table printed to a terminal takes (``kvvmm replay``, ``kvvmm plan``):
#: wider, a terminal wraps every row onto two lines and the columns no longer line up.
TERMINAL_COLUMNS = 100


def _column_blocks(widths: Sequence[int], width: int) -> list[list[int]]:
    """The columns after the first, packed left to right into blocks that each fit
    ``width`` with the first column (a row's name) repeated at the left of every block."""
    blocks: list[list[int]] = []
    used = widths[0]
    for i in range(1, len(widths)):
        if blocks and blocks[-1] and used + 2 + widths[i] <= width:
            blocks[-1].append(i)
            used += 2 + widths[i]
        else:
            blocks.append([i])
            used = widths[0] + 2 + widths[i]
    return blocks


def _fitted_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                  width: int | None = TERMINAL_COLUMNS) -> list[str]:
    """:func:`_table`, split into blocks of columns when wider than ``width`` characters.

    Each block repeats the first column, so every line of every block reads on its own;
    blocks are separated by a blank line. ``None``: never split.
    """
    lines = _table(header, rows)
    if width is None or max(map(len, lines)) <= width:
        return lines
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out: list[str] = []
    for block in _column_blocks(widths, width):
        keep = [0, *block]
        if out:
            out.append("")
        out += _table([header[i] for i in keep], [[r[i] for i in keep] for r in rows])
    return out


@dataclass(frozen=True, slots=True)
class Table:
    """One table of a report: a title, a header and rows of formatted cells.

    Attributes:
        title: what the table shows ("" for none); printed above it.
        header: the column names; the first column names each row.
        rows: the cells, as text (formatted by ``kvvmm.units``), one sequence per row.
    """

    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def text(self, width: int | None = TERMINAL_COLUMNS) -> list[str]:
        """The table as padded text lines, split into column blocks wider than ``width``."""
        body = _fitted_table(self.header, self.rows, width) if self.rows else ["(no rows)"]
        return ([self.title] if self.title else []) + body

    def html(self) -> str:
        """The table as HTML that fits a notebook cell: names left, figures right, headers
        wrapping at spaces (never cut), cells on one line; wider than the cell, it scrolls."""
        esc = html.escape
        th = ("padding:2px 8px;border-bottom:1px solid #adb5bd;vertical-align:bottom;"
              "white-space:normal;font-weight:600;text-align:")
        td = "padding:1px 8px;white-space:nowrap;text-align:"
        head = "".join(f'<th style="{th}{"left" if i == 0 else "right"}">{esc(h)}</th>'
                       for i, h in enumerate(self.header))
        body = "".join(
            "<tr>" + "".join(f'<td style="{td}{"left" if i == 0 else "right"}">{esc(c)}</td>'
                             for i, c in enumerate(r)) + "</tr>"
            for r in self.rows)
        caption = (f'<caption style="text-align:left;font-weight:600;padding:4px 0">'
                   f"{esc(self.title)}</caption>" if self.title else "")
        # not "kvvmm-table": a panel's table widget has that class (the browser test's hook)
        return ('<div class="kvvmm-report-table" '
                'style="overflow-x:auto;max-width:100%;margin:4px 0">'
                '<table style="border-collapse:collapse;font-size:12px;'
                'font-variant-numeric:tabular-nums">'
                f"{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")

    def html_px(self, size: float = 12) -> float:
        """About how wide :meth:`html` draws (pixels): each column as wide as its widest
        cell or its header's longest word (a header wraps at spaces), plus its padding."""
        cols = zip(self.header, *self.rows, strict=True) if self.rows else (
            (h,) for h in self.header)
        px = 0.0
        for head, *cells in cols:
            words = max((_text_px(w, size) for w in head.split()), default=0.0)
            px += 16 + max([words, *(_text_px(c, size) for c in cells)])
        return px


@dataclass(frozen=True, slots=True)
class Report:
    """Lines of text and tables: printed as text (each line at most
    :data:`TERMINAL_COLUMNS`), shown in a notebook as HTML.

    Attributes:
        lead: sentences before the tables (wrapped to the width in text).
        tables: the tables, in order.
        tail: sentences after them.
    """

    lead: tuple[str, ...]
    tables: tuple[Table, ...]
    tail: tuple[str, ...] = ()

    def text(self, width: int | None = TERMINAL_COLUMNS) -> str:
        """Everything as text; ``width``: the widest line (None: no wrapping, no split)."""
        def wrap(lines: tuple[str, ...]) -> list[str]:
            if width is None:
                return list(lines)
            return [w for line in lines
                    for w in textwrap.wrap(line, width, subsequent_indent="  ") or [""]]

        out = wrap(self.lead)
        for t in self.tables:
            out += t.text(width)
        return "\n".join(out + wrap(self.tail))

    def html(self) -> str:
        """Everything as HTML: sentences as paragraphs that wrap, tables as HTML tables."""
        def para(lines: tuple[str, ...]) -> str:
            return "".join(f'<p style="margin:2px 0;font-size:12px">{html.escape(x)}</p>'
                           for x in lines)

        return ('<div class="kvvmm-report">' + para(self.lead)
                + "".join(t.html() for t in self.tables) + para(self.tail) + "</div>")

    def __str__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return self.html()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


@dataclass(frozen=True, slots=True)
class StrategyStyle:
    """How one memory strategy draws, the same in every figure (memory over time, stalls,
    the trade-off, ``kvvmm replay``'s report and PNG).

    Attributes:
        color: its colour (one per strategy, in every figure).
        dash: its line's dash pattern (plotly's ``line.dash``).
        width: its line's width (px): a strategy that can lie on another's line is drawn
            thinner and dashed, on top, so both show.
        symbol: its marker in point charts (an open symbol over a filled one where points
            can coincide).
        layer: drawing order, lowest first (wide solid lines under thin dashed ones).
    """

    color: str
    dash: str
    width: float
    symbol: str
    layer: int


#: One style per strategy of ``kvvmm.workload.STRATEGIES``: matplotlib's ten colours without
#: its grey, which the "used by requests" lines take. Pairs whose lines coincide get a solid
#: wide line and a thin dashed one drawn over it: ``finalize`` backs what ``static`` backs
#: (the replay's PNG showed one line for both), ``page-elastic+pool`` the pages
#: ``page-elastic`` backs, ``prefix+shrink`` prefix growth's line until it shrinks.
STRATEGY_STYLES: dict[str, StrategyStyle] = {
    "static": StrategyStyle("#1f77b4", "solid", 4.0, "circle", 0),
    "finalize": StrategyStyle("#ff7f0e", "dash", 2.0, "diamond-open", 1),
    "prefix": StrategyStyle("#2ca02c", "solid", 3.0, "square", 0),
    "prefix+shrink": StrategyStyle("#bcbd22", "dot", 2.5, "square-open", 1),
    "page-elastic": StrategyStyle("#9467bd", "solid", 4.0, "triangle-up", 0),
    "page-elastic+pool": StrategyStyle("#d62728", "dash", 2.0, "triangle-down-open", 1),
    "xl-page-elastic": StrategyStyle("#17becf", "dashdot", 2.0, "hexagon", 1),
    "request-ranges": StrategyStyle("#8c564b", "solid", 2.5, "star", 0),
    "request-ranges+deferred": StrategyStyle("#e377c2", "longdash", 2.5, "pentagon-open", 1),
    "vllm-extensible": StrategyStyle("#393b79", "dot", 2.0, "x", 2),
}

#: Colours for a strategy of the reader's own (a ``Strategy`` subclass): none of the above,
#: picked by the name, so one strategy keeps its colour in every figure.
_OWN_COLORS = ("#343a40", "#f783ac", "#5c7cfa", "#ffa94d", "#20c997", "#845ef7")


def strategy_style(name: str) -> StrategyStyle:
    """The style of strategy ``name`` (:data:`STRATEGY_STYLES`; a strategy of one's own gets
    a colour of its own, the same in every figure, drawn long-dash-dot on top)."""
    known = STRATEGY_STYLES.get(name)
    if known is not None:
        return known
    color = _OWN_COLORS[zlib.crc32(name.encode()) % len(_OWN_COLORS)]
    return StrategyStyle(color, "longdashdot", 2.5, "cross", 2)

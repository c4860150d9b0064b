"""Helpers every figure and report of :mod:`kvvmm.viz` shares: axis units, arrays, tables."""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from typing import Any

from kvvmm.errors import ArgumentError
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

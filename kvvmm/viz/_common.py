"""Helpers every figure and report of :mod:`kvvmm.viz` shares: axis units, arrays, tables."""

from __future__ import annotations

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

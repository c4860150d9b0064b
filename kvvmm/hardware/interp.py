"""The interpolators of measured curves: piecewise linear, flat past the ends.

Driver-call costs and copy bandwidth are both measured at a few handle sizes (2 MiB, 32 MiB,
512 MiB, ...), spaced by powers of two; between them kvvmm interpolates on a log2 axis
(:class:`Log2Curve`). A cold call's share of its premium is measured at a few pauses and
runs from none at no pause: that curve is linear in the pause itself (:class:`LinearCurve`).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LinearCurve", "Log2Curve"]


@dataclass(frozen=True, slots=True)
class Log2Curve:
    """Measured ``(size_bytes, value)`` points, interpolated in log2(size)."""

    xs: tuple[float, ...]  #: log2 of each measured size, ascending
    ys: tuple[float, ...]  #: the value measured at each size

    @classmethod
    def from_points(cls, points: Sequence[tuple[int, float]]) -> Log2Curve:
        """Build from ``[(size_bytes, value), ...]`` (any order, sizes > 0, at least one)."""
        if not points:
            raise ValueError("a curve needs at least one measured point")
        pts = sorted((math.log2(s), float(v)) for s, v in points)
        return cls(tuple(x for x, _ in pts), tuple(y for _, y in pts))

    def __call__(self, size: int | float) -> float:
        xs, ys = self.xs, self.ys
        if size <= 0:
            return ys[0]
        x = math.log2(size)
        i = bisect_right(xs, x)
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1]
        t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + t * (ys[i] - ys[i - 1])


@dataclass(frozen=True, slots=True)
class LinearCurve:
    """Measured ``(x, value)`` points, interpolated linearly in x."""

    xs: tuple[float, ...]  #: each measured x, ascending
    ys: tuple[float, ...]  #: the value measured at each x

    @classmethod
    def from_points(cls, points: Sequence[tuple[float, float]]) -> LinearCurve:
        """Build from ``[(x, value), ...]`` (any order, distinct xs, at least one)."""
        if not points:
            raise ValueError("a curve needs at least one measured point")
        pts = sorted((float(x), float(v)) for x, v in points)
        return cls(tuple(x for x, _ in pts), tuple(y for _, y in pts))

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        i = bisect_right(xs, x)
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1]
        t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + t * (ys[i] - ys[i - 1])

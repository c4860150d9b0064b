"""One measured quantity, and every statistic read from it, computed here and nowhere else.

A :class:`Measurement` keeps every sample it was made from (so a report can show the rounds
as well as the figure), and gives the figures the sections report: the median, the trimmed
mean (what the simulator sums: docs/MEASUREMENTS.md), the p99. Percentiles
are one function, :func:`percentile`, in its two conventions: the nearest rank (a p99 of 122
steps is the second largest, a sample that was seen) and linear between order statistics
(the p10 / p50 / p90 of a profile's spread, which may fall between samples).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvvmm.checks import is_number, number_arg
from kvvmm.errors import ArgumentError

__all__ = ["Measurement", "mean_us", "median_us", "percentile", "trimmed_mean"]


def percentile(samples: Sequence[float], q: float, *, interpolate: bool = False) -> float:
    """The ``q`` quantile of ``samples`` (in any order).

    Args:
        samples: the values (at least one; finite numbers).
        q: the quantile, 0 to 1 (0.99 for a p99).
        interpolate: linear between the order statistics around ``q * (n - 1)``; without
            it, the nearest rank (the smallest sample with at least ``q`` of them at or
            below it).
    Returns:
        The quantile, in the samples' unit.
    Raises:
        ArgumentError: no samples, a sample that is not a finite number, or ``q`` outside
            0 to 1.
    """
    number_arg("q", q, lo=0.0, hi=1.0)
    s = sorted(samples)
    if not s or not all(is_number(x) for x in s):
        raise ArgumentError("samples", list(samples)[:8], "a non-empty list of finite numbers")
    if not interpolate:
        return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]
    pos = q * (len(s) - 1)
    i = int(pos)
    j = min(i + 1, len(s) - 1)
    return s[i] + (pos - i) * (s[j] - s[i])


@dataclass(frozen=True, slots=True)
class Measurement:
    """Every sample of one quantity (one call's time at one size, one step's wait), in the
    unit it was taken in (seconds, unless the maker says otherwise)."""

    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Iterable[float]) -> Measurement:
        """A measurement of ``samples`` (at least one).

        Raises:
            ArgumentError: no samples.
        """
        got = tuple(float(x) for x in samples)
        if not got:
            raise ArgumentError("samples", [], "at least one sample")
        return cls(got)

    @property
    def median(self) -> float:
        """The median sample."""
        return statistics.median(self.samples)

    def trimmed_mean(self, high: float = 0.02, low: float = 0.0) -> float:
        """The mean without the slowest ``high`` and the fastest ``low`` shares of the
        samples (``int(n * share)`` of them; at least one sample kept).

        What the simulator sums must be a mean, not a median: a growth is the sum of
        thousands of calls and operations, and their costs are skewed (a garbage
        collection, an interrupt), so medians of the parts under-predict the whole. The
        slowest 2% are left out by default so that one 10 ms stall in 200 reps does not move
        a figure by 50 µs.
        """
        v = sorted(self.samples)
        lo = int(len(v) * low)
        hi = len(v) - int(len(v) * high)
        kept = v[lo:hi] or v
        return statistics.fmean(kept)

    @property
    def p99(self) -> float:
        """The nearest-rank 99th percentile."""
        return percentile(self.samples, 0.99)

    def median_us(self) -> float:
        """The median in µs, of samples in seconds (3 decimals)."""
        return round(self.median * 1e6, 3)

    def mean_us(self) -> float:
        """The trimmed mean (:meth:`trimmed_mean`) in µs, of samples in seconds (3 decimals)."""
        return round(self.trimmed_mean() * 1e6, 3)


def median_us(samples: Iterable[float]) -> float:
    """:meth:`Measurement.median_us` of ``samples`` (seconds)."""
    return Measurement.of(samples).median_us()


def mean_us(samples: Iterable[float]) -> float:
    """:meth:`Measurement.mean_us` of ``samples`` (seconds)."""
    return Measurement.of(samples).mean_us()


def trimmed_mean(samples: Iterable[float]) -> float:
    """:meth:`Measurement.trimmed_mean` of ``samples``, in their unit."""
    return Measurement.of(samples).trimmed_mean()

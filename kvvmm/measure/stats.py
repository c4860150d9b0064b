"""One measured quantity, and every statistic read from it, computed here and nowhere else.

A :class:`Measurement` keeps every sample it was made from and gives the figures the sections
report: the median, the trimmed mean (what the simulator sums), the p99. Percentiles are one
function, :func:`percentile`: the nearest rank (a sample that was seen) or linear between
order statistics (a spread's p10 / p50 / p90).

A profile's ``spread`` section (read by :mod:`kvvmm.hardware.spread`) is written here too, by
``kvvmm calibrate --quick --profile``: :func:`ratios` of one calibration's figures to
another's, pooled into :func:`quantiles` by :func:`spread_section`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvvmm.checks import is_number, number_arg
from kvvmm.errors import ArgumentError
from kvvmm.hardware.interp import Log2Curve
from kvvmm.hardware.spread import CALLS, GROUPS, QUANTILES, figures_of
from kvvmm.units import MiB

__all__ = ["Measurement", "mean_us", "median_factor", "median_us", "percentile", "quantiles",
           "ratios", "spread_section", "trimmed_mean"]


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

        What the simulator sums must be a mean, not a median: the parts' costs are skewed, so
        medians of the parts under-predict the whole. The slowest 2% are left out by default
        so that one stall does not move a figure.
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


# -- a profile's spread ----------------------------------------------------------------------

#: Groups whose figures are curves by handle size (labels are MiB; ratios interpolate).
_CURVES = frozenset((*(f"call_costs.{c}" for c in CALLS), "set_access_per_mapping",
                     "unmap_per_mapping"))
#: Most calibrations a history keeps (the oldest go first).
MAX_HISTORY = 16


def quantiles(samples: Sequence[float]) -> dict[str, float]:
    """p10 / p50 / p90 of ``samples`` (linear between order statistics; one sample: a point).

    Raises:
        ArgumentError: no samples, or one that is not a finite number > 0.
    """
    xs = list(samples)
    if not xs or not all(is_number(x) and x > 0 for x in xs):
        raise ArgumentError("samples", xs[:8], "a non-empty list of finite ratios > 0")
    return {name: round(percentile(xs, q, interpolate=True), 4) for name, q in QUANTILES}


def median_factor(factors: Mapping[str, float]) -> float:
    """The median of the groups' factors (1 when there are none)."""
    return statistics.median(factors.values()) if factors else 1.0


def _curve_of(labels: Mapping[str, float]) -> Log2Curve:
    return Log2Curve.from_points([(max(1, round(float(k) * MiB)), v) for k, v in labels.items()])


def ratios(base: Mapping[str, Mapping[str, float]], other: Mapping[str, Mapping[str, float]],
           ) -> dict[str, list[float]]:
    """Per group, ``other / base`` at each of ``base``'s labels both can say.

    A curve is read at ``base``'s sizes (``other`` interpolated in log2 size, flat past its
    ends); other groups pair labels by name. A figure of 0 or below on either side (nothing
    to scale, a fitted residual, a term a fit dropped) gives no ratio.
    """
    out: dict[str, list[float]] = {}
    for group, b in base.items():
        o = other.get(group)
        if not o:
            continue
        got: list[float] = []
        if group in _CURVES:
            curve = _curve_of(o)
            for k, v in b.items():
                r = curve(float(k) * MiB) / v if v > 0 else 0.0
                if r > 0:
                    got.append(r)
        else:
            for k, v in b.items():
                if v > 0 and k in o and o[k] > 0:
                    got.append(o[k] / v)
        if got:
            out[group] = got
    return out


def spread_section(data: Mapping[str, Any], *, history: Sequence[Mapping[str, Any]] = (),
                   rounds: Mapping[str, Sequence[float]] | None = None,
                   source: str) -> dict[str, Any]:
    """A ``spread`` section for ``data``'s figures: quantiles over the history and rounds.

    The profile's own figures count as one calibration (a ratio of 1 at each).

    Args:
        data: the profile the factors are relative to.
        history: earlier calibrations' figures (``{"date", "source", "figures"}``), kept in
            the section as they are (the newest :data:`MAX_HISTORY`).
        rounds: per group, ratios of single rounds to their mean (a calibration's own
            round-to-round spread), pooled with the history's ratios.
        source: how the samples were taken, for the section's ``source``.
    Returns:
        The section (``figures`` holds only groups with at least one sample).
    """
    base = figures_of(data)
    # This profile's own calibration is one of those kept: a ratio of 1 at each figure.
    pooled: dict[str, list[float]] = {g: [1.0] * len(v) for g, v in base.items()}
    for entry in history:
        figs = entry.get("figures")
        if isinstance(figs, Mapping):
            for g, got in ratios(base, figs).items():
                pooled[g].extend(got)
    for g, rs in (rounds or {}).items():
        if g in pooled:
            pooled[g].extend(float(r) for r in rs if math.isfinite(r) and r > 0)
    figures = {g: quantiles(rs) | {"samples": len(rs)} for g, rs in pooled.items() if rs}
    return {
        "unit": "each figure group's quantiles (p10, p50, p90) over the rounds and the "
                "calibrations kept, as multiples of the figure this profile carries; a group "
                "not listed is a point (factor 1)",
        "source": source,
        "figures": {g: figures[g] for g in GROUPS if g in figures},
        "history": [dict(h) for h in list(history)[-MAX_HISTORY:]],
    }

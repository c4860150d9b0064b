"""Values a run collects one at a time (a step's stall, a request's first token), kept in
bounded memory however long the run.

A :class:`Tally` keeps every value, in the order added, up to ``exact_limit`` of them (an
hour of Azure's conversation trace adds about 20,000 per kind; the limit is a million), so
a short run's percentiles are exact, nearest rank, as they always were. Past the limit it
folds them into a log-bucketed histogram (DDSketch's: Masson et al., VLDB 2019) of relative
accuracy :data:`RELATIVE_ERROR`: a quantile it gives lies within 0.5 % of the true value of
that rank, for any count. The count, sum, minimum and maximum stay exact, and a fixed-size
uniform sample (reservoir sampling, seeded) stands in for the values where a figure plots
them. Its memory is then a few thousand buckets (one per 1 % of range between the smallest
and largest value) plus the sample, whatever the count.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Iterable

from kvvmm.checks import int_arg
from kvvmm.errors import ArgumentError

__all__ = ["EXACT_LIMIT", "RELATIVE_ERROR", "SAMPLE_SIZE", "Tally"]

#: Values a tally keeps exactly (8 bytes each) before it folds them into buckets.
EXACT_LIMIT = 1_000_000
#: A folded tally's quantile is within this fraction of the true value of its rank.
RELATIVE_ERROR = 0.005
#: Values a folded tally keeps as a uniform sample, for figures that plot values.
SAMPLE_SIZE = 20_000

_GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LOG_GAMMA = math.log(_GAMMA)


class Tally:
    """Float values added one at a time: exact up to ``exact_limit``, then a bounded summary.

    Args:
        values: values to start with.
        exact_limit: values kept exactly (in the order added) before folding, >= 1 (None:
            :data:`EXACT_LIMIT`, read when the tally is made).
        sample_size: values a folded tally keeps as a uniform sample, >= 1 (None:
            :data:`SAMPLE_SIZE`).
        seed: the sample's seed (the same values give the same sample).
    """

    __slots__ = ("_buckets", "_exact", "_low", "_rng", "_sample", "_sorted", "count",
                 "exact_limit", "max", "min", "sample_size", "total")

    def __init__(self, values: Iterable[float] = (), *, exact_limit: int | None = None,
                 sample_size: int | None = None, seed: int = 0) -> None:
        exact_limit = EXACT_LIMIT if exact_limit is None else exact_limit
        sample_size = SAMPLE_SIZE if sample_size is None else sample_size
        int_arg("exact_limit", exact_limit, lo=1, limit="an int >= 1 (values)")
        int_arg("sample_size", sample_size, lo=1, limit="an int >= 1 (values)")
        self.exact_limit = exact_limit
        self.sample_size = sample_size
        self.count = 0  #: values added
        self.total = 0.0  #: their sum
        self.min = math.inf  #: the smallest (inf: none yet)
        self.max = -math.inf  #: the largest (-inf: none yet)
        self._exact: array[float] | None = array("d")  # None once folded
        self._sorted: list[float] | None = None  # the exact values sorted, while unchanged
        self._buckets: dict[int, int] = {}  # bucket index -> values in it (folded)
        self._low = 0  # folded values <= 0 (no log bucket holds them)
        self._sample: list[float] = []
        self._rng = random.Random(seed)
        for v in values:
            self.append(v)

    @property
    def exact(self) -> bool:
        """Whether every value is still kept (percentiles exact)."""
        return self._exact is not None

    def __len__(self) -> int:
        return self.count

    def append(self, v: float) -> None:
        """Add one value."""
        self.count += 1
        self.total += v
        if v < self.min:
            self.min = v
        if v > self.max:
            self.max = v
        ex = self._exact
        if ex is not None:
            ex.append(v)
            self._sorted = None
            if len(ex) > self.exact_limit:
                self._fold(ex)
            return
        self._bucket(v)
        j = self._rng.randrange(self.count)  # reservoir sampling (Vitter's algorithm R)
        if j < self.sample_size:
            self._sample[j] = v

    def extend(self, values: Iterable[float]) -> None:
        """Add values in order."""
        for v in values:
            self.append(v)

    def _fold(self, ex: array[float]) -> None:
        for v in ex:
            self._bucket(v)
        k = self.sample_size
        self._sample = (list(ex) if len(ex) <= k
                        else [ex[i] for i in self._rng.sample(range(len(ex)), k)])
        self._exact = None
        self._sorted = None

    def _bucket(self, v: float) -> None:
        if v > 0.0:
            i = math.ceil(math.log(v) / _LOG_GAMMA)
            b = self._buckets
            b[i] = b.get(i, 0) + 1
        else:
            self._low += 1

    def values(self) -> tuple[float, ...]:
        """Every value, in the order added.

        Raises:
            ArgumentError: the tally has folded (more than ``exact_limit`` values): use
                :meth:`quantile`, :meth:`at_rank` or :meth:`sample`.
        """
        if self._exact is None:
            raise ArgumentError("values", f"<{self.count:,} values>",
                                f"at most {self.exact_limit:,} kept one by one (this tally "
                                f"keeps a summary: read quantile(), at_rank() or sample())")
        return tuple(self._exact)

    def sample(self) -> tuple[float, ...]:
        """Every value while exact, else a uniform sample of ``sample_size`` of them."""
        return tuple(self._exact) if self._exact is not None else tuple(self._sample)

    def at_rank(self, k: int) -> float:
        """The ``k``-th smallest value (1-based, clamped to [1, count]); 0 for none. Exact
        while :attr:`exact`, else within :data:`RELATIVE_ERROR` of it (the first and last
        ranks are the exact minimum and maximum)."""
        n = self.count
        if n == 0:
            return 0.0
        k = min(max(k, 1), n)
        if self._exact is not None:
            s = self._sorted
            if s is None:
                s = self._sorted = sorted(self._exact)
            return float(s[k - 1])
        if k == 1:
            return float(self.min)
        if k == n:
            return float(self.max)
        seen = self._low
        if k <= seen:
            return float(self.min)
        for i in sorted(self._buckets):
            seen += self._buckets[i]
            if seen >= k:
                value = 2.0 * _GAMMA ** i / (_GAMMA + 1.0)
                return float(min(max(value, self.min), self.max))
        return float(self.max)  # not reached: the buckets hold every value

    def quantile(self, q: float) -> float:
        """The ``q``-th percentile (0..100), nearest rank; 0 for none."""
        n = self.count
        if n == 0:
            return 0.0
        return self.at_rank(max(1, -(-int(q * n) // 100)))

    def summary_size(self) -> int:
        """Numbers held: the exact values, or the buckets and the sample (what bounds its
        memory)."""
        if self._exact is not None:
            return len(self._exact)
        return len(self._buckets) + len(self._sample)

    def _state(self) -> tuple[object, ...]:
        if self._exact is not None:
            return (self.count, tuple(self._exact))
        return (self.count, self.total, self.min, self.max, self._low,
                tuple(sorted(self._buckets.items())))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tally):
            return NotImplemented
        return self._state() == other._state()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        kind = "exact" if self.exact else f"folded, within {RELATIVE_ERROR:.1%}"
        return f"Tally({self.count:,} values, {kind})"

"""SlotRanges: a best-fit allocator of contiguous unit ranges (pure bookkeeping, no driver).

With the interleaved layout a contiguous range of slots is one VA range, so giving each
request one contiguous range lets the owner back it with one handle. The units are the
caller's (blocks of whole granules for :class:`~kvvmm.owner.RangeBacking`, pages for the
workload lab).

Best-fit, not buddy: request sizes are not powers of two, and rounding each up to one would
back up to 2x the memory. Best-fit takes the smallest free extent that fits (ties: the lowest
address) and a free joins its free neighbours at once; what is left is external
fragmentation, which :attr:`SlotRanges.fragmentation` measures. ``alloc`` and ``free`` are a
bisection each into a list ordered by length.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from kvvmm.checks import int_arg
from kvvmm.errors import ArgumentError, OutOfRangeError

__all__ = ["RangesFullError", "SlotRanges"]


class RangesFullError(OutOfRangeError):
    """No free extent (or, for :meth:`SlotRanges.alloc_pieces`, no free units) is large enough."""


class SlotRanges:
    """Free and used extents over units ``[first, units)``.

    Args:
        units: units in all (an int > 0).
        first: units below it are never handed out (e.g. 1: the block holding slot 0).
    """

    def __init__(self, units: int, *, first: int = 0, free: bool = True) -> None:
        int_arg("units", units, lo=1)
        int_arg("first", first, lo=0)
        if first >= units:
            raise OutOfRangeError("first", first, f"< units ({units})")
        self.units = units
        self.first = first
        self._start: dict[int, int] = {}  # free extent start -> length
        self._end: dict[int, int] = {}  # free extent end -> start
        self._by_len: list[tuple[int, int]] = []  # (length, start), sorted
        self._starts: list[int] = []  # free extent starts, sorted
        self.free_units = 0  #: units free now
        if free:
            self._add(first, units - first)

    def __repr__(self) -> str:
        return (f"SlotRanges({self.units} units, {self.free_units} free in "
                f"{len(self._start)} extents)")

    # -- internals ----------------------------------------------------------------------

    def _add(self, start: int, n: int) -> None:
        self._start[start] = n
        self._end[start + n] = start
        insort(self._by_len, (n, start))
        insort(self._starts, start)
        self.free_units += n

    def _remove(self, start: int) -> int:
        n = self._start.pop(start)
        del self._end[start + n]
        i = bisect_left(self._by_len, (n, start))
        del self._by_len[i]
        del self._starts[bisect_left(self._starts, start)]
        self.free_units -= n
        return n

    def _check(self, start: object, n: object) -> tuple[int, int]:
        if (type(start) is int and type(n) is int and start >= self.first and n >= 1
                and start + n <= self.units):
            return start, n  # the usual case, checked without messages
        int_arg("start", start, lo=self.first)
        int_arg("n", n, lo=1, unit="units")
        assert isinstance(start, int) and isinstance(n, int)
        if start + n > self.units:
            raise OutOfRangeError("start + n", start + n, f"<= units ({self.units})")
        return start, n

    # -- queries ------------------------------------------------------------------------

    @property
    def largest_free(self) -> int:
        """Units in the largest free extent (0 when none is free)."""
        return self._by_len[-1][0] if self._by_len else 0

    @property
    def extents(self) -> list[tuple[int, int]]:
        """Free extents as ``(start, length)``, lowest first."""
        return sorted(self._start.items())

    @property
    def fragmentation(self) -> float:
        """``1 - largest_free / free_units``: 0 when the free units are one extent."""
        return 1.0 - self.largest_free / self.free_units if self.free_units else 0.0

    def is_free(self, start: int, n: int) -> bool:
        """Whether ``[start, start + n)`` lies inside one free extent."""
        i = bisect_left(self._starts, start + 1) - 1
        if i < 0:
            return False
        s = self._starts[i]
        return s + self._start[s] >= start + n

    # -- changes ------------------------------------------------------------------------

    def alloc(self, n: int) -> int:
        """Take ``n`` contiguous units from the smallest free extent that holds them.

        Returns:
            The first unit.
        Raises:
            ArgumentError: ``n`` not an int >= 1.
            RangesFullError: no free extent holds ``n`` units (nothing changed).
        """
        int_arg("n", n, lo=1, limit="an int >= 1 (units)")
        by_len = self._by_len
        i = bisect_left(by_len, (n, -1))
        if i == len(by_len):
            raise RangesFullError("n", n, f"<= the largest free extent ({self.largest_free} "
                                          f"units; {self.free_units} free in "
                                          f"{len(by_len)} extents)")
        length, start = by_len[i]
        self._remove(start)
        if length > n:
            self._add(start + n, length - n)
        return start

    def alloc_pieces(self, n: int, *, max_pieces: int | None = None) -> list[tuple[int, int]]:
        """Take ``n`` units as few extents as possible: whole extents, largest first, the
        last piece best-fit. For callers that can use several ranges (a page table).

        Returns:
            ``(start, length)`` pieces, lowest start first, lengths summing to ``n``.
        Raises:
            RangesFullError: fewer than ``n`` units free (or more than ``max_pieces`` needed);
                nothing changed.
        """
        int_arg("n", n, lo=1, limit="an int >= 1 (units)")
        if n > self.free_units:
            raise RangesFullError("n", n, f"<= the free units ({self.free_units})")
        if self.largest_free >= n:
            return [(self.alloc(n), n)]
        plan: list[tuple[int, int]] = []
        left = n
        for length, start in reversed(self._by_len):
            if left <= 0:
                break
            take = min(length, left)
            plan.append((start, take))
            left -= take
        if max_pieces is not None and len(plan) > max_pieces:
            raise RangesFullError("n", n, f"a request that fits in {max_pieces} free extents "
                                          f"(it needs {len(plan)})")
        # the last piece best-fit: the smallest extent that holds what the others leave
        if len(plan) > 1:
            rest = plan[-1][1]
            used = {s for s, _ in plan[:-1]}
            i = bisect_left(self._by_len, (rest, -1))
            while self._by_len[i][1] in used:
                i += 1
            plan[-1] = (self._by_len[i][1], rest)
        for start, take in plan:
            self.take(start, take)
        return sorted(plan)

    def take(self, start: int, n: int) -> None:
        """Take the given units ``[start, start + n)``, which must all be free.

        Raises:
            ArgumentError, OutOfRangeError: bad arguments, or units not free; nothing changed.
        """
        start, n = self._check(start, n)
        if not self.is_free(start, n):
            raise ArgumentError("start", start, f"a free range of {n} units (units "
                                                f"[{start}, {start + n}) are not all free)")
        s = self._starts[bisect_left(self._starts, start + 1) - 1]
        length = self._remove(s)
        if start > s:
            self._add(s, start - s)
        if s + length > start + n:
            self._add(start + n, s + length - start - n)

    def grow(self, start: int, n: int, more: int) -> bool:
        """Extend the used range ``[start, start + n)`` by ``more`` units in place, if the
        units after it are free. Returns whether it did (nothing changes otherwise)."""
        start, n = self._check(start, n)
        int_arg("more", more, lo=1, unit="units")
        end = start + n
        nxt = self._start.get(end)
        if nxt is None or nxt < more:
            return False
        self._remove(end)
        if nxt > more:
            self._add(end + more, nxt - more)
        return True

    def free(self, start: int, n: int) -> None:
        """Give ``[start, start + n)`` back, joining it with free neighbours.

        Raises:
            ArgumentError, OutOfRangeError: bad arguments, or any of the units already free
                (a double free); nothing changed.
        """
        start, n = self._check(start, n)
        end = start + n
        starts = self._starts
        i = bisect_left(starts, end) - 1  # the last free extent starting before end
        if i >= 0:
            s = starts[i]
            if s + self._start[s] > start:
                raise ArgumentError("start", start, f"a used range (units [{start}, {end}) "
                                                    f"overlap the free extent [{s}, "
                                                    f"{s + self._start[s]}))")
        lo, hi = start, end
        before = self._end.get(start)
        if before is not None:
            self._remove(before)
            lo = before
        after = self._start.get(end)
        if after is not None:
            self._remove(end)
            hi = end + after
        self._add(lo, hi - lo)

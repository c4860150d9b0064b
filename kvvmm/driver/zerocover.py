"""The zero cover: which unbacked VA a driver keeps mapped to read-only zero memory, and how.

Pure bookkeeping and planning, no CUDA: :class:`~kvvmm.driver.cuda.CudaDriver` with
``zero_page`` on makes the calls this module plans, and records each one that succeeded here.

CUDA maps whole handles only (a map of part of a handle is CUDA_ERROR_NOT_SUPPORTED), and
``cuMemSetAccess`` costs about 40 µs per *mapping* whatever its size (docs/MEASUREMENTS.md
§9). So unbacked VA is covered with few, large zero mappings: the driver holds one zeroed
handle per piece size, the granularity ``g`` doubled up to the block size ``Z``
(``g, 2g, 4g, ..., Z``; ``Z / g`` a power of two), and tiles VA greedily: at each position
the largest piece size that the position is aligned to (relative to its reservation's start)
and that still fits. A reservation is then covered by whole blocks plus at most
``log2(Z/g)`` smaller pieces at each unaligned end.

Why the halving sizes, not only ``g`` and ``Z``: a map into the middle of a block must
unmap that block and cover what is left of it on either side. With granule pieces only that
is up to ``Z/g - 1`` new mappings (a 2 MiB commit into a 64 MiB block: 31 mappings, about
1.2 ms of access calls); with the halving sizes at most ``log2(Z/g)`` on each side (5), for
``Z - g`` more bytes of zero memory, once per driver.

Invariants (``tests/driver/test_zerocover.py`` checks them over random map/unmap sequences):

- pieces are disjoint, lie inside a registered reservation, and each has a size in
  :attr:`ZeroCover.sizes` and starts at a multiple of its size from the reservation's start;
- with no failure, the pieces and the real mappings tile each reservation exactly;
- :meth:`ZeroCover.uncover` for ``[lo, hi)`` unmaps only pieces that overlap it and re-covers
  only VA those pieces covered outside it; :meth:`ZeroCover.cover` plans only inside
  ``[lo, hi)``.

A failure whose undo also fails can leave VA that is neither a real mapping nor covered (a
*hole*: reading it faults); the book then says exactly which pieces are mapped, and the
driver reports the holes (``uncovered_bytes``). A later map over a hole is allowed.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Piece", "ZeroCover", "ZeroCoverStats", "runs"]

#: One zero mapping: ``(start, size)``.
Piece = tuple[int, int]


@dataclass(frozen=True, slots=True)
class ZeroCoverStats:
    """What a driver's zero cover holds (``CudaDriver.zero_stats()``); not in ``stats()``."""

    block: int  #: the largest piece size (``Z``), bytes
    piece_sizes: tuple[int, ...]  #: every piece size, ascending (``g`` .. ``Z``)
    zero_bytes: int  #: device memory the zero handles hold (their sizes summed), bytes
    mappings: int  #: zero mappings now
    covered_bytes: int  #: VA bytes mapped to zero memory
    #: reserved VA that is neither really mapped nor covered (0 unless an undo failed)
    uncovered_bytes: int


def runs(pieces: Iterable[Piece]) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each run of adjacent pieces, in order (``pieces`` sorted by start)."""
    out: list[tuple[int, int]] = []
    for start, size in pieces:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], start + size)
        else:
            out.append((start, start + size))
    return out


class ZeroCover:
    """The zero mappings of one driver (start -> size, with a sorted index) and their plans.

    Planning (:meth:`cover`, :meth:`uncover`) changes nothing; :meth:`add` and
    :meth:`remove` record what the driver did. Not locked: the driver calls it under its own
    lock. Raises ``ValueError`` for a plan or record that would break an invariant (a driver
    bug, never a user's mistake: the driver checks calls before it plans).
    """

    def __init__(self, granularity: int, block: int) -> None:
        if granularity <= 0 or block <= 0 or block % granularity:
            raise ValueError(f"block {block} must be a positive multiple of {granularity}")
        ratio = block // granularity
        if ratio & (ratio - 1):
            raise ValueError(f"block / granularity = {ratio} must be a power of two")
        self.gran = granularity
        self.block = block
        #: piece sizes, ascending: the granularity doubled up to the block
        self.sizes: tuple[int, ...] = tuple(
            granularity << k for k in range(ratio.bit_length())
        )
        self._res: dict[int, int] = {}  # reservation start -> size
        self._res_starts: list[int] = []
        self._pieces: dict[int, int] = {}  # piece start -> size
        self._starts: list[int] = []  # sorted piece starts
        self.covered_bytes = 0  #: VA bytes the pieces cover

    # -- reservations -------------------------------------------------------------------

    def add_reservation(self, base: int, size: int) -> None:
        if base % self.gran or size <= 0 or size % self.gran:
            raise ValueError(f"reservation [{base:#x}, +{size:#x}) is not granule-aligned")
        i = bisect_right(self._res_starts, base)
        if (i and self._res_starts[i - 1] + self._res[self._res_starts[i - 1]] > base) or (
            i < len(self._res_starts) and self._res_starts[i] < base + size
        ):
            raise ValueError(f"reservation [{base:#x}, +{size:#x}) overlaps another")
        self._res[base] = size
        self._res_starts.insert(i, base)

    def drop_reservation(self, base: int) -> None:
        """Forget a reservation; it must hold no piece."""
        size = self._res[base]
        if self.overlapping(base, base + size):
            raise ValueError(f"reservation {base:#x} still has zero pieces")
        del self._res[base]
        self._res_starts.remove(base)

    def reservation_of(self, lo: int, hi: int) -> int:
        """Start of the reservation holding ``[lo, hi)``."""
        i = bisect_right(self._res_starts, lo) - 1
        if i < 0 or hi > self._res_starts[i] + self._res[self._res_starts[i]] or hi <= lo:
            raise ValueError(f"[{lo:#x}, {hi:#x}) is not inside one reservation")
        return self._res_starts[i]

    def reservations(self) -> dict[int, int]:
        return dict(self._res)

    # -- lookups ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._starts)

    def __iter__(self) -> Iterator[Piece]:
        """Every piece, by start."""
        pieces = self._pieces
        return ((s, pieces[s]) for s in self._starts)

    def __contains__(self, piece: object) -> bool:
        return (isinstance(piece, tuple) and len(piece) == 2
                and self._pieces.get(piece[0]) == piece[1])

    def overlapping(self, lo: int, hi: int) -> list[Piece]:
        """The pieces that overlap ``[lo, hi)``, by start."""
        starts, pieces = self._starts, self._pieces
        i = bisect_right(starts, lo) - 1
        if i < 0 or starts[i] + pieces[starts[i]] <= lo:
            i += 1
        j = bisect_left(starts, hi)
        return [(s, pieces[s]) for s in starts[i:j]]

    def gaps(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts ``[a, b)`` of ``[lo, hi)`` that no piece covers."""
        out: list[tuple[int, int]] = []
        pos = lo
        for start, size in self.overlapping(lo, hi):
            if start > pos:
                out.append((pos, start))
            pos = max(pos, start + size)
        if pos < hi:
            out.append((pos, hi))
        return out

    # -- planning -----------------------------------------------------------------------

    def _tile(self, base: int, lo: int, hi: int) -> list[Piece]:
        """Greedy pieces tiling ``[lo, hi)``, aligned relative to ``base``."""
        out: list[Piece] = []
        sizes, z = self.sizes, self.block
        pos = lo
        # The unaligned head, the whole blocks, the tail: the middle without a search.
        first = base + -(-(lo - base) // z) * z
        last = base + (hi - base) // z * z
        stops = ((first, False), (last, True), (hi, False)) if first < last else ((hi, False),)
        for stop, blocks in stops:
            if blocks:
                out += [(p, z) for p in range(pos, stop, z)]
                pos = stop
                continue
            while pos < stop:
                rel = pos - base
                size = self.gran
                for s in reversed(sizes):
                    if rel % s == 0 and pos + s <= stop:
                        size = s
                        break
                out.append((pos, size))
                pos += size
        return out

    def cover(self, lo: int, hi: int) -> list[Piece]:
        """The pieces to map over ``[lo, hi)`` (granule-aligned, inside one reservation,
        with no piece in it yet), by start."""
        self._check_range(lo, hi)
        if self.overlapping(lo, hi):
            raise ValueError(f"[{lo:#x}, {hi:#x}) is already partly covered")
        return self._tile(self.reservation_of(lo, hi), lo, hi)

    def uncover(self, lo: int, hi: int) -> tuple[list[Piece], list[Piece]]:
        """For a real map over ``[lo, hi)``: ``(old, new)``, the pieces overlapping it (to
        unmap) and the pieces that re-cover what ``old`` covered outside it (to map)."""
        self._check_range(lo, hi)
        base = self.reservation_of(lo, hi)
        old = self.overlapping(lo, hi)
        new: list[Piece] = []
        if old:
            if old[0][0] < lo:
                new += self._tile(base, old[0][0], lo)
            end = old[-1][0] + old[-1][1]
            if end > hi:
                new += self._tile(base, hi, end)
        return old, new

    def _check_range(self, lo: int, hi: int) -> None:
        if lo % self.gran or hi % self.gran or hi <= lo:
            raise ValueError(f"[{lo:#x}, {hi:#x}) is not a granule-aligned range")

    # -- records ------------------------------------------------------------------------

    def add(self, pieces: Sequence[Piece]) -> None:
        """Record mapped pieces (sorted by start, each checked against the invariants)."""
        starts = self._starts
        for lo, hi in runs(pieces):
            i = bisect_left(starts, lo)
            if (i < len(starts) and starts[i] < hi) or (
                i and starts[i - 1] + self._pieces[starts[i - 1]] > lo
            ):
                raise ValueError(f"[{lo:#x}, {hi:#x}) overlaps a recorded zero piece")
        for start, size in pieces:
            base = self.reservation_of(start, start + size)
            if size not in self.sizes or (start - base) % size:
                raise ValueError(f"piece ({start:#x}, {size:#x}) breaks the size rule")
        for lo, hi in runs(pieces):
            i = bisect_left(starts, lo)
            mine = [p for p in pieces if lo <= p[0] < hi]
            starts[i:i] = [s for s, _ in mine]
            for s, n in mine:
                self._pieces[s] = n
                self.covered_bytes += n

    def remove(self, pieces: Sequence[Piece]) -> None:
        """Forget unmapped pieces (each must be recorded exactly so)."""
        for piece in pieces:
            if piece not in self:
                raise ValueError(f"piece ({piece[0]:#x}, {piece[1]:#x}) is not recorded")
        starts = self._starts
        for lo, hi in runs(pieces):
            i, j = bisect_left(starts, lo), bisect_left(starts, hi)
            del starts[i:j]
        for start, size in pieces:
            del self._pieces[start]
            self.covered_bytes -= size

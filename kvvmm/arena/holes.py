"""Holes: back and give back any granule-aligned range of an allocation, not just a prefix.

``HolesMixin`` gives :class:`~kvvmm.arena.arena.Arena` ``commit_range(s)`` and
``decommit_range(s)`` (with their :class:`~kvvmm.arena.records.RangeResult` reports), and
``prepare_ranges``, the handle pool's look-ahead that backs ranges with the arena's lock
free. Each runs in the transactions of :class:`~kvvmm.arena.state._ArenaState`.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvvmm.arena.records import RangeResult, _Alloc, _insert, _Map, _overlaps, _touching
from kvvmm.arena.state import _ArenaState, _locked, log
from kvvmm.arena.transaction import Transaction
from kvvmm.errors import ClosedError, DriverError
from kvvmm.units import fmt_range


class HolesMixin(_ArenaState):
    """Range commits and decommits of an :class:`~kvvmm.arena.arena.Arena` (holes allowed)."""

    # -- commit -------------------------------------------------------------------------

    def commit_range(self, offset: int, start: int, nbytes: int) -> int:
        """Back ``[start, start + nbytes)`` of the allocation at ``offset``, holes allowed.

        Each unbacked gap in it gets one new handle, so a :meth:`decommit_range` of the same
        range gives it back whole.

        Args:
            offset: an allocation's offset.
            start: bytes from the allocation's start, a multiple of the granularity.
            nbytes: bytes, a multiple of the granularity; ``start + nbytes <= size``.
        Returns:
            Bytes newly backed.
        Raises:
            ArgumentError, OutOfRangeError, AlignmentError: bad arguments; nothing changed.
            DriverError: a driver call failed; everything this call did is undone.
        """
        return self.commit_ranges([(offset, start, nbytes)])

    @_locked
    def commit_ranges(self, requests: Iterable[tuple[int, int, int]]) -> int:
        """Commit several ``(offset, start, nbytes)`` ranges as one transaction (every range
        checked first); see :meth:`commit_range`."""
        self._check_open("commit_range")
        plan = [self._check_range("commit_range", o, s, n) for o, s, n in requests]
        return self._commit_ranges(plan, "commit_range")

    def prepare_ranges(self, requests: Iterable[tuple[int, int, int]]) -> int:
        """Back ranges ahead of need, making the driver calls with the arena's lock free.

        For the handle pool's look-ahead: each unbacked gap is booked "in flight" under the
        lock, backed with no lock held, then published under the lock; a commit that needs
        it waits (:attr:`inflight_waits`). A gap that fails is undone and stays unbacked;
        the others stand (a hint, not a transaction).

        Returns:
            Bytes published. 0 after ``close()``.
        Raises:
            ArgumentError, OutOfRangeError, AlignmentError: bad ranges; nothing booked.
        """
        with self._lock:
            if self._closed or self._sleeping is not None:  # asleep: nothing to back ahead
                return 0
            plan = [self._check_range("prepare_ranges", o, s, n) for o, s, n in requests]
            booked: list[tuple[_Alloc, int, int]] = []
            fixed = self._captures.fixed  # a fixed capacity: skip what would grow past it
            for a, lo, hi in plan:
                mine = self._inflight.setdefault(a.offset, [])
                va = self.base + a.offset
                for s, e in self._gaps(a, lo, hi):
                    if fixed and self._captures.blocks_growth((va + s, va + e),
                                                              (va, va + a.size)):
                        continue
                    if not _overlaps(mine, s, e):
                        mine.append((s, e))
                        booked.append((a, s, e))
        done = 0
        for a, s, e in booked:
            size, va = e - s, self.base + a.offset + s
            h: int | None = None
            mapped = False
            try:
                if self._closed:
                    raise ClosedError(f"arena {self.name!r} closed during a look-ahead")
                h = self._new_handle(size)
                self.driver.map(va, size, h)
                mapped = True
                self._set_access(va, size)
            except BaseException as err:
                self._drop_prepared(a, s, e, h, mapped, err)
                if not isinstance(err, (DriverError, ClosedError)):
                    raise
                continue
            with self._lock:
                _insert(a, _Map(a.offset + s, size, h, self._next_hid))
                self._next_hid += 1
                self._inflight[a.offset].remove((s, e))
                self._note("commit_range", offset=a.offset, start=s, nbytes=size)
                self._cond.notify_all()
            done += size
        return done

    def _drop_prepared(self, a: _Alloc, s: int, e: int, h: int | None, mapped: bool,
                       err: BaseException) -> None:
        """Undo one look-ahead gap that failed (no lock held for the driver calls)."""
        undo = Transaction()
        size, va = e - s, self.base + a.offset + s
        if h is not None:
            undo.push(f"release(handle={h})", self._drop_handle, h, size)
        if mapped:  # the driver refuses this during a capture: then the handle stays mapped
            undo.push(f"unmap(va={va:#x}, size={size})", self.driver.unmap, va, size)
        undo.unwind(err)
        with self._lock:
            self._inflight[a.offset].remove((s, e))
            self._cond.notify_all()
        log.info("arena %r: look-ahead of %s failed: %s", self.name,
                 fmt_range(a.offset + s, a.offset + e), err)

    # -- decommit -----------------------------------------------------------------------

    def decommit_range(self, offset: int, start: int, nbytes: int) -> int:
        """Give back the mappings that lie wholly inside ``[start, start + nbytes)``.

        A mapping the range cuts stays whole: :meth:`decommit_ranges_report` names it.

        Args:
            offset: an allocation's offset.
            start, nbytes: a granule-aligned range of it (bytes from its start).
        Returns:
            Bytes given back.
        Raises:
            ArgumentError, OutOfRangeError, AlignmentError: bad arguments; nothing changed.
            DriverError: as for :meth:`decommit_many_report`.
        """
        return self.decommit_ranges([(offset, start, nbytes)])

    def decommit_ranges(self, requests: Iterable[tuple[int, int, int]]) -> int:
        """:meth:`decommit_ranges_report`, returning the bytes given back in all."""
        return sum(r.given_bytes for r in self.decommit_ranges_report(requests))

    @_locked
    def decommit_ranges_report(
        self, requests: Iterable[tuple[int, int, int]]
    ) -> tuple[RangeResult, ...]:
        """Decommit several ranges as one transaction, as :meth:`decommit_many_report`;
        one :class:`RangeResult` per range."""
        self._check_open("decommit_range")
        plan = [self._check_range("decommit_range", o, s, n) for o, s, n in requests]
        self._wait_inflight(plan)
        drop: dict[int, list[_Map]] = {}
        dropped: set[int] = set()  # id() of every mapping in ``drop`` (a set, not a scan)
        cut: list[tuple[tuple[int, int], ...]] = []
        inside: list[list[_Map]] = []
        for a, lo, hi in plan:
            lo_abs, hi_abs = a.offset + lo, a.offset + hi
            mine, cuts = [], []
            for m in _touching(a.maps, lo_abs, hi_abs):
                if m.offset >= lo_abs and m.offset + m.size <= hi_abs:
                    mine.append(m)
                else:
                    cuts.append((m.offset, m.offset + m.size))
            cut.append(tuple(cuts))
            inside.append(mine)
            got = drop.setdefault(a.offset, [])
            for m in mine:
                if id(m) not in dropped:
                    dropped.add(id(m))
                    got.append(m)
        self._give_back([(self._by_offset[o], sorted(ms, key=lambda m: m.offset))
                         for o, ms in drop.items() if ms], "decommit_range")
        out = []
        seen: set[int] = set()
        for (a, lo, hi), mine, kept in zip(plan, inside, cut, strict=True):
            given = sum(m.size for m in mine if id(m) not in seen)
            seen.update(id(m) for m in mine)
            out.append(RangeResult(name=a.name, offset=a.offset, start=lo, nbytes=hi - lo,
                                   given_bytes=given, backed_bytes=a.backed,
                                   kept_mappings=kept))
            if mine:
                self._note("decommit_range", offset=a.offset, start=lo, nbytes=hi - lo)
        self._release_gone()
        return tuple(out)

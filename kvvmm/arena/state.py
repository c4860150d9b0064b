"""The state every part of an arena shares, and the transactions that back and unback it.

``_ArenaState`` declares what :class:`~kvvmm.arena.arena.Arena` sets up in ``__init__`` (so
the mixins type-check on their own) and holds the steps every commit and decommit runs
through. ``_locked`` runs a method under the arena's lock.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from kvvmm.arena.reclaim import ReclaimStats
from kvvmm.arena.records import (
    _Alloc,
    _discard,
    _insert,
    _Map,
    _map_offset,
    _overlaps,
    _prefix,
    _runs,
    _Sleep,
)
from kvvmm.arena.transaction import Transaction
from kvvmm.checks import int_arg, is_int
from kvvmm.driver.base import Driver
from kvvmm.errors import (
    AlignmentError,
    ArgumentError,
    AsleepError,
    ClosedError,
    DriverError,
    DriverOutOfMemoryError,
    OutOfRangeError,
)
from kvvmm.record.trace import Trace

if TYPE_CHECKING:
    from kvvmm.arena.captures import CaptureRegistry
    from kvvmm.arena.pool import HandlePool, PoolTag
    from kvvmm.arena.reclaim import CacheReleaser

log = logging.getLogger("kvvmm.arena.arena")

#: What a sleeping arena refuses: every change of its mappings (a wake maps the remembered
#: ranges back, and must find them unmapped), and exports of handles it no longer holds.
_AWAKE_ONLY = frozenset({"commit", "decommit", "commit_range", "decommit_range", "adopt",
                         "adopt_range", "export_handles"})

_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound="_ArenaState")


def _locked(fn: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Run an arena method under the arena's lock (a tensor's last reference can go, and
    end a view, on any thread)."""

    @functools.wraps(fn)
    def wrapper(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return fn(self, *args, **kwargs)

    return wrapper


class _ArenaState:
    """What an arena holds (set by ``Arena.__init__``) and the steps its changes share."""

    _lock: threading.RLock
    _cond: threading.Condition
    _handle_pool: HandlePool | None
    #: who this arena is to a shared HandlePool (whose bytes a handle given back holds)
    pool_tag: PoolTag
    _inflight: dict[int, list[tuple[int, int]]]
    inflight_waits: int
    _gone: list[tuple[int, int]]
    #: adopted handles of shared memory: released when given back, never pooled
    _adopted: set[int]
    driver: Driver
    name: str
    device: int
    granularity: int
    reserved_bytes: int
    base: int
    cursor_bytes: int
    _allocs: list[_Alloc]
    _by_offset: dict[int, _Alloc]
    _names: set[str]
    _next_hid: int
    _work: Callable[[str, int], None] | None
    _closed: bool
    _released: bool
    _views: int
    _leftover: list[tuple[int, int]]
    _pool: Any
    _dropping_pool: bool
    _access: tuple[int, ...] | None
    _trace: Trace | None
    _arena_id: int
    #: what a sleeping arena remembers (:mod:`~kvvmm.arena.sleep`); None while awake
    _sleeping: _Sleep | None = None
    #: what baked the arena's VA in (:mod:`~kvvmm.arena.captures`)
    _captures: CaptureRegistry
    #: asked to hand cached memory back when a create runs out (:mod:`~kvvmm.arena.reclaim`)
    _releaser: CacheReleaser | None
    _reclaim: ReclaimStats = ReclaimStats()  # frozen: replaced, never changed in place

    # -- basics -------------------------------------------------------------------------

    def _note(self, op: str, **args: Any) -> None:
        if self._trace is not None:
            self._trace.add_op(self._arena_id, op, **args)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"arena {self.name!r}: {what} after close()")
        if self._sleeping is not None and what in _AWAKE_ONLY:
            raise AsleepError(f"arena {self.name!r}: {what} while asleep (its mappings were "
                              f"given back by sleep()); call wake() first")

    def _alloc_at(self, offset: object) -> _Alloc:
        if not is_int(offset):
            raise ArgumentError("offset", offset, "an int (bytes from the arena base)")
        a = self._by_offset.get(offset)
        if a is None:
            starts = [x.offset for x in self._allocs]
            cls = AlignmentError if offset % self.granularity else OutOfRangeError
            raise cls("offset", offset, f"the start of an allocation, one of {starts[:8]}"
                      + ("..." if len(starts) > 8 else ""))
        return a

    # -- backing ------------------------------------------------------------------------

    def _check_range(self, what: str, offset: object, start: object,
                     nbytes: object) -> tuple[_Alloc, int, int]:
        """A granule-aligned ``[start, start + nbytes)`` inside the allocation at ``offset``."""
        a = self._alloc_at(offset)
        g = self.granularity
        if (type(start) is int and type(nbytes) is int and 0 <= start <= a.size
                and 0 <= nbytes <= a.size - start and not start % g and not nbytes % g):
            return a, start, start + nbytes  # the usual case, checked without messages
        int_arg("start", start, lo=0, hi=a.size,
                limit=f"in [0, {a.size}] (allocation {a.name!r} is {a.size} bytes)")
        assert isinstance(start, int)
        room = a.size - start
        int_arg("nbytes", nbytes, lo=0, hi=room,
                limit=f"in [0, {room}] (allocation {a.name!r} has {room} bytes from start "
                      f"{start})")
        assert isinstance(nbytes, int)
        for name, v in (("start", start), ("nbytes", nbytes)):
            if v % g:
                raise AlignmentError(name, v, f"a multiple of the granularity {g} ({what} "
                                              f"takes granule-aligned ranges)")
        return a, start, start + nbytes

    def _gaps(self, a: _Alloc, lo: int, hi: int) -> list[tuple[int, int]]:
        """Unbacked ``[s, e)`` (allocation-relative) inside ``[lo, hi)``, in order; a
        bisection finds where to start, so the cost does not grow with the mappings."""
        out: list[tuple[int, int]] = []
        pos = lo
        maps = a.maps
        if maps:  # the backed prefix holds no gap: start past it (O(1) when it has no hole)
            pos = max(lo, min(_prefix(a), hi))
        i = max(0, bisect.bisect_right(maps, a.offset + pos, key=_map_offset) - 1)
        for j in range(i, len(maps)):
            m = maps[j]
            ms, me = m.offset - a.offset, m.offset - a.offset + m.size
            if me <= pos:
                continue
            if ms >= hi:
                break
            if ms > pos:
                out.append((pos, ms))
            pos = max(pos, me)
            if pos >= hi:
                break
        if pos < hi:
            out.append((pos, hi))
        return out

    def _new_handle(self, size: int) -> int:
        """A handle of ``size``: the pool's if it holds one, else a create. Out of memory,
        the pool is trimmed and the create tried once more, then the cache releaser is asked
        (:meth:`_create_after_release`)."""
        pool = self._handle_pool
        if pool is not None:
            h = pool.take(size, self.pool_tag)
            if h is not None:
                return h
        try:
            return self.driver.create(size)
        except DriverOutOfMemoryError as e:
            if pool is None or not pool.trim(size):
                return self._create_after_release(size, e)
        try:
            return self.driver.create(size)
        except DriverOutOfMemoryError as e:
            return self._create_after_release(size, e)

    def _create_after_release(self, size: int, err: DriverOutOfMemoryError) -> int:
        """After a create ran out of memory: ask the cache releaser to hand back what it
        holds free and, if it freed something, try once more; else re-raise ``err``."""
        from dataclasses import replace

        releaser = self._releaser
        if releaser is None:
            raise err
        freed = max(0, releaser.release_cached(size))
        with self._lock:  # the look-ahead makes handles with the lock free: count under it
            st = self._reclaim
            self._reclaim = replace(st, releases=st.releases + 1,
                                    released_bytes=st.released_bytes + freed,
                                    retries=st.retries + (freed > 0))
        if not freed:
            raise err
        try:
            h = self.driver.create(size)
        except DriverOutOfMemoryError as again:
            with self._lock:
                st = self._reclaim
                self._reclaim = replace(st, retries_failed=st.retries_failed + 1)
            again.add_note(f"arena {self.name!r}: tried once more after the cache released "
                           f"{freed} bytes; still out of memory")
            raise
        log.info("arena %r: a create of %d bytes succeeded after the cache released %d "
                 "bytes", self.name, size, freed)
        return h

    @property
    def reclaim_stats(self) -> ReclaimStats:
        """What this arena's out-of-memory retries did (releases asked, bytes, retries)."""
        return self._reclaim

    def _back_gap(self, a: _Alloc, s: int, e: int, undo: Transaction,
                  new: list[_Map] | None = None) -> int:
        """Back ``[s, e)`` of ``a`` (unbacked, aligned) with one new handle; push undo steps
        (``new`` collects the mapping made)."""
        d = self.driver
        size = e - s
        va = self.base + a.offset + s
        h = self._new_handle(size)
        undo.push(f"release(handle={h})", self._drop_handle, h, size)
        d.map(va, size, h)
        undo.push(f"unmap(va={va:#x}, size={size})", d.unmap, va, size)
        self._set_access(va, size)
        m = _Map(a.offset + s, size, h, 0)
        _insert(a, m)
        if new is not None:
            new.append(m)

        def forget() -> None:
            a.maps.remove(m)
            a.backed -= size

        undo.push("forget", forget)
        return size

    def _unpooled(self, gone: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Give what the pool keeps to it; return the handles left to release (an adopted
        handle is always released: it was never this arena's to reuse)."""
        pool, adopted = self._handle_pool, self._adopted
        out = []
        for h, s in gone:
            if h in adopted:
                adopted.discard(h)
                out.append((h, s))
            elif pool is None or not pool.give(h, s, self.pool_tag):
                out.append((h, s))
        return out

    def _drop_handle(self, h: int, size: int) -> None:
        """An unmapped handle goes back to the pool (up to its cap) or to the driver."""
        pool = self._handle_pool
        if pool is None or not pool.give(h, size, self.pool_tag):
            self.driver.release(h)

    def _wait_inflight(self, ranges: Sequence[tuple[_Alloc, int, int]]) -> None:
        """Wait (the lock released) while the pool's thread backs part of ``ranges`` (backing
        it here too would map over it)."""
        while self._inflight and any(
            _overlaps(self._inflight.get(a.offset, ()), lo, hi) for a, lo, hi in ranges
        ):
            self._cond.wait(timeout=1.0)
            self.inflight_waits += 1

    def _commit_ranges(self, plan: Sequence[tuple[_Alloc, int, int]], op: str) -> int:
        self._wait_inflight(plan)
        if self._captures.fixed:  # before any driver call: a capacity a capture baked in
            base = self.base
            self._captures.check_grow(
                [(base + a.offset + s, base + a.offset + e)
                 for a, lo, hi in plan for s, e in self._gaps(a, lo, hi)],
                [(base + a.offset, base + a.offset + a.size) for a, _, _ in plan])
        undo = Transaction()
        added = 0
        first: dict[int, int] = {}  # id(allocation) -> its first place in the plan
        new: list[tuple[int, _Map]] = []
        try:
            for a, lo, hi in plan:
                place = first.setdefault(id(a), len(first))
                made: list[_Map] = []
                for s, e in self._gaps(a, lo, hi):
                    added += self._back_gap(a, s, e, undo, made)
                new += [(place, m) for m in made]
        except BaseException as e:  # a driver's OSError or a Ctrl-C must not leak handles
            undo.unwind(e)
            raise
        # Ids in plan order, then by offset: the same on replay.
        for _, m in sorted(new, key=lambda pm: (pm[0], pm[1].offset)):
            m.hid = self._next_hid
            self._next_hid += 1
        if self._work is not None:
            self._work("arena.commit", len(new))
        if self._trace is not None:
            for a, lo, hi in plan:
                if op == "commit":
                    self._note("commit", offset=a.offset, nbytes=hi)
                else:
                    self._note(op, offset=a.offset, start=lo, nbytes=hi - lo)
        return added

    # -- giving back --------------------------------------------------------------------

    def _give_back(self, plan: Sequence[tuple[_Alloc, list[_Map]]],
                   op: str = "decommit") -> dict[int, int]:
        """Unmap ``plan``'s mappings (sorted per allocation), one unmap per run; forget them.

        A failed unmap maps every run unmapped before it back. The handles wait in ``_gone``
        for :meth:`_release_gone`. Every unmap passes here, so a live capture refuses it
        here (``op`` names the operation), before the first driver call.
        """
        if self._captures:
            base = self.base
            self._captures.check_unmap(op, [(base + r[0].offset,
                                             base + r[-1].offset + r[-1].size)
                                            for _a, ms in plan for r in _runs(ms)])
        d = self.driver
        undo = Transaction()
        try:
            for a, ms in plan:
                for run in _runs(ms):
                    start, end = run[0].offset, run[-1].offset + run[-1].size
                    d.unmap(self.base + start, end - start)
                    for m in run:
                        undo.push(f"map back handle {m.hid} at offset {m.offset}",
                                  self._map_back_or_forget, a, m)
        except BaseException as e:  # a Ctrl-C between unmaps must not lose the bytes either
            undo.unwind(e)
            raise
        undo.commit()
        given: dict[int, int] = {}
        for a, ms in plan:
            _discard(a, ms)
            size = sum(m.size for m in ms)
            a.backed -= size
            given[a.offset] = given.get(a.offset, 0) + size
            self._gone += [(m.handle, m.size) for m in ms]
        if self._work is not None:
            self._work("arena.decommit", sum(len(ms) for _, ms in plan))
        return given

    def _release_gone(self) -> None:
        """Past the point of no return: the VA no longer reaches these handles."""
        gone, self._gone = self._gone, []
        gone = self._unpooled(gone)  # retained for the next commit: two maps, not create+release
        self._leftover += gone
        if gone:
            self._release_leftover("decommit or close again to retry")

    def _map_back(self, m: _Map) -> None:
        """Map a handle back where it was (undo of an unmap: the handle kept its bytes)."""
        self.driver.map(self.base + m.offset, m.size, m.handle)
        self._set_access(self.base + m.offset, m.size)

    def _map_back_or_forget(self, a: _Alloc, m: _Map) -> None:
        """Undo one unmap of :meth:`_give_back`; where it fails, forget the mapping (the
        books never list VA the driver does not map) and keep its handle for release."""
        try:
            self.driver.map(self.base + m.offset, m.size, m.handle)
        except BaseException:
            self._forget(a, m)
            raise
        try:
            self._set_access(self.base + m.offset, m.size)
        except BaseException:
            try:  # mapped but unreachable: take it off again so the books stay true
                self.driver.unmap(self.base + m.offset, m.size)
            except Exception as e:  # still mapped: the books keep it, and say so
                e.add_note(f"handle {m.hid} stays mapped at offset {m.offset} without access")
                raise
            self._forget(a, m)
            raise

    def _forget(self, a: _Alloc, m: _Map) -> None:
        """Take a mapping the driver no longer has out of the books; keep its handle."""
        _discard(a, [m])
        a.backed -= m.size
        self._leftover.append((m.handle, m.size))

    @property
    def unreleased_bytes(self) -> int:
        """Memory of handles a failed release left with the arena (0 normally)."""
        return sum(size for _, size in self._leftover)

    def _set_access(self, va: int, size: int) -> None:
        if self._access is None:
            self.driver.set_access(va, size)
        else:
            self.driver.set_access(va, size, self._access)

    def _release_leftover(self, retry: str = "call close() again to release them") -> None:
        while self._leftover:
            h, _ = self._leftover[0]
            try:
                self.driver.release(h)
            except DriverError as e:
                e.add_note(f"arena {self.name!r} still holds {len(self._leftover)} handles "
                           f"({self.unreleased_bytes} bytes) it could not release; {retry}")
                raise
            self._leftover.pop(0)

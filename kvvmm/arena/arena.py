"""Arena: one VA reservation, bump allocation, commit/decommit, tensors over the VA.

An arena reserves VA once, hands out granularity-aligned pieces of it (``allocate``), and
backs each piece from its start as far as asked (``commit``), one whole handle per
extension. ``decommit`` gives back whole mappings beyond a kept prefix. Every multi-step
change is a transaction: if any driver call fails, the calls before it are undone, nothing
leaks, the snapshot is as it was, and the error is re-raised with any failure of the undo
attached as a note.

Tensors over the VA need no compilation: ``meta`` tensors on the simulator, ``frombuffer``
over host memory, DLPack over device memory. A tensor keeps its arena alive, and ``close()``
never unmaps memory that a live tensor can reach: it waits for the last one to go.

Several devices: ``grant_access(devices)`` lets peers (other GPUs of the process) read and
write what the arena backs, now and in every later commit; ``tensor(..., device=peer)`` is
the peer's view of the same VA. Between processes: ``export_handles(offset)`` gives POSIX
file descriptors for an allocation's handles, and another process backs an allocation of its
own arena with them (``driver.import_handle`` then ``adopt``).
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from kvvmm.arena.transaction import Transaction
from kvvmm.arena.views import ViewLease, make_tensor
from kvvmm.checks import int_arg
from kvvmm.driver.base import Driver, MemoryKind
from kvvmm.dtypes import dtype_itemsize, dtype_name
from kvvmm.errors import (
    AlignmentError,
    ArgumentError,
    ClosedError,
    DriverError,
    DriverOutOfMemoryError,
    DriverUnavailableError,
    KvvmmError,
    OutOfRangeError,
    ReservationExhaustedError,
)
from kvvmm.record.trace import Trace
from kvvmm.snapshot import AllocationInfo, ArenaSnapshot, MappingInfo
from kvvmm.units import align_up, fmt_bytes, fmt_range

if TYPE_CHECKING:
    import torch

    from kvvmm.arena.pool import HandlePool

__all__ = ["MAX_RESERVE_BYTES", "Arena", "DecommitResult", "RangeResult"]

#: The most VA one arena may reserve: 2**48 bytes (256 TiB). CUDA's VA space on Hopper and
#: Blackwell is 49 bits (part of it taken by the process's other mappings) and x86-64 user
#: space is 47 bits, so no driver could give more; asking for more is a layout bug (a token
#: count off by orders of magnitude), refused before the driver is asked.
MAX_RESERVE_BYTES = 1 << 48

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(fn: Callable[Concatenate[Arena, _P], _R]) -> Callable[Concatenate[Arena, _P], _R]:
    """Run an arena method under the arena's lock.

    Arenas are touched from more than one thread: torch calls the pool's allocator from the
    allocating thread, and a tensor's last reference can go (and end a view) on any thread.
    """

    @functools.wraps(fn)
    def wrapper(self: Arena, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return fn(self, *args, **kwargs)

    return wrapper


def check_driver(driver: object, name: str = "driver") -> None:
    """Refuse what is not a driver object (None, a kind's name) before it is first called.

    Raises:
        ArgumentError: naming ``name``; a kind's name gets the hint to open it first.
    """
    if isinstance(driver, Driver):
        return
    hint = (f"; open it first: kvvmm.open_driver({driver!r})"
            if driver in ("auto", "sim", "host", "cuda") else "")
    raise ArgumentError(name, driver, f"a driver object (SimDriver, HostDriver, CudaDriver, "
                                      f"or a wrapper of one){hint}")


# -- live state --------------------------------------------------------------------------


@dataclass(slots=True)
class _Map:
    offset: int
    size: int
    handle: int  # the driver's handle
    hid: int  # the arena's id for it


@dataclass(slots=True)
class _Alloc:
    name: str
    offset: int
    size: int
    requested: int
    backed: int = 0  # bytes backed in the allocation (holes not counted)
    maps: list[_Map] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DecommitResult:
    """What one decommit did to one allocation (a record: nothing live).

    Maps are whole handles, so a decommit gives back only the mappings that lie wholly at or
    beyond ``keep_bytes``; the mapping that straddles it stays, and with it more than was
    asked to stay. ``given_bytes == 0`` with a ``kept_mapping`` is the silent no-op the lab
    must be able to explain: that mapping is the boundary that stopped it.
    """

    name: str  #: the allocation's name
    offset: int  #: the allocation's offset from the arena base
    keep_bytes: int  #: bytes asked to stay backed from the allocation's start
    given_bytes: int  #: bytes given back (unmapped and released)
    backed_bytes: int  #: bytes backed from the allocation's start afterwards
    #: ``[start, end)`` (from the arena base) of the mapping that straddles ``keep_bytes`` and
    #: so stayed; None when the backing now ends at or before ``keep_bytes``
    kept_mapping: tuple[int, int] | None

    @property
    def held_bytes(self) -> int:
        """Bytes that stayed backed beyond ``keep_bytes`` because a mapping straddles it."""
        return max(self.backed_bytes - self.keep_bytes, 0)

    def __str__(self) -> str:
        text = f"{self.name}: gave back {fmt_bytes(self.given_bytes)}"
        if self.kept_mapping is not None:
            start, end = self.kept_mapping
            text += (f"; the mapping {fmt_range(start, end)} straddles keep "
                     f"{fmt_bytes(self.keep_bytes)}, so {fmt_bytes(self.held_bytes)} beyond it "
                     f"stays backed (maps are whole handles)")
        return text


@dataclass(frozen=True, slots=True)
class RangeResult:
    """What one range decommit did to one allocation (a record: nothing live).

    Maps are whole handles, so only the mappings lying wholly inside the range go; those it
    cuts stay, and ``kept_mappings`` names each (``[start, end)`` from the arena base), as
    :class:`DecommitResult` names the mapping that straddles a kept prefix.
    """

    name: str  #: the allocation's name
    offset: int  #: the allocation's offset from the arena base
    start: int  #: the range's start, from the allocation's start
    nbytes: int  #: the range's length
    given_bytes: int  #: bytes given back (unmapped and released)
    backed_bytes: int  #: bytes backed in the allocation afterwards (holes not counted)
    kept_mappings: tuple[tuple[int, int], ...]  #: mappings the range cuts, which stayed

    @property
    def held_bytes(self) -> int:
        """Bytes of the range that stayed backed because a mapping it cuts stays."""
        lo, hi = self.offset + self.start, self.offset + self.start + self.nbytes
        return sum(min(e, hi) - max(s, lo) for s, e in self.kept_mappings)

    def __str__(self) -> str:
        text = (f"{self.name}: gave back {fmt_bytes(self.given_bytes)} of "
                f"{fmt_range(self.offset + self.start, self.offset + self.start + self.nbytes)}")
        if self.kept_mappings:
            s, e = self.kept_mappings[0]
            text += (f"; {len(self.kept_mappings)} mapping(s) the range cuts stay (first "
                     f"{fmt_range(s, e)}), {fmt_bytes(self.held_bytes)} of the range with them "
                     f"(maps are whole handles)")
        return text


def _insert(a: _Alloc, m: _Map) -> None:
    """Put ``m`` among ``a``'s mappings, kept sorted by offset."""
    i = bisect.bisect_left([x.offset for x in a.maps], m.offset)
    a.maps.insert(i, m)
    a.backed += m.size


def _overlaps(ranges: Iterable[tuple[int, int]], lo: int, hi: int) -> bool:
    return any(s < hi and lo < e for s, e in ranges)


def _runs(ms: Sequence[_Map]) -> list[list[_Map]]:
    """``ms`` (sorted) split into runs of adjacent mappings."""
    out: list[list[_Map]] = []
    for m in ms:
        if out and out[-1][-1].offset + out[-1][-1].size == m.offset:
            out[-1].append(m)
        else:
            out.append([m])
    return out


def _prefix(a: _Alloc) -> int:
    """Bytes backed contiguously from ``a``'s start."""
    end = a.offset
    for m in a.maps:
        if m.offset != end:
            break
        end += m.size
    return end - a.offset


class Arena:
    """One VA reservation with bump allocation, commit/decommit and tensor views.

    Args:
        driver: any :class:`~kvvmm.driver.base.Driver`.
        reserve_bytes: VA to reserve (rounded up to the granularity); costs no memory.
        device: device ordinal for tensors (default: the driver's).
        name: shown in snapshots, plots and errors.
        trace: a :class:`~kvvmm.record.Trace` to record the arena's operations in (open,
            allocate, commit, ...), next to the driver calls a ``TracingDriver`` records
            there; :func:`kvvmm.replay.replay_arenas` rebuilds the arena from it.
        pool: a :class:`~kvvmm.arena.pool.HandlePool` of the same driver: commits take
            handles from it (and only map), decommits give handles back to it (up to its
            cap), an out-of-memory create draws it down first. None: create and release.
    Raises:
        ArgumentError: ``driver`` not a driver, or ``reserve_bytes`` not a positive int.
        OutOfRangeError: ``reserve_bytes`` above :data:`MAX_RESERVE_BYTES`; nothing reserved.
        DriverError: the reservation failed.
    """

    def __init__(
        self, driver: Driver, *, reserve_bytes: int, device: int | None = None,
        name: str = "arena", trace: Trace | None = None, pool: HandlePool | None = None,
    ) -> None:
        check_driver(driver)
        int_arg("reserve_bytes", reserve_bytes, lo=1, hi=MAX_RESERVE_BYTES,
                limit=f"an int > 0 and <= {MAX_RESERVE_BYTES} (bytes; 256 TiB, more VA "
                      f"than any device addresses)")
        if device is not None and device != driver.device:
            raise ArgumentError("device", device, f"the driver's device {driver.device}")
        self._lock = threading.RLock()
        # Signalled when the pool's thread publishes (or drops) a range it backed outside
        # the lock; a commit or decommit that needs that range waits on it.
        self._cond = threading.Condition(self._lock)
        if pool is not None and getattr(pool, "driver", None) is not driver:
            raise ArgumentError("pool", pool, "a HandlePool of this arena's driver")
        self._handle_pool: HandlePool | None = pool
        # allocation offset -> [start, end) (allocation-relative) the pool's thread is backing
        self._inflight: dict[int, list[tuple[int, int]]] = {}
        self.inflight_waits = 0  #: times a commit or decommit waited for an in-flight range
        self._gone: list[tuple[int, int]] = []  # unmapped handles a decommit is releasing
        self.driver = driver
        self.name = str(name)
        self.device = driver.device
        self.granularity = driver.granularity()
        self.reserved_bytes = align_up(reserve_bytes, self.granularity)
        self.base = driver.reserve(self.reserved_bytes, self.granularity)
        self.cursor_bytes = 0
        self._allocs: list[_Alloc] = []
        self._by_offset: dict[int, _Alloc] = {}
        self._names: set[str] = set()  # allocation names, for the uniqueness check
        self._next_hid = 1
        self._closed = False
        self._released = False  # VA freed (teardown done)
        self._views = 0
        # (handle, size) of handles a failed release left with the arena (close or decommit):
        # their VA is already unmapped, so only a later release can give the memory back.
        self._leftover: list[tuple[int, int]] = []
        self._pool: Any = None
        self._dropping_pool = False
        # Devices that get access at each commit; None: the driver's own only (the default
        # call, kept as it was: no device list on the hot path).
        self._access: tuple[int, ...] | None = None
        if trace is not None and not isinstance(trace, Trace):
            raise ArgumentError("trace", trace, "a kvvmm.record.Trace or None")
        self._trace = trace
        self._arena_id = trace.open_arena() if trace is not None else -1
        self._note("open", name=self.name, reserve_bytes=self.reserved_bytes, base=self.base)

    # -- basics -------------------------------------------------------------------------

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"Arena({self.name!r}, {fmt_bytes(self.reserved_bytes)} at "
                f"{fmt_range(self.base, self.base + self.reserved_bytes)}, "
                f"{fmt_bytes(self.backed_bytes)} backed, {state})")

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called (memory may wait for live tensors to go)."""
        return self._closed

    @property
    def released(self) -> bool:
        """True once the reservation and all its memory were given back to the driver."""
        return self._released

    @property
    def live_views(self) -> int:
        """Tensors (and their views) made by :meth:`tensor` that are still alive."""
        return self._views

    @property
    def backed_bytes(self) -> int:
        return sum(a.backed for a in self._allocs)

    def _note(self, op: str, **args: Any) -> None:
        if self._trace is not None:
            self._trace.add_op(self._arena_id, op, **args)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"arena {self.name!r}: {what} after close()")

    def _alloc_at(self, offset: object) -> _Alloc:
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise ArgumentError("offset", offset, "an int (bytes from the arena base)")
        a = self._by_offset.get(offset)
        if a is None:
            starts = [x.offset for x in self._allocs]
            cls = AlignmentError if offset % self.granularity else OutOfRangeError
            raise cls("offset", offset, f"the start of an allocation, one of {starts[:8]}"
                      + ("..." if len(starts) > 8 else ""))
        return a

    def backed_of(self, offset: int) -> int:
        """Bytes backed in the allocation at ``offset`` (holes not counted)."""
        return self._alloc_at(offset).backed

    def prefix_of(self, offset: int) -> int:
        """Bytes backed contiguously from the start of the allocation at ``offset``."""
        return _prefix(self._alloc_at(offset))

    def mappings_of(self, offset: int) -> list[tuple[int, int]]:
        """``[(start, end), ...]`` of the allocation's mappings, allocation-relative, sorted."""
        a = self._alloc_at(offset)
        return [(m.offset - a.offset, m.offset - a.offset + m.size) for m in a.maps]

    @property
    def handle_pool(self) -> HandlePool | None:
        """The :class:`~kvvmm.arena.pool.HandlePool` commits draw from, if any."""
        return self._handle_pool

    # -- allocate -----------------------------------------------------------------------

    @_locked
    def allocate(self, nbytes: int, name: str | None = None) -> int:
        """Claim ``nbytes`` of the reservation (rounded up to the granularity).

        Args:
            nbytes: bytes, > 0.
            name: shown in snapshots (default ``"alloc<i>"``); must be unique.
        Returns:
            The allocation's offset from the arena base (granularity-aligned).
        Raises:
            ArgumentError: ``nbytes`` not a positive int, or ``name`` already used.
            ReservationExhaustedError: not enough reservation left.
            ClosedError: after ``close()``.
        """
        self._check_open("allocate")
        int_arg("nbytes", nbytes, lo=1, limit="an int > 0 (bytes)")
        size = align_up(nbytes, self.granularity)
        left = self.reserved_bytes - self.cursor_bytes
        if size > left:
            raise ReservationExhaustedError(
                f"arena {self.name!r}: allocate({nbytes}) needs {size} bytes "
                f"({fmt_bytes(size)}) but only {left} of {self.reserved_bytes} reserved bytes "
                f"are left; reserve more VA (it costs no memory)"
            )
        label = f"alloc{len(self._allocs)}" if name is None else str(name)
        if label in self._names:
            raise ArgumentError("name", label, "unique within the arena")
        a = _Alloc(label, self.cursor_bytes, size, nbytes)
        self._allocs.append(a)
        self._names.add(label)
        self._by_offset[a.offset] = a
        self.cursor_bytes += size
        self._note("allocate", name=label, nbytes=nbytes, offset=a.offset)
        return a.offset

    # -- commit -------------------------------------------------------------------------

    def _check_commit(self, offset: object, nbytes: object) -> tuple[_Alloc, int]:
        a = self._alloc_at(offset)
        int_arg("nbytes", nbytes, lo=0, hi=a.size,
             limit=f"in [0, {a.size}] (allocation {a.name!r} is {a.size} bytes)")
        assert isinstance(nbytes, int)
        return a, align_up(nbytes, self.granularity)

    def _check_range(self, what: str, offset: object, start: object,
                     nbytes: object) -> tuple[_Alloc, int, int]:
        """A granule-aligned ``[start, start + nbytes)`` inside the allocation at ``offset``."""
        a = self._alloc_at(offset)
        int_arg("start", start, lo=0, hi=a.size,
                limit=f"in [0, {a.size}] (allocation {a.name!r} is {a.size} bytes)")
        assert isinstance(start, int)
        room = a.size - start
        int_arg("nbytes", nbytes, lo=0, hi=room,
                limit=f"in [0, {room}] (allocation {a.name!r} has {room} bytes from start "
                      f"{start})")
        assert isinstance(nbytes, int)
        g = self.granularity
        for name, v in (("start", start), ("nbytes", nbytes)):
            if v % g:
                raise AlignmentError(name, v, f"a multiple of the granularity {g} ({what} "
                                              f"takes granule-aligned ranges)")
        return a, start, start + nbytes

    def _gaps(self, a: _Alloc, lo: int, hi: int) -> list[tuple[int, int]]:
        """Unbacked ``[s, e)`` (allocation-relative) inside ``[lo, hi)``, in order."""
        out: list[tuple[int, int]] = []
        pos = lo
        for m in a.maps:
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
        """A handle of ``size``: the pool's if it holds one, else a create.

        Memory pressure: an out-of-memory create draws the pool down first (its idle
        handles are memory nobody maps) and is tried once more.
        """
        pool = self._handle_pool
        if pool is not None:
            h = pool.take(size)
            if h is not None:
                return h
        try:
            return self.driver.create(size)
        except DriverOutOfMemoryError:
            if pool is None or not pool.trim(size):
                raise
            return self.driver.create(size)

    def _back_gap(self, a: _Alloc, s: int, e: int, undo: Transaction) -> int:
        """Back ``[s, e)`` of ``a`` (unbacked, aligned) with one new handle; push undo steps."""
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

        def forget() -> None:
            a.maps.remove(m)
            a.backed -= size

        undo.push("forget", forget)
        return size

    def _drop_handle(self, h: int, size: int) -> None:
        """An unmapped handle goes back to the pool (up to its cap) or to the driver."""
        pool = self._handle_pool
        if pool is None or not pool.give(h, size):
            self.driver.release(h)

    def _wait_inflight(self, ranges: Sequence[tuple[_Alloc, int, int]]) -> None:
        """Wait (the lock released) while the pool's thread backs part of ``ranges``.

        Its driver calls run outside the arena's lock, so the range is booked "in flight"
        until it publishes; backing it here too would map over it.
        """
        while self._inflight and any(
            _overlaps(self._inflight.get(a.offset, ()), lo, hi) for a, lo, hi in ranges
        ):
            self._cond.wait(timeout=1.0)
            self.inflight_waits += 1

    def _commit_ranges(self, plan: Sequence[tuple[_Alloc, int, int]], op: str) -> int:
        self._wait_inflight(plan)
        undo = Transaction()
        added = 0
        try:
            for a, lo, hi in plan:
                for s, e in self._gaps(a, lo, hi):
                    added += self._back_gap(a, s, e, undo)
        except BaseException as e:  # a driver's OSError or a Ctrl-C must not leak handles
            undo.unwind(e)
            raise
        for a, _, _ in plan:  # ids only for handles that stayed: the same on replay
            for m in a.maps:
                if m.hid == 0:
                    m.hid = self._next_hid
                    self._next_hid += 1
        if self._trace is not None:
            for a, lo, hi in plan:
                if op == "commit":
                    self._note("commit", offset=a.offset, nbytes=hi)
                else:
                    self._note(op, offset=a.offset, start=lo, nbytes=hi - lo)
        return added

    def commit(self, offset: int, nbytes: int) -> int:
        """Back the first ``nbytes`` of the allocation at ``offset``.

        Backing only grows: asking for less than is backed does nothing. Every hole in
        ``[0, nbytes)`` gets one new handle (with no holes: one handle after the backed
        prefix, as always).

        Args:
            offset: an allocation's offset (from :meth:`allocate`).
            nbytes: bytes that must be backed from its start, in ``[0, its size]``;
                rounded up to the granularity.
        Returns:
            Bytes newly backed (0 if already enough).
        Raises:
            ArgumentError, OutOfRangeError: bad offset or size; nothing changed.
            DriverError: a driver call failed; everything this call did is undone.
        """
        return self.commit_many([(offset, nbytes)])

    @_locked
    def commit_many(self, requests: Iterable[tuple[int, int]]) -> int:
        """Commit several allocations as one transaction; see :meth:`commit`.

        Every request is checked before any driver call; if a call fails, the handles
        made for earlier requests are unmapped and released again.
        """
        self._check_open("commit")
        plan = [(a, 0, n) for a, n in (self._check_commit(o, n) for o, n in requests)]
        return self._commit_ranges(plan, "commit")

    def commit_range(self, offset: int, start: int, nbytes: int) -> int:
        """Back ``[start, start + nbytes)`` of the allocation at ``offset``, holes allowed.

        What is already backed in the range stays; each unbacked gap in it gets one new
        handle (create, map, set access), so a later :meth:`decommit_range` of that same
        range can give it back whole.

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
        """Commit several ``(offset, start, nbytes)`` ranges as one transaction.

        Every range is checked before any driver call; a failure undoes every handle made.
        See :meth:`commit_range`.
        """
        self._check_open("commit_range")
        plan = [self._check_range("commit_range", o, s, n) for o, s, n in requests]
        return self._commit_ranges(plan, "commit_range")

    def prepare_ranges(self, requests: Iterable[tuple[int, int, int]]) -> int:
        """Back ranges ahead of need, making the driver calls with the arena's lock free.

        For a background thread (the handle pool's look-ahead): under the lock, each unbacked
        gap of the ranges that no one else is backing is booked "in flight"; with no lock
        held, each gets a handle (the pool's or a create), a map and access; under the lock
        again it is published as a mapping (recorded as a ``commit_range``). A commit or
        decommit that needs an in-flight gap waits for it (:attr:`inflight_waits` counts
        those waits). A gap that fails is undone (unmap, handle dropped) and stays unbacked;
        the others stand: a look-ahead is a hint, not a transaction.

        Returns:
            Bytes published. 0 after ``close()``.
        Raises:
            ArgumentError, OutOfRangeError, AlignmentError: bad ranges; nothing booked.
        """
        with self._lock:
            if self._closed:
                return 0
            plan = [self._check_range("prepare_ranges", o, s, n) for o, s, n in requests]
            booked: list[tuple[_Alloc, int, int]] = []
            for a, lo, hi in plan:
                mine = self._inflight.setdefault(a.offset, [])
                for s, e in self._gaps(a, lo, hi):
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

    def decommit(self, offset: int, keep_bytes: int) -> int:
        """Give back whole mappings of the allocation at ``offset`` beyond ``keep_bytes``.

        A mapping that straddles ``keep_bytes`` stays (maps are whole handles), so more
        than ``keep_bytes`` may stay backed, and a decommit may give back nothing at all:
        :meth:`decommit_report` says which mapping stopped it.

        Returns:
            Bytes given back.
        Raises:
            ArgumentError, OutOfRangeError: bad offset or size; nothing changed.
            DriverError: a driver call failed; see :meth:`decommit_many`.
        """
        return self.decommit_many([(offset, keep_bytes)])

    def decommit_report(self, offset: int, keep_bytes: int) -> DecommitResult:
        """:meth:`decommit`, returning what it did (bytes given back, the mapping kept)."""
        return self.decommit_many_report([(offset, keep_bytes)])[0]

    def decommit_many(self, requests: Iterable[tuple[int, int]]) -> int:
        """Decommit several allocations as one transaction; see :meth:`decommit_many_report`.

        Returns:
            Bytes given back in all.
        """
        return sum(r.given_bytes for r in self.decommit_many_report(requests))

    @_locked
    def decommit_many_report(
        self, requests: Iterable[tuple[int, int]]
    ) -> tuple[DecommitResult, ...]:
        """Decommit several allocations as one transaction and say what happened to each.

        Every request is checked before any driver call. Each run of adjacent dropped
        mappings is unmapped in one call first, and each unmap pushes its undo (map the same
        handles back, set access): the handles still hold the memory, so a failed unmap puts
        every byte back where it was. Only when every unmap succeeded are the handles
        released.

        A release cannot lose a byte anyone can still reach (the VA is already unmapped), but
        it can fail: then the decommit stands (the snapshot shows the mappings gone), the
        arena keeps the handles it could not release (:attr:`unreleased_bytes`) and retries
        them at the next decommit that gives something back and at :meth:`close`, and the
        error says so in a note.

        Args:
            requests: ``(offset, keep_bytes)`` pairs; ``keep_bytes`` in ``[0, size]``. An
                allocation named twice keeps the smaller of its two. Every mapping that
                starts at or beyond ``keep_bytes`` goes (holes included).
        Returns:
            One :class:`DecommitResult` per allocation, in the order first named.
        Raises:
            ArgumentError, OutOfRangeError: a bad request; nothing changed.
            DriverError: an unmap or a set access failed (every mapping and every byte is as
                it was), or a release failed after the unmaps (the decommit stands; see above).
            ClosedError: after ``close()``.
        """
        self._check_open("decommit")
        keep: dict[int, int] = {}  # offset -> smallest keep asked for it (one unmap each)
        for o, k in requests:
            a = self._alloc_at(o)
            int_arg("keep_bytes", k, lo=0, hi=a.size,
                 limit=f"in [0, {a.size}] (allocation {a.name!r} is {a.size} bytes)")
            keep[a.offset] = min(k, keep.get(a.offset, k))
        self._wait_inflight([(self._by_offset[o], k, self._by_offset[o].size)
                             for o, k in keep.items()])
        plan = [(a, [m for m in a.maps if m.offset - a.offset >= k])
                for a, k in ((self._by_offset[o], k) for o, k in keep.items())]
        given = self._give_back([(a, ms) for a, ms in plan if ms])
        for a, ms in plan:
            if ms:
                last = a.maps[-1].offset + a.maps[-1].size - a.offset if a.maps else 0
                self._note("decommit", offset=a.offset, keep_bytes=last)
        results = tuple(self._decommit_result(self._by_offset[o], k, given.get(o, 0))
                        for o, k in keep.items())
        self._release_gone()
        return results

    def decommit_range(self, offset: int, start: int, nbytes: int) -> int:
        """Give back the mappings that lie wholly inside ``[start, start + nbytes)``.

        Maps are whole handles: a mapping the range cuts (one that starts before it or ends
        after it) stays, as a mapping straddling ``keep_bytes`` stays in :meth:`decommit`;
        :meth:`decommit_range_report` names each one.

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

    def decommit_range_report(self, offset: int, start: int, nbytes: int) -> RangeResult:
        """:meth:`decommit_range`, returning what it did (see :class:`RangeResult`)."""
        return self.decommit_ranges_report([(offset, start, nbytes)])[0]

    def decommit_ranges(self, requests: Iterable[tuple[int, int, int]]) -> int:
        """Decommit several ``(offset, start, nbytes)`` ranges as one transaction.

        Returns:
            Bytes given back in all.
        """
        return sum(r.given_bytes for r in self.decommit_ranges_report(requests))

    @_locked
    def decommit_ranges_report(
        self, requests: Iterable[tuple[int, int, int]]
    ) -> tuple[RangeResult, ...]:
        """Decommit several ranges as one transaction; one :class:`RangeResult` per range.

        The transaction is :meth:`decommit_many_report`'s: every range checked first, every
        unmap undone if one fails, releases only after every unmap succeeded.
        """
        self._check_open("decommit_range")
        plan = [self._check_range("decommit_range", o, s, n) for o, s, n in requests]
        self._wait_inflight(plan)
        drop: dict[int, list[_Map]] = {}
        cut: list[tuple[tuple[int, int], ...]] = []
        inside: list[list[_Map]] = []
        for a, lo, hi in plan:
            lo_abs, hi_abs = a.offset + lo, a.offset + hi
            mine = [m for m in a.maps if m.offset >= lo_abs and m.offset + m.size <= hi_abs]
            cut.append(tuple((m.offset, m.offset + m.size) for m in a.maps
                             if m.offset < hi_abs and m.offset + m.size > lo_abs
                             and not (m.offset >= lo_abs and m.offset + m.size <= hi_abs)))
            inside.append(mine)
            got = drop.setdefault(a.offset, [])
            got += [m for m in mine if all(m is not x for x in got)]
        self._give_back([(self._by_offset[o], sorted(ms, key=lambda m: m.offset))
                         for o, ms in drop.items() if ms])
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

    def _give_back(self, plan: Sequence[tuple[_Alloc, list[_Map]]]) -> dict[int, int]:
        """Unmap ``plan``'s mappings (sorted per allocation) in runs; forget them.

        One unmap per run of adjacent mappings (CUDA unmaps several whole mappings in one
        call). A failed unmap maps every run unmapped before it back (same handles, same
        bytes). The handles wait in ``_gone`` for :meth:`_release_gone`.
        """
        d = self.driver
        undo = Transaction()
        try:
            for _a, ms in plan:
                for run in _runs(ms):
                    start, end = run[0].offset, run[-1].offset + run[-1].size
                    d.unmap(self.base + start, end - start)
                    for m in run:
                        undo.push(f"map back handle {m.hid} at offset {m.offset}",
                                  self._map_back, m)
        except BaseException as e:  # a Ctrl-C between unmaps must not lose the bytes either
            undo.unwind(e)
            raise
        undo.commit()
        given: dict[int, int] = {}
        for a, ms in plan:
            gone = {id(m) for m in ms}
            a.maps = [m for m in a.maps if id(m) not in gone]
            size = sum(m.size for m in ms)
            a.backed -= size
            given[a.offset] = given.get(a.offset, 0) + size
            self._gone += [(m.handle, m.size) for m in ms]
        return given

    def _release_gone(self) -> None:
        """Past the point of no return: the VA no longer reaches these handles."""
        gone, self._gone = self._gone, []
        pool = self._handle_pool
        if pool is not None:  # retained for the next commit: two map calls, not create+release
            gone = [(h, s) for h, s in gone if not pool.give(h, s)]
        self._leftover += gone
        if gone:
            self._release_leftover("decommit or close again to retry")

    def _decommit_result(self, a: _Alloc, keep_bytes: int, given: int) -> DecommitResult:
        kept: tuple[int, int] | None = None
        straddle = [m for m in a.maps
                    if m.offset - a.offset < keep_bytes < m.offset - a.offset + m.size]
        if straddle:
            last = straddle[0]  # the mapping that straddles keep_bytes
            kept = (last.offset, last.offset + last.size)
        end = a.maps[-1].offset + a.maps[-1].size - a.offset if a.maps else 0
        return DecommitResult(name=a.name, offset=a.offset, keep_bytes=keep_bytes,
                              given_bytes=given, backed_bytes=end, kept_mapping=kept)

    def _map_back(self, m: _Map) -> None:
        """Map a handle back where it was (undo of an unmap: the handle kept its bytes)."""
        self.driver.map(self.base + m.offset, m.size, m.handle)
        self._set_access(self.base + m.offset, m.size)

    @property
    def unreleased_bytes(self) -> int:
        """Memory of handles a failed release left with the arena (0 normally)."""
        return sum(size for _, size in self._leftover)

    # -- several devices and processes -----------------------------------------------

    def _set_access(self, va: int, size: int) -> None:
        if self._access is None:
            self.driver.set_access(va, size)
        else:
            self.driver.set_access(va, size, self._access)

    @property
    def peer_devices(self) -> tuple[int, ...]:
        """Other devices given access by :meth:`grant_access` (empty: only the arena's)."""
        return () if self._access is None else self._access[1:]

    @_locked
    def grant_access(self, devices: Iterable[int]) -> None:
        """Let other devices (peers) read and write all the arena backs, now and later.

        Every backed allocation gets access for the arena's device and ``devices`` (one
        ``set_access(..., devices=...)`` per allocation), and every later commit maps with
        the same access. Access is only ever widened.

        Args:
            devices: device ordinals (the arena's own may be among them).
        Raises:
            ArgumentError: ``devices`` not ints.
            DriverError: the driver refused (CUDA_ERROR_INVALID_VALUE: not a device of the
                process; CUDA_ERROR_INVALID_DEVICE: no peer path to this device). The arena's
                record is unchanged;
                allocations granted before the failing call stay accessible to the peers
                (access cannot be narrowed here). With nothing backed yet, a bad device is
                only seen at the next commit, which then fails and is undone.
            ClosedError: after ``close()``.
        """
        self._check_open("grant_access")
        extra = list(devices)
        for i, dev in enumerate(extra):
            int_arg(f"devices[{i}]", dev, lo=0, limit="a device ordinal (an int >= 0)")
        new = tuple(dict.fromkeys((self.device, *self.peer_devices, *extra)))
        if len(new) == 1:
            return
        d = self.driver
        for a in self._allocs:  # one call per run of adjacent mappings (holes are not mapped)
            for run in _runs(a.maps):
                start, end = run[0].offset, run[-1].offset + run[-1].size
                d.set_access(self.base + start, end - start, new)
        self._access = new
        self._note("grant_access", devices=list(new))

    @_locked
    def export_handles(self, offset: int) -> list[tuple[int, int]]:
        """POSIX file descriptors for the handles backing the allocation at ``offset``.

        Send them to another process (``multiprocessing.reduction.send_handle``), which backs
        an allocation of its own arena with them in the same order: ``import_handle(fd,
        size)`` and :meth:`adopt` for each. The caller owns the descriptors (close them once
        sent). The driver must share handles (CudaDriver(exportable=True), HostDriver).

        Returns:
            ``[(fd, size_bytes), ...]`` in VA order, covering the backed prefix.
        Raises:
            DriverError: an export failed; descriptors already made are closed.
        """
        self._check_open("export_handles")
        a = self._alloc_at(offset)
        out: list[tuple[int, int]] = []
        try:
            for m in a.maps:
                out.append((self.driver.export_handle(m.handle), m.size))
        except DriverError:
            for fd, _ in out:
                os.close(fd)
            raise
        return out

    @_locked
    def adopt(self, offset: int, handle: int, nbytes: int) -> int:
        """Back the next ``nbytes`` of the allocation at ``offset`` with ``handle``.

        For a handle the caller made, typically ``driver.import_handle(fd, size)`` of memory
        another process exported: it is mapped right after the allocation's backed prefix and
        made accessible (to peers too, after :meth:`grant_access`). From then on the arena
        owns it and releases it on decommit or close, like its own.

        Args:
            offset: an allocation's offset.
            handle: a live handle of this arena's driver, of exactly ``nbytes``.
            nbytes: the handle's size, a multiple of the granularity that fits the
                allocation after its backed prefix.
        Returns:
            ``nbytes``.
        Raises:
            ArgumentError, OutOfRangeError, AlignmentError: bad arguments; nothing changed.
            DriverError: the map or the access failed; undone, and the handle is still the
                caller's.
        """
        self._check_open("adopt")
        a = self._alloc_at(offset)
        prefix = _prefix(a)
        nxt = [m.offset - a.offset for m in a.maps if m.offset - a.offset > prefix]
        room = (nxt[0] if nxt else a.size) - prefix
        int_arg("nbytes", nbytes, lo=1, hi=room,
             limit=f"in [1, {room}] (allocation {a.name!r} has {room} unbacked bytes after "
                   f"its {prefix}-byte backed prefix)")
        if nbytes % self.granularity:
            raise AlignmentError("nbytes", nbytes,
                                 f"a multiple of the granularity {self.granularity}")
        self._map_callers_handle(a, prefix, handle, nbytes)
        self._note("adopt", offset=a.offset, nbytes=nbytes)
        return nbytes

    def _map_callers_handle(self, a: _Alloc, start: int, handle: int, nbytes: int) -> None:
        """Map a caller-made ``handle`` at ``start`` of ``a`` and grant access (adopt and
        adopt_range): the map is undone if the access fails, and the handle stays the
        caller's until both succeeded."""
        d = self.driver
        va = self.base + a.offset + start
        d.map(va, nbytes, handle)
        try:
            self._set_access(va, nbytes)
        except BaseException as e:
            undo = Transaction()
            undo.push(f"unmap(va={va:#x}, size={nbytes})", lambda: d.unmap(va, nbytes))
            undo.unwind(e)
            raise
        _insert(a, _Map(a.offset + start, nbytes, handle, self._next_hid))
        self._next_hid += 1

    @_locked
    def adopt_range(self, offset: int, start: int, handle: int, nbytes: int) -> int:
        """Back ``[start, start + nbytes)`` of the allocation at ``offset`` with ``handle``.

        :meth:`adopt` anywhere: for a handle the caller made ahead (a collective page commit
        in :mod:`kvvmm.distributed` creates every handle before any rank maps one), mapped
        at a granule-aligned range that no mapping overlaps, holes allowed around it, and made
        accessible. From then on the arena owns it, as its own. Recorded as a
        ``commit_range`` (a replay backs the same range with memory of its own).

        Args:
            offset: an allocation's offset.
            start: bytes from the allocation's start, a multiple of the granularity.
            handle: a live handle of this arena's driver, of exactly ``nbytes``.
            nbytes: the handle's size, > 0, a multiple of the granularity;
                ``start + nbytes <= size``.
        Returns:
            ``nbytes``.
        Raises:
            ArgumentError, OutOfRangeError, AlignmentError: bad arguments, or the range
                overlaps a mapping; nothing changed.
            DriverError: the map or the access failed; undone, and the handle is still the
                caller's.
        """
        self._check_open("adopt_range")
        a, lo, hi = self._check_range("adopt_range", offset, start, nbytes)
        if hi == lo:
            raise ArgumentError("nbytes", nbytes, "> 0 (the handle's size)")
        self._wait_inflight([(a, lo, hi)])  # the look-ahead may be mapping it right now
        self._check_open("adopt_range")
        hit = [(m.offset - a.offset, m.offset - a.offset + m.size) for m in a.maps
               if m.offset - a.offset < hi and lo < m.offset - a.offset + m.size]
        if hit:  # mapping over a mapping would fail in the driver, or worse, on the host
            raise ArgumentError("start", start,
                                f"a range that no mapping overlaps: [{lo}, {hi}) of allocation "
                                f"{a.name!r} overlaps its mapping(s) {hit[:4]}")
        self._map_callers_handle(a, lo, handle, nbytes)
        self._note("commit_range", offset=a.offset, start=lo, nbytes=nbytes)
        return nbytes

    # -- tensors ------------------------------------------------------------------------

    @_locked
    def tensor(self, offset: int, shape: Sequence[int], dtype: Any, *,
               device: int | None = None) -> torch.Tensor:
        """A torch tensor over ``[offset, offset + nbytes)`` of the reservation, no copy.

        On the simulator it is a ``meta`` tensor (shape and dtype, no memory); on host memory
        it aliases the bytes (``torch.frombuffer``); on a GPU it aliases device memory
        (DLPack). Memory need not be backed yet: touching unbacked VA faults, as on a GPU.
        The tensor keeps the arena alive, and ``close()`` waits for it to go.

        Args:
            offset: bytes from the arena base; must leave room for the tensor.
            shape: dimensions, each > 0.
            dtype: a torch dtype or its name (``"bfloat16"``).
            device: the device whose view it is (default: the arena's); another device must
                have been given access (:meth:`grant_access`): on a GPU its tensor lives on
                ``cuda:<device>`` and reads the arena's memory over the peer link.
        Raises:
            ArgumentError, OutOfRangeError, UnknownDtypeError: bad arguments.
            ClosedError: after ``close()``.
        """
        self._check_open("tensor")
        if device is None or device == self.device:
            view_device = self.device
        elif device in self.peer_devices:
            view_device = device
        else:
            raise ArgumentError("device", device,
                                f"the arena's device {self.device} or one given access "
                                f"(grant_access): {list(self.peer_devices)}")
        dims = tuple(shape)
        for i, n in enumerate(dims):
            int_arg(f"shape[{i}]", n, lo=1, limit="an int > 0")
        name = dtype_name(dtype)
        itemsize = dtype_itemsize(name)
        nbytes = itemsize
        for n in dims:
            nbytes *= n
        int_arg("offset", offset, lo=0, hi=self.reserved_bytes - nbytes,
             limit=f"in [0, {self.reserved_bytes - nbytes}] so that {nbytes} bytes fit in the "
                   f"{self.reserved_bytes}-byte reservation")
        if offset % itemsize:
            raise AlignmentError("offset", offset, f"a multiple of the itemsize {itemsize}")
        return make_tensor(self, self.base + offset, nbytes, dims, name, view_device)

    @property
    def pool(self) -> Any:
        """A ``torch.cuda.MemPool`` allocating from this reservation (CUDA driver only).

        For code that allocates with plain ``torch.empty`` inside
        ``torch.cuda.use_mem_pool(arena.pool)``: each tensor gets a fresh, unbacked
        allocation; back it with :meth:`commit` before touching it. Nothing is compiled.

        Raises:
            DriverUnavailableError: the driver's memory is not CUDA device memory.
            ClosedError: after ``close()``.
        """
        self._check_open("pool")
        if self.driver.memory is not MemoryKind.DEVICE:
            raise DriverUnavailableError(
                f"Arena.pool needs CUDA device memory; this arena's driver is "
                f"{self.driver.kind!r} (use Arena.tensor, which works on every driver)"
            )
        if self._pool is None:
            from kvvmm.arena.mempool import make_pool

            self._pool = make_pool(self)
        return self._pool

    def _drop_pool(self) -> None:
        """Let torch hand the pool's segments back (their frees end the views they hold)."""
        pool, self._pool = self._pool, None
        self._dropping_pool = True  # close() tears down itself, so errors reach the caller
        try:
            del pool
            import torch

            torch.cuda.empty_cache()
        finally:
            self._dropping_pool = False

    @_locked
    def lease(self) -> ViewLease:
        """A claim on the arena's memory for something that can still reach it.

        :meth:`close` waits until every lease has ended (``lease.release()``, or the lease
        garbage-collected). Tensors from :meth:`tensor` and segments of :attr:`pool` each hold
        one; a caller that hands the arena's VA to other code can take one too.

        Raises:
            ClosedError: after ``close()``.
        """
        self._check_open("lease")
        # A driver that can crash under a live view (host, CUDA) refuses close() and free()
        # of a pinned reservation: one pin per lease, dropped as the lease ends.
        pin = getattr(self.driver, "pin", None)
        if pin is not None:
            pin(self.base)
        self._views += 1
        return ViewLease(self, self._view_gone)

    @_locked
    def _view_gone(self) -> None:
        self._views -= 1
        unpin = getattr(self.driver, "unpin", None)
        if unpin is not None and not self._released:
            unpin(self.base)
        if self._dropping_pool:
            return
        if self._closed and not self._released and self._views == 0:
            try:
                self._teardown()
            except KvvmmError as e:  # nobody to raise to: a finalizer
                log.error("arena %r: deferred close failed: %s", self.name, e)

    # -- snapshot / close ---------------------------------------------------------------

    @_locked
    def snapshot(self) -> ArenaSnapshot:
        """Frozen view of the arena now (works after close too)."""
        allocs = tuple(AllocationInfo(a.name, a.offset, a.size, a.requested, a.backed,
                                      _prefix(a))
                       for a in self._allocs)
        maps = tuple(MappingInfo(m.offset, m.size, m.hid, a.name)
                     for a in self._allocs for m in a.maps)
        return ArenaSnapshot(
            name=self.name, driver=self.driver.kind, device_name=self.driver.name,
            granularity=self.granularity, base=self.base, reserved_bytes=self.reserved_bytes,
            cursor_bytes=self.cursor_bytes, allocations=allocs, mappings=maps,
            backed_bytes=sum(a.backed for a in self._allocs), closed=self._closed,
            peer_devices=self.peer_devices,
            pool_bytes=0 if self._handle_pool is None else self._handle_pool.held_bytes,
        )

    @_locked
    def close(self) -> None:
        """Give everything back: unmap, free the reservation, release the handles.

        Idempotent. If tensors made by :meth:`tensor` are still alive, the arena is marked
        closed now and its memory is given back when the last of them goes. The pool (if
        any) is dropped; tensors allocated from it that are still alive keep the arena
        waiting until they go and ``torch.cuda.empty_cache()`` hands their segments back.

        Raises:
            DriverError: an unmap or the free failed (the arena is open again, as it was),
                or a release failed after the VA was freed (the arena is closed and keeps the
                handle; call ``close()`` again to retry).
        """
        if self._released:
            if self._leftover:
                self._release_leftover()
            return
        self._closed = True
        if self._pool is not None:
            self._drop_pool()
        if self._views:
            return  # _view_gone finishes the job
        self._wait_inflight([(a, 0, a.size) for a in self._allocs])
        try:
            self._teardown()
        except BaseException:
            if not self._released:
                self._closed = False  # nothing was given back: usable as before
            raise

    def _teardown(self) -> None:
        d = self.driver
        undo = Transaction()
        try:
            for a in self._allocs:  # one unmap per run of adjacent mappings
                for run in _runs(a.maps):
                    start, end = run[0].offset, run[-1].offset + run[-1].size
                    d.unmap(self.base + start, end - start)
                    undo.push(f"remap {a.name} at {start}", functools.partial(self._remap, run))
            d.free(self.base, self.reserved_bytes)
        except BaseException as e:
            undo.unwind(e)
            raise
        self._released = True
        self._note("close")
        self._gone += [(m.handle, m.size) for a in self._allocs for m in a.maps]
        for a in self._allocs:
            a.maps.clear()
            a.backed = 0
        gone, self._gone = self._gone, []
        pool = self._handle_pool
        if pool is not None:  # retained (up to the pool's cap) for the next arena
            gone = [(h, sz) for h, sz in gone if not pool.give(h, sz)]
        self._leftover += gone
        self._release_leftover()

    def _remap(self, run: list[_Map]) -> None:
        """Map a run's handles back after its unmap (undo in a failed close)."""
        for m in run:
            self._map_back(m)

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

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

__all__ = ["MAX_RESERVE_BYTES", "Arena", "DecommitResult"]

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
    backed: int = 0
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
    Raises:
        ArgumentError: ``driver`` not a driver, or ``reserve_bytes`` not a positive int.
        OutOfRangeError: ``reserve_bytes`` above :data:`MAX_RESERVE_BYTES`; nothing reserved.
        DriverError: the reservation failed.
    """

    def __init__(
        self, driver: Driver, *, reserve_bytes: int, device: int | None = None,
        name: str = "arena", trace: Trace | None = None,
    ) -> None:
        check_driver(driver)
        int_arg("reserve_bytes", reserve_bytes, lo=1, hi=MAX_RESERVE_BYTES,
                limit=f"an int > 0 and <= {MAX_RESERVE_BYTES} (bytes; 256 TiB, more VA "
                      f"than any device addresses)")
        if device is not None and device != driver.device:
            raise ArgumentError("device", device, f"the driver's device {driver.device}")
        self._lock = threading.RLock()
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
        """Bytes backed from the start of the allocation at ``offset``."""
        return self._alloc_at(offset).backed

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

    def _extend(self, a: _Alloc, target: int, undo: Transaction) -> int:
        """Back ``a`` up to ``target`` with one new handle, pushing undo steps."""
        d = self.driver
        ext = target - a.backed
        va = self.base + a.offset + a.backed
        h = d.create(ext)
        undo.push(f"release(handle={h})", lambda: d.release(h))
        d.map(va, ext, h)
        undo.push(f"unmap(va={va:#x}, size={ext})", lambda: d.unmap(va, ext))
        self._set_access(va, ext)
        m = _Map(a.offset + a.backed, ext, h, 0)
        a.maps.append(m)
        a.backed = target

        def forget() -> None:
            a.maps.remove(m)
            a.backed -= ext

        undo.push("forget", forget)
        return ext

    def commit(self, offset: int, nbytes: int) -> int:
        """Back the first ``nbytes`` of the allocation at ``offset`` (one new handle).

        Backing only grows: asking for less than is backed does nothing.

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
        plan = [self._check_commit(o, n) for o, n in requests]
        undo = Transaction()
        added = 0
        try:
            for a, target in plan:
                if target > a.backed:
                    added += self._extend(a, target, undo)
        except BaseException as e:  # a driver's OSError or a Ctrl-C must not leak handles
            undo.unwind(e)
            raise
        for a, _ in plan:  # ids only for handles that stayed: the same on replay
            for m in a.maps:
                if m.hid == 0:
                    m.hid = self._next_hid
                    self._next_hid += 1
        if self._trace is not None:
            for a, target in plan:
                self._note("commit", offset=a.offset, nbytes=target)
        return added

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

        Every request is checked before any driver call. Each allocation's dropped range is
        unmapped in one call first, and each unmap pushes its undo (map the same handles
        back, set access): the handles still hold the memory, so a failed unmap puts every
        byte back where it was. Only when every unmap succeeded are the handles released.

        A release cannot lose a byte anyone can still reach (the VA is already unmapped), but
        it can fail: then the decommit stands (the snapshot shows the mappings gone), the
        arena keeps the handles it could not release (:attr:`unreleased_bytes`) and retries
        them at the next decommit that gives something back and at :meth:`close`, and the
        error says so in a note.

        Args:
            requests: ``(offset, keep_bytes)`` pairs; ``keep_bytes`` in ``[0, size]``. An
                allocation named twice keeps the smaller of its two.
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
        plan: list[tuple[_Alloc, int]] = []
        for o, k in keep.items():
            a = self._by_offset[o]
            drop = [i for i, m in enumerate(a.maps) if m.offset - a.offset >= k]
            if drop:
                plan.append((a, drop[0]))
        d = self.driver
        undo = Transaction()
        try:
            for a, first in plan:  # one unmap per allocation, each undone by mapping back
                start = a.maps[first].offset
                d.unmap(self.base + start, a.offset + a.backed - start)
                for m in a.maps[first:]:
                    undo.push(f"map back handle {m.hid} at offset {m.offset}", self._map_back, m)
        except BaseException as e:  # a Ctrl-C between unmaps must not lose the bytes either
            undo.unwind(e)
            raise
        undo.commit()
        given: dict[int, int] = {}
        gone: list[tuple[int, int]] = []
        for a, first in plan:
            before = a.backed
            gone += [(m.handle, m.size) for m in a.maps[first:]]
            del a.maps[first:]
            a.backed = a.maps[-1].offset + a.maps[-1].size - a.offset if a.maps else 0
            given[a.offset] = before - a.backed
            self._note("decommit", offset=a.offset, keep_bytes=a.backed)
        results = tuple(self._decommit_result(self._by_offset[o], k, given.get(o, 0))
                        for o, k in keep.items())
        # Past the point of no return: the VA no longer reaches these handles.
        self._leftover += gone
        if gone:
            self._release_leftover("decommit or close again to retry")
        return results

    def _decommit_result(self, a: _Alloc, keep_bytes: int, given: int) -> DecommitResult:
        kept: tuple[int, int] | None = None
        if a.maps and keep_bytes < a.backed:
            last = a.maps[-1]  # the mapping that straddles keep_bytes
            kept = (last.offset, last.offset + last.size)
        return DecommitResult(name=a.name, offset=a.offset, keep_bytes=keep_bytes,
                              given_bytes=given, backed_bytes=a.backed, kept_mapping=kept)

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
        for a in self._allocs:
            if a.backed:
                d.set_access(self.base + a.offset, a.backed, new)
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
        room = a.size - a.backed
        int_arg("nbytes", nbytes, lo=1, hi=room,
             limit=f"in [1, {room}] (allocation {a.name!r} has {room} bytes after its "
                   f"{a.backed} backed)")
        if nbytes % self.granularity:
            raise AlignmentError("nbytes", nbytes,
                                 f"a multiple of the granularity {self.granularity}")
        d = self.driver
        va = self.base + a.offset + a.backed
        d.map(va, nbytes, handle)
        try:
            self._set_access(va, nbytes)
        except BaseException as e:
            undo = Transaction()
            undo.push(f"unmap(va={va:#x}, size={nbytes})", lambda: d.unmap(va, nbytes))
            undo.unwind(e)
            raise
        a.maps.append(_Map(a.offset + a.backed, nbytes, handle, self._next_hid))
        self._next_hid += 1
        a.backed += nbytes
        self._note("adopt", offset=a.offset, nbytes=nbytes)
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
        allocs = tuple(AllocationInfo(a.name, a.offset, a.size, a.requested, a.backed)
                       for a in self._allocs)
        maps = tuple(MappingInfo(m.offset, m.size, m.hid, a.name)
                     for a in self._allocs for m in a.maps)
        return ArenaSnapshot(
            name=self.name, driver=self.driver.kind, device_name=self.driver.name,
            granularity=self.granularity, base=self.base, reserved_bytes=self.reserved_bytes,
            cursor_bytes=self.cursor_bytes, allocations=allocs, mappings=maps,
            backed_bytes=sum(a.backed for a in self._allocs), closed=self._closed,
            peer_devices=self.peer_devices,
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
            for a in self._allocs:
                if not a.maps:
                    continue
                va, size = self.base + a.offset, a.backed
                d.unmap(va, size)
                undo.push(f"remap {a.name}", functools.partial(self._remap, a))
            d.free(self.base, self.reserved_bytes)
        except BaseException as e:
            undo.unwind(e)
            raise
        self._released = True
        self._note("close")
        self._leftover += [(m.handle, m.size) for a in self._allocs for m in a.maps]
        for a in self._allocs:
            a.maps.clear()
            a.backed = 0
        self._release_leftover()

    def _remap(self, a: _Alloc) -> None:
        """Map ``a``'s handles back after its unmap (undo in a failed close)."""
        for m in a.maps:
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

"""Arena: one VA reservation, bump allocation, commit/decommit, tensors over the VA.

An arena reserves VA once, hands out granularity-aligned pieces of it (``allocate``), and
backs each piece from its start as far as asked (``commit``), one whole handle per
extension; ``decommit`` gives back whole mappings beyond a kept prefix. Every multi-step
change is a transaction: a failed driver call undoes the calls before it, and any failure of
the undo is attached to the error as a note.

Tensors over the VA (``meta`` on the simulator, ``frombuffer`` over host memory, DLPack over
device memory) keep the arena alive; ``close()`` waits for the last one. Peers:
``grant_access(devices)``; other processes: ``export_handles`` then ``adopt``.

The parts are mixins of their own (``state``, ``holes``, ``sharing``, ``sleep``,
``captures``, ``reclaim``); this module keeps construction, allocation, prefix
commit/decommit, tensors, leases, the pool, snapshot and close.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvvmm.arena.captures import CaptureRegistry, CapturesMixin
from kvvmm.arena.holes import HolesMixin
from kvvmm.arena.pool import PoolTag, register_arena
from kvvmm.arena.reclaim import CacheReleaser, releaser_for
from kvvmm.arena.records import (
    DecommitResult,
    RangeResult,
    _Alloc,
    _Map,
    _prefix,
    _runs,
    check_driver,
)
from kvvmm.arena.sharing import SharingMixin
from kvvmm.arena.sleep import SleepMixin, SleepResult
from kvvmm.arena.state import _locked, log
from kvvmm.arena.transaction import Transaction
from kvvmm.arena.views import ViewLease, make_tensor
from kvvmm.checks import int_arg
from kvvmm.driver.base import Driver, MemoryKind, work_hook
from kvvmm.dtypes import dtype_itemsize, dtype_name
from kvvmm.errors import (
    AlignmentError,
    ArgumentError,
    DriverUnavailableError,
    KvvmmError,
    ReservationExhaustedError,
)
from kvvmm.record.trace import Trace
from kvvmm.snapshot import AllocationInfo, ArenaSnapshot, MappingInfo
from kvvmm.units import align_up, fmt_bytes, fmt_range

if TYPE_CHECKING:
    import torch

    from kvvmm.arena.pool import HandlePool

__all__ = ["MAX_RESERVE_BYTES", "Arena", "DecommitResult", "RangeResult", "SleepResult",
           "check_driver"]

#: The most VA one arena may reserve: 2**48 bytes (256 TiB), more than any driver could give
#: (x86-64 user space is 47 bits); asking for more is a layout bug, refused up front.
MAX_RESERVE_BYTES = 1 << 48


#: each arena's tag for a shared HandlePool (unique in the process)
_POOL_TAGS = itertools.count(1)


class Arena(HolesMixin, SharingMixin, SleepMixin, CapturesMixin):
    """One VA reservation with bump allocation, commit/decommit and tensor views.

    Args:
        driver: any :class:`~kvvmm.driver.base.Driver`.
        reserve_bytes: VA to reserve (rounded up to the granularity); costs no memory.
        device: device ordinal for tensors (default: the driver's).
        name: shown in snapshots, plots and errors.
        trace: a :class:`~kvvmm.record.Trace` to record the arena's operations in
            (:func:`kvvmm.replay.replay_arenas` rebuilds the arena from it).
        pool: a :class:`~kvvmm.arena.pool.HandlePool` of the same driver that commits take
            handles from and decommits give them back to. None: create and release.
        cache_releaser, retry_on_oom: what hands cached memory back when a create runs out
            (then tried once more), and the opt-out: :func:`~kvvmm.arena.reclaim.releaser_for`.
    Raises:
        ArgumentError: ``driver`` not a driver, or ``reserve_bytes`` not a positive int.
        OutOfRangeError: ``reserve_bytes`` above :data:`MAX_RESERVE_BYTES`; nothing reserved.
        DriverError: the reservation failed.
    """

    def __init__(
        self, driver: Driver, *, reserve_bytes: int, device: int | None = None,
        name: str = "arena", trace: Trace | None = None, pool: HandlePool | None = None,
        cache_releaser: CacheReleaser | None = None, retry_on_oom: bool = True,
    ) -> None:
        check_driver(driver)
        int_arg("reserve_bytes", reserve_bytes, lo=1, hi=MAX_RESERVE_BYTES,
                limit=f"an int > 0 and <= {MAX_RESERVE_BYTES} (bytes; 256 TiB, more VA "
                      f"than any device addresses)")
        if device is not None and device != driver.device:
            raise ArgumentError("device", device, f"the driver's device {driver.device}")
        self._lock = threading.RLock()
        # Signalled when the pool's thread publishes (or drops) a range it backed unlocked.
        self._cond = threading.Condition(self._lock)
        if pool is not None and getattr(pool, "driver", None) is not driver:
            raise ArgumentError("pool", pool, "a HandlePool of this arena's driver")
        self._releaser = releaser_for(driver, cache_releaser, retry_on_oom)
        self._handle_pool: HandlePool | None = pool
        self.pool_tag = PoolTag(next(_POOL_TAGS))
        # allocation offset -> [start, end) (allocation-relative) the pool's thread is backing
        self._inflight: dict[int, list[tuple[int, int]]] = {}
        self.inflight_waits = 0  #: times a commit or decommit waited for an in-flight range
        self._gone: list[tuple[int, int]] = []  # unmapped handles a decommit is releasing
        self._adopted: set[int] = set()
        self.driver = driver
        self.name = str(name)
        self.device = driver.device
        self.granularity = driver.granularity()
        self.reserved_bytes = align_up(reserve_bytes, self.granularity)
        self.base = driver.reserve(self.reserved_bytes, self.granularity)
        self._captures = CaptureRegistry(self.name, self.base, self.base + self.reserved_bytes)
        self.cursor_bytes = 0
        self._allocs: list[_Alloc] = []
        self._by_offset: dict[int, _Alloc] = {}
        self._names: set[str] = set()  # allocation names, for the uniqueness check
        self._next_hid = 1
        self._closed = False
        self._released = False  # VA freed (teardown done)
        self._views = 0
        # (handle, size) of handles a failed release left, their VA already unmapped.
        self._leftover: list[tuple[int, int]] = []
        self._pool: Any = None
        self._dropping_pool = False
        # Devices that get access at each commit; None: the driver's own only.
        self._access: tuple[int, ...] | None = None
        if trace is not None and not isinstance(trace, Trace):
            raise ArgumentError("trace", trace, "a kvvmm.record.Trace or None")
        self._trace = trace
        self._arena_id = trace.open_arena() if trace is not None else -1
        # The simulator's charge for the library's own work (None on real drivers).
        self._work: Callable[[str, int], None] | None = work_hook(driver)
        self._note("open", name=self.name, reserve_bytes=self.reserved_bytes, base=self.base)
        if self._work is not None:
            self._work("arena.open", 0)
        register_arena(self)  # adopt refuses a handle this arena holds

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

    def mappings_over(self, offset: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """The allocation's mappings that overlap ``[lo, hi)`` (allocation-relative bytes),
        as :meth:`mappings_of` gives them, found by bisection: costs the mappings found."""
        a = self._alloc_at(offset)
        maps, base = a.maps, a.offset
        i = max(bisect.bisect_right(maps, base + lo, key=lambda m: m.offset) - 1, 0)
        out = []
        while i < len(maps) and maps[i].offset < base + hi:
            m = maps[i]
            if m.offset + m.size > base + lo:
                out.append((m.offset - base, m.offset - base + m.size))
            i += 1
        return out

    @property
    def handle_pool(self) -> HandlePool | None:
        """The :class:`~kvvmm.arena.pool.HandlePool` commits draw from, if any."""
        return self._handle_pool

    @_locked
    def new_handle(self, nbytes: int) -> int:
        """A handle of ``nbytes`` made as a commit makes one (from the pool, else a create
        with the out-of-memory retry), for a caller that maps it itself
        (:meth:`adopt_range`, ``own=True``) or releases it.

        Raises:
            ArgumentError: ``nbytes`` not a positive multiple of the granularity.
            DriverError: the create failed (out of memory after the retries, ...).
        """
        self._check_open("new_handle")
        int_arg("nbytes", nbytes, lo=1, unit="bytes")
        if nbytes % self.granularity:
            raise ArgumentError("nbytes", nbytes,
                                f"a multiple of the granularity ({self.granularity})")
        return self._new_handle(nbytes)

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

    def commit(self, offset: int, nbytes: int) -> int:
        """Back the first ``nbytes`` of the allocation at ``offset``.

        Backing only grows; every hole in ``[0, nbytes)`` gets one new handle.

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
        """Commit several allocations as one transaction (every request checked first);
        see :meth:`commit`."""
        self._check_open("commit")
        plan = [(a, 0, n) for a, n in (self._check_commit(o, n) for o, n in requests)]
        return self._commit_ranges(plan, "commit")

    # -- decommit -----------------------------------------------------------------------

    def decommit(self, offset: int, keep_bytes: int) -> int:
        """Give back whole mappings of the allocation at ``offset`` beyond ``keep_bytes``.

        A mapping that straddles ``keep_bytes`` stays whole: :meth:`decommit_many_report`
        says which.

        Returns:
            Bytes given back.
        Raises:
            ArgumentError, OutOfRangeError: bad offset or size; nothing changed.
            DriverError: a driver call failed; see :meth:`decommit_many`.
        """
        return self.decommit_many([(offset, keep_bytes)])

    def decommit_many(self, requests: Iterable[tuple[int, int]]) -> int:
        """:meth:`decommit_many_report`, returning the bytes given back in all."""
        return sum(r.given_bytes for r in self.decommit_many_report(requests))

    @_locked
    def decommit_many_report(
        self, requests: Iterable[tuple[int, int]]
    ) -> tuple[DecommitResult, ...]:
        """Decommit several allocations as one transaction and say what happened to each.

        Every request is checked before any driver call; every unmap comes before any
        release, so a failed unmap maps the same handles back, bytes and all. A release
        that fails after the unmaps leaves the decommit standing: the arena keeps the
        handle (:attr:`unreleased_bytes`) and retries it at the next decommit and at
        :meth:`close`.

        Args:
            requests: ``(offset, keep_bytes)`` pairs; ``keep_bytes`` in ``[0, size]``. An
                allocation named twice keeps the smaller of its two. Every mapping that
                starts at or beyond ``keep_bytes`` goes (holes included).
        Returns:
            One :class:`DecommitResult` per allocation, in the order first named.
        Raises:
            ArgumentError, OutOfRangeError: a bad request; nothing changed.
            DriverError: an unmap or a set access failed (every mapping and every byte is as
                it was), or a release failed after the unmaps (the decommit stands).
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

    # -- tensors ------------------------------------------------------------------------

    @_locked
    def tensor(self, offset: int, shape: Sequence[int], dtype: Any, *,
               device: int | None = None) -> torch.Tensor:
        """A torch tensor over ``[offset, offset + nbytes)`` of the reservation, no copy.

        ``meta`` on the simulator, aliasing the bytes on host memory and on a GPU. The VA
        need not be backed yet. The tensor keeps the arena alive until it goes.

        Args:
            offset: bytes from the arena base; must leave room for the tensor.
            shape: dimensions, each > 0.
            dtype: a torch dtype or its name (``"bfloat16"``).
            device: the device whose view it is (default: the arena's; another must have
                been given access, :meth:`grant_access`).
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
        t = make_tensor(self, self.base + offset, nbytes, dims, name, view_device)
        if self._work is not None:
            self._work("arena.tensor", 1)
        return t

    @property
    def pool(self) -> Any:
        """A ``torch.cuda.MemPool`` allocating from this reservation (CUDA driver only).

        Inside ``torch.cuda.use_mem_pool(arena.pool)`` each ``torch.empty`` gets a fresh,
        unbacked allocation; back it with :meth:`commit` before touching it.

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
        garbage-collected). Every tensor and pool segment holds one.

        Raises:
            ClosedError: after ``close()``.
        """
        self._check_open("lease")
        # the driver refuses to free a pinned reservation: one pin per lease
        self.driver.pin(self.base)
        self._views += 1
        return ViewLease(self, self._view_gone)

    @_locked
    def _view_gone(self) -> None:
        self._views -= 1
        if not self._released:
            self.driver.unpin(self.base)
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
            asleep_bytes=self.asleep_bytes, asleep_mappings=self._asleep_mappings(),
            captures=tuple(c.name for c in self._captures.live), oom_retries=self._reclaim.retries,
        )

    @_locked
    def close(self) -> None:
        """Give everything back: unmap, free the reservation, release the handles.

        Idempotent. With tensors (or pool segments) still alive the arena is closed now and
        its memory given back when the last of them goes.

        Raises:
            DriverError: an unmap or the free failed (the arena is open again, as it was),
                or a release failed after the VA was freed (the arena is closed and keeps the
                handle; call ``close()`` again to retry).
        """
        if self._released:
            if self._leftover:
                self._release_leftover()
            return
        self._captures.check_close()  # a live capture still uses the VA: nothing changes
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
        self._drop_sleep()  # a sleeping arena's backup: nothing will wake it now
        self._note("close")
        if self._work is not None:
            self._work("arena.close", sum(len(a.maps) for a in self._allocs))
        self._gone += [(m.handle, m.size) for a in self._allocs for m in a.maps]
        for a in self._allocs:
            a.maps.clear()
            a.backed = 0
        gone, self._gone = self._gone, []
        gone = self._unpooled(gone)  # retained (up to the pool's cap) for the next arena
        self._leftover += gone
        self._release_leftover()

    def _remap(self, run: list[_Map]) -> None:
        """Map a run's handles back after its unmap (undo in a failed close)."""
        for m in run:
            self._map_back(m)

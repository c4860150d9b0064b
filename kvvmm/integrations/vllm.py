"""vLLM's ``VmmDriver``, backed by kvvmm: vLLM's growable KV cache on any kvvmm driver.

vLLM makes every VMM call of its growable KV cache through one seam, the cached factory
``vllm.utils.vmm_driver.get_vmm_driver()``. :class:`KvvmmVmmDriver` answers its ``VmmDriver``
calls over any kvvmm driver (wrappers included), and :func:`install` puts it there::

    import kvvmm, kvvmm.integrations.vllm as kv; kv.install(kvvmm.open_driver("cuda"))

Only :func:`install` imports vLLM. Failures are vLLM's ``RuntimeError("GPU driver error
<code>: <text>")``, each also its kvvmm class. What differs and what is added (the budget,
sleep with contents, RDMA readiness, snapshots): docs/VLLM.md.
"""

from __future__ import annotations

import ctypes
import importlib
import itertools
import sys
import threading
import types
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvvmm.arena import Transaction, device_tensor
from kvvmm.arena.backup import Backup, HostBackup, make_backup
from kvvmm.arena.sleep import SleepResult
from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    Driver,
    MemoryKind,
    check_driver,
    driver_error,
)
from kvvmm.errors import (
    ArgumentError,
    AsleepError,
    BackupError,
    DriverError,
    DriverOutOfMemoryError,
    KvvmmError,
    SleepRefusedError,
    StateError,
)
from kvvmm.integrations import twin_class
from kvvmm.snapshot import AllocationInfo, ArenaSnapshot, MappingInfo

__all__ = ["MEM_HANDLE_TYPE_FABRIC", "MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", "VLLM_MODULE",
           "KvvmmVmmDriver", "SegmentBacking", "VllmDriverError", "VllmUnavailableError",
           "install", "uninstall"]

#: The module whose factory :func:`install` replaces.
VLLM_MODULE = "vllm.utils.vmm_driver"
#: ``export_handle_types`` bits, as vLLM (and CUDA's ``CUmemAllocationHandleType``) number them.
MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: int = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
MEM_HANDLE_TYPE_FABRIC: int = 8  # CU_MEM_HANDLE_TYPE_FABRIC

CUDA_ERROR_NOT_PERMITTED = "CUDA_ERROR_NOT_PERMITTED"
#: CUDA's code and ``cuGetErrorString`` text for each error name kvvmm's drivers raise.
_UNKNOWN = (999, "unknown error")
_CODES = {CUDA_ERROR_INVALID_VALUE: (1, "invalid argument"),
          "CUDA_ERROR_OUT_OF_MEMORY": (2, "out of memory"),
          CUDA_ERROR_INVALID_DEVICE: (101, "invalid device ordinal"),
          "CUDA_ERROR_ILLEGAL_ADDRESS": (700, "an illegal memory access was encountered"),
          CUDA_ERROR_NOT_PERMITTED: (800, "operation not permitted"),
          CUDA_ERROR_NOT_SUPPORTED: (801, "operation not supported"),
          "CUDA_ERROR_UNKNOWN": _UNKNOWN}
#: DLPack device types (``kDLCPU``, ``kDLCUDA``); 0 is none, which torch refuses.
_DLPACK = {MemoryKind.DEVICE: 2, MemoryKind.HOST: 1, MemoryKind.NONE: 0}


class VllmUnavailableError(KvvmmError, ImportError):
    """``vllm.utils.vmm_driver`` (vLLM 0.34+) is not importable: install it, or use the class."""


class VllmDriverError(KvvmmError, RuntimeError):
    """A kvvmm failure as vLLM's drivers raise one: ``GPU driver error <code>: <text>``; also
    an instance of its kvvmm class (a twin in :class:`runtime_errors`), with its fields."""

    code: int = _UNKNOWN[0]


class runtime_errors:  # a namespace, lower-case as the module path it makes reads
    """The ``VllmDriverError`` twins of kvvmm's errors, by their kvvmm name."""


def as_vllm_error(err: KvvmmError) -> VllmDriverError:
    """``err`` as vLLM's drivers would raise it (see :class:`VllmDriverError`)."""
    if isinstance(err, VllmDriverError):
        return err
    cls: Any = twin_class(type(err), VllmDriverError, runtime_errors, __name__)
    # A refusal while asleep is CUDA's answer to an operation the state does not permit.
    name = (err.cuda_error if isinstance(err, DriverError) else
            CUDA_ERROR_NOT_PERMITTED if isinstance(err, AsleepError) else "")
    code, text = _CODES.get(name, _UNKNOWN)
    new = cls.__new__(cls)
    new.__dict__.update(err.__dict__)
    new.args = (f"GPU driver error {code}: {text} ({err})",)
    new.code = code
    return new  # type: ignore[no-any-return]


class _Handle:
    """One handle this object gave vLLM: the driver's handle behind it now.

    Plain slots with a hand-written constructor (not a dataclass's default factories): one
    is made on every ``create``, the hot path's one allocation of a record."""

    __slots__ = ("inner", "own", "released", "vas", "whole")

    def __init__(self, inner: int, vas: set[int] | None = None, own: bool = False) -> None:
        self.inner = inner
        self.released = False  # vLLM released it (its memory stays while mapped)
        self.vas: set[int] = set() if vas is None else vas  # where it is mapped
        self.whole = 0  # consolidated: the id of kvvmm's own handle that now holds its bytes
        self.own = own  # kvvmm's own (a consolidated segment's): vLLM never saw its id


class _Reservation:
    """One reservation: what is mapped in it (by VA), its peers, its sleep (made on every
    ``reserve``: plain slots, as :class:`_Handle`)."""

    __slots__ = ("asleep", "maps", "peers", "pieces", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.maps: dict[int, tuple[int, int]] = {}  # va -> (size, handle id)
        self.peers: set[int] = set()  # other devices given access
        self.asleep: _Asleep | None = None
        # vLLM's chunks inside a consolidated mapping: va -> (size, vLLM's id, the mapping's va)
        self.pieces: dict[int, tuple[int, int, int]] = {}


@dataclass(slots=True, eq=False)
class _Asleep:
    """One sleep of one or more reservations: they wake together, from one backup."""

    parts: list[tuple[_Reservation, list[tuple[int, int, int]]]]  # (va, size, id), by VA
    backup: Backup | None
    leftover: list[int]  # driver handles the sleep's release failed to give back

    @property
    def maps(self) -> list[tuple[int, int, int]]:
        return [m for _, ms in self.parts for m in ms]


@dataclass(frozen=True, slots=True)
class SegmentBacking:
    """How one segment ``[offset, offset + size_bytes)`` of a reservation is backed."""

    offset: int  #: from the reservation's base
    size_bytes: int
    allocations: int  #: physical allocations (mappings) reaching into the segment
    backed_bytes: int  #: bytes of the segment that are mapped

    @property
    def rdma_ready(self) -> bool:
        """The whole segment lies in one physical allocation, as RDMA registration needs."""
        return self.allocations == 1 and self.backed_bytes == self.size_bytes


class KvvmmVmmDriver:
    """vLLM's ``VmmDriver`` over a kvvmm driver (see docs/VLLM.md).

    Every call vLLM makes takes the adapter's lock once, around the driver's call and the
    records sleep, wake and consolidate read, so threads never see them disagree. The
    driver's calls are its bound methods, looked up here once (a driver's calls are fixed
    when it is made; ``CudaDriver``'s hot ones are slots chosen then), and what the driver
    checks itself (sizes, alignment, its handles and reservations) is not checked again:
    the adapter checks only what it adds (its ids, the device, a sleep). The cost this buys
    is in "The per-call overhead benchmark" of docs/VLLM.md.

    Args:
        driver: any kvvmm driver, wrappers included; the caller keeps and closes it.
    Raises:
        ArgumentError: ``driver`` is not a driver.
    """

    def __init__(self, driver: Driver) -> None:
        check_driver(driver)
        self._driver = driver
        self._device_index = driver.device
        #: kDLCUDA, kDLCPU (host: real bytes) or 0 (sim: no memory; torch refuses it)
        self.dlpack_device_type: int = _DLPACK[driver.memory]
        self._lock = threading.RLock()
        self._res: dict[int, _Reservation] = {}
        self._bases: list[int] = []  # sorted
        self._handles: dict[int, _Handle] = {}
        self._ids = itertools.count(1)
        self._leftover: list[int] = []  # driver handles a consolidation failed to release
        # The driver's calls vLLM's calls make, bound once (vLLM's calls make no other).
        self._reserve, self._free, self._create = driver.reserve, driver.free, driver.create
        self._map, self._unmap, self._release = driver.map, driver.unmap, driver.release
        self._set_access = driver.set_access

    @property
    def driver(self) -> Driver:
        """The kvvmm driver underneath (read-only: its calls are bound at construction)."""
        return self._driver

    # -- vLLM's VmmDriver ------------------------------------------------------------------

    def error_string(self, code: int) -> str:
        """``cuGetErrorString``'s text for a CUDA error code."""
        return next((t for c, t in _CODES.values() if c == code), _UNKNOWN[1])

    def unusable_runtime_reason(self, device_index: int) -> str | None:
        """Why this driver cannot back vLLM's growable allocations here, or None."""
        if device_index != self.driver.device:
            return f"kvvmm's driver is on device {self.driver.device}, not {device_index}"
        return ("kvvmm's simulator holds no memory: no tensor can be made over its VA"
                if self.driver.memory is MemoryKind.NONE else None)

    def ensure_context(self, device_index: int) -> None:
        """Check ``device_index`` is the driver's (kvvmm's CUDA driver binds its context)."""
        try:
            self._device("ensure_context", device_index)
        except KvvmmError as e:
            raise as_vllm_error(e) from e

    def granularity(self, device_index: int) -> int:
        """The driver's granularity: every size and address vLLM passes is a multiple."""
        try:
            self._device("granularity", device_index)
            return self.driver.granularity()
        except KvvmmError as e:
            raise as_vllm_error(e) from e

    # The hot calls: each holds the lock once (acquire/release, cheaper than ``with``), and
    # one try around the body makes a kvvmm error vLLM's (free in Python 3.11+ until raised).

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of VA; return its base pointer."""
        self._lock.acquire()
        try:
            va = self._reserve(size, 0)
            self._res[va] = _Reservation(size)
            insort(self._bases, va)
            return va
        except KvvmmError as e:
            raise as_vllm_error(e) from e
        finally:
            self._lock.release()

    def free_reserved(self, ptr: int, size: int) -> None:
        """Give back the reservation at ``ptr`` (nothing mapped in it)."""
        self._lock.acquire()
        try:
            r = self._awake("free_reserved", ptr)
            if self._leftover:
                self._release_leftovers()
            self._free(ptr, size)
            if r is not None and self._res.pop(ptr, None) is not None:
                del self._bases[bisect_left(self._bases, ptr)]
        except KvvmmError as e:
            raise as_vllm_error(e) from e
        finally:
            self._lock.release()

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> int:
        """Create ``size`` bytes on ``device_index``; return a handle. POSIX fd export needs
        a ``"posix_fd"`` driver (else 801); FABRIC is dropped where the driver has none."""
        if (type(device_index) is not int or device_index != self._device_index
                or type(export_handle_types) is not int or export_handle_types < 0
                or export_handle_types & MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR):
            self._check_create(device_index, export_handle_types)
        self._lock.acquire()
        try:
            inner = self._create(size)
            hid = next(self._ids)
            self._handles[hid] = _Handle(inner)
            return hid
        except KvvmmError as e:
            raise as_vllm_error(e) from e
        finally:
            self._lock.release()

    def map(self, ptr: int, size: int, handle: int) -> None:
        """Map the whole of ``handle`` at ``ptr``, inside a reservation."""
        self._lock.acquire()
        try:
            h = self._handle("map", handle)
            r = self._awake("map", ptr)
            if h.whole:  # its driver handle is gone: the bytes live in the segment's one
                raise driver_error("map", {"handle": handle}, CUDA_ERROR_INVALID_VALUE,
                                   "its chunk is part of a consolidated segment now")
            self._map(ptr, size, h.inner)
            if r is not None:
                r.maps[ptr] = (size, handle)
            h.vas.add(ptr)
        except KvvmmError as e:
            raise as_vllm_error(e) from e
        finally:
            self._lock.release()

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        """Make mapped ``[ptr, ptr + size)`` readable and writable by ``device_index``."""
        self._lock.acquire()
        try:
            r = self._awake("set_access", ptr)
            if device_index == self._device_index:
                self._set_access(ptr, size)
            else:
                self._set_access(ptr, size, [device_index])
                if r is not None:
                    r.peers.add(device_index)
        except KvvmmError as e:
            raise as_vllm_error(e) from e
        finally:
            self._lock.release()

    def unmap(self, ptr: int, size: int) -> None:
        """Unmap ``[ptr, ptr + size)``: whole mappings only."""
        self._lock.acquire()
        try:
            r = self._awake("unmap", ptr)
            if r is not None and r.pieces and self._unmap_pieces(r, ptr, size):
                return
            self._unmap(ptr, size)
            if r is None:
                return
            m = r.maps.get(ptr)
            if m is not None and m[0] == size:  # one whole mapping (vLLM's every unmap)
                del r.maps[ptr]
                self._unmapped(m[1], ptr)
            else:
                for va in [va for va in r.maps if ptr <= va < ptr + size]:
                    self._unmapped(r.maps.pop(va)[1], va)
        except KvvmmError as e:
            raise as_vllm_error(e) from e
        finally:
            self._lock.release()

    def release(self, handle: int) -> None:
        """Release ``handle``; its memory goes when its last mapping goes."""
        self._lock.acquire()
        try:
            h = self._handle("release", handle)
            for va in h.vas:
                self._awake("release", va)
            if not h.whole:  # a consolidated chunk's bytes go with its segment's mapping
                self._release(h.inner)
            h.released = True
            if not h.vas:
                del self._handles[handle]
        except KvvmmError as e:
            raise as_vllm_error(e) from e
        finally:
            self._lock.release()

    # -- what kvvmm adds ---------------------------------------------------------------------

    def backing(self, base: int, segments: Sequence[tuple[int, int]]) -> tuple[SegmentBacking, ...]:
        """How each segment of the reservation at ``base`` is backed: RDMA readiness.

        Args:
            base: a reservation's base pointer.
            segments: ``(offset, size_bytes)`` from ``base``, one per segment.
        Returns:
            One :class:`SegmentBacking` per segment (``rdma_ready``: one allocation holds it).
        Raises:
            ArgumentError: an unknown ``base``, or a segment not two ints inside it.
        """
        with self._lock:
            r = self._reservation(base)
            out = []
            for i, seg in enumerate(segments):
                if not (isinstance(seg, Sequence) and len(seg) == 2
                        and all(type(v) is int and v >= 0 for v in seg)
                        and seg[0] + seg[1] <= r.size):
                    raise ArgumentError(f"segments[{i}]", seg, "(offset, size_bytes): ints "
                                        f">= 0 inside the reservation's {r.size} bytes")
                off, end = seg[0], seg[0] + seg[1]
                hits = [(va - base, va - base + n) for va, (n, _) in r.maps.items()
                        if va - base < end and va - base + n > off]
                backed = sum(min(e, end) - max(o, off) for o, e in hits)
                out.append(SegmentBacking(off, seg[1], len(hits), backed))
            return tuple(out)

    def consolidate(self, base: int, segment: tuple[int, int]) -> SegmentBacking:
        """Back one segment with one physical allocation, keeping its bytes, VA and vLLM's ids.

        A new allocation of the segment's size is made while the old ones stay mapped (double
        footprint), the bytes go to host memory and back (as in sleep), the old chunks are
        replaced at the same VA, access as before, and released. vLLM's ids stay valid: its
        memory goes when vLLM has unmapped every chunk. The simulator: nothing to keep.

        Args:
            base: a reservation's base pointer.
            segment: ``(offset, size_bytes)`` from ``base``, as for :meth:`backing`.
        Returns:
            The segment's :class:`SegmentBacking` now (one allocation: ``rdma_ready``).
        Raises:
            ArgumentError: an unknown base, or a segment not wholly mapped in whole chunks.
            AsleepError: the reservation is asleep. StateError: a chunk's handle was released
                while mapped (it could not be mapped back on failure).
            DriverOutOfMemoryError: no room for the new allocation (its note names the bytes).
            DriverError, BackupError: a step failed; the old mappings and bytes are back.
        """
        with self._lock:
            before = self.backing(base, [segment])[0]  # checks base and segment
            r, (off, n) = self._res[base], segment
            self._awake("consolidate", base)  # refused while asleep
            va0 = base + off
            olds = sorted((va, m, hid) for va, (m, hid) in r.maps.items()
                          if va < va0 + n and va + m > va0)
            if not n or before.backed_bytes != n or sum(m for _, m, _ in olds) != n:
                raise ArgumentError("segment", segment, "wholly mapped, in whole chunks",
                                    f"mapped there: {[(va - base, m) for va, m, _ in olds]}")
            if len(olds) == 1:
                return before
            if any(self._handles[hid].released for _, _, hid in olds):
                raise StateError(f"consolidate({base:#x}): a chunk's handle was released "
                                 "while mapped; nothing changed")
            self._release_leftovers()
            store = HostBackup()  # pinned on CUDA, as sleep's default
            self._sync()
            self._copy(olds, store, save=True, op="consolidate")
            undo = Transaction()
            try:
                try:
                    inner = self.driver.create(n)
                except DriverOutOfMemoryError as e:
                    e.add_note(f"consolidate needs {n} bytes more while the segment's "
                               f"{len(olds)} allocations stay mapped for the copy")
                    raise
                undo.push(f"release {inner}", self.driver.release, inner)
                self._unmap_undoably(undo, [(r, olds)])
                self.driver.map(va0, n, inner)
                undo.push(f"unmap {va0:#x}", self.driver.unmap, va0, n)
                self._access(r, va0, n)
                self._copy([(va0, n, 0)], store, save=False, op="consolidate")
            except BaseException as e:
                undo.unwind(e)
                store.drop()
                raise
            undo.commit()
            store.drop()
            wid = next(self._ids)
            self._handles[wid] = _Handle(inner, vas={va0}, own=True)
            for va, m, hid in olds:
                del r.maps[va]
                h = self._handles.pop(hid) if self._handles[hid].own else self._handles[hid]
                r.pieces.update({va: (m, hid, va0)} if not h.own else {  # earlier consolidation's
                    p: (pn, ph, va0) for p, (pn, ph, w) in r.pieces.items() if w == va})
                self._leftover.append(h.inner)
            r.maps[va0] = (n, wid)
            for ph in (ph for _, ph, w in r.pieces.values() if w == va0):
                self._handles[ph].whole = wid
            self._release_leftovers("the consolidation stands")
            return self.backing(base, [segment])[0]

    def snapshot(self, base: int, name: str = "vllm") -> ArenaSnapshot:
        """The reservation at ``base`` as an arena snapshot, which ``kvvmm.viz`` draws.

        One allocation spans the reservation; mappings carry this object's handle ids;
        asleep, ``asleep_mappings`` are where a wake maps the memory again.

        Raises:
            ArgumentError: ``base`` is not a reservation made here.
        """
        with self._lock:
            r = self._reservation(base)
            maps = tuple(MappingInfo(va - base, n, hid, name)
                         for va, (n, hid) in sorted(r.maps.items()))
            prefix = 0
            for m in maps:
                prefix += m.size_bytes if m.offset == prefix else 0
            sleeping = () if r.asleep is None else tuple(
                MappingInfo(va - base, n, hid, name) for q, ms in r.asleep.parts if q is r
                for va, n, hid in ms)
            backed = sum(m.size_bytes for m in maps)
            return ArenaSnapshot(
                name, self.driver.kind, self.driver.name, self.driver.granularity(), base,
                r.size, r.size, (AllocationInfo(name, 0, r.size, r.size, backed, prefix),),
                maps, backed, False, tuple(sorted(r.peers)),
                asleep_bytes=sum(m.size_bytes for m in sleeping), asleep_mappings=sleeping)

    def sleep(self, bases: Sequence[int] | None = None, *, backup: str | Backup | None = "host",
              path: Any = None) -> SleepResult:
        """Give back the memory mapped in reservations, keeping their VA and the contents.

        Pointers, views and captured graphs stay valid; :meth:`wake` maps new memory at the
        same VA under the same handle ids, bytes copied back. Asleep, vLLM's calls on that VA
        are refused (``AsleepError``, CUDA's 800). Those put to sleep together wake together.

        Args:
            bases: reservations' base pointers (None: every one made here).
            backup: ``"host"`` (default; pinned on CUDA), ``"disk"`` (``path``), a kvvmm
                ``Backup``, or None to drop the contents (a wake gives fresh memory).
            path: the new file for ``backup="disk"``.
        Returns:
            A :class:`~kvvmm.arena.sleep.SleepResult` (``pool_bytes`` 0: no pool here).
        Raises:
            ArgumentError, SleepRefusedError (asleep already, or a handle released while
                mapped, which a failed sleep could not map back), BackupError: nothing changed.
            DriverError: an unmap failed (all mapped back, bytes and all), or a release after
                every unmap (the sleep stands; :meth:`wake` retries it).
        """
        with self._lock:
            picked = self._pick(bases)
            for base, r in picked:
                why = ("is asleep already" if r.asleep is not None else "maps a handle released "
                       "while mapped" if any(self._handles[h].released for _, h in
                                             r.maps.values()) else "")
                if why:
                    raise SleepRefusedError(f"sleep: the reservation at {base:#x} {why}; "
                                            "nothing changed")
            store = make_backup(backup, path)  # checked even with nothing to keep
            if not picked:
                return SleepResult(None, 0, 0, 0, 0)
            group = _Asleep([(r, sorted((va, n, hid) for va, (n, hid) in r.maps.items()))
                             for _, r in picked], store, [])
            flat = group.maps
            self._sync()
            if store is not None:
                self._copy(flat, store, save=True)
            undo = Transaction()
            try:
                self._unmap_undoably(undo, group.parts)
            except BaseException as e:
                undo.unwind(e)
                if store is not None:
                    store.drop()
                raise
            undo.commit()
            failed: Exception | None = None
            for va, _, hid in flat:
                self._handles[hid].vas.discard(va)
                try:
                    self.driver.release(self._handles[hid].inner)
                except Exception as e:  # past every unmap: the sleep stands
                    group.leftover.append(self._handles[hid].inner)
                    failed = failed or e
            for r, _ in group.parts:
                r.maps.clear()
                r.asleep = group
            if failed is not None:
                failed.add_note("the sleep stands; wake() retries the release")
                raise failed
            nb = sum(n for _, n, _ in flat)
            return SleepResult(store.kind if store else None, nb, len(flat), nb if store else 0, 0)

    def wake(self, bases: Sequence[int] | None = None) -> int:
        """Map new memory where :meth:`sleep` gave it back, same handle ids, bytes copied back.

        Args:
            bases: reservations' base pointers (None: every asleep one); those put to sleep
                with them wake too.
        Returns:
            Bytes backed again.
        Raises:
            ArgumentError: an unknown base. SleepRefusedError: one named is awake.
            DriverError, BackupError: a create (out of memory, budget), map, access or copy
                failed: all made is given back; still asleep with the backup; retry later.
        """
        with self._lock:
            picked = self._pick(bases)
            for base, r in picked:
                if r.asleep is None and bases is not None:
                    raise SleepRefusedError(f"wake: the reservation at {base:#x} is awake")
            groups = {id(r.asleep): r.asleep for _, r in picked if r.asleep is not None}
            return sum(self._wake(g) for g in groups.values())

    def _wake(self, group: _Asleep) -> int:
        while group.leftover:  # a sleep's release that failed: the memory is needed now
            self.driver.release(group.leftover[0])
            group.leftover.pop(0)
        undo = Transaction()
        made: list[tuple[int, int]] = []  # (handle id, driver handle)
        try:
            for r, maps in group.parts:
                for va, n, hid in maps:
                    inner = self.driver.create(n)
                    undo.push(f"release {inner}", self.driver.release, inner)
                    self.driver.map(va, n, inner)
                    undo.push(f"unmap {va:#x}", self.driver.unmap, va, n)
                    self._access(r, va, n)
                    made.append((hid, inner))
            if group.backup is not None:
                self._copy(group.maps, group.backup, save=False)
        except BaseException as e:
            undo.unwind(e)
            raise
        undo.commit()
        for (hid, inner), (va, _, _) in zip(made, group.maps, strict=True):
            self._handles[hid].inner = inner
            self._handles[hid].vas.add(va)
        for r, maps in group.parts:
            r.maps.update((va, (n, hid)) for va, n, hid in maps)
            r.asleep = None
        if group.backup is not None:
            group.backup.drop()
        return sum(n for _, n, _ in group.maps)

    # -- helpers ---------------------------------------------------------------------------

    def _device(self, call: str, device_index: object) -> None:
        if type(device_index) is not int or device_index != self._device_index:
            raise driver_error(call, {"device": device_index} if type(device_index) is int
                               else {}, CUDA_ERROR_INVALID_DEVICE,
                               f"kvvmm's driver is on device {self._device_index}")

    def _check_create(self, device_index: object, export_handle_types: object) -> None:
        """``create``'s checks of what it adds, once its one-line test saw something to check:
        another device (101), a bad ``export_handle_types`` (1), POSIX fds asked of a driver
        without them (801). Raises vLLM's error, or returns (POSIX fds on a posix_fd driver)."""
        try:
            self._device("create", device_index)
            if type(export_handle_types) is not int or export_handle_types < 0:
                raise driver_error("create", {}, CUDA_ERROR_INVALID_VALUE,
                                   f"export_handle_types={export_handle_types!r}: an int of "
                                   "CUmemAllocationHandleType bits")
            have = self.driver.handle_type
            if export_handle_types & MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR and have != "posix_fd":
                raise driver_error("create", {"export_handle_types": export_handle_types},
                                   CUDA_ERROR_NOT_SUPPORTED, f"POSIX file descriptors asked of "
                                   f"a driver whose handles are {have!r} (want 'posix_fd')")
        except KvvmmError as e:
            raise as_vllm_error(e) from e

    def _handle(self, call: str, hid: object) -> _Handle:
        h = self._handles.get(hid) if type(hid) is int else None
        if h is None or h.released or h.own:
            raise driver_error(call, {"handle": hid} if type(hid) is int else {},
                               CUDA_ERROR_INVALID_VALUE, "not a live handle this driver made")
        return h

    def _awake(self, call: str, va: object) -> _Reservation | None:
        """The reservation holding ``va`` (None: none made here); refused while asleep."""
        if type(va) is not int:
            return None
        bases = self._bases
        i = bisect_right(bases, va) - 1
        if i < 0:
            return None
        r = self._res[bases[i]]
        if va >= bases[i] + r.size:
            return None
        if r.asleep is not None:
            raise AsleepError(f"{call}({va:#x}) refused: the reservation is asleep (kvvmm "
                              "sleep); wake() first. Nothing changed")
        return r

    def _unmapped(self, hid: int, va: int) -> None:
        """Handle ``hid`` is no longer mapped at ``va``; a released one unmapped everywhere
        is forgotten."""
        h = self._handles[hid]
        h.vas.discard(va)
        if h.released and not h.vas:
            del self._handles[hid]

    def _reservation(self, base: object) -> _Reservation:
        r = self._res.get(base) if type(base) is int else None
        if r is None:
            raise ArgumentError("base", base, "the base pointer of a live reservation made "
                                "through this driver", f"they are {[hex(b) for b in self._bases]}")
        return r

    def _pick(self, bases: Sequence[int] | None) -> list[tuple[int, _Reservation]]:
        if bases is None:
            return [(b, self._res[b]) for b in self._bases]
        if isinstance(bases, (str, bytes)) or not isinstance(bases, Sequence):
            raise ArgumentError("bases", bases, "a sequence of base pointers, or None")
        return [(b, self._reservation(b)) for b in dict.fromkeys(bases)]

    def _sync(self) -> None:
        torch = sys.modules.get("torch")  # never import it just to ask
        if self.driver.memory is MemoryKind.DEVICE and torch and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.driver.device)  # vLLM's work on the VA is done

    def _access(self, r: _Reservation, va: int, n: int) -> None:
        self.driver.set_access(va, n)
        if r.peers:
            self.driver.set_access(va, n, sorted(r.peers))

    def _unmap_undoably(self, undo: Transaction, parts: Sequence[
            tuple[_Reservation, Sequence[tuple[int, int, int]]]]) -> None:
        """Unmap each ``(va, size, id)`` of each reservation; ``undo`` maps it back, same
        handle (bytes kept), then gives the access that reservation gives."""
        for r, maps in parts:
            for va, n, hid in maps:
                self.driver.unmap(va, n)
                undo.push(f"access {va:#x}", self._access, r, va, n)
                undo.push(f"map {va:#x} back", self.driver.map, va, n,
                          self._handles[hid].inner)

    def _release_leftovers(self, stands: str = "") -> None:
        """Release the driver handles a consolidation or unmap left; a failure keeps them."""
        try:
            while self._leftover:
                self.driver.release(self._leftover[0])
                self._leftover.pop(0)
        except Exception as e:
            e.add_note(f"{stands}{'; ' if stands else ''}consolidate, free_reserved or the "
                       "unmap of a consolidated segment retries the release")
            raise

    def _unmap_pieces(self, r: _Reservation, ptr: int, size: int) -> bool:
        """vLLM's unmap of chunks of a consolidated segment; False: none in the range."""
        hit = [va for va in r.pieces if ptr <= va < ptr + size]
        if not hit:
            return False
        wva = r.pieces[hit[0]][2]
        if ptr not in r.pieces or sum(r.pieces[v][0] for v in hit) != size or any(
                r.pieces[v][2] != wva for v in hit):
            raise driver_error("unmap", {"ptr": ptr, "size": size}, CUDA_ERROR_INVALID_VALUE,
                               "not whole chunks of one consolidated segment")
        n, wid = r.maps[wva]
        if all(v in hit for v, (_, _, w) in r.pieces.items() if w == wva):
            self.driver.unmap(wva, n)  # the last of its chunks: the memory goes
            del r.maps[wva]
            self._leftover.append(self._handles.pop(wid).inner)
        for va in hit:
            self._unmapped(r.pieces.pop(va)[1], va)
        self._release_leftovers("the unmap stands")
        return True

    def _copy(self, maps: Sequence[tuple[int, int, int]], store: Backup, *, save: bool,
              op: str = "sleep") -> None:
        """Copy every mapping's bytes out to ``store`` or back, at consecutive positions."""
        import torch

        views: list[Any] = []
        try:
            for va, n, _ in maps:
                if self.driver.memory is MemoryKind.NONE:
                    views.append(torch.empty(n, dtype=torch.uint8, device="meta"))
                elif self.driver.memory is MemoryKind.HOST:
                    buf = (ctypes.c_uint8 * n).from_address(va)
                    views.append(torch.frombuffer(buf, dtype=torch.uint8))
                else:
                    views.append(device_tensor(va, n, (n,), torch.uint8, self.driver.device,
                                               self))
            like = views[0] if views else torch.empty(0, dtype=torch.uint8, device="meta")
            if save:
                store.open(sum(v.numel() for v in views), like)
            starts = itertools.accumulate((v.numel() for v in views), initial=0)
            for pos, v in zip(starts, views, strict=False):  # starts has one past the end
                (store.save if save else store.load)(pos, v)
            store.flush(like.device)
        except Exception as e:
            if save:
                store.drop()
            if isinstance(e, KvvmmError):
                raise
            what = "copy-out to" if save else "copy back from"
            raise BackupError(f"vLLM {op}: the {what} the {store.kind} backup failed: {e!r}; "
                              + ("still asleep" if op == "sleep" and not save
                                 else "nothing changed")) from e
        finally:
            views.clear()


# -- install ---------------------------------------------------------------------------------

_state: dict[str, Any] = {}


def install(driver: Driver | KvvmmVmmDriver) -> KvvmmVmmDriver:
    """Make vLLM's ``get_vmm_driver()`` return a :class:`KvvmmVmmDriver` over ``driver``.

    Replaces the factory in ``vllm.utils.vmm_driver`` and in every loaded vLLM module that
    bound it by name (``extensible_tensor``), clearing vLLM's cached answers. Call it before
    vLLM creates its KV cache, in each worker process; again, it replaces the adapter.

    Args:
        driver: a kvvmm driver (a ``BudgetedDriver`` books every commit), or an adapter.
    Returns:
        The adapter vLLM now calls (for ``sleep``, ``snapshot``, ``backing``).
    Raises:
        VllmUnavailableError: ``vllm.utils.vmm_driver`` is not importable here.
        ArgumentError: ``driver`` is not a driver.
    """
    adapter = driver if isinstance(driver, KvvmmVmmDriver) else KvvmmVmmDriver(driver)
    try:
        mod = importlib.import_module(VLLM_MODULE)
    except ImportError as e:
        raise VllmUnavailableError(
            f"kvvmm.integrations.vllm.install: {VLLM_MODULE} cannot be imported ({e}); "
            "install vLLM 0.34 or later here, or use KvvmmVmmDriver directly") from e
    current = mod.get_vmm_driver
    original = _state["original"] if _state.get("module") is mod else current

    def get_vmm_driver() -> KvvmmVmmDriver:
        """vLLM's VMM driver: kvvmm's adapter (``kvvmm.integrations.vllm.install``)."""
        return adapter

    get_vmm_driver.cache_clear = lambda: None  # type: ignore[attr-defined]
    _rebind(current, get_vmm_driver, original)
    _state.update(original=original, adapter=adapter, factory=get_vmm_driver, module=mod)
    return adapter


def uninstall() -> bool:
    """Put vLLM's own factory back where :func:`install` replaced it. True if it did."""
    if "factory" not in _state:
        return False
    _rebind(_state["factory"], _state["original"], _state["original"])
    _state.clear()
    return True


def _rebind(old: Callable[..., Any], new: Callable[..., Any],
            original: Callable[..., Any]) -> None:
    """``new`` wherever a vLLM module holds ``old`` (or vLLM's own factory) as
    ``get_vmm_driver``; vLLM's caches cleared."""
    for name, m in list(sys.modules.items()):
        if ((name == "vllm" or name.startswith("vllm.")) and isinstance(m, types.ModuleType)
                and getattr(m, "get_vmm_driver", None) in (old, original)):
            m.get_vmm_driver = new  # type: ignore[attr-defined]
    for fn in (original, getattr(sys.modules.get(VLLM_MODULE), "vmm_unavailable_reason", None)):
        getattr(fn, "cache_clear", lambda: None)()

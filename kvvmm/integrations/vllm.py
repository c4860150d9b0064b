"""vLLM's ``VmmDriver``, backed by kvvmm: vLLM's growable KV cache on any kvvmm driver.

vLLM makes every VMM call of its growable KV cache (``ExtensibleTensor`` and the
``ExtensibleKVCache`` that sizes it) through one seam, ``vllm.utils.vmm_driver
.get_vmm_driver()``: a cached factory returning a ``VmmDriver`` (``granularity``,
``reserve``, ``free_reserved``, ``create``, ``map``, ``set_access``, ``unmap``,
``release``, ``ensure_context``, ``error_string``, ``unusable_runtime_reason`` and
``dlpack_device_type``). :class:`KvvmmVmmDriver` answers those calls over any kvvmm driver
(CUDA's, the host or sim one, a ``BudgetedDriver``, ``TracingDriver`` or ``FaultyDriver``
around one), and :func:`install` puts it behind that seam in one line::

    import kvvmm, kvvmm.integrations.vllm as kv; kv.install(kvvmm.open_driver("cuda"))

vLLM is not imported here (nor needed) until :func:`install` is called.

Same as vLLM's ``CudaVmmDriver``: the signatures, what each call returns (a base pointer, a
handle int, the granularity), and the failures: a ``RuntimeError`` reading ``GPU driver
error <code>: <cuGetErrorString's text>``, as its ``_check`` raises, so ``ExtensibleTensor``'s
own recovery runs (a refused create: empty torch's cache and retry once; a refused map: the
handle is released). Each such error is also an instance of its kvvmm class
(``DriverOutOfMemoryError``, ``BudgetExceededError``, ...), with that error's fields.

Where it differs, and why:

- **Handles** are this object's ids (1, 2, ...), not the driver's: :meth:`sleep` gives the
  memory back and :meth:`wake` maps new memory under the same ids, so the handles vLLM keeps
  (``_VirtualBuffer._handles``) stay true.
- **Granularity** is the kvvmm driver's (the unit it enforces): CUDA's recommended one when
  the driver was opened so, where vLLM asks CUDA for the minimum (both 2 MiB on H100/H200).
- **export_handle_types**: POSIX file descriptors need a driver whose handles are
  ``"posix_fd"`` (else CUDA_ERROR_NOT_SUPPORTED); FABRIC is honoured where the driver's
  handles are FABRIC ones and dropped otherwise, as vLLM's driver drops it where FABRIC is
  unavailable.
- **dlpack_device_type**: kDLCUDA on CUDA; kDLCPU on the host driver (vLLM's views are CPU
  tensors over real bytes); 0 on the simulator, which holds no memory (torch refuses it).
- **One device**: a call naming a ``device_index`` other than the driver's is refused
  (CUDA_ERROR_INVALID_DEVICE, as CUDA answers an ordinal it has no memory on).

What vLLM lacks, through the same seam: every create charged to the per-GPU budget (install
over a ``BudgetedDriver``); :meth:`KvvmmVmmDriver.sleep` / :meth:`~KvvmmVmmDriver.wake` that
keep the KV contents (vLLM's own sleep recommits zeros); :meth:`~KvvmmVmmDriver.backing`,
how many physical allocations back each segment (what RDMA registration needs: one); and
:meth:`~KvvmmVmmDriver.snapshot`, each reservation as an ``ArenaSnapshot`` that
``kvvmm.viz.describe`` and ``va_map`` draw. docs/VLLM.md is the user's page.
"""

from __future__ import annotations

import bisect
import importlib
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvvmm.arena import Transaction, device_tensor
from kvvmm.arena.backup import Backup, make_backup
from kvvmm.checks import int_arg
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
    DriverError,
    KvvmmError,
    SleepRefusedError,
)
from kvvmm.snapshot import AllocationInfo, ArenaSnapshot, MappingInfo

__all__ = [
    "MEM_HANDLE_TYPE_FABRIC",
    "MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    "VLLM_MODULE",
    "KvvmmVmmDriver",
    "SegmentBacking",
    "VllmDriverError",
    "VllmSleepResult",
    "VllmUnavailableError",
    "install",
    "installed",
    "uninstall",
]

#: The module whose factory :func:`install` replaces.
VLLM_MODULE = "vllm.utils.vmm_driver"
#: ``export_handle_types`` bits, as vLLM (and CUDA's ``CUmemAllocationHandleType``) number them.
MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
MEM_HANDLE_TYPE_FABRIC = 8

CUDA_ERROR_NOT_PERMITTED = "CUDA_ERROR_NOT_PERMITTED"
#: CUDA's code and ``cuGetErrorString`` text for each error name kvvmm's drivers raise.
_CODES = {
    CUDA_ERROR_INVALID_VALUE: (1, "invalid argument"),
    "CUDA_ERROR_OUT_OF_MEMORY": (2, "out of memory"),
    CUDA_ERROR_INVALID_DEVICE: (101, "invalid device ordinal"),
    CUDA_ERROR_NOT_PERMITTED: (800, "operation not permitted"),
    CUDA_ERROR_NOT_SUPPORTED: (801, "operation not supported"),
    "CUDA_ERROR_ILLEGAL_ADDRESS": (700, "an illegal memory access was encountered"),
    "CUDA_ERROR_UNKNOWN": (999, "unknown error"),
}
_UNKNOWN = (999, "unknown error")
_TEXT = {code: text for code, text in _CODES.values()}
#: DLPack device types (``kDLCPU``, ``kDLCUDA``); 0 is none, which torch refuses.
_DLPACK = {MemoryKind.DEVICE: 2, MemoryKind.HOST: 1, MemoryKind.NONE: 0}


class VllmUnavailableError(KvvmmError, ImportError):
    """vLLM cannot be imported here, so :func:`install` has no factory to replace.

    Install vLLM (0.34 or later: the release with ``vllm.utils.vmm_driver``) in this
    environment, or use :class:`KvvmmVmmDriver` directly.
    """


class VllmDriverError(KvvmmError, RuntimeError):
    """A kvvmm failure as vLLM's drivers raise one: ``GPU driver error <code>: <text>``.

    Every such error is also an instance of its kvvmm class (a twin made on first use, in
    :class:`runtime_errors`), with that error's fields; ``code`` is CUDA's number for it.
    """

    code: int = _UNKNOWN[0]


class runtime_errors:  # a namespace, lower-case as the module path it makes reads
    """The ``VllmDriverError`` twins of kvvmm's errors, by their kvvmm name."""


def _twin(cls: type[KvvmmError]) -> type[KvvmmError]:
    sub = runtime_errors.__dict__.get(cls.__name__)
    if not (isinstance(sub, type) and issubclass(sub, cls)):
        sub = types.new_class(cls.__name__, (cls, VllmDriverError))
        sub.__module__ = __name__
        sub.__qualname__ = f"runtime_errors.{cls.__name__}"
        sub.__doc__ = cls.__doc__
        setattr(runtime_errors, cls.__name__, sub)
    return sub


def as_vllm_error(err: KvvmmError) -> VllmDriverError:
    """``err`` as vLLM's drivers would raise it (see :class:`VllmDriverError`)."""
    if isinstance(err, VllmDriverError):
        return err
    # A refusal while asleep is CUDA's answer to an operation the state does not permit.
    name = (err.cuda_error if isinstance(err, DriverError) else
            CUDA_ERROR_NOT_PERMITTED if isinstance(err, AsleepError) else "")
    code, text = _CODES.get(name, _UNKNOWN)
    new = _twin(type(err)).__new__(_twin(type(err)))
    new.__dict__.update(err.__dict__)
    new.args = (f"GPU driver error {code}: {text} ({err})",)
    new.code = code  # type: ignore[attr-defined]
    return new  # type: ignore[return-value]


@contextmanager
def _vllm_errors() -> Iterator[None]:
    try:
        yield
    except KvvmmError as e:
        raise as_vllm_error(e) from e


class _Handle:
    """One handle this object gave vLLM: the driver's handle behind it now."""

    __slots__ = ("export", "inner", "released", "size", "vas")

    def __init__(self, inner: int, size: int, export: int) -> None:
        self.inner = inner
        self.size = size
        self.export = export
        self.released = False  # vLLM released it (its memory stays while mapped)
        self.vas: set[int] = set()  # where it is mapped


class _Reservation:
    """One reservation and what is mapped in it, by VA; a sleep's plan while asleep."""

    __slots__ = ("asleep", "maps", "peers", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.maps: dict[int, tuple[int, int]] = {}  # va -> (size, handle id)
        self.peers: set[int] = set()  # other devices given access
        self.asleep: _Asleep | None = None


@dataclass(slots=True)
class _Asleep:
    """One sleep of one or more reservations: they wake together, from one backup."""

    parts: list[tuple[_Reservation, list[tuple[int, int, int]]]]  # (va, size, id), by VA
    backup: Backup | None
    leftover: list[int]  # driver handles the sleep's release failed to give back

    @property
    def maps(self) -> list[tuple[int, int, int]]:
        return [m for _, ms in self.parts for m in ms]

    def of(self, r: _Reservation) -> list[tuple[int, int, int]]:
        return next(ms for q, ms in self.parts if q is r)


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


@dataclass(frozen=True, slots=True)
class VllmSleepResult:
    """What one :meth:`KvvmmVmmDriver.sleep` did."""

    reservations: int  #: reservations put to sleep
    mappings: int  #: mappings given back (a wake makes as many)
    given_bytes: int  #: physical bytes unmapped and released
    backup: str | None  #: where the contents are kept (``"host"``, ``"disk"``), or None
    backup_bytes: int  #: bytes copied out (0 without a backup)


class KvvmmVmmDriver:
    """vLLM's ``VmmDriver`` over a kvvmm driver (see the module docstring).

    Args:
        driver: any kvvmm driver, wrappers included; the caller keeps and closes it.
    Raises:
        ArgumentError: ``driver`` is not a driver.
    """

    def __init__(self, driver: Driver) -> None:
        check_driver(driver)
        self.driver = driver
        #: what vLLM builds its tensors over the VA as (see the module docstring)
        self.dlpack_device_type: int = _DLPACK[driver.memory]
        self._lock = threading.RLock()
        self._res: dict[int, _Reservation] = {}
        self._bases: list[int] = []  # sorted
        self._handles: dict[int, _Handle] = {}
        self._next_id = 1

    def __repr__(self) -> str:
        return f"KvvmmVmmDriver({self.driver!r})"

    # -- vLLM's VmmDriver ------------------------------------------------------------------

    def error_string(self, code: int) -> str:
        """``cuGetErrorString``'s text for a CUDA error code this adapter raises."""
        return _TEXT.get(code, _UNKNOWN[1])

    def unusable_runtime_reason(self, device_index: int) -> str | None:
        """Why this driver cannot back vLLM's growable allocations here, or None."""
        if device_index != self.driver.device:
            return (f"kvvmm's {self.driver.kind} driver is on device {self.driver.device}, "
                    f"not {device_index}")
        if self.driver.memory is MemoryKind.NONE:
            return ("kvvmm's simulator holds no memory: vLLM's tensors cannot be made over "
                    "its VA")
        return None

    def ensure_context(self, device_index: int) -> None:
        """Check ``device_index`` is the driver's (kvvmm's CUDA driver binds its context)."""
        with _vllm_errors():
            self._device("ensure_context", device_index)

    def granularity(self, device_index: int) -> int:
        """The driver's granularity: every size and address vLLM passes is a multiple."""
        with _vllm_errors():
            self._device("granularity", device_index)
            return self.driver.granularity()

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of VA; return its base pointer."""
        with self._lock, _vllm_errors():
            va = self.driver.reserve(size, 0)
            self._res[va] = _Reservation(size)
            bisect.insort(self._bases, va)
            return va

    def free_reserved(self, ptr: int, size: int) -> None:
        """Give back the reservation at ``ptr`` (nothing mapped in it)."""
        with self._lock, _vllm_errors():
            r = self._res.get(ptr)
            if r is not None:
                self._awake(r, "free_reserved", ptr)
            self.driver.free(ptr, size)
            if r is not None:
                del self._res[ptr]
                self._bases.remove(ptr)

    def create(self, size: int, device_index: int, export_handle_types: int = 0) -> int:
        """Create ``size`` bytes of physical memory on ``device_index``; return a handle."""
        with self._lock, _vllm_errors():
            self._device("create", device_index, size=size)
            export = self._export(size, export_handle_types)
            inner = self.driver.create(size)
            hid = self._next_id
            self._next_id += 1
            self._handles[hid] = _Handle(inner, size, export)
            return hid

    def map(self, ptr: int, size: int, handle: int) -> None:
        """Map the whole of ``handle`` at ``ptr``, inside a reservation."""
        with self._lock, _vllm_errors():
            h = self._handle("map", handle, va=ptr, size=size)
            r = self._find(ptr)
            if r is not None:
                self._awake(r[1], "map", ptr)
            self.driver.map(ptr, size, h.inner)
            if r is not None:
                r[1].maps[ptr] = (size, handle)
            h.vas.add(ptr)

    def set_access(self, ptr: int, size: int, device_index: int) -> None:
        """Make mapped ``[ptr, ptr + size)`` readable and writable by ``device_index``."""
        with self._lock, _vllm_errors():
            r = self._find(ptr)
            if r is not None:
                self._awake(r[1], "set_access", ptr)
            if device_index == self.driver.device:
                self.driver.set_access(ptr, size)
            else:
                self.driver.set_access(ptr, size, [device_index])
                if r is not None:
                    r[1].peers.add(device_index)

    def unmap(self, ptr: int, size: int) -> None:
        """Unmap ``[ptr, ptr + size)``: whole mappings only."""
        with self._lock, _vllm_errors():
            r = self._find(ptr)
            if r is not None:
                self._awake(r[1], "unmap", ptr)
            self.driver.unmap(ptr, size)
            if r is not None:
                for va in [va for va in r[1].maps if ptr <= va < ptr + size]:
                    _, hid = r[1].maps.pop(va)
                    self._unmapped(hid, va)

    def release(self, handle: int) -> None:
        """Release ``handle``; its memory goes when its last mapping goes."""
        with self._lock, _vllm_errors():
            h = self._handle("release", handle)
            if any(self._asleep_at(va) for va in h.vas):
                raise AsleepError(f"release({handle}) refused: the handle's mapping is asleep "
                                  f"(kvvmm sleep); wake() first. Nothing changed")
            self.driver.release(h.inner)
            h.released = True
            if not h.vas:
                del self._handles[handle]

    # -- what kvvmm adds ---------------------------------------------------------------------

    def reservations(self) -> tuple[int, ...]:
        """The base pointers of the live reservations made through this object, in order."""
        with self._lock:
            return tuple(self._bases)

    def backing(self, base: int, segments: Sequence[tuple[int, int]]) -> tuple[SegmentBacking, ...]:
        """How each segment of the reservation at ``base`` is backed (RDMA readiness).

        Args:
            base: a reservation's base pointer (``ExtensibleTensor.base_ptr``).
            segments: ``(offset, size_bytes)`` from ``base`` for each segment, e.g.
                ``zip(t.segment_offsets, committed sizes)``.
        Returns:
            One :class:`SegmentBacking` per segment, in order: ``allocations`` is how many
            physical allocations reach into it, ``rdma_ready`` whether one holds it whole.
        Raises:
            ArgumentError: ``base`` is not a reservation made here, or a segment lies
                outside it.
        """
        with self._lock:
            r = self._reservation(base)
            out = []
            for i, seg in enumerate(segments):
                off, size = (int_arg(f"segments[{i}][{j}]", v, lo=0) for j, v in
                             enumerate(seg))
                if off + size > r.size:
                    raise ArgumentError(f"segments[{i}]", seg,
                                        f"inside the reservation's {r.size} bytes")
                maps = [(va - base, s) for va, (s, _) in r.maps.items()
                        if va - base < off + size and va - base + s > off]
                backed = sum(min(o + s, off + size) - max(o, off) for o, s in maps)
                out.append(SegmentBacking(off, size, len(maps), backed))
            return tuple(out)

    def snapshot(self, base: int, name: str = "vllm") -> ArenaSnapshot:
        """The reservation at ``base`` as an arena snapshot (``kvvmm.viz`` draws it).

        One allocation spans the reservation; mappings carry this object's handle ids.
        Asleep, the mappings a wake makes again are ``asleep_mappings``.

        Raises:
            ArgumentError: ``base`` is not a reservation made here.
        """
        with self._lock:
            r = self._reservation(base)
            maps = tuple(MappingInfo(va - base, s, hid, name)
                         for va, (s, hid) in sorted(r.maps.items()))
            backed = sum(m.size_bytes for m in maps)
            prefix = 0
            for m in maps:
                if m.offset != prefix:
                    break
                prefix += m.size_bytes
            sleeping = () if r.asleep is None else tuple(
                MappingInfo(va - base, s, hid, name) for va, s, hid in r.asleep.of(r))
            return ArenaSnapshot(
                name=name, driver=self.driver.kind, device_name=self.driver.name,
                granularity=self.driver.granularity(), base=base, reserved_bytes=r.size,
                cursor_bytes=r.size,
                allocations=(AllocationInfo(name, 0, r.size, r.size, backed, prefix),),
                mappings=maps, backed_bytes=backed, closed=False,
                peer_devices=tuple(sorted(r.peers)),
                asleep_bytes=sum(m.size_bytes for m in sleeping), asleep_mappings=sleeping)

    def asleep(self, base: int) -> bool:
        """Whether the reservation at ``base`` is asleep."""
        with self._lock:
            return self._reservation(base).asleep is not None

    def sleep(self, bases: Sequence[int] | None = None, *, backup: str | Backup | None = "host",
              path: Any = None) -> VllmSleepResult:
        """Give back the memory mapped in reservations, keeping their VA and the contents.

        vLLM's pointers, views and captured graphs stay valid; :meth:`wake` maps new memory
        at the same VA under the same handle ids and copies the bytes back. While asleep,
        vLLM's calls on that VA (map, unmap, set_access, release, free_reserved) are refused
        (``AsleepError``, as a RuntimeError), and reading it shows what the driver shows for
        unmapped VA (zeros on the host driver). Reservations put to sleep together wake
        together (one backup holds their bytes).

        Args:
            bases: reservations' base pointers (None: every one made here).
            backup: ``"host"`` (default; pinned on CUDA), ``"disk"`` (``path``), a kvvmm
                ``Backup``, or None to drop the contents (a wake gives fresh memory).
            path: the new file for ``backup="disk"``.
        Returns:
            A :class:`VllmSleepResult`.
        Raises:
            ArgumentError: an unknown base or a bad backup; nothing changed.
            SleepRefusedError: one is asleep already, or maps a handle vLLM released (its
                memory could not be mapped back if the sleep failed); nothing changed.
            BackupError: the copy-out failed; nothing changed.
            DriverError: an unmap failed (every mapping is back, bytes and all), or a
                release after every unmap (the sleep stands; :meth:`wake` retries it).
        """
        with self._lock:
            picked = self._pick(bases)
            for base, r in picked:
                if r.asleep is not None:
                    raise SleepRefusedError(f"sleep: the reservation at {base:#x} is asleep "
                                            "already; wake() first")
                for va, (_, hid) in r.maps.items():
                    if self._handles[hid].released:
                        raise SleepRefusedError(
                            f"sleep: the mapping at {va:#x} holds handle {hid}, which was "
                            "released while mapped; nothing changed")
            store = make_backup(backup, path)
            group = _Asleep([(r, sorted((va, s, hid) for va, (s, hid) in r.maps.items()))
                             for _, r in picked], store, [])
            flat = group.maps
            self._sync()
            if store is not None:
                self._copy(flat, store, save=True)
            undo = Transaction()
            try:
                for va, size, hid in flat:
                    self.driver.unmap(va, size)
                    undo.push(f"map {va:#x} back", self._remap, va, size, hid)
            except BaseException as e:
                undo.unwind(e)
                if store is not None:
                    store.drop()
                raise
            undo.commit()
            failed: BaseException | None = None
            for va, _, hid in flat:
                h = self._handles[hid]
                h.vas.discard(va)
                try:
                    self.driver.release(h.inner)
                except Exception as e:  # past every unmap: the sleep stands
                    group.leftover.append(h.inner)
                    failed = failed or e
            for r, _ in group.parts:
                r.maps.clear()
                r.asleep = group
            if failed is not None:
                failed.add_note("the sleep stands; wake() retries the release")
                raise failed
            nbytes = sum(s for _, s, _ in flat)
            return VllmSleepResult(len(group.parts), len(flat), nbytes,
                                   None if store is None else store.kind,
                                   0 if store is None else nbytes)

    def wake(self, bases: Sequence[int] | None = None) -> int:
        """Map new memory where :meth:`sleep` gave it back, same handle ids, bytes copied back.

        Args:
            bases: reservations' base pointers (None: every asleep one made here); the
                others put to sleep with them wake too.
        Returns:
            Bytes backed again.
        Raises:
            ArgumentError: an unknown base; SleepRefusedError: one named is awake.
            DriverError, BackupError: a create, map, access or copy failed (out of memory,
                a budget's limit): every handle the wake made is given back, the
                reservations are asleep with their backups intact; retry later.
        """
        with self._lock:
            groups: list[_Asleep] = []
            for base, r in self._pick(bases):
                if r.asleep is None:
                    if bases is not None:
                        raise SleepRefusedError(f"wake: the reservation at {base:#x} is awake")
                elif r.asleep not in groups:
                    groups.append(r.asleep)
            return sum(self._wake(g) for g in groups)

    def _wake(self, group: _Asleep) -> int:
        while group.leftover:  # a sleep's release that failed: the memory is needed now
            self.driver.release(group.leftover[0])
            group.leftover.pop(0)
        undo = Transaction()
        made: list[tuple[int, int, int]] = []  # (va, handle id, driver handle)
        try:
            for r, maps in group.parts:
                for va, size, hid in maps:
                    inner = self.driver.create(size)
                    undo.push(f"release {inner}", self.driver.release, inner)
                    self.driver.map(va, size, inner)
                    undo.push(f"unmap {va:#x}", self.driver.unmap, va, size)
                    self.driver.set_access(va, size)
                    if r.peers:
                        self.driver.set_access(va, size, sorted(r.peers))
                    made.append((va, hid, inner))
            if group.backup is not None:
                self._copy(group.maps, group.backup, save=False)
        except BaseException as e:
            undo.unwind(e)
            raise
        undo.commit()
        for va, hid, inner in made:
            self._handles[hid].inner = inner
            self._handles[hid].vas.add(va)
        for r, maps in group.parts:
            r.maps.update((va, (size, hid)) for va, size, hid in maps)
            r.asleep = None
        if group.backup is not None:
            group.backup.drop()
        return sum(size for _, size, _ in group.maps)

    # -- helpers ---------------------------------------------------------------------------

    def _device(self, call: str, device_index: object, **args: int) -> None:
        if type(device_index) is not int or device_index != self.driver.device:
            if type(device_index) is int:
                args["device"] = device_index
            raise driver_error(call, args, CUDA_ERROR_INVALID_DEVICE,
                               f"kvvmm's {self.driver.kind} driver is on device "
                               f"{self.driver.device}")

    def _export(self, size: int, types_: object) -> int:
        if not isinstance(types_, int) or types_ < 0:
            raise driver_error("create", {"size": size}, CUDA_ERROR_INVALID_VALUE,
                               f"export_handle_types={types_!r}: an int of "
                               f"CUmemAllocationHandleType bits")
        have = self.driver.handle_type
        if types_ & MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR and have != "posix_fd":
            raise driver_error("create", {"size": size, "export_handle_types": types_},
                               CUDA_ERROR_NOT_SUPPORTED,
                               f"POSIX file descriptors asked, but kvvmm's driver's handles "
                               f"are {have!r} (open it with handle_type='posix_fd')")
        return types_ if have == "fabric" else types_ & ~MEM_HANDLE_TYPE_FABRIC

    def _handle(self, call: str, hid: object, **args: int) -> _Handle:
        h = self._handles.get(hid) if type(hid) is int else None
        if h is None or h.released:
            if type(hid) is int:
                args["handle"] = hid
            raise driver_error(call, args, CUDA_ERROR_INVALID_VALUE,
                               "not a live handle this driver created")
        return h

    def _unmapped(self, hid: int, va: int) -> None:
        h = self._handles[hid]
        h.vas.discard(va)
        if h.released and not h.vas:
            del self._handles[hid]

    def _find(self, va: object) -> tuple[int, _Reservation] | None:
        if not isinstance(va, int):
            return None
        i = bisect.bisect_right(self._bases, va) - 1
        if i < 0:
            return None
        base = self._bases[i]
        r = self._res[base]
        return (base, r) if va < base + r.size else None

    def _asleep_at(self, va: int) -> bool:
        r = self._find(va)
        return r is not None and r[1].asleep is not None

    def _awake(self, r: _Reservation, call: str, va: int) -> None:
        if r.asleep is not None:
            raise AsleepError(f"{call}({va:#x}) refused: the reservation is asleep (kvvmm "
                              "sleep); wake() first. Nothing changed")

    def _reservation(self, base: object) -> _Reservation:
        r = self._res.get(base) if isinstance(base, int) else None
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

    def _remap(self, va: int, size: int, hid: int) -> None:
        """Undo of a sleep's unmap: the same handle back at the same VA (bytes and all)."""
        self.driver.map(va, size, self._handles[hid].inner)
        self.driver.set_access(va, size)

    def _sync(self) -> None:
        if self.driver.memory is MemoryKind.DEVICE:
            torch = sys.modules.get("torch")  # never import it just to ask
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.synchronize(self.driver.device)

    def _tensor(self, va: int, size: int) -> Any:
        import torch

        kind = self.driver.memory
        if kind is MemoryKind.NONE:
            return torch.empty(size, dtype=torch.uint8, device="meta")
        if kind is MemoryKind.HOST:
            import ctypes

            return torch.frombuffer((ctypes.c_uint8 * size).from_address(va),
                                    dtype=torch.uint8)
        return device_tensor(va, size, (size,), torch.uint8, self.driver.device, self)

    def _copy(self, maps: Sequence[tuple[int, int, int]], store: Backup, *, save: bool) -> None:
        """Copy every mapping's bytes out to ``store`` or back, at consecutive positions."""
        from kvvmm.errors import BackupError

        views: list[Any] = []
        try:
            views = [self._tensor(va, size) for va, size, _ in maps]
            like = views[0] if views else self._tensor(0, 0)
            if save:
                store.open(sum(size for _, size, _ in maps), like)
            pos = 0
            for v in views:
                (store.save if save else store.load)(pos, v)
                pos += v.numel()
            store.flush(like.device)
        except Exception as e:
            if save:
                store.drop()
            if isinstance(e, KvvmmError):
                raise
            raise BackupError(f"vLLM sleep: the {'copy-out' if save else 'copy back'} of "
                              f"the {store.kind} backup failed: {type(e).__name__}: {e}; "
                              + ("nothing changed" if save else "still asleep, backup "
                                 "intact")) from e
        finally:
            views.clear()


# -- install ---------------------------------------------------------------------------------

_state: dict[str, Any] = {}


def installed() -> KvvmmVmmDriver | None:
    """The adapter :func:`install` put behind vLLM's factory, or None."""
    return _state.get("adapter")


def install(driver: Driver | KvvmmVmmDriver) -> KvvmmVmmDriver:
    """Make vLLM's ``get_vmm_driver()`` return a :class:`KvvmmVmmDriver` over ``driver``.

    Replaces the factory in ``vllm.utils.vmm_driver`` and in every loaded vLLM module that
    bound it by name (``from vllm.utils.vmm_driver import get_vmm_driver``), and clears the
    cached answers of vLLM's factory and of ``vmm_unavailable_reason``. Call it before vLLM
    creates its KV cache (in each worker process). Installing again replaces the adapter.

    Args:
        driver: a kvvmm driver (``kvvmm.open_driver("cuda")``; a ``BudgetedDriver`` to book
            every commit to the GPU's budget), or an adapter made already.
    Returns:
        The adapter vLLM now calls (for :meth:`~KvvmmVmmDriver.sleep`, ``snapshot``, ...).
    Raises:
        VllmUnavailableError: vLLM (with ``vllm.utils.vmm_driver``) is not importable here.
        ArgumentError: ``driver`` is not a driver.
    """
    adapter = driver if isinstance(driver, KvvmmVmmDriver) else KvvmmVmmDriver(driver)
    try:
        mod = importlib.import_module(VLLM_MODULE)
    except ImportError as e:
        raise VllmUnavailableError(
            f"kvvmm.integrations.vllm.install: {VLLM_MODULE} cannot be imported ({e}); "
            "install vLLM 0.34 or later here, or use KvvmmVmmDriver directly") from e
    original = _state.get("original", mod.get_vmm_driver)

    def get_vmm_driver() -> KvvmmVmmDriver:
        """vLLM's VMM driver: kvvmm's adapter (``kvvmm.integrations.vllm.install``)."""
        return adapter

    get_vmm_driver.cache_clear = lambda: None  # type: ignore[attr-defined]
    get_vmm_driver.kvvmm_adapter = adapter  # type: ignore[attr-defined]
    _rebind(mod.get_vmm_driver, get_vmm_driver, original)
    _state.update(original=original, adapter=adapter, factory=get_vmm_driver, module=mod)
    return adapter


def uninstall() -> bool:
    """Put vLLM's own factory back where :func:`install` replaced it. True if it did."""
    factory = _state.pop("factory", None)
    if factory is None:
        return False
    original = _state.pop("original")
    _state.pop("adapter", None)
    _state.pop("module", None)
    _rebind(factory, original, original)
    return True


def _rebind(old: Callable[..., Any], new: Callable[..., Any],
            original: Callable[..., Any]) -> None:
    """``new`` wherever a vLLM module holds ``old`` (or vLLM's own factory) as
    ``get_vmm_driver``; vLLM's caches cleared."""
    for name, m in list(sys.modules.items()):
        if ((name == "vllm" or name.startswith("vllm.")) and isinstance(m, types.ModuleType)
                and getattr(m, "get_vmm_driver", None) in (old, original)):
            m.get_vmm_driver = new  # type: ignore[attr-defined]
    for fn in (original, getattr(sys.modules.get(VLLM_MODULE), "vmm_unavailable_reason",
                                 None)):
        clear = getattr(fn, "cache_clear", None)
        if callable(clear):
            clear()

"""HostDriver: the VMM protocol on Linux host memory, with real bytes.

reserve = ``mmap(PROT_READ, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)`` (a read-only view of
the kernel's zero page: see "Safe reads" below); create = ``memfd_create(MFD_ALLOW_SEALING)`` +
``ftruncate`` + ``posix_fallocate`` + ``F_ADD_SEALS(F_SEAL_SHRINK|F_SEAL_GROW)`` (the pages
exist once created, like ``cuMemCreate``; fresh memfd pages are zero, so a recommit never shows
an earlier tenant's bytes); map = ``mmap(MAP_SHARED|MAP_FIXED)`` of the fd at the VA
(``PROT_NONE``: mapped but not yet accessible, as on a GPU before ``cuMemSetAccess``); set
access = ``mprotect(READ|WRITE)``; unmap = map the reservation's read-only placeholder back
over the range; release = close the fd (the mapping keeps the pages); free = ``munmap``.

Safe reads: reserved VA that is not mapped reads as zeros (printing a tensor before its
commit shows zeros instead of killing the process with SIGSEGV); *writing* to it still faults
(SIGSEGV), as touching unbacked VA does on a GPU, so a write past the backed span never lands
anywhere. Mapped VA before ``set_access`` faults on any touch.

Sealed handles: the memfd behind every handle is sealed against shrinking and growing once
its size is set, so a process that imports an exported handle cannot ``ftruncate`` it (EPERM)
and kill this one with SIGBUS; ``import_handle`` takes only memfds sealed that way.

Close: ``close()`` gives back everything still held, but refuses (``BusyError``, nothing
given back) while a reservation is pinned (:meth:`HostDriver.pin`: a tensor can still reach
it); ``free`` of a pinned reservation is refused the same way. Calls from several threads are
safe: one lock per driver around each call's check and act.

Handles cross processes as their memfd: ``export_handle`` gives a ``dup`` of it, which another
process receives (``multiprocessing.reduction.send_handle`` / ``recv_handle``, SCM_RIGHTS)
and passes to ``import_handle``; both processes then map the same pages. Host memory has one
"device": set access for any other device is refused (CUDA_ERROR_INVALID_VALUE, as CUDA
refuses an ordinal it does not have).

The rules are the shared :class:`VmmBook`'s, and the arguments pass the shared
:func:`~kvvmm.driver.base.check_call_ints`, so the host driver refuses exactly what the
simulator does, before any syscall.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import itertools
import mmap as _mmap
import os
import stat
import sys
import threading
from collections.abc import Sequence

from kvvmm.checks import is_int
from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    Driver,
    DriverStats,
    MemoryKind,
    Pins,
    check_call_ints,
    driver_error,
    locked,
    refuse_close,
)
from kvvmm.driver.book import VmmBook
from kvvmm.errors import ArgumentError, DriverUnavailableError
from kvvmm.units import MiB

__all__ = ["HostDriver"]

_PROT_NONE = 0
_PROT_READ = _mmap.PROT_READ
_PROT_RW = _mmap.PROT_READ | _mmap.PROT_WRITE
_MAP_SHARED = 0x01
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
#: The seals every handle's memfd gets: its size can no longer change (no SIGBUS by a peer).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW



def _libc() -> ctypes.CDLL:
    if not sys.platform.startswith("linux"):
        raise DriverUnavailableError(
            f"the host driver needs Linux (memfd_create, mmap MAP_FIXED); this is {sys.platform}"
        )
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.restype = ctypes.c_int
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class HostDriver(Driver):
    """Host-memory VMM: the driver protocol over mmap and memfd, real bytes on the CPU.

    Args:
        granularity: allocation unit in bytes (default 2 MiB, as on H100/H200); a multiple
            of the OS page size.
        capacity_bytes: cap on the memory this driver will create (default: the host's
            available memory when the driver opens). Create beyond it is out of memory.
        device: device ordinal to report (host memory has one "device", 0).
    """

    kind = "host"
    memory = MemoryKind.HOST
    handle_type = "posix_fd"  #: its exports are memfds, POSIX file descriptors

    def __init__(
        self, *, granularity: int = 2 * MiB, capacity_bytes: int | None = None, device: int = 0
    ) -> None:
        page = _mmap.PAGESIZE
        if not is_int(granularity) or granularity <= 0 or granularity % page:
            raise ArgumentError("granularity", granularity, f"a positive multiple of {page}")
        if capacity_bytes is not None and (not is_int(capacity_bytes) or capacity_bytes <= 0):
            raise ArgumentError("capacity_bytes", capacity_bytes, "an int > 0 or None")
        self._libc = _libc()
        self.device = device
        self.name = "host memory"
        cap = _mem_available() if capacity_bytes is None else capacity_bytes
        self._book = VmmBook(granularity, cap)
        self._fds: dict[int, int] = {}  # handle -> memfd (handle ids are our own counter)
        self._handle_ids = itertools.count(1)
        self._pins = Pins()  # reservation start -> pins (views that reach it)
        # Reentrant: close() makes the driver's own calls under it.
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        book = self._book
        return f"HostDriver(granularity={book.gran}, capacity_bytes={book.capacity_bytes})"

    def _os_error(self, call: str, args: dict[str, int], what: str) -> Exception:
        err = ctypes.get_errno()
        name = CUDA_ERROR_OUT_OF_MEMORY if err in (errno.ENOMEM, errno.ENOSPC) else (
            "CUDA_ERROR_UNKNOWN"
        )
        return driver_error(call, args, name, f"{what}: {os.strerror(err)}")

    def _placeholder(self, va: int, size: int, fixed: bool) -> int:
        # PROT_READ over private anonymous memory never written: every page reads as the
        # kernel's one zero page (no memory used); a write faults.
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | (_MAP_FIXED if fixed else 0)
        got = self._libc.mmap(va if fixed else None, size, _PROT_READ, flags, -1, 0)
        return -1 if got in (None, _MAP_FAILED) else int(got)

    def granularity(self) -> int:
        return self._book.gran

    @locked
    def reserve(self, size: int, align: int = 0) -> int:
        size, align = check_call_ints("reserve", size=size, align=align).values()
        align = self._book.check_reserve(size, align)
        if size + align >= 1 << 64:  # the over-reservation below must not wrap in size_t
            raise driver_error("reserve", {"size": size, "align": align},
                               CUDA_ERROR_OUT_OF_MEMORY, "no VA range that large exists")
        # Over-reserve by `align`, then trim both ends to an aligned range.
        raw = self._placeholder(0, size + align, fixed=False)
        if raw < 0:
            raise self._os_error("reserve", {"size": size, "align": align}, "mmap(PROT_NONE)")
        va = -(-raw // align) * align
        if va > raw:
            self._libc.munmap(raw, va - raw)
        tail = raw + size + align - (va + size)
        if tail:
            self._libc.munmap(va + size, tail)
        self._book.apply_reserve(va, size)
        return va

    @locked
    def free(self, va: int, size: int) -> None:
        va, size = check_call_ints("free", va=va, size=size).values()
        self._book.check_free(va, size)
        self._pins.check_free(va, size)
        if self._libc.munmap(va, size) != 0:
            raise self._os_error("free", {"va": va, "size": size}, "munmap")
        self._book.apply_free(va)
        self._pins.forget(va)

    @locked
    def create(self, size: int) -> int:
        (size,) = check_call_ints("create", size=size).values()
        book = self._book
        book.check_create(size, book.capacity_bytes - book.physical_bytes)
        args = {"size": size}
        fd = -1
        try:
            fd = os.memfd_create("kvvmm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            # Fixed size from now on: a peer that imports it cannot truncate it under us.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            # Out of memory, or out of file descriptors (one per live handle: EMFILE).
            full = (errno.ENOMEM, errno.ENOSPC, errno.EMFILE, errno.ENFILE)
            name = CUDA_ERROR_OUT_OF_MEMORY if e.errno in full else "CUDA_ERROR_UNKNOWN"
            raise driver_error("create", args, name, f"memfd: {e.strerror}") from None
        handle = next(self._handle_ids)
        self._fds[handle] = fd
        book.apply_create(handle, size)
        return handle

    @locked
    def release(self, handle: int) -> None:
        (handle,) = check_call_ints("release", handle=handle).values()
        self._book.check_release(handle)
        os.close(self._fds.pop(handle))  # a live mapping keeps the pages
        self._book.apply_release(handle)

    @locked
    def map(self, va: int, size: int, handle: int) -> None:
        va, size, handle = check_call_ints("map", va=va, size=size, handle=handle).values()
        res = self._book.check_map(va, size, handle)
        got = self._libc.mmap(va, size, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, self._fds[handle], 0)
        if got in (None, _MAP_FAILED):
            # MAP_FIXED failed: the placeholder may be gone; put it back before reporting.
            self._placeholder(va, size, fixed=True)
            raise self._os_error("map", {"va": va, "size": size, "handle": handle}, "mmap(fd)")
        self._book.apply_map(va, size, handle, res)

    @locked
    def unmap(self, va: int, size: int) -> None:
        va, size = check_call_ints("unmap", va=va, size=size).values()
        starts = self._book.covered("unmap", va, size)
        if self._placeholder(va, size, fixed=True) != va:
            raise self._os_error("unmap", {"va": va, "size": size}, "mmap(PROT_NONE)")
        self._book.apply_unmap(starts)

    @locked
    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        va, size = check_call_ints("set_access", va=va, size=size).values()
        if devices is not None:
            self._check_devices(va, size, devices)
        self._book.covered("set_access", va, size)
        if self._libc.mprotect(va, size, _PROT_RW) != 0:
            raise self._os_error("set_access", {"va": va, "size": size}, "mprotect")

    def _check_devices(self, va: int, size: int, devices: Sequence[int]) -> None:
        if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices:
            raise ArgumentError("devices", devices, "a non-empty sequence of device ordinals")
        for d in devices:
            d = check_call_ints("set_access", device=d)["device"]
            if d != self.device:
                raise driver_error(  # INVALID_VALUE: CUDA's answer for an ordinal it lacks
                    "set_access", {"va": va, "size": size}, CUDA_ERROR_INVALID_VALUE,
                    f"device {d!r}: host memory has one device ({self.device}); peer access "
                    "needs GPUs (CudaDriver) or a SimNode",
                )

    @locked
    def mem_info(self) -> tuple[int, int]:
        book = self._book
        free = min(book.capacity_bytes - book.physical_bytes, _mem_available())
        return max(free, 0), book.capacity_bytes

    @locked
    def stats(self) -> DriverStats:
        return self._book.stats()

    @locked
    def export_handle(self, handle: int) -> int:
        """A ``dup`` of ``handle``'s memfd (close-on-exec); the caller owns it.

        Send it to another process with ``multiprocessing.reduction.send_handle``; there,
        ``import_handle(fd, size)`` maps the same pages.
        """
        (handle,) = check_call_ints("export_handle", handle=handle).values()
        self._book.check_export(handle)
        try:
            return os.dup(self._fds[handle])  # Python makes it non-inheritable (CLOEXEC)
        except OSError as e:
            raise driver_error("export_handle", {"handle": handle}, "CUDA_ERROR_UNKNOWN",
                               f"dup: {e.strerror}") from None

    @locked
    def import_handle(self, fd: int, size: int) -> int:
        """Take ``fd`` (a memfd another process exported) as a handle of ``size`` bytes.

        ``fstat`` must show a regular file of exactly ``size`` bytes, sealed against shrinking
        and growing (a memfd from ``export_handle``: nobody can truncate it under the mapping
        and kill this process with SIGBUS), and not one of this driver's own. On success the driver
        owns ``fd`` (closed by ``release``); on failure it is still the caller's. The pages
        count for the process that created them: this driver's capacity is not charged.
        """
        fd, size = check_call_ints("import_handle", fd=fd, size=size).values()
        book = self._book
        book.check_import(fd, size)
        args = {"fd": fd, "size": size}
        if fd in self._fds.values():
            raise driver_error("import_handle", args, CUDA_ERROR_INVALID_VALUE,
                               f"fd {fd} is this driver's own memfd of a live handle; import "
                               "a descriptor from export_handle (a dup) instead")
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise driver_error("import_handle", args, CUDA_ERROR_INVALID_VALUE,
                               f"fd {fd} is not an open file descriptor ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise driver_error("import_handle", args, CUDA_ERROR_INVALID_VALUE,
                               f"fd {fd} is not a memfd or file (mode {st.st_mode:#o})")
        if st.st_size != size:
            raise driver_error(
                "import_handle", args, CUDA_ERROR_INVALID_VALUE,
                f"fd {fd} holds {st.st_size} bytes, not {size}: maps take whole handles",
            )
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:  # EINVAL: not a memfd (a plain file can be truncated by anyone)
            seals = 0
        if seals & _SEALS != _SEALS:
            raise driver_error(
                "import_handle", args, CUDA_ERROR_INVALID_VALUE,
                f"fd {fd} is not a memfd sealed against resizing (seals {seals:#x}): another "
                "process could truncate it under the mapping (SIGBUS)",
            )
        os.set_inheritable(fd, False)
        handle = next(self._handle_ids)
        self._fds[handle] = fd
        book.apply_import(handle, size)
        return handle

    @locked
    def pin(self, va: int) -> None:
        """Mark the reservation starting at ``va`` as reachable by a view (a tensor).

        While pinned, ``free`` of it and ``close()`` are refused (:class:`BusyError`):
        unmapping the VA under a live tensor would crash the process, or alias its bytes
        with whatever the OS puts there next. Pins count; :meth:`unpin` drops one.

        Raises:
            DriverError: CUDA_ERROR_INVALID_VALUE if ``va`` is not a reservation's start.
        """
        (va,) = check_call_ints("pin", va=va).values()
        if va not in self._book.res:
            raise driver_error("pin", {"va": va}, CUDA_ERROR_INVALID_VALUE,
                               f"{va:#x} is not the start of a reservation")
        self._pins.add(va)

    @locked
    def unpin(self, va: int) -> None:
        """Drop one pin of the reservation at ``va`` (a no-op if it has none)."""
        (va,) = check_call_ints("unpin", va=va).values()
        self._pins.drop(va)

    @locked
    def close(self) -> None:
        """Unmap, release and free everything still held (for tests and interpreter exit).

        Raises:
            BusyError: a reservation is pinned (a tensor can still reach it); nothing was
                given back.
        """
        book = self._book
        refuse_close("host", book.stats(), self._pins.pinned())
        for va in list(book.map_starts):
            self.unmap(va, book.maps[va][0])
        for h in list(self._fds):
            self.release(h)
        for va in list(book.res_starts):
            self.free(va, book.res[va])

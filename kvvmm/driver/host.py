"""HostDriver: the VMM protocol on Linux host memory, with real bytes.

reserve = ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``; create =
``memfd_create`` + ``ftruncate`` + ``posix_fallocate`` (the pages exist once created, like
``cuMemCreate``); map = ``mmap(MAP_SHARED|MAP_FIXED)`` of the fd at the VA (``PROT_NONE``:
mapped but not yet accessible, as on a GPU before ``cuMemSetAccess``); set access =
``mprotect(READ|WRITE)``; unmap = map the reservation's ``PROT_NONE`` placeholder back over
the range; release = close the fd (the mapping keeps the pages); free = ``munmap``.

Handles cross processes as their memfd: ``export_handle`` gives a ``dup`` of it, which another
process receives (``multiprocessing.reduction.send_handle`` / ``recv_handle``, SCM_RIGHTS)
and passes to ``import_handle``; both processes then map the same pages. Host memory has one
"device": set access for any other device is refused (CUDA_ERROR_INVALID_VALUE, as CUDA
refuses an ordinal it does not have).

Touching VA that is reserved but not mapped faults (SIGSEGV), as on a GPU. The rules are
the shared :class:`VmmBook`'s, so the host driver refuses exactly what the simulator does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap as _mmap
import os
import stat
import sys
from collections.abc import Sequence

from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    DriverStats,
    MemoryKind,
    VmmBook,
    driver_error,
)
from kvvmm.errors import ArgumentError, DriverUnavailableError
from kvvmm.units import MiB

__all__ = ["HostDriver"]

_PROT_NONE = 0
_PROT_RW = _mmap.PROT_READ | _mmap.PROT_WRITE
_MAP_SHARED = 0x01
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


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


class HostDriver:
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

    def __init__(
        self, *, granularity: int = 2 * MiB, capacity_bytes: int | None = None, device: int = 0
    ) -> None:
        page = _mmap.PAGESIZE
        if isinstance(granularity, bool) or not isinstance(granularity, int) or (
            granularity <= 0 or granularity % page
        ):
            raise ArgumentError("granularity", granularity, f"a positive multiple of {page}")
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int)
            or capacity_bytes <= 0
        ):
            raise ArgumentError("capacity_bytes", capacity_bytes, "an int > 0 or None")
        self._libc = _libc()
        self.device = device
        self.name = "host memory"
        cap = _mem_available() if capacity_bytes is None else capacity_bytes
        self._book = VmmBook(granularity, cap)
        self._fds: dict[int, int] = {}  # handle -> memfd (handle ids are our own counter)
        self._next_handle = 1

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
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | (_MAP_FIXED if fixed else 0)
        got = self._libc.mmap(va if fixed else None, size, _PROT_NONE, flags, -1, 0)
        return -1 if got in (None, _MAP_FAILED) else int(got)

    def granularity(self) -> int:
        return self._book.gran

    def reserve(self, size: int, align: int = 0) -> int:
        align = self._book.check_reserve(size, align)
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

    def free(self, va: int, size: int) -> None:
        self._book.check_free(va, size)
        if self._libc.munmap(va, size) != 0:
            raise self._os_error("free", {"va": va, "size": size}, "munmap")
        self._book.apply_free(va)

    def create(self, size: int) -> int:
        book = self._book
        book.check_create(size, book.capacity_bytes - book.physical_bytes)
        args = {"size": size}
        fd = -1
        try:
            fd = os.memfd_create("kvvmm", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            # Out of memory, or out of file descriptors (one per live handle: EMFILE).
            full = (errno.ENOMEM, errno.ENOSPC, errno.EMFILE, errno.ENFILE)
            name = CUDA_ERROR_OUT_OF_MEMORY if e.errno in full else "CUDA_ERROR_UNKNOWN"
            raise driver_error("create", args, name, f"memfd: {e.strerror}") from None
        handle = self._next_handle
        self._next_handle += 1
        self._fds[handle] = fd
        book.apply_create(handle, size)
        return handle

    def release(self, handle: int) -> None:
        self._book.check_release(handle)
        os.close(self._fds.pop(handle))  # a live mapping keeps the pages
        self._book.apply_release(handle)

    def map(self, va: int, size: int, handle: int) -> None:
        res = self._book.check_map(va, size, handle)
        got = self._libc.mmap(va, size, _PROT_NONE, _MAP_SHARED | _MAP_FIXED, self._fds[handle], 0)
        if got in (None, _MAP_FAILED):
            # MAP_FIXED failed: the placeholder may be gone; put it back before reporting.
            self._placeholder(va, size, fixed=True)
            raise self._os_error("map", {"va": va, "size": size, "handle": handle}, "mmap(fd)")
        self._book.apply_map(va, size, handle, res)

    def unmap(self, va: int, size: int) -> None:
        starts = self._book.covered("unmap", va, size)
        if self._placeholder(va, size, fixed=True) != va:
            raise self._os_error("unmap", {"va": va, "size": size}, "mmap(PROT_NONE)")
        self._book.apply_unmap(starts)

    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        if devices is not None:
            self._check_devices(va, size, devices)
        self._book.covered("set_access", va, size)
        if self._libc.mprotect(va, size, _PROT_RW) != 0:
            raise self._os_error("set_access", {"va": va, "size": size}, "mprotect")

    def _check_devices(self, va: int, size: int, devices: Sequence[int]) -> None:
        if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices:
            raise ArgumentError("devices", devices, "a non-empty sequence of device ordinals")
        for d in devices:
            if isinstance(d, bool) or d != self.device:
                raise driver_error(  # INVALID_VALUE: CUDA's answer for an ordinal it lacks
                    "set_access", {"va": va, "size": size}, CUDA_ERROR_INVALID_VALUE,
                    f"device {d!r}: host memory has one device ({self.device}); peer access "
                    "needs GPUs (CudaDriver) or a SimNode",
                )

    def mem_info(self) -> tuple[int, int]:
        book = self._book
        free = min(book.capacity_bytes - book.physical_bytes, _mem_available())
        return max(free, 0), book.capacity_bytes

    def stats(self) -> DriverStats:
        return self._book.stats()

    def export_handle(self, handle: int) -> int:
        """A ``dup`` of ``handle``'s memfd (close-on-exec); the caller owns it.

        Send it to another process with ``multiprocessing.reduction.send_handle``; there,
        ``import_handle(fd, size)`` maps the same pages.
        """
        self._book.check_export(handle)
        try:
            return os.dup(self._fds[handle])  # Python makes it non-inheritable (CLOEXEC)
        except OSError as e:
            raise driver_error("export_handle", {"handle": handle}, "CUDA_ERROR_UNKNOWN",
                               f"dup: {e.strerror}") from None

    def import_handle(self, fd: int, size: int) -> int:
        """Take ``fd`` (a memfd another process exported) as a handle of ``size`` bytes.

        ``fstat`` must show a regular file of exactly ``size`` bytes. On success the driver
        owns ``fd`` (closed by ``release``); on failure it is still the caller's. The pages
        count for the process that created them: this driver's capacity is not charged.
        """
        book = self._book
        book.check_import(fd, size)
        args = {"fd": fd, "size": size}
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
        os.set_inheritable(fd, False)
        handle = self._next_handle
        self._next_handle += 1
        self._fds[handle] = fd
        book.apply_import(handle, size)
        return handle

    def close(self) -> None:
        """Unmap, release and free everything still held (for tests and interpreter exit)."""
        book = self._book
        for va in list(book.map_starts):
            self.unmap(va, book.maps[va][0])
        for h in list(self._fds):
            self.release(h)
        for va in list(book.res_starts):
            self.free(va, book.res[va])

"""VmmBook: the driver rules of :mod:`kvvmm.driver.base` in pure Python, and the state they need.

The simulated and host drivers share it, so they refuse exactly the same calls with exactly
the same CUDA error names.
"""

from __future__ import annotations

from bisect import bisect_right, insort

from kvvmm.checks import is_int
from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    DriverStats,
    driver_error,
)
from kvvmm.errors import ArgumentError, DriverError

__all__ = ["VmmBook"]


class _Handle:
    __slots__ = ("maps", "released", "size")
    imported = False  # its memory counts for the driver that created it, not this book

    def __init__(self, size: int) -> None:
        self.size = size
        self.released = False
        self.maps = 0


class _ImportedHandle(_Handle):
    __slots__ = ()
    imported = True


class VmmBook:
    """The driver rules and the state they need: reservations, handles, mappings.

    ``check_*`` validates a call and raises the :class:`DriverError` CUDA would; ``apply_*``
    records a call that succeeded. Drivers with a side effect (mmap, a CUDA call) run it
    between the two so a failed side effect leaves the book untouched.
    """

    def __init__(self, granularity: int, capacity_bytes: int) -> None:
        if granularity <= 0:
            raise ArgumentError("granularity", granularity, "> 0")
        self.gran = granularity
        self.capacity_bytes = capacity_bytes
        self.res: dict[int, int] = {}  # reservation start -> size
        self.res_starts: list[int] = []  # sorted reservation starts
        self.handles: dict[int, _Handle] = {}
        self.maps: dict[int, tuple[int, int]] = {}  # mapping start -> (size, handle)
        self.map_starts: list[int] = []  # sorted mapping starts
        self.res_maps: dict[int, int] = {}  # reservation start -> live mappings in it
        self.physical_bytes = 0
        self.mapped_bytes = 0
        self.live_handles = 0

    # -- helpers ----------------------------------------------------------------------

    def _bad(self, call: str, args: dict[str, int], reason: str) -> DriverError:
        return driver_error(call, args, CUDA_ERROR_INVALID_VALUE, reason)

    def _aligned(self, call: str, args: dict[str, int], **vals: int) -> None:
        g = self.gran
        for k, v in vals.items():
            if v <= 0 and k == "size":
                raise self._bad(call, args, f"size must be > 0, got {v}")
            if v % g:
                raise self._bad(
                    call, args, f"{k}={v:#x} is not a multiple of the granularity {g:#x}"
                )

    def reservation_of(self, va: int, size: int) -> int | None:
        """Start of the reservation holding all of ``[va, va+size)``, else None."""
        i = bisect_right(self.res_starts, va) - 1
        if i < 0:
            return None
        start = self.res_starts[i]
        return start if va + size <= start + self.res[start] else None

    # -- reserve / free ---------------------------------------------------------------

    def check_reserve(self, size: int, align: int) -> int:
        """Validate a reserve; return the alignment the VA gets (at least the granularity)."""
        args = {"size": size, "align": align}
        self._aligned("reserve", args, size=size)
        # As on an H200: any power of two is accepted (below the granularity the VA is
        # aligned to the granularity anyway); 3 MiB or 3x the granularity is refused.
        if align < 0 or align & (align - 1):
            raise self._bad("reserve", args, f"align={align:#x} is not 0 or a power of two")
        return max(align, self.gran)

    def apply_reserve(self, va: int, size: int) -> None:
        self.res[va] = size
        insort(self.res_starts, va)
        self.res_maps[va] = 0

    def check_free(self, va: int, size: int) -> None:
        args = {"va": va, "size": size}
        got = self.res.get(va)
        if got is None:
            raise self._bad("free", args, f"{va:#x} is not the start of a reservation")
        if got != size:
            raise self._bad("free", args, f"the reservation at {va:#x} is {got} bytes, not {size}")
        if self.res_maps[va]:
            raise self._bad("free", args, f"{self.res_maps[va]} mappings are still in it")

    def apply_free(self, va: int) -> None:
        del self.res[va]
        del self.res_maps[va]
        self.res_starts.pop(bisect_right(self.res_starts, va) - 1)

    # -- create / release -------------------------------------------------------------

    def check_create(self, size: int, free_bytes: int) -> None:
        if size <= 0 or size % self.gran:
            self._aligned("create", {"size": size}, size=size)
        if size > free_bytes:
            raise driver_error(
                "create", {"size": size}, CUDA_ERROR_OUT_OF_MEMORY,
                f"{size} bytes asked, {free_bytes} free",
            )

    def apply_create(self, handle: int, size: int) -> None:
        self.handles[handle] = _Handle(size)
        self.physical_bytes += size
        self.live_handles += 1

    def check_export(self, handle: int) -> _Handle:
        h = self.handles.get(handle)
        if h is None or h.released:
            raise self._bad("export_handle", {"handle": handle}, f"handle {handle} is not live")
        return h

    def check_import(self, fd: int, size: int) -> None:
        args = {"fd": fd, "size": size}
        if not is_int(fd) or fd < 0:
            raise self._bad("import_handle", args, f"fd={fd!r} is not a file descriptor")
        self._aligned("import_handle", args, size=size)

    def apply_import(self, handle: int, size: int) -> None:
        """Record an imported handle: live and mappable, its memory counted by its creator."""
        self.handles[handle] = _ImportedHandle(size)
        self.live_handles += 1

    def check_release(self, handle: int) -> _Handle:
        h = self.handles.get(handle)
        if h is None or h.released:
            raise self._bad("release", {"handle": handle}, f"handle {handle} is not live")
        return h

    def apply_release(self, handle: int) -> None:
        h = self.handles[handle]
        h.released = True
        self.live_handles -= 1
        if not h.maps:
            del self.handles[handle]
            if not h.imported:
                self.physical_bytes -= h.size

    # -- map / unmap / access ---------------------------------------------------------

    def check_map(self, va: int, size: int, handle: int) -> int:
        """Validate a map; return the start of the reservation it lands in."""
        args = {"va": va, "size": size, "handle": handle}
        g = self.gran
        if va % g or size <= 0 or size % g:  # the common case checked inline: a hot call
            self._aligned("map", args, va=va, size=size)
        h = self.handles.get(handle)
        if h is None or h.released:
            raise self._bad("map", args, f"handle {handle} is not live")
        if size != h.size:
            # What an H200 answers (driver 580, CUDA 13.0) for a map of part of a handle, or of
            # more than it: not supported (GB300 refuses partial maps too).
            raise driver_error(
                "map", args, CUDA_ERROR_NOT_SUPPORTED,
                f"size {size} != the handle's {h.size} bytes: maps take whole handles",
            )
        res = self.reservation_of(va, size)
        if res is None:
            raise self._bad("map", args, "the range is not inside one reservation")
        starts = self.map_starts
        i = bisect_right(starts, va) - 1
        if i >= 0 and starts[i] + self.maps[starts[i]][0] > va:
            raise self._bad("map", args, f"{starts[i]:#x} is already mapped there")
        if i + 1 < len(starts) and starts[i + 1] < va + size:
            raise self._bad("map", args, f"{starts[i + 1]:#x} is already mapped there")
        return res

    def apply_map(self, va: int, size: int, handle: int, res: int) -> None:
        self.maps[va] = (size, handle)
        insort(self.map_starts, va)
        self.handles[handle].maps += 1
        self.res_maps[res] += 1
        self.mapped_bytes += size

    def covered(self, call: str, va: int, size: int) -> list[int]:
        """Mapping starts that exactly tile ``[va, va+size)``; raise unless they do."""
        args = {"va": va, "size": size}
        g = self.gran
        if va % g or size <= 0 or size % g:  # the common case checked inline: a hot call
            self._aligned(call, args, va=va, size=size)
        starts = self.map_starts
        i = bisect_right(starts, va) - 1
        if i < 0 or starts[i] != va:
            if i >= 0 and starts[i] + self.maps[starts[i]][0] > va:
                raise self._bad(call, args, f"{va:#x} is inside the mapping at {starts[i]:#x}")
            raise self._bad(call, args, f"nothing is mapped at {va:#x}")
        out: list[int] = []
        pos, end = va, va + size
        while pos < end:
            if i >= len(starts) or starts[i] != pos:
                raise self._bad(call, args, f"{pos:#x} is not mapped")
            msize = self.maps[pos][0]
            if pos + msize > end:
                raise self._bad(
                    call, args,
                    f"the mapping at {pos:#x} ({msize} bytes) ends past {end:#x}: "
                    "part of a mapping",
                )
            out.append(pos)
            pos += msize
            i += 1
        return out

    def apply_unmap(self, starts: list[int]) -> None:
        for va in starts:
            size, handle = self.maps.pop(va)
            self.mapped_bytes -= size
            res = self.reservation_of(va, size)
            assert res is not None  # a mapping always lies in its reservation
            self.res_maps[res] -= 1
            h = self.handles[handle]
            h.maps -= 1
            if h.released and not h.maps:
                del self.handles[handle]
                if not h.imported:
                    self.physical_bytes -= h.size
        # Rebuild once: removing k items one by one would be O(k * n).
        if len(starts) == 1:
            self.map_starts.pop(bisect_right(self.map_starts, starts[0]) - 1)
        else:
            gone = set(starts)
            self.map_starts = [s for s in self.map_starts if s not in gone]

    def stats(self) -> DriverStats:
        return DriverStats(
            reservations=len(self.res),
            reserved_bytes=sum(self.res.values()),
            handles=self.live_handles,
            mappings=len(self.maps),
            mapped_bytes=self.mapped_bytes,
            physical_bytes=self.physical_bytes,
        )

"""SimDriver: the driver rules with no memory at all, for laptops, notebooks and tests.

It refuses exactly what CUDA refuses (the shared :class:`VmmBook`), hands out deterministic
addresses and handles (so notebook outputs compare exactly), runs out of memory past its
device profile's capacity, and advances a simulated clock by a cost model fitted to what an
H200 measured (``shared/measurements/h200-seed-baseline.json``, 2026-11-29).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

from kvvmm.driver.base import DriverStats, MemoryKind, VmmBook
from kvvmm.errors import ArgumentError
from kvvmm.units import GiB, MiB

__all__ = ["COST_TABLE_US", "PROFILES", "DeviceProfile", "SimDriver", "get_profile"]


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """A GPU as the simulator sees it: memory capacity and VMM granularity, with sources."""

    key: str  #: short name used in APIs (``"h200"``)
    name: str  #: what ``nvidia-smi`` calls it
    capacity_bytes: int  #: total device memory as ``cuMemGetInfo`` reports it
    granularity_bytes: int  #: ``cuMemGetAllocationGranularity`` (minimum)
    source: str  #: where the two figures come from


PROFILES: dict[str, DeviceProfile] = {
    p.key: p
    for p in (
        DeviceProfile(
            "h100", "NVIDIA H100 80GB HBM3", 81559 * MiB, 2 * MiB,
            "capacity: nvidia-smi total 81559 MiB on H100 SXM5 80GB (datasheet: 80 GB HBM3); "
            "granularity: 2 MiB, cuMemGetAllocationGranularity on Hopper (same chip as H200)",
        ),
        DeviceProfile(
            "h200", "NVIDIA H200", int(139.8 * GiB), 2 * MiB,
            "measured on an H200 with torch.cuda.mem_get_info and "
            "cuMemGetAllocationGranularity, 2026-11-29 (shared/measurements/"
            "h200-seed-baseline.json: mem_total_gib 139.8, granularity_min 2097152)",
        ),
        DeviceProfile(
            "b200", "NVIDIA B200", 183359 * MiB, 2 * MiB,
            "capacity: nvidia-smi total 183359 MiB on B200 (datasheet: 180 GB HBM3e); "
            "granularity: 2 MiB, the VMM minimum on NVIDIA data-center GPUs (not measured here)",
        ),
        DeviceProfile(
            "gb300", "NVIDIA GB300", 288 * 10**9, 2 * MiB,
            "capacity: datasheet 288 GB HBM3e per Blackwell Ultra GPU (decimal GB; not "
            "measured here); granularity: 2 MiB (not measured here); partial-handle maps "
            "are refused on GB300, which every kvvmm driver enforces",
        ),
    )
}


def get_profile(profile: str | DeviceProfile) -> DeviceProfile:
    """Look a profile up by key (``"h200"``); pass a :class:`DeviceProfile` through."""
    if isinstance(profile, DeviceProfile):
        return profile
    key = str(profile).lower().replace("-", "").replace(" ", "")
    try:
        return PROFILES[key]
    except KeyError:
        raise ArgumentError("profile", profile, f"one of {sorted(PROFILES)}") from None


#: Microseconds per call by handle size, measured on an H200 (median of 5 to 200 calls;
#: ``h200-seed-baseline.json`` "raw"). Sizes in MiB.
COST_TABLE_US: dict[str, tuple[tuple[int, float], ...]] = {
    "create": ((2, 12.75), (32, 12.66), (512, 20.19), (4096, 195.4)),
    "map": ((2, 2.35), (32, 2.4), (512, 2.86), (4096, 7.34)),
    "set_access": ((2, 27.21), (32, 43.42), (512, 60.51), (4096, 209.86)),
    "unmap": ((2, 18.83), (32, 26.36), (512, 31.4), (4096, 73.21)),
    "release": ((2, 13.35), (32, 35.65), (512, 235.41), (4096, 1945.48)),
    # reserve/free barely depend on size (7-33 us for 64 GiB to 1 TiB).
    "reserve": ((65536, 33.0), (262144, 7.6), (1048576, 7.1)),
    "free": ((65536, 21.7), (262144, 7.8), (1048576, 157.2)),
}


class _CostModel:
    """Piecewise-linear in log2(size) between measured points, flat beyond the ends."""

    def __init__(self, table: dict[str, tuple[tuple[int, float], ...]]) -> None:
        self._pts = {
            op: ([math.log2(mib * MiB) for mib, _ in pts], [us for _, us in pts])
            for op, pts in table.items()
        }

    def __call__(self, op: str, size: int) -> float:
        xs, ys = self._pts[op]
        if size <= 0:
            return ys[0]
        x = math.log2(size)
        i = bisect_right(xs, x)
        if i == 0:
            return ys[0]
        if i == len(xs):
            return ys[-1]
        t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + t * (ys[i] - ys[i - 1])


_COST = _CostModel(COST_TABLE_US)
_MEM_INFO_US = 0.4  # a cheap query: the cuda-python call floor measured on the H200


class SimDriver:
    """A device with no memory: the driver rules, deterministic addresses, a cost clock.

    Args:
        profile: device profile key (``"h100"``, ``"h200"``, ``"b200"``, ``"gb300"``) or a
            :class:`DeviceProfile`.
        device: device ordinal to report.
        capacity_bytes: override the profile's capacity (e.g. a small GPU for a notebook).
        used_bytes: memory held by others (CUDA context, other processes): create fails
            past ``capacity_bytes - used_bytes``.
        base_va: first address handed out; reservations follow it in order.
    """

    kind = "sim"
    memory = MemoryKind.NONE

    def __init__(
        self,
        profile: str | DeviceProfile = "h200",
        *,
        device: int = 0,
        capacity_bytes: int | None = None,
        used_bytes: int = 0,
        base_va: int = 0x7F00_0000_0000,
    ) -> None:
        self.profile = get_profile(profile)
        cap = self.profile.capacity_bytes if capacity_bytes is None else capacity_bytes
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            raise ArgumentError("capacity_bytes", capacity_bytes, "an int > 0 (bytes) or None")
        if isinstance(used_bytes, bool) or not isinstance(used_bytes, int):
            raise ArgumentError("used_bytes", used_bytes, f"an int in [0, {cap}] (bytes)")
        if not 0 <= used_bytes <= cap:
            raise ArgumentError("used_bytes", used_bytes, f"in [0, {cap}] (the capacity)")
        self.device = device
        self.name = self.profile.name
        self._book = VmmBook(self.profile.granularity_bytes, cap)
        self._used_bytes = used_bytes
        self._next_va = base_va
        self._next_handle = 1
        #: Simulated time spent in driver calls, in microseconds (the H200 cost model).
        self.clock_us = 0.0

    def __repr__(self) -> str:
        return f"SimDriver(profile={self.profile.key!r}, device={self.device})"

    def granularity(self) -> int:
        return self._book.gran

    def reserve(self, size: int, align: int = 0) -> int:
        align = self._book.check_reserve(size, align)
        va = -(-self._next_va // align) * align
        self._next_va = va + size
        self._book.apply_reserve(va, size)
        self.clock_us += _COST("reserve", size)
        return va

    def free(self, va: int, size: int) -> None:
        self._book.check_free(va, size)
        self._book.apply_free(va)
        self.clock_us += _COST("free", size)

    def create(self, size: int) -> int:
        book = self._book
        book.check_create(size, book.capacity_bytes - self._used_bytes - book.physical_bytes)
        handle = self._next_handle
        self._next_handle += 1
        book.apply_create(handle, size)
        self.clock_us += _COST("create", size)
        return handle

    def release(self, handle: int) -> None:
        h = self._book.check_release(handle)
        self._book.apply_release(handle)
        self.clock_us += _COST("release", h.size)

    def map(self, va: int, size: int, handle: int) -> None:
        res = self._book.check_map(va, size, handle)
        self._book.apply_map(va, size, handle, res)
        self.clock_us += _COST("map", size)

    def unmap(self, va: int, size: int) -> None:
        starts = self._book.covered("unmap", va, size)
        self._book.apply_unmap(starts)
        self.clock_us += _COST("unmap", size)

    def set_access(self, va: int, size: int) -> None:
        self._book.covered("set_access", va, size)
        self.clock_us += _COST("set_access", size)

    def mem_info(self) -> tuple[int, int]:
        self.clock_us += _MEM_INFO_US
        book = self._book
        return book.capacity_bytes - self._used_bytes - book.physical_bytes, book.capacity_bytes

    def stats(self) -> DriverStats:
        return self._book.stats()

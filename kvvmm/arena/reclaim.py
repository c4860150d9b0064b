"""Memory held by a cache beside the arena: released, and a commit tried once more.

torch's caching allocator keeps the blocks its tensors freed, and the card counts them as
used: a commit that runs out of memory while that cache holds free blocks would succeed
once they are handed back (``torch.cuda.empty_cache()``). The arena asks a
:class:`CacheReleaser` to do that when a create fails for lack of memory, then tries the
create once more, inside the same transaction (:meth:`_ArenaState._new_handle
<kvvmm.arena.state._ArenaState._new_handle>`: every commit path makes its handles there).

The releaser is an object passed in, never a guess about where the arena runs:
:class:`TorchCacheReleaser` empties torch's cache (only once torch has initialised CUDA in
this process; it imports nothing itself); :class:`HeldMemoryReleaser` stands in for it on
the simulator and the host driver (handles held by a fake cache, released on request).

:class:`TorchAllocatorCap` caps torch's caching allocator at what a KV budget leaves of the
device (``torch.cuda.set_per_process_memory_fraction``), and follows that budget as it
changes: torch then cannot grow into memory the owner or the broker counts on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvvmm.checks import bool_arg, int_arg
from kvvmm.driver.base import Driver, MemoryKind
from kvvmm.errors import ArgumentError

__all__ = ["CacheReleaser", "HeldMemoryReleaser", "ReclaimStats", "TorchAllocatorCap",
           "TorchCacheReleaser", "releaser_for"]


@runtime_checkable
class CacheReleaser(Protocol):
    """Something that holds free memory of the arena's device and can hand it back."""

    def release_cached(self, need_bytes: int) -> int:
        """Hand back what the cache holds free.

        Args:
            need_bytes: the size of the create that ran out of memory (a hint).
        Returns:
            Bytes handed back to the device; 0 when there was nothing to hand back (the
            arena then does not retry: the create would fail again).
        """
        ...


@dataclass(frozen=True, slots=True)
class ReclaimStats:
    """What an arena's out-of-memory retries did, since it was made."""

    #: times a create ran out of memory and the releaser was asked
    releases: int = 0
    #: bytes the releaser said it handed back, in all
    released_bytes: int = 0
    #: creates tried once more after a release (at most one per out-of-memory create)
    retries: int = 0
    #: of those, the ones that ran out of memory again
    retries_failed: int = 0


def _torch_cuda() -> Any:
    """``torch.cuda`` if torch is imported and has initialised CUDA here, else None."""
    torch = sys.modules.get("torch")  # never imported from here: no torch, no cache
    if torch is None:
        return None
    cuda = torch.cuda
    return cuda if cuda.is_initialized() else None


class TorchCacheReleaser:
    """Empties torch's CUDA caching allocator (``torch.cuda.empty_cache()``).

    Acts only where torch is imported and has initialised CUDA in this process: otherwise
    torch holds no cache and the answer is 0 (nothing imported, nothing initialised).

    Args:
        device: the CUDA ordinal whose reserved bytes measure what was handed back.
    """

    __slots__ = ("device",)

    def __init__(self, device: int = 0) -> None:
        int_arg("device", device, lo=0, limit="a CUDA device ordinal >= 0")
        self.device = device

    def release_cached(self, need_bytes: int) -> int:
        """Empty torch's cache; return how much less torch reserves on the device."""
        cuda = _torch_cuda()
        if cuda is None:
            return 0
        before = int(cuda.memory_reserved(self.device))
        cuda.empty_cache()
        return max(0, before - int(cuda.memory_reserved(self.device)))


def releaser_for(driver: Driver, cache_releaser: object,
                 retry_on_oom: object) -> CacheReleaser | None:
    """The releaser an arena of ``driver`` asks when a create runs out of memory.

    Args:
        driver: the arena's driver.
        cache_releaser: a :class:`CacheReleaser`, or None for the default: torch's cache
            (:class:`TorchCacheReleaser`) where the driver's memory is device memory,
            none elsewhere (the simulator and the host driver share no cache with torch).
        retry_on_oom: False opts out: no release, no retry.
    Returns:
        The releaser, or None (an out-of-memory create then fails the commit as it comes).
    Raises:
        ArgumentError: ``cache_releaser`` not a releaser, or ``retry_on_oom`` not a bool.
    """
    bool_arg("retry_on_oom", retry_on_oom, limit="a bool")
    if cache_releaser is not None and not isinstance(cache_releaser, CacheReleaser):
        raise ArgumentError("cache_releaser", cache_releaser,
                            "an object with release_cached(need_bytes) -> int, or None")
    if not retry_on_oom:
        return None
    if cache_releaser is None and driver.memory is MemoryKind.DEVICE:
        return TorchCacheReleaser(driver.device)
    return cache_releaser


class HeldMemoryReleaser:
    """A stand-in for torch's cache on any driver: handles held, released on request.

    Makes ``nbytes`` of handles on ``driver`` at construction (memory nobody maps, as torch's
    free blocks are); :meth:`release_cached` releases all of them, once. For tests and the
    lab on the simulator and the host driver.

    Args:
        driver: the driver whose memory the cache holds (the arena's, or the inner driver
            under a wrapper, so the cache's calls stay out of the wrapper's count).
        nbytes: bytes to hold, a positive multiple of the driver's granularity.
    Raises:
        ArgumentError, AlignmentError: bad ``nbytes``.
        DriverError: the driver could not make the handles (none is left behind).
    """

    def __init__(self, driver: Driver, nbytes: int) -> None:
        g = driver.granularity()
        int_arg("nbytes", nbytes, lo=g, limit=f"an int >= the granularity {g} (bytes)")
        if nbytes % g:
            raise ArgumentError("nbytes", nbytes, f"a multiple of the granularity {g}")
        self.driver = driver
        self.calls = 0  #: times release_cached was called
        self._held: list[int] = []
        try:
            for _ in range(nbytes // g):
                self._held.append(driver.create(g))
        except BaseException:
            self.close()
            raise

    @property
    def held_bytes(self) -> int:
        """Bytes the cache still holds."""
        return len(self._held) * self.driver.granularity()

    def release_cached(self, need_bytes: int) -> int:
        """Release every held handle; return the bytes handed back."""
        self.calls += 1
        return self.close()

    def close(self) -> int:
        """Release what is still held (idempotent); return the bytes handed back."""
        g = self.driver.granularity()
        given = 0
        while self._held:
            self.driver.release(self._held[-1])
            self._held.pop()
            given += g
        return given


class TorchAllocatorCap:
    """Caps torch's caching allocator at what a KV budget leaves of the device.

    ``follow(kv_bytes)`` sets torch's per-process memory fraction to
    ``(total - kv_bytes - headroom) / total``: torch's allocator then raises its own
    out-of-memory error before it takes memory the owner (its reserve) or the broker (the
    tenant's budget) counts on. Call it again whenever that budget changes.

    Args:
        device: the CUDA ordinal.
        total_bytes: the device's memory (default: torch's ``total_memory`` for it).
        headroom_bytes: kept from torch as well (CUDA context, NCCL buffers), >= 0.
        set_fraction: what sets the fraction (default:
            ``torch.cuda.set_per_process_memory_fraction``, imported on the first call);
            tests pass a recorder.
    Raises:
        ArgumentError, OutOfRangeError: bad sizes.
    """

    def __init__(self, device: int = 0, *, total_bytes: int | None = None,
                 headroom_bytes: int = 0,
                 set_fraction: Callable[[float, int], object] | None = None) -> None:
        int_arg("device", device, lo=0, limit="a CUDA device ordinal >= 0")
        if total_bytes is not None:
            int_arg("total_bytes", total_bytes, lo=1, unit="bytes")
        int_arg("headroom_bytes", headroom_bytes, lo=0, unit="bytes")
        self.device = device
        self._total = total_bytes
        self.headroom_bytes = headroom_bytes
        self._set = set_fraction
        self.fraction: float | None = None  #: the fraction set last (None: never set)

    @property
    def total_bytes(self) -> int:
        """The device's memory the fraction is of."""
        if self._total is None:
            import torch

            self._total = int(torch.cuda.get_device_properties(self.device).total_memory)
        return self._total

    def follow(self, kv_bytes: int) -> float:
        """Cap torch at what ``kv_bytes`` (and the headroom) leave of the device.

        Args:
            kv_bytes: the KV budget: an owner's reservation, or the broker's limit for
                this tenant, in ``[0, total_bytes - headroom_bytes]``.
        Returns:
            The fraction set.
        Raises:
            OutOfRangeError: ``kv_bytes`` leaves torch nothing; nothing was set.
        """
        total = self.total_bytes
        room = total - self.headroom_bytes
        int_arg("kv_bytes", kv_bytes, lo=0, hi=room - 1,
                limit=f"in [0, {room - 1}] (the device's {total} bytes less the headroom "
                      f"{self.headroom_bytes}, leaving torch at least one byte)")
        fraction = (room - kv_bytes) / total
        setter = self._set
        if setter is None:
            import torch

            setter = torch.cuda.set_per_process_memory_fraction
        setter(fraction, self.device)
        self.fraction = fraction
        return fraction

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
changes: torch then cannot grow into memory the owner or the broker counts on. A tenant of
the budget broker keeps one in step with its share (``Tenant.cap_torch``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvvmm.checks import bool_arg, int_arg
from kvvmm.driver.base import Driver, MemoryKind
from kvvmm.errors import ArgumentError, ClosedError, KvvmmError

__all__ = ["CacheReleaser", "HeldMemoryReleaser", "ReclaimStats", "TorchAllocatorCap",
           "TorchCacheReleaser", "TorchCapError", "releaser_for"]


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


class TorchCapError(KvvmmError, RuntimeError):
    """torch's caching allocator could not be capped: nothing was changed.

    ``reason`` says why: torch is not installed, or is a CPU build (it holds no device
    memory to cap: run on a CUDA build, or do not opt in), or torch refused the fraction.
    """

    def __init__(self, device: int, fraction: float | None, reason: str) -> None:
        self.device = device  #: the CUDA ordinal
        self.fraction = fraction  #: the fraction asked (None: none computed yet)
        self.reason = reason
        asked = "" if fraction is None else f" at fraction {fraction:.6f}"
        super().__init__(f"torch's allocator on cuda:{device} could not be capped{asked}: "
                         f"{reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.device, self.fraction, self.reason), self.__dict__)


def _torch_cuda_for_cap(device: int) -> Any:
    """``torch.cuda``, refused with :class:`TorchCapError` where it cannot cap anything."""
    try:
        import torch
    except ImportError as e:
        raise TorchCapError(device, None, f"torch is not installed ({e})") from None
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else "no CUDA device visible"
        raise TorchCapError(device, None, f"torch {torch.__version__} has no usable CUDA "
                                          f"({build}): there is no device cache to cap")
    return torch.cuda


class TorchAllocatorCap:
    """Caps torch's caching allocator at what a KV budget leaves of the device.

    ``follow(kv_bytes)`` sets torch's per-process memory fraction to
    ``(total - kv_bytes - headroom) / total``: torch's allocator then raises its own
    out-of-memory error before it takes memory the owner (its reservation) or the broker
    (the tenant's share) counts on. Call it again whenever that budget changes, or let a
    tenant do it (:meth:`Tenant.cap_torch <kvvmm.budget.tenant.Tenant.cap_torch>`).
    :meth:`close` lifts the cap (fraction 1.0, torch's default), so that what runs next in
    the process does not inherit it.

    Args:
        device: the CUDA ordinal.
        total_bytes: the device's memory (default: torch's ``total_memory`` for it).
        headroom_bytes: kept from torch as well (CUDA context, NCCL buffers), >= 0.
        set_fraction: what sets the fraction (default:
            ``torch.cuda.set_per_process_memory_fraction``); tests pass a recorder.
    Raises:
        ArgumentError, OutOfRangeError: bad sizes.
        TorchCapError: no ``set_fraction`` given and torch cannot cap this device (not
            installed, a CPU build, no CUDA device).
    """

    def __init__(self, device: int = 0, *, total_bytes: int | None = None,
                 headroom_bytes: int = 0,
                 set_fraction: Callable[[float, int], object] | None = None) -> None:
        int_arg("device", device, lo=0, limit="a CUDA device ordinal >= 0")
        if total_bytes is not None:
            int_arg("total_bytes", total_bytes, lo=1, unit="bytes")
        int_arg("headroom_bytes", headroom_bytes, lo=0, unit="bytes")
        if set_fraction is not None and not callable(set_fraction):
            raise ArgumentError("set_fraction", set_fraction,
                                "a callable (fraction, device), or None for torch's")
        if set_fraction is None or total_bytes is None:
            cuda = _torch_cuda_for_cap(device)
            if total_bytes is None:
                total_bytes = int(cuda.get_device_properties(device).total_memory)
            if set_fraction is None:
                set_fraction = cuda.set_per_process_memory_fraction
        self.device = device
        self.total_bytes: int = total_bytes  #: the device's memory the fraction is of
        self.headroom_bytes = headroom_bytes
        self._set = set_fraction
        self.fraction: float | None = None  #: the fraction set last (None: no cap stands)
        self.kv_bytes: int | None = None  #: the KV bytes followed last (None: no cap)
        self.closed = False  #: :meth:`close` ran: the cap is lifted and follows no more

    def follow(self, kv_bytes: int) -> float:
        """Cap torch at what ``kv_bytes`` (and the headroom) leave of the device.

        Args:
            kv_bytes: the KV budget: an owner's reservation, or the broker's share of this
                tenant, in ``[0, total_bytes - headroom_bytes)``.
        Returns:
            The fraction set.
        Raises:
            OutOfRangeError: ``kv_bytes`` leaves torch nothing; nothing was set.
            TorchCapError: torch refused the fraction; the cap is as it was.
            ClosedError: after :meth:`close`.
        """
        if self.closed:
            raise ClosedError(f"torch cap of cuda:{self.device} used after close()")
        total = self.total_bytes
        room = total - self.headroom_bytes
        int_arg("kv_bytes", kv_bytes, lo=0, hi=room - 1,
                limit=f"in [0, {room - 1}] (the device's {total} bytes less the headroom "
                      f"{self.headroom_bytes}, leaving torch at least one byte)")
        fraction = (room - kv_bytes) / total
        self._apply(fraction)
        self.kv_bytes = kv_bytes
        return fraction

    def _apply(self, fraction: float) -> None:
        try:
            self._set(fraction, self.device)
        except Exception as e:  # torch's RuntimeError or ValueError, a recorder's own
            raise TorchCapError(self.device, fraction, f"{type(e).__name__}: {e}") from e
        self.fraction = fraction

    def close(self) -> None:
        """Lift the cap (torch's default fraction, 1.0) if one stands, and follow no more;
        idempotent.

        Raises:
            TorchCapError: torch refused; the cap stands (close again to retry).
        """
        if self.fraction is not None:
            self._apply(1.0)
            self.fraction = self.kv_bytes = None
        self.closed = True

"""Views of an arena's memory: leases that keep it alive, and torch tensors over its VA.

Anything that can still reach an arena's memory (a tensor's storage, a pool segment) holds
a :class:`ViewLease`; ``Arena.close()`` never unmaps memory under a live lease.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvvmm.driver.base import MemoryKind

if TYPE_CHECKING:
    import torch

    from kvvmm.arena.arena import Arena

__all__ = ["ViewLease", "make_tensor"]


class ViewLease:
    """A claim on an arena's memory by something that can still reach it.

    Made by :meth:`Arena.lease <kvvmm.arena.Arena.lease>`; it ends at :meth:`release` or
    when garbage-collected, whichever comes first.
    """

    __slots__ = ("__weakref__", "_fin", "arena")

    def __init__(self, arena: Arena, on_end: Callable[[], None]) -> None:
        self.arena = arena  # keeps the arena alive as long as the lease
        self._fin = weakref.finalize(self, on_end)
        # Not at interpreter exit: atexit must not unmap memory a live tensor (still reachable
        # from other exit hooks) can touch; the process's end gives everything back anyway.
        self._fin.atexit = False

    @property
    def alive(self) -> bool:
        """True until the lease ends."""
        return self._fin.alive

    def release(self) -> None:
        """End the lease now (idempotent)."""
        self._fin()


def make_tensor(arena: Arena, ptr: int, nbytes: int, dims: tuple[int, ...], dtype: str,
                device: int) -> torch.Tensor:
    """A tensor over ``[ptr, ptr + nbytes)`` of ``arena``'s VA, holding a lease on the arena.

    ``dtype`` is a torch dtype name; ``device`` the device whose view it is (arguments
    checked by the caller).
    """
    import torch

    tdtype = getattr(torch, dtype)
    kind = arena.driver.memory
    if kind is MemoryKind.NONE:
        return torch.empty(dims, dtype=tdtype, device="meta")
    lease = arena.lease()
    if kind is MemoryKind.HOST:
        import ctypes

        buf: Any = (ctypes.c_uint8 * nbytes).from_address(ptr)
        buf.keeper = lease  # frombuffer holds buf, buf holds the lease
        flat = torch.frombuffer(buf, dtype=torch.uint8)
        return flat.view(tdtype).view(dims)
    from kvvmm.arena._dlpack import device_tensor

    return device_tensor(ptr, nbytes, dims, tdtype, device, lease)

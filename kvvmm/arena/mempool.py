"""``Arena.pool``: a ``torch.cuda.MemPool`` over an arena's reservation, with no compilation.

torch's pluggable-allocator hook takes two C function pointers; here they are ctypes
callbacks into Python, so nothing is compiled or loaded from disk.

Each pool allocation is a bump ``Arena.allocate`` (unbacked until committed) holding a
:class:`~kvvmm.arena.views.ViewLease`: ``Arena.close`` waits until torch hands every segment
back. torch calls the callbacks from the allocating thread (ctypes takes the GIL).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING, Any

from kvvmm.errors import KvvmmError

if TYPE_CHECKING:
    from kvvmm.arena.arena import Arena
    from kvvmm.arena.views import ViewLease

__all__ = ["make_pool"]

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
# torch may call a free function until the process exits: the callbacks must outlive every
# pool, so they are kept for the life of the process (two small objects per pool).
_KEEP: list[tuple[Any, Any]] = []


def make_pool(arena: Arena) -> Any:
    """Build a ``torch.cuda.MemPool`` whose allocations bump-allocate from ``arena``."""
    import torch

    ref = weakref.ref(arena)
    live: dict[int, ViewLease] = {}  # pointer -> the lease of a segment torch holds
    count = [0]

    def alloc(size: int, device: int, stream: int) -> int | None:
        a = ref()
        # NULL (None) is torch's out-of-memory; the pool serves only its arena's device.
        if a is None or a.closed or size <= 0 or device != a.device:
            return None
        try:  # torch calls from the allocating thread; the arena locks itself
            off = a.allocate(size, name=f"pool{id(live):x}.{count[0]}")
            lease = a.lease()
        except KvvmmError:  # exhausted, or closed in between (the VA stays claimed: no memory)
            return None
        count[0] += 1
        ptr = a.base + off
        live[ptr] = lease
        return ptr

    def free(ptr: int | None, size: int, device: int, stream: int) -> None:
        lease = live.pop(ptr, None) if ptr is not None else None
        if lease is not None:
            lease.release()

    cb_alloc, cb_free = _ALLOC(alloc), _FREE(free)
    _KEEP.append((cb_alloc, cb_free))
    fn_alloc = int(ctypes.cast(cb_alloc, ctypes.c_void_p).value or 0)
    fn_free = int(ctypes.cast(cb_free, ctypes.c_void_p).value or 0)
    allocator = torch._C._cuda_customAllocator(fn_alloc, fn_free)
    try:
        # no_split: hand our bump pointers back verbatim (one segment per tensor).
        return torch.cuda.MemPool(allocator, no_split=True)
    except TypeError:  # older torch without no_split
        return torch.cuda.MemPool(allocator)

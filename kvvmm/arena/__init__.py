"""The arena wing: one VA reservation, its allocations and backing, and views of its memory.

:class:`Arena` (``arena``) is built from ``state`` (shared state, lock, backing
transactions), ``holes``, ``sharing``, ``sleep`` (with ``backup`` and ``pinned``),
``captures`` and ``reclaim``, its records in ``records``; ``transaction`` is the undo stack,
``views`` the tensors over the VA, ``mempool`` a ``torch.cuda.MemPool`` over it, ``_dlpack``
the device tensors (its :func:`device_tensor` is exported here).
"""

from __future__ import annotations

from kvvmm.arena._dlpack import device_tensor
from kvvmm.arena.arena import Arena, DecommitResult
from kvvmm.arena.transaction import Transaction
from kvvmm.arena.views import ViewLease

__all__ = ["Arena", "DecommitResult", "Transaction", "ViewLease", "device_tensor"]

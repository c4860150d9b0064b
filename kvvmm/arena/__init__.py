"""The arena wing: one VA reservation, its allocations and backing, and views of its memory.

- :mod:`~kvvmm.arena.arena`: :class:`Arena` (reserve, allocate, commit/decommit, close);
  built on :mod:`~kvvmm.arena.state` (shared state, lock, backing transactions),
  :mod:`~kvvmm.arena.holes` (range commits and decommits) and :mod:`~kvvmm.arena.sharing`
  (peers, export and adopt), with its records in :mod:`~kvvmm.arena.records`, and
  :mod:`~kvvmm.arena.sleep` (sleep and wake: every handle given back, the VA kept), whose
  bytes :mod:`~kvvmm.arena.backup` keeps (pinned host memory, or a file through mmap);
- :mod:`~kvvmm.arena.transaction`: the undo stack every multi-step change runs in;
- :mod:`~kvvmm.arena.captures`: what baked the arena's VA in (graphs, registrations), and
  the unmaps it refuses; :mod:`~kvvmm.arena.reclaim`: cache releasers (torch's cache) asked
  before an out-of-memory create is tried once more, and torch's allocator capped;
- :mod:`~kvvmm.arena.views`: :class:`ViewLease` and the tensors over the VA;
- :mod:`~kvvmm.arena.mempool`: ``Arena.pool``, a ``torch.cuda.MemPool`` over the reservation;
- ``_dlpack``: device tensors through DLPack, with no compilation; its :func:`device_tensor`
  (a CUDA tensor over raw device VA, what the arena's tensors are made with) is exported here.
"""

from __future__ import annotations

from kvvmm.arena._dlpack import device_tensor
from kvvmm.arena.arena import Arena, DecommitResult
from kvvmm.arena.transaction import Transaction
from kvvmm.arena.views import ViewLease

__all__ = ["Arena", "DecommitResult", "Transaction", "ViewLease", "device_tensor"]

"""Owners of KV buffers: one arena's buffers (:mod:`~kvvmm.owner.buffers`), one owner per
device (:mod:`~kvvmm.owner.tp`), owners that resize together over torch.distributed
(:mod:`~kvvmm.owner.collective`, and :mod:`~kvvmm.owner.spawn` to run them on loopback; both
imported from :mod:`~kvvmm.owner.distributed`).

``from kvvmm.owner import KvBufferOwner`` is the import for most code; the TP and collective
owners load their modules only when asked for.
"""

from kvvmm.owner.buffers import KvBufferOwner, ShrinkResult
from kvvmm.owner.elastic import BackingStats, Lease, RangeBacking
from kvvmm.owner.options import OwnerOptions
from kvvmm.owner.views import layer_views, paged_layer_views

__all__ = ["BackingStats", "KvBufferOwner", "Lease", "OwnerOptions", "RangeBacking",
           "ShrinkResult", "layer_views", "paged_layer_views"]

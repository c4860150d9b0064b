"""Owners that resize together over torch.distributed, and a world of processes to run them.

The import path for both (docs/USING.md, notebook 08): :class:`DistributedOwner` lives in
:mod:`kvvmm.owner.collective` (the four-phase agreement, its design in that module's
docstring), :func:`spawn` and :class:`TpWorkerError` in :mod:`kvvmm.owner.spawn`.
"""

from kvvmm.owner.collective import DistributedOwner
from kvvmm.owner.spawn import TpWorkerError, spawn

__all__ = ["DistributedOwner", "TpWorkerError", "spawn"]

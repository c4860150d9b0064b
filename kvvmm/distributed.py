"""Moved to :mod:`kvvmm.owner.distributed` in 0.3; this name goes in 0.4."""

import warnings as _warnings

from kvvmm.owner.distributed import *  # noqa: F403
from kvvmm.owner.distributed import __all__  # noqa: F401

_warnings.warn("kvvmm.distributed moved to kvvmm.owner.distributed (0.3); import it from there",
               DeprecationWarning, stacklevel=2)

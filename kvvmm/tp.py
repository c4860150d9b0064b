"""Moved to :mod:`kvvmm.owner.tp` in 0.3; this name goes in 0.4."""

import warnings as _warnings

from kvvmm.owner.tp import *  # noqa: F403
from kvvmm.owner.tp import __all__  # noqa: F401

_warnings.warn("kvvmm.tp moved to kvvmm.owner.tp (0.3); import it from there",
               DeprecationWarning, stacklevel=2)

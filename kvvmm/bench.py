"""Moved to :mod:`kvvmm.measure.bench` in 0.3; this name goes in 0.4."""

import warnings as _warnings

from kvvmm.measure.bench import *  # noqa: F403
from kvvmm.measure.bench import __all__  # noqa: F401

_warnings.warn("kvvmm.bench moved to kvvmm.measure.bench (0.3); import it from there",
               DeprecationWarning, stacklevel=2)

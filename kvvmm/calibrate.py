"""Moved to :mod:`kvvmm.measure.calibrate` in 0.3; this name goes in 0.4."""

import warnings as _warnings

from kvvmm.measure.calibrate import *  # noqa: F403
from kvvmm.measure.calibrate import __all__  # noqa: F401

_warnings.warn("kvvmm.calibrate moved to kvvmm.measure.calibrate (0.3); import it from there",
               DeprecationWarning, stacklevel=2)

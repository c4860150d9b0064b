"""Moved to :mod:`kvvmm.cli.replay` in 0.3; this name goes in 0.4."""

import warnings as _warnings

from kvvmm.cli.replay import *  # noqa: F403
from kvvmm.cli.replay import __all__  # noqa: F401

_warnings.warn("kvvmm.workload.cli moved to kvvmm.cli.replay (0.3); import it from there",
               DeprecationWarning, stacklevel=2)

"""Moved to :mod:`kvvmm.cli.workspace` in 0.3; this name goes in 0.4."""

import warnings as _warnings

from kvvmm.cli.workspace import *  # noqa: F403
from kvvmm.cli.workspace import __all__  # noqa: F401

_warnings.warn("kvvmm.workspace moved to kvvmm.cli.workspace (0.3); import it from there",
               DeprecationWarning, stacklevel=2)

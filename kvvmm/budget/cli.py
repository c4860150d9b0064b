"""Moved to :mod:`kvvmm.cli.budget` in 0.3; this name goes in 0.4."""

import warnings as _warnings

from kvvmm.cli.budget import *  # noqa: F403
from kvvmm.cli.budget import __all__  # noqa: F401

_warnings.warn("kvvmm.budget.cli moved to kvvmm.cli.budget (0.3); import it from there",
               DeprecationWarning, stacklevel=2)

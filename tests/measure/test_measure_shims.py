"""kvvmm.bench and kvvmm.calibrate moved to kvvmm.measure in 0.3 (issue 23): the old names still
import for one release, with the same public objects, and say where they went."""

from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize("name", ["bench", "calibrate"])
def test_the_old_module_warns_and_gives_the_same_public_objects(name: str) -> None:
    new = importlib.import_module(f"kvvmm.measure.{name}")
    sys.modules.pop(f"kvvmm.{name}", None)
    with pytest.warns(DeprecationWarning, match=f"kvvmm.measure.{name}"):
        old = importlib.import_module(f"kvvmm.{name}")
    assert old.__all__ == new.__all__
    for public in new.__all__:
        assert getattr(old, public) is getattr(new, public), public

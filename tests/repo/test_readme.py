"""The README names what is there: every notebook and every command (the map of the package is
docs/DESIGN.md's)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_names_every_notebook() -> None:
    missing = [p.stem for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
               if f"`{p.stem}`" not in README]
    assert not missing, f"README.md's notebooks section does not name {missing}"


def test_the_readme_names_every_command() -> None:
    from kvvmm import cli

    sub = next(a for a in cli._parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    commands = set(sub.choices)
    assert {"lab", "plan", "map", "bench", "calibrate", "replay"} <= commands
    missing = sorted(c for c in commands if not re.search(rf"`(kvvmm )?{c}`", README))
    assert not missing, f"README.md does not name the command(s) {missing}"


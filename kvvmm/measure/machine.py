"""What a benchmark records of the machine it ran on: the CPU, the load, the commit, versions.

CPU figures from a shared 2-core machine mean little without the load they ran under, and a
result names the commit that made it; the ``bench/`` scripts write these three the same way.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

from kvvmm._version import __version__

__all__ = ["commit", "cpu_model", "load_average", "versions"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's answer elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit(root: Path) -> str:
    """The commit checked out at ``root`` (``"?"`` outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, two decimals (empty where there are none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def versions(root: Path, *dists: str) -> dict[str, str | None]:
    """Python's, kvvmm's and each named distribution's version, and the commit at ``root``.

    A distribution not installed reads ``None`` (a CPU-only machine has no ``cuda-bindings``).
    """
    out: dict[str, str | None] = {"python": platform.python_version(), "kvvmm": __version__,
                                  "commit": commit(root)}
    for dist in dists:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out

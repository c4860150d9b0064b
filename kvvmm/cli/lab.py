"""``kvvmm lab``: JupyterLab on the repository's notebooks, with ``KVVMM_DRIVER`` set."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvvmm.cli.common import _err, show
from kvvmm.driver import DRIVER_ENV

__all__ = ["DRIVER_ENV", "find_notebooks", "is_root", "lab_command"]

Launcher = Callable[[Sequence[str], Mapping[str, str]], int]
GpuProbe = Callable[[], bool]


def find_notebooks(start: Path | None = None) -> Path | None:
    """The notebooks folder: ``./notebooks`` (or ``.`` if it holds them), else the one next
    to the package (an editable install or a checkout)."""
    here = Path.cwd() if start is None else start
    pkg_repo = Path(__file__).resolve().parents[2]
    for cand in (here / "notebooks", here, pkg_repo / "notebooks"):
        if cand.is_dir() and any(cand.glob("[0-9][0-9]_*.ipynb")):
            return cand
    return None


def _gpu_usable() -> bool:
    """True when the CUDA driver opens; asked in a child process so no context stays here."""
    code = "from kvvmm.driver import open_driver; open_driver('cuda')"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def lab_command(args: argparse.Namespace, notebooks: Path, gpu_probe: GpuProbe = _gpu_usable,
                environ: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start JupyterLab for ``kvvmm lab`` (nothing is run).

    ``--driver auto`` becomes ``cuda`` when ``gpu_probe()`` says a GPU is usable, else
    ``sim`` (every notebook runs there, and its outputs match the saved ones).
    """
    driver = args.driver
    if driver == "auto":
        driver = "cuda" if gpu_probe() else "sim"
    argv = [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={notebooks}"]
    tour = notebooks / "01_tour.ipynb"
    if tour.exists():
        argv.append("--LabApp.default_url=/lab/tree/01_tour.ipynb")
    if args.port is not None:
        argv.append(f"--ServerApp.port={args.port}")
    if args.no_browser:
        argv.append("--no-browser")
    if is_root():
        # Jupyter refuses to start as root without it; containers and CI machines run so.
        argv.append("--allow-root")
    argv += list(args.jupyter_args or [])
    env = dict(os.environ if environ is None else environ)
    env[DRIVER_ENV] = driver
    return argv, env


def is_root() -> bool:
    """True when running as root (POSIX); Jupyter then needs ``--allow-root``."""
    geteuid = getattr(os, "geteuid", None)
    return geteuid is not None and geteuid() == 0


def _launch(argv: Sequence[str], env: Mapping[str, str]) -> int:
    try:
        return subprocess.call(list(argv), env=dict(env))
    except KeyboardInterrupt:
        return 0


def _cmd_lab(args: argparse.Namespace, launch: Launcher, gpu_probe: GpuProbe) -> int:
    if args.notebooks is not None and not Path(args.notebooks).is_dir():
        _err("lab", f"no notebooks folder: --notebooks {args.notebooks!r} is not a folder")
        return 2
    notebooks = Path(args.notebooks) if args.notebooks else find_notebooks()
    if notebooks is None or not notebooks.is_dir():
        _err("lab", "no notebooks folder found: run this in the kvvmm repository (it has "
                    "notebooks/) or pass --notebooks DIR")
        return 2
    # JupyterLab autosaves whatever it opens: it opens working copies in an ignored folder,
    # so using the lab never changes a tracked notebook (a user's edits stay in the copies).
    from kvvmm.cli.workspace import prepare_workspace

    work = prepare_workspace(notebooks)
    argv, env = lab_command(args, work, gpu_probe)
    print(f"kvvmm lab: {DRIVER_ENV}={env[DRIVER_ENV]}, working copies of {show(notebooks)} in "
          f"{show(work)} (git ignores them; delete one to get the current version back)",
          flush=True)
    return launch(argv, env)

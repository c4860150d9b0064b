"""Where the committed measurements are: the ``bench/results`` folder of a kvvmm checkout.

A folder named explicitly (``--results DIR``), else ``bench/results`` beside the imported
``kvvmm`` package (a checkout). Anything else (an installed wheel, no folder named) is an error;
nothing is searched for in the current directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvvmm.errors import ArgumentError

__all__ = ["checkout_root", "results_dir", "shipped_profile_path"]


def checkout_root() -> Path:
    """The folder the imported ``kvvmm`` package lives in (a checkout, or site-packages)."""
    return Path(__file__).resolve().parents[2]


def shipped_profile_path(key: str = "h200") -> Path:
    """The shipped profile file of ``key`` inside the imported package."""
    return checkout_root() / "kvvmm" / "hardware" / "data" / f"{key}.json"


def results_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The committed results folder: ``explicit``, else the checkout's ``bench/results``.

    Args:
        explicit: a folder to read the results from, or None for the checkout's.
    Returns:
        The folder (it exists).
    Raises:
        ArgumentError: the folder named is not a directory, or, with none named, this
            kvvmm was not imported from a checkout that has ``bench/results``.
    """
    if explicit is not None:
        path = Path(explicit)
        if not path.is_dir():
            raise ArgumentError("results", str(explicit), "a folder of committed results")
        return path
    path = checkout_root() / "bench" / "results"
    if not path.is_dir():
        raise ArgumentError("results", str(path),
                            "a kvvmm checkout's bench/results (this kvvmm is not imported from "
                            "a checkout: pass --results DIR)")
    return path

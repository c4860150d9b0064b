"""The lab's working folder: copies of the notebooks that JupyterLab may save over.

JupyterLab saves what it opens, outputs and widget state included, so ``kvvmm lab`` opens
a git-ignored working folder (``notebooks/.work/``) filled from the tracked notebooks. A
working copy that exists is never overwritten; delete it to get the tracked version back.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["WORK_DIR_NAME", "prepare_workspace"]

#: The working folder's name under the notebooks folder (``.gitignore`` lists it).
WORK_DIR_NAME = ".work"

#: What is copied: the notebooks (``01_tour.ipynb``...) and nothing that build.py runs.
_PATTERN = "[0-9][0-9]_*.ipynb"


def prepare_workspace(notebooks: Path, work: Path | None = None) -> Path:
    """Make the lab's working folder: a copy of each tracked notebook not copied yet.

    Args:
        notebooks: the folder of tracked notebooks (``notebooks/``).
        work: the working folder (default ``notebooks/.work``); made if missing.
    Returns:
        The working folder, to open JupyterLab on.
    Raises:
        FileNotFoundError: ``notebooks`` is not a folder or holds no notebook.
        ValueError: ``work`` is ``notebooks`` itself (saves would change the tracked files).
    """
    notebooks = Path(notebooks)
    if not notebooks.is_dir():
        raise FileNotFoundError(f"notebooks={str(notebooks)!r} is not a folder")
    sources = sorted(notebooks.glob(_PATTERN))
    if not sources:
        raise FileNotFoundError(f"no notebook ({_PATTERN}) in {str(notebooks)!r}")
    work = notebooks / WORK_DIR_NAME if work is None else Path(work)
    if work.resolve() == notebooks.resolve():
        raise ValueError(f"work={str(work)!r} is the notebooks folder itself: JupyterLab's "
                         "saves would rewrite the tracked notebooks; pick another folder")
    work.mkdir(parents=True, exist_ok=True)
    for src in sources:
        dst = work / src.name
        if not dst.exists():  # the user's copy, with their edits: never overwritten
            shutil.copy2(src, dst)
    return work

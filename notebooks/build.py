"""Generate, run and clean the notebooks from their sources: the one way to change them.

    python notebooks/build.py              # all five
    python notebooks/build.py 03_growth    # one (a name, or its source's path)
    python notebooks/build.py --check      # no execution: exit 1 if a saved .ipynb has drifted

Each notebook's source is ``src/NN_name.py`` in jupytext's percent format: ``# %%`` starts
a code cell, ``# %% [markdown]`` a markdown cell (its lines commented), and
``# %% tags=["nbval-ignore-output"]`` a code cell whose output nbval does not compare (a
figure, a widget or a fact of the machine; every other cell's output is compared exactly,
after ``sanitize.cfg``). Edit the sources, in an editor or in JupyterLab through jupytext,
then run this script. It reads a source with jupytext, runs it with nbclient in this Python
(on the sim driver: ``KVVMM_DRIVER`` is removed from the environment; notebook 05 picks CUDA
or the host driver itself), strips it with ``_clean.py`` (no widget state, figures and
widgets reduced to a text note), numbers its cells (``01-00``, ``01-01``, ...) and saves it
as ``NN_name.ipynb`` with its outputs and execution counts, which nbval then compares.

``--check`` compares each saved ``.ipynb`` with its source, cell by cell (type, source,
tags), and names the notebook and the first cell that differs.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from pathlib import Path
from typing import Any

import jupytext
import nbformat

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
sys.path.insert(0, str(HERE))
from _clean import clean  # noqa: E402  (a sibling script, not a package)

#: What a cell is, for ``--check``: its type, its source and its tags.
Cell = tuple[str, str, tuple[str, ...]]


def names() -> list[str]:
    """The notebooks, in order: one per source in ``src/``."""
    return sorted(p.stem for p in SRC.glob("[0-9][0-9]_*.py"))


def read_source(name: str) -> Any:
    """The notebook ``src/<name>.py`` describes, without outputs (an nbformat notebook)."""
    nb = jupytext.read(SRC / f"{name}.py", fmt="py:percent")
    nb.metadata = nbformat.from_dict({
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    })
    for cell in nb.cells:  # keep the tags; jupytext's own bookkeeping stays in the .py
        tags = list(cell.metadata.get("tags", []))
        cell.metadata = nbformat.from_dict({"tags": tags} if tags else {})
    return nb


def cells(nb: Any) -> list[Cell]:
    """Each cell's type, source and tags: what a source and its .ipynb must agree on."""
    return [(c.cell_type, c.source, tuple(c.metadata.get("tags", []))) for c in nb.cells]


def drift(name: str) -> str | None:
    """Why ``<name>.ipynb`` does not match ``src/<name>.py``, or None if it does."""
    path = HERE / f"{name}.ipynb"
    if not path.exists():
        return f"{path.name} is missing"
    want = cells(read_source(name))
    have = cells(nbformat.read(path, as_version=4))
    for i, (w, h) in enumerate(zip(want, have, strict=False)):
        if w == h:
            continue
        what = [k for k, a, b in zip(("type", "source", "tags"), w, h, strict=True) if a != b]
        msg = f"{path.name}: cell {i} ({w[0]}) differs from src/{name}.py in {', '.join(what)}"
        if w[1] != h[1]:
            diff = difflib.unified_diff(h[1].splitlines(), w[1].splitlines(), f"{name}.ipynb",
                                        f"src/{name}.py", lineterm="", n=1)
            msg += "\n" + "\n".join(list(diff)[:12])
        elif w[2] != h[2]:
            msg += f": {list(h[2])} in the .ipynb, {list(w[2])} in the source"
        return msg
    if len(want) != len(have):
        return (f"{path.name}: {len(have)} cells, src/{name}.py {len(want)}: cell "
                f"{min(len(want), len(have))} is only in the "
                f"{'source' if len(want) > len(have) else '.ipynb'}")
    return None


def build(name: str) -> Path:
    """Run ``src/<name>.py`` as a notebook and save it, clean, as ``<name>.ipynb``."""
    from nbclient import NotebookClient

    nb = read_source(name)
    env_driver = os.environ.pop("KVVMM_DRIVER", None)  # sim, as nbval runs them
    try:
        client = NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(HERE)}},
                                record_timing=False)
        client.execute()
    finally:
        if env_driver is not None:
            os.environ["KVVMM_DRIVER"] = env_driver
    clean(nb)
    for i, cell in enumerate(nb.cells):  # nbformat ids are random: stable ones, small diffs
        cell["id"] = f"{name[:2]}-{i:02d}"
    path = HERE / f"{name}.ipynb"
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="notebooks to build (default: all)")
    ap.add_argument("--check", action="store_true",
                    help="run nothing; exit 1 if a saved .ipynb's cells differ from its source")
    args = ap.parse_args(argv)
    known = names()
    chosen = [Path(n).stem for n in args.names] or known
    for name in chosen:
        if name not in known:
            print(f"unknown notebook {name!r}: one of {known}", file=sys.stderr)
            return 2
    if args.check:
        problems = [p for p in map(drift, chosen) if p]
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("rebuild with: python notebooks/build.py", file=sys.stderr)
            return 1
        print(f"{len(chosen)} notebook"
              + ("s match their sources" if len(chosen) > 1 else " matches its source"))
        return 0
    for name in chosen:
        t0 = time.perf_counter()
        path = build(name)
        print(f"{path.name}: {path.stat().st_size / 1024:.1f} KiB, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Strip a notebook to what the repository keeps: outputs and counts, no widget state, no bulk.

    python notebooks/_clean.py notebooks/*.ipynb     # rewrite in place
    python notebooks/_clean.py --check notebooks/*.ipynb   # exit 1 if any would change

What goes:
- ``metadata.widgets`` (the saved widget state JupyterLab writes) and per-cell timing
  metadata (``metadata.execution``);
- in cells tagged ``nbval-ignore-output`` (figures, widgets, machine-specific facts): every
  rich output (widget views, plotly JSON, HTML with plotly.js inlined, images) becomes a
  one-line ``text/plain`` note, so the file stays small; printed text stays;
- elsewhere: widget-view outputs keep only their ``text/plain`` fallback.

nbval does not compare ignore-tagged cells, so what they keep changes no test.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import nbformat

IGNORE_TAG = "nbval-ignore-output"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"


def _note(data: dict[str, Any]) -> str:
    if WIDGET_MIME in data:
        return "[a widget panel: run the notebook to use it]"
    if PLOTLY_MIME in data or "plotly" in str(data.get("text/html", ""))[:20000]:
        return "[a plotly figure: run the notebook to draw it]"
    return "[rich output: run the notebook to see it]"


def clean(nb: Any) -> Any:
    """Clean ``nb`` (an nbformat NotebookNode) in place and return it."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        ignored = IGNORE_TAG in cell.metadata.get("tags", [])
        outputs = []
        for out in cell.outputs:
            if out.output_type not in ("display_data", "execute_result"):
                outputs.append(out)
                continue
            data = out.get("data", {})
            rich = set(data) - {"text/plain"}
            if ignored and rich:
                data = {"text/plain": _note(data)}
            elif WIDGET_MIME in data:
                data = {"text/plain": data.get("text/plain", _note(data))}
            out["data"] = nbformat.from_dict(data)
            out["metadata"] = nbformat.from_dict({})
            if out.output_type == "display_data" and outputs and outputs[-1].get("data") == data:
                continue  # the same note twice (a figure redrawn) says nothing new
            outputs.append(out)
        cell.outputs = outputs
    return nb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if dirty")
    args = ap.parse_args(argv)
    dirty = 0
    for path in args.paths:
        before = path.read_text(encoding="utf-8")
        nb = clean(nbformat.reads(before, as_version=4))
        after = nbformat.writes(nb) + "\n"
        if after != before:
            dirty += 1
            if args.check:
                print(f"{path}: not clean (run python notebooks/_clean.py {path})")
            else:
                path.write_text(after, encoding="utf-8")
                print(f"cleaned {path}")
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())

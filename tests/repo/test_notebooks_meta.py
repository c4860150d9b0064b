"""The saved notebooks are their sources, small, clean, executed, and end in asserts.

nbval (``pytest --nbval notebooks/``) checks that re-running each notebook reproduces its
saved outputs; this file checks how they are made and saved: each ``.ipynb`` has the cells
of its jupytext source ``notebooks/src/NN_name.py`` (``notebooks/build.py`` generates it;
a notebook edited but not rebuilt, or rebuilt from an edited file, fails here), the
sources are clean Python, and each of the five notebooks is at most 200 KB, carries no
widget state, has its outputs and execution counts, tags every figure and widget cell so
nbval does not compare it, and ends in a cell of asserts.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
#: The notebooks every checkout has (DESIGN.md's five); later ones (06_workloads, ...) join
#: by having a source in notebooks/src/.
REQUIRED = ("01_tour", "02_layouts", "03_growth", "04_failures", "05_gpu")
NAMES = tuple(sorted(p.stem for p in (NOTEBOOKS / "src").glob("[0-9][0-9]_*.py")))
IGNORE = "nbval-ignore-output"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
MAX_BYTES = 200 * 1000
REBUILD = "rebuild with: python notebooks/build.py"


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))
    return data


def _code_cells(nb: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _source(cell: dict[str, Any]) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else str(src)


def _build_script() -> ModuleType:
    """``notebooks/build.py``, loaded under a name no installed package has (``build`` is one)."""
    spec = importlib.util.spec_from_file_location("kvvmm_notebooks_build",
                                                  NOTEBOOKS / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_five_onboarding_notebooks_are_there_and_every_notebook_is_built() -> None:
    found = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert set(REQUIRED) <= set(NAMES), NAMES
    assert found == list(NAMES)


def test_each_notebook_has_a_source_and_nothing_else_does() -> None:
    found = sorted(p.stem for p in (NOTEBOOKS / "src").glob("*.py"))
    assert found == list(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_notebook_has_the_cells_of_its_source(name: str) -> None:
    pytest.importorskip("jupytext")
    problem = _build_script().drift(name)
    assert problem is None, f"{problem}\n{REBUILD} {name}"


def test_the_drift_check_names_the_first_cell_that_differs(tmp_path: Path) -> None:
    pytest.importorskip("jupytext")
    nbformat = pytest.importorskip("nbformat")
    build = _build_script()
    build.HERE = tmp_path  # the saved notebooks it reads; the sources stay the repo's
    nb = nbformat.read(NOTEBOOKS / "01_tour.ipynb", as_version=4)
    untagged = next(i for i, c in enumerate(nb.cells) if c.metadata.get("tags"))
    nb.cells[untagged].metadata["tags"] = []
    nbformat.write(nb, tmp_path / "01_tour.ipynb")
    assert f"cell {untagged} (code) differs from src/01_tour.py in tags" in build.drift("01_tour")
    nb.cells[3].source += "\nprint('edited in JupyterLab')"
    nbformat.write(nb, tmp_path / "01_tour.ipynb")
    problem = build.drift("01_tour")
    assert problem is not None and "cell 3 (code)" in problem and "edited" in problem
    del nb.cells[3:]
    nbformat.write(nb, tmp_path / "01_tour.ipynb")
    assert "cell 3 is only in the source" in build.drift("01_tour")
    assert "missing" in build.drift("02_layouts")


def test_the_sources_pass_ruff_and_compile() -> None:
    """Notebook idioms (an import where a cell first needs it, a bare name to display a
    widget) are allowed by pyproject's per-file-ignores for notebooks/src; nothing else is."""
    for path in sorted((NOTEBOOKS / "src").glob("*.py")):
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format=concise",
         "notebooks"],
        cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"ruff check notebooks:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("name", NAMES)
def test_a_notebook_is_at_most_200_kb(name: str) -> None:
    size = (NOTEBOOKS / f"{name}.ipynb").stat().st_size
    assert size <= MAX_BYTES, f"{name}.ipynb is {size} bytes: {REBUILD} {name}"


@pytest.mark.parametrize("name", NAMES)
def test_a_notebook_carries_no_widget_state(name: str) -> None:
    nb = _load(name)
    assert "widgets" not in nb["metadata"]
    for cell in _code_cells(nb):
        for out in cell.get("outputs", []):
            assert WIDGET_MIME not in out.get("data", {}), (name, _source(cell)[:60])
            assert "text/html" not in out.get("data", {}) or IGNORE not in cell["metadata"].get(
                "tags", []), (name, _source(cell)[:60])


@pytest.mark.parametrize("name", NAMES)
def test_a_notebook_is_saved_executed_with_its_outputs(name: str) -> None:
    cells = _code_cells(_load(name))
    counts = [c["execution_count"] for c in cells]
    assert counts == list(range(1, len(cells) + 1)), "run top to bottom once, then saved"
    printed = [c for c in cells if c.get("outputs") and IGNORE not in c["metadata"].get("tags", [])]
    assert len(printed) >= 3, "text summaries for nbval to compare"
    for c in cells:
        for out in c.get("outputs", []):
            assert out["output_type"] != "error", (name, _source(c)[:60])


@pytest.mark.parametrize("name", NAMES)
def test_a_notebook_ends_in_assert_cells(name: str) -> None:
    last = _code_cells(_load(name))[-1]
    lines = [ln.strip() for ln in _source(last).splitlines()]
    asserts = [ln for ln in lines if ln.startswith("assert ")]
    assert asserts, f"{name}: the last code cell must check the notebook's claims with assert"
    assert IGNORE not in last["metadata"].get("tags", [])


_FIGURE_OR_WIDGET = re.compile(
    r"^(va_map|timeline|handle_sizes|bandwidth_by_handle_size)\(|^\w*lab\s*$|^explorer\s*$",
    re.MULTILINE,
)


@pytest.mark.parametrize("name", NAMES)
def test_figure_and_widget_cells_are_excluded_from_comparison(name: str) -> None:
    for cell in _code_cells(_load(name)):
        src = _source(cell)
        last_line = src.strip().splitlines()[-1]
        if _FIGURE_OR_WIDGET.search(last_line):
            assert IGNORE in cell["metadata"].get("tags", []), (name, last_line)


def test_the_notebooks_are_as_the_cleaner_leaves_them() -> None:
    nbformat = pytest.importorskip("nbformat")
    sys.path.insert(0, str(NOTEBOOKS))
    try:
        from _clean import clean
    finally:
        sys.path.remove(str(NOTEBOOKS))
    for name in NAMES:
        text = (NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8")
        nb = nbformat.reads(text, as_version=4)
        assert nbformat.writes(clean(nb)) + "\n" == text, f"{name}: {REBUILD} {name}"


def test_the_sanitize_file_masks_addresses_but_not_offsets() -> None:
    plugin = pytest.importorskip("nbval.plugin")
    patterns = plugin.get_sanitize_patterns(
        (NOTEBOOKS / "sanitize.cfg").read_text(encoding="utf-8"))
    assert len(patterns) >= 3

    def sanitize(text: str) -> str:  # as nbval applies them
        for regex, replace in patterns:
            text = re.sub(regex, replace, text)
        return text

    line = "reserved 40.0 MiB at base 0x7f0180e00000, cursor 40.0 MiB"
    assert sanitize(line) == sanitize(line.replace("0x7f0180e00000", "0x302000000"))
    assert sanitize("k0  [0xa00000, 0x1400000)") == "k0  [0xa00000, 0x1400000)"
    assert "0x7f" not in sanitize("map(va=0x7f0000200000, size=8388608)")

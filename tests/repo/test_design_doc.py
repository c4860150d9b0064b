"""docs/DESIGN.md names the layers as built: one row per layer of tests/repo/test_layering.py, in
its order, and in each row every module the layering test puts in that layer (so a new wing
or a moved module cannot land without the page saying where it sits)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "DESIGN.md").read_text()


def _layering():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "_layering", ROOT / "tests" / "repo" / "test_layering.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


LAYERING = _layering()


def _rows() -> dict[str, str]:
    """``layer -> its row`` of the page's layers table, in order."""
    rows = {}
    for line in DOC.splitlines():
        m = re.match(r"\| `([a-z-]+)` \| (.*)", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_the_design_page_has_one_row_per_layer_in_the_layering_tests_order() -> None:
    assert list(_rows()) == list(LAYERING.LAYERS)


def test_each_layers_row_names_every_module_the_layering_test_puts_there() -> None:
    rows = _rows()
    missing = [(module, layer) for module, layer in LAYERING.LAYER_OF.items()
               if f"`{module}`" not in rows[layer].split(" | ")[0]]
    assert not missing, f"docs/DESIGN.md's layer rows lack: {missing}"


def test_the_map_names_every_wing_of_the_package() -> None:
    section = DOC.split("## Map of the repo", 1)[1]
    wings = sorted(p.name for p in (ROOT / "kvvmm").iterdir()
                   if p.is_dir() and (p / "__init__.py").is_file())
    missing = [w for w in wings if not re.search(rf"^\s+{w}/\s", section, re.MULTILINE)]
    assert not missing, f"docs/DESIGN.md's map of the repo does not name kvvmm/{missing}"


def test_the_page_the_code_cites_exists_and_the_readme_links_it() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docs/DESIGN.md" in readme


def test_every_module_over_600_lines_has_its_reason_on_the_page_and_no_other_is_listed() -> None:
    long = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvvmm").rglob("*.py")
                  if len(p.read_text().splitlines()) > 600)
    section = DOC.split("## Modules over 600 lines", 1)[1]
    listed = sorted(re.findall(r"^\| `(kvvmm/[^`]+\.py)` \|", section, flags=re.M))
    assert long == listed, (f"over 600 lines without a row: {sorted(set(long) - set(listed))}; "
                            f"listed but not over: {sorted(set(listed) - set(long))}")

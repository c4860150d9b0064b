"""bench/ (its scripts and probes) uses kvvmm's public names only.

A bench script that imports ``kvvmm.arena._dlpack`` or calls an owner's ``_all_reduce_min``
breaks when the package moves its insides, and measures what no user can call. So every
``bench/**/*.py`` is read here and refused when it names a private kvvmm name: a module or
name with a leading underscore in a ``from kvvmm... import`` or ``import kvvmm...``, an
attribute path through one (``kvvmm.x._y``, ``backup_mod._pieces``), or a private attribute
the package defines (a ``_method`` of one of its classes) reached on any object but ``self``.
Dunders (``__version__``) are public.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvvmm"
BENCH = ROOT / "bench"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_private_names() -> frozenset[str]:
    """The private functions, classes, methods and ``self._x`` attributes kvvmm defines."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if _private(node.name):
                    names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "self" and _private(node.attr)):
                names.add(node.attr)
    return frozenset(names)


def private_uses(source: str, private_names: frozenset[str]) -> list[tuple[int, str]]:
    """``(line, what)`` for each private kvvmm name ``source`` uses."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    kvvmm_names: set[str] = set()  # local names bound to a kvvmm module or object
    other_names: set[str] = set()  # local names bound to anything else imported
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module.split(".")[0] != "kvvmm":
                other_names.update(a.asname or a.name for a in node.names)
                continue
            bad_module = any(_private(part) for part in module.split("."))
            for alias in node.names:
                kvvmm_names.add(alias.asname or alias.name)
                if bad_module or _private(alias.name):
                    found.append((node.lineno, f"from {module} import {alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                bound = alias.asname or parts[0]
                if parts[0] != "kvvmm":
                    other_names.add(bound)
                    continue
                kvvmm_names.add(bound)
                if any(_private(part) for part in parts):
                    found.append((node.lineno, f"import {alias.name}"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        root: ast.expr = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        root_name = root.id if isinstance(root, ast.Name) else None
        through_kvvmm = root_name in kvvmm_names
        # a private the package defines, on an object (not bench's own, not self's)
        on_an_object = (node.attr in private_names and root_name not in ("self", "cls")
                        and root_name not in other_names)
        if through_kvvmm or on_an_object:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_no_bench_script_or_probe_uses_a_private_kvvmm_name() -> None:
    private_names = package_private_names()
    problems = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in sorted(BENCH.rglob("*.py"))
        for line, what in private_uses(path.read_text(encoding="utf-8"), private_names)
    ]
    if problems:
        pytest.fail("bench/ reaches into kvvmm's private names; give each a public name in "
                    "its wing (or use a public API):\n" + "\n".join(problems), pytrace=False)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from kvvmm.arena._dlpack import device_tensor", "from kvvmm.arena._dlpack"),
        ("from kvvmm.arena.backup import _pow2_pieces", "import _pow2_pieces"),
        ("from kvvmm.arena import backup as b\nb._pow2_pieces(1)", "b._pow2_pieces"),
        ("import kvvmm.arena._dlpack as dl", "import kvvmm.arena._dlpack"),
        ("import kvvmm\nkvvmm.arena._dlpack.device_tensor", "kvvmm.arena._dlpack"),
        ("def f(coll):\n    return coll._all_reduce_min([1])", "coll._all_reduce_min"),
        ("from kvvmm.arena import device_tensor", None),
        ("from kvvmm.arena.backup import pow2_pieces", None),
        ("from kvvmm import __version__", None),
        ("import kvvmm\nkvvmm.__version__", None),
        ("class T:\n    def f(self):\n        return self._all_reduce_min", None),
        ("import bench_fidelity as bf\nbf._all_reduce_min()", None),  # bench's own module
        ("import os\nos._exit(0)", None),
    ],
)
def test_the_checker_flags_what_it_should(source: str, expected: str | None) -> None:
    found = private_uses(textwrap.dedent(source), frozenset({"_all_reduce_min"}))
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0][1], found

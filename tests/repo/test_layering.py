"""Imports point down DESIGN.md's layers; heavy and GPU-only packages stay where they belong.

Every module of the package has a row in LAYER_OF below. A module may import kvvmm modules of
its own layer or lower ones, never higher: that keeps the drivers free of arena logic, the
arena free of plotting, and lets a laptop with no torch or GPU `import kvvmm`.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvvmm"

# Lowest first.
LAYERS = (
    "foundation",  # errors, units, checks: no kvvmm imports but each other
    "data",  # hardware profiles and models, dtype facts, the frozen snapshot records
    "policy",  # growth policies (pure)
    "driver-base",  # the Driver protocol and the rules
    "driver",  # sim, host, faults, cuda, and the driver package (open_driver)
    "record",  # traces of driver calls and arena operations, the tracing driver
    "layout",  # buffer descriptions, presets, model configs, capacity planner (pure)
    "arena",  # the arena, its transactions, views and pool
    "owner",  # KV owners, TP owners, replays, the decode-growth experiment
    "budget",  # the per-GPU budget broker across processes: ledger, tenants, BudgetedDriver
    "workload",  # request traces, generator, serving model, memory strategies, replay
    "viz",
    "lab",
    "integrations",  # engine adapters (SGLang): the library's public API behind an engine's
    "measure",  # measuring on a GPU: kvvmm bench, kvvmm calibrate
    "cli",
)

# A new module needs a row here, or lives in a package that has one: pick its layer from
# DESIGN.md's "Layers". A sub-package's row covers its modules; a longer name wins.
LAYER_OF = {
    "kvvmm.errors": "foundation",
    "kvvmm.units": "foundation",
    "kvvmm.checks": "foundation",
    "kvvmm._version": "foundation",  # the version, readable from any layer
    "kvvmm.hardware": "data",
    "kvvmm.dtypes": "data",
    "kvvmm.snapshot": "data",
    "kvvmm.policy": "policy",
    "kvvmm.driver.base": "driver-base",
    "kvvmm.driver.book": "driver-base",  # the rules in Python (VmmBook), moved out of base
    "kvvmm.driver": "driver",
    "kvvmm.record": "record",
    "kvvmm.layout": "layout",
    "kvvmm.arena": "arena",
    "kvvmm.owner": "owner",
    "kvvmm.replay": "owner",  # rebuilds arenas from a trace
    "kvvmm.growth": "owner",  # decode growth under each policy, on real owners
    "kvvmm.pressure": "owner",  # 0.3: the pressure poll, over drivers, pools and owners
    "kvvmm.budget": "budget",
    "kvvmm.workload": "workload",
    "kvvmm.viz": "viz",
    "kvvmm.lab": "lab",
    "kvvmm.integrations": "integrations",
    "kvvmm.cli": "cli",  # dispatch, one module per command, the lab's working copies
    "kvvmm.measure": "measure",  # `kvvmm bench` and `kvvmm calibrate`: owners and arenas on a GPU
    "kvvmm.__main__": "cli",
    # The package root re-exports everything: only the CLI may import it from inside.
    "kvvmm": "cli",
}


def layer_of(module: str) -> str | None:
    """The layer of ``module``: its own row, else its nearest package's; None if neither."""
    parts = module.split(".")
    while parts:
        name = ".".join(parts)
        if name in LAYER_OF and (name != "kvvmm" or module == "kvvmm"):
            return LAYER_OF[name]
        parts.pop()
    return None


def _in(module: str, packages: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


# kvvmm/__init__.py imports from every layer (it is the public surface); it is checked only for
# the third-party rules below.
EXEMPT_FROM_LAYERS = {"kvvmm"}

RANK = {name: i for i, name in enumerate(LAYERS)}

# Third-party packages and the kvvmm modules allowed to import them. torch is further
# restricted to function bodies (lazy), wherever it is imported.
ONLY_IN = {
    "plotly": {"kvvmm.viz", "kvvmm.lab", "kvvmm.cli"},
    "ipywidgets": {"kvvmm.viz", "kvvmm.lab", "kvvmm.cli"},
    # cuda.bindings (and the rest of the cuda namespace): the CUDA driver is the only module
    # that talks to CUDA directly.
    # `kvvmm bench` is the one exception: it times the raw cuda-python call side by side with
    # CudaDriver's (the overhead target), importing cuda.bindings inside its functions only.
    "cuda": {"kvvmm.driver.cuda", "kvvmm.measure.bench"},
}
LAZY_ONLY = {"torch"}


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target, as seen in a module's source."""

    target: str  # absolute dotted name (for `from a import b`: a.b if that is a module, else a)
    line: int
    in_function: bool  # inside a def/lambda body, so it runs only when called
    type_checking_only: bool  # under `if TYPE_CHECKING:`; never runs


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for p in sorted(PACKAGE.rglob("*.py"))
        if "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts
    }


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> list[Import]:
    """Every import in ``source`` with absolute targets; ``known`` names the kvvmm modules."""
    found: list[Import] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, node.lineno, in_function, type_checking))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in known else base
                found.append(Import(target, node.lineno, in_function, type_checking))
        inner_fn = in_function or isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
        )
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, inner_fn, True)
            for child in node.orelse:
                visit(child, inner_fn, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, inner_fn, type_checking)

    visit(ast.parse(source), False, False)
    return found


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _layer_order() -> str:
    return " -> ".join(LAYERS)


def layer_violations(module: str, imports: list[Import]) -> list[str]:
    if module in EXEMPT_FROM_LAYERS:
        return []
    own = layer_of(module)
    assert own is not None, module
    out = []
    for imp in imports:
        if _top(imp.target) != "kvvmm":
            continue
        theirs = layer_of(imp.target)
        if theirs is None:
            out.append(
                f"{module}:{imp.line} imports {imp.target}, which has no row in LAYER_OF "
                "(tests/repo/test_layering.py): add it there"
            )
            continue
        if RANK[theirs] > RANK[own]:
            out.append(
                f"{module}:{imp.line} (layer {own!r}) imports {imp.target} (layer {theirs!r}), "
                f"a higher layer; imports must point down: {_layer_order()}"
                + (
                    " (import from the defining module, not the package root)"
                    if imp.target == "kvvmm"
                    else ""
                )
            )
    return out


def third_party_violations(module: str, imports: list[Import]) -> list[str]:
    out = []
    for imp in imports:
        top = _top(imp.target)
        if top in LAZY_ONLY and not imp.in_function and not imp.type_checking_only:
            out.append(
                f"{module}:{imp.line} imports {imp.target} at module level; import it inside "
                "the function that makes a tensor, so `import kvvmm` needs no torch"
            )
        if top in ONLY_IN and not _in(module, ONLY_IN[top]):
            out.append(f"{module}:{imp.line} imports {imp.target}; only {sorted(ONLY_IN[top])} may")
    return out


def _all_imports() -> dict[str, list[Import]]:
    modules = package_modules()
    known = set(modules)
    return {
        name: imports_of(
            name, path.read_text(encoding="utf-8"), known, is_package=path.name == "__init__.py"
        )
        for name, path in modules.items()
    }


def test_every_module_of_the_package_has_a_layer() -> None:
    missing = sorted(m for m in package_modules() if layer_of(m) is None)
    if missing:
        pytest.fail(
            f"modules with no layer: {missing}. Add each to LAYER_OF in "
            "tests/repo/test_layering.py "
            f"(layers, lowest first: {_layer_order()})",
            pytrace=False,
        )


def test_kvvmm_imports_point_down_the_layers() -> None:
    problems = [
        p
        for name, imports in _all_imports().items()
        if layer_of(name) is not None
        for p in layer_violations(name, imports)
    ]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_torch_is_imported_only_inside_functions_and_gpu_and_ui_packages_only_where_allowed() -> (
    None
):
    problems = [
        p for name, imports in _all_imports().items() for p in third_party_violations(name, imports)
    ]
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("kvvmm.driver.base", "from kvvmm.arena import Arena", "higher layer"),
        ("kvvmm.driver.base", "from kvvmm.driver import sim", "higher layer"),
        ("kvvmm.driver.sim", "from .base import VmmBook", None),
        ("kvvmm.driver.sim", "from ..owner import KvBufferOwner", "higher layer"),
        ("kvvmm.policy", "def f():\n    from kvvmm.layout import KvBufferDesc", "higher layer"),
        ("kvvmm.viz", "import kvvmm", "package root"),
        ("kvvmm.arena", "from kvvmm import units", None),
        ("kvvmm.arena", "from kvvmm.newthing import x", "no row in LAYER_OF"),
        ("kvvmm.arena.arena", "from kvvmm.owner import KvBufferOwner", "higher layer"),
        ("kvvmm.record.trace", "from kvvmm.arena import Arena", "higher layer"),
        ("kvvmm.hardware.cost", "from kvvmm.driver import SimDriver", "higher layer"),
        ("kvvmm.snapshot", "from kvvmm.arena import Arena", "higher layer"),
        ("kvvmm.lab.arena_lab", "import plotly.graph_objects as go", None),
        ("kvvmm.arena", "import torch", "module level"),
        ("kvvmm.arena", "try:\n    import torch\nexcept ImportError:\n    pass", "module level"),
        ("kvvmm.arena", "def t():\n    import torch", None),
        (
            "kvvmm.arena",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch",
            None,
        ),
        ("kvvmm.owner", "def f():\n    import plotly.graph_objects as go", "only"),
        ("kvvmm.viz", "import plotly.graph_objects as go", None),
        ("kvvmm.arena", "def f():\n    from cuda.bindings import driver", "only"),
        ("kvvmm.driver.cuda", "from cuda.bindings import driver", None),
    ],
)
def test_the_checker_flags_what_it_should(module: str, source: str, expected: str | None) -> None:
    known = set(LAYER_OF) | set(package_modules())
    imports = imports_of(module, textwrap.dedent(source), known)
    problems = layer_violations(module, imports) + third_party_violations(module, imports)
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems


_HEAVY = ("torch", "plotly", "ipywidgets", "cuda")

_PROBE = """
import json, sys
heavy = {heavy!r}
if {block}:
    import importlib.abc

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in heavy:
                raise ImportError(f"{{name}} is blocked: kvvmm must import without it")
            return None

    sys.meta_path.insert(0, Block())
import kvvmm
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""


def _import_kvvmm_in_a_fresh_process(block: bool) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(heavy=_HEAVY, block=block)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, f"import kvvmm failed:\n{proc.stderr}"
    loaded: list[str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return loaded


def test_import_kvvmm_loads_no_torch_plotly_ipywidgets_or_cuda() -> None:
    assert _import_kvvmm_in_a_fresh_process(block=False) == []


def test_import_kvvmm_works_where_torch_plotly_ipywidgets_and_cuda_are_missing() -> None:
    assert _import_kvvmm_in_a_fresh_process(block=True) == []


# -- the calibration's wall, and tests that load scripts -------------------------------------


def test_nothing_below_measure_imports_it() -> None:
    """The calibration workshop (kvvmm.measure) measures and fits; the library only reads
    what it wrote (kvvmm/hardware's data and models): no module outside the measure layer
    and the command line above it imports kvvmm.measure, not even inside a function."""
    modules = package_modules()
    known = set(modules)
    found = []
    for module, path in modules.items():
        if layer_of(module) in ("measure", "cli"):
            continue
        for imp in imports_of(module, path.read_text(encoding="utf-8"), known,
                              path.name == "__init__.py"):
            if imp.target == "kvvmm.measure" or imp.target.startswith("kvvmm.measure."):
                found.append(f"{module}:{imp.line} imports {imp.target}")
    assert not found, "below measure, kvvmm.measure is imported:\n" + "\n".join(found)


#: Calls that run or load a file by its path instead of importing a module.
_BY_PATH = frozenset(("spec_from_file_location", "run_path", "run_module", "exec_module"))


def loads_bench_by_path(source: str) -> list[int]:
    """Lines of ``source`` where a function (or the module body) loads a file by path
    (``importlib.util.spec_from_file_location``, ``runpy``) and names ``bench`` (a path part
    or a path string under it): a benchmark is run as a user runs it, in its own process,
    and what calibrates is imported from ``kvvmm.measure``."""
    tree = ast.parse(source)
    scopes: list[ast.AST] = [tree, *(n for n in ast.walk(tree)
                                     if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]
    found = []
    for scope in scopes:
        body = scope.body if isinstance(scope, ast.Module) else [scope]
        nodes = [n for stmt in body for n in ast.walk(stmt)]
        if isinstance(scope, ast.Module):  # the module's own statements, not its functions'
            nodes = [n for stmt in body
                     if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
                     for n in ast.walk(stmt)]
        calls = [n for n in nodes if isinstance(n, ast.Call)
                 and ((isinstance(n.func, ast.Attribute) and n.func.attr in _BY_PATH)
                      or (isinstance(n.func, ast.Name) and n.func.id in _BY_PATH))]
        names_bench = any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                          and (n.value == "bench" or n.value.startswith("bench/")
                               or "/bench/" in n.value)
                          for n in nodes)
        if calls and names_bench:
            found += [c.lineno for c in calls]
    return sorted(set(found))


@pytest.mark.parametrize(("source", "flagged"), [
    ('import importlib.util\ndef f(root):\n'
     '    return importlib.util.spec_from_file_location("m", root / "bench" / "x.py")', True),
    ('import runpy\ndef f():\n    return runpy.run_path("bench/sleep/bench_sleep.py")', True),
    ('import importlib.util\nfrom pathlib import Path\n'
     'spec = importlib.util.spec_from_file_location("b", Path("bench") / "x.py")', True),
    ('import importlib.util\ndef f(root):\n'
     '    return importlib.util.spec_from_file_location("m", root / "notebooks" / "b.py")',
     False),
    ('import subprocess, sys\ndef f():\n'
     '    return subprocess.run([sys.executable, "bench/sim/bench_sim.py"])', False),
])
def test_the_by_path_scan_flags_what_loads_a_bench_script(source: str, flagged: bool) -> None:
    assert bool(loads_bench_by_path(source)) is flagged


def test_no_test_loads_a_bench_script_by_its_path() -> None:
    tests = ROOT / "tests"
    found = [f"{p.relative_to(ROOT)}:{line}"
             for p in sorted(tests.rglob("*.py"))
             for line in loads_bench_by_path(p.read_text(encoding="utf-8"))]
    assert not found, ("a test loads a bench script by its path; run it as a user does "
                       "(subprocess) or import what it tests from kvvmm:\n" + "\n".join(found))

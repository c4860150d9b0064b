"""No object's ``__dict__`` is rewritten, and every wrapper of a driver is a DriverWrapper.

Issue 47 item 7. A method swapped by writing the instance ``__dict__`` is a call that does
not go where the class says: CudaDriver's hot calls and BudgetedDriver's pass-through calls
are declared fields set at construction instead (``__slots__``), and a wrapper of a driver
subclasses :class:`kvvmm.driver.DriverWrapper` (as httpx's transports subclass
``BaseTransport``). Read from the source (the AST), so a module that only runs on a GPU is
checked here too.

Exempt, by module, function and the name written: the integrations' copy of an error's
fields onto its engine-typed twin, a fresh exception made in the same function (its state
is the error's, and ``__reduce__`` rebuilds it the same way).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvvmm"

#: (module, function, name whose __dict__ is written): each writes a new exception's state
#: from the error it stands for.
EXEMPT = {
    ("kvvmm/integrations/vllm.py", "as_vllm_error", "new"),
    ("kvvmm/integrations/sglang.py", "as_runtime_error", "new"),
}

#: What writes a dict in place.
_MUTATORS = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}

#: The classes that are drivers of their own, not wrappers of one: they subclass Driver.
DRIVERS = {"SimDriver", "HostDriver", "CudaDriver", "DriverWrapper"}


def _dict_of(node: ast.AST) -> str | None:
    """The source of X when ``node`` is ``X.__dict__`` or ``vars(X)``, else None."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return ast.unparse(node.value)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "vars" and len(node.args) == 1):
        return ast.unparse(node.args[0])
    return None


def _writes(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, enclosing function, X) for each write of ``X.__dict__`` in ``tree``."""
    out: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, fn: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn = node.name
        owner: str | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _MUTATORS:  # X.__dict__.update(...), vars(X).pop(...)
                owner = _dict_of(node.func.value)
            elif (node.func.attr == "__setattr__" and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant)
                  and node.args[1].value == "__dict__"):  # object.__setattr__(x, "__dict__")
                owner = ast.unparse(node.args[0])
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value == "__dict__"):
            owner = ast.unparse(node.args[0])
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                       else [node.target])
            for t in targets:
                for sub in ast.walk(t):  # tuples of targets too
                    if isinstance(sub, ast.Subscript):  # X.__dict__[k] = v
                        owner = owner or _dict_of(sub.value)
                    elif isinstance(sub, ast.Attribute) and sub.attr == "__dict__":
                        owner = owner or ast.unparse(sub.value)  # X.__dict__ = {...}
        if owner is not None:
            out.append((getattr(node, "lineno", 0), fn, owner))
        for child in ast.iter_child_nodes(node):
            visit(child, fn)

    visit(tree, "<module>")
    return out


def _modules() -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(ROOT).as_posix(), ast.parse(p.read_text(), str(p)))
            for p in sorted(PACKAGE.rglob("*.py"))]


def test_no_module_of_the_package_writes_an_objects_dict() -> None:
    found, used = [], set()
    for rel, tree in _modules():
        for line, fn, owner in _writes(tree):
            if (rel, fn, owner) in EXEMPT:
                used.add((rel, fn, owner))
            else:
                found.append(f"{rel}:{line} in {fn}(): writes {owner}.__dict__")
    assert not found, ("declare the field (__slots__, or an attribute the constructor sets) "
                       "or subclass DriverWrapper instead:\n" + "\n".join(found))
    # An exemption that matches nothing any more is taken out, not left to cover a new write.
    assert used == EXEMPT, f"stale exemptions: {sorted(EXEMPT - used)}"


def test_the_check_sees_each_way_of_writing_a_dict() -> None:
    src = """
def f(self, other):
    self.__dict__.update(map=1)
    self.__dict__["unmap"] = 2
    vars(self).setdefault("create", 3)
    vars(other)["x"] = 4
    setattr(self, "__dict__", {})
    object.__setattr__(self, "__dict__", {})
    self.__dict__ = {}
    a, self.__dict__["b"] = 1, 2
    del self.__dict__["c"]
    return self.__dict__, self.__dict__.get("inner"), dict(self.__dict__)
"""
    got = [(line, owner) for line, _, owner in _writes(ast.parse(src))]
    assert got == [(3, "self"), (4, "self"), (5, "self"), (6, "other"), (7, "self"),
                   (8, "self"), (9, "self"), (10, "self"), (11, "self")]


def test_every_driver_class_of_the_package_is_a_driver_or_a_driver_wrapper() -> None:
    # A class that subclasses Driver itself is one of the drivers; anything that wraps one
    # subclasses DriverWrapper (one place, _call, for what every call passes).
    direct = []
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(b) in ("Driver", "base.Driver") for b in node.bases):
                direct.append(node.name)
                assert node.name in DRIVERS, (
                    f"{rel}: {node.name} subclasses Driver: a wrapper of a driver subclasses "
                    "kvvmm.driver.DriverWrapper")
    assert set(direct) == DRIVERS

"""Drivers by name for the contract tests, and the little call language their rows are written in.

``open_driver_kind(kind, monkeypatch)`` opens a fresh driver of one of :data:`KINDS`: the
simulator (H200 profile), the host driver, or the CUDA driver with its hot calls in C
(``cuda-c``) or in Python (``cuda-python``, i.e. ``KVVMM_CUDA_FASTPATH=0`` when it is made).
A CUDA kind that cannot run here skips the test that asked for it.

A script is a few driver calls, one statement a line (or several, split by ``;``), in the
units the rules are stated in::

    a = reserve(8G)          # G is the driver's granularity, 4K is 4096 bytes
    h = create(2G)
    map(a + G, 2G, h)        # a comment after a call is its label (the golden probes use it)

The calls are the protocol's (``reserve(size, align=0)``, ``free``, ``create``, ``release``,
``map``, ``unmap``, ``set_access``), plus ``mapped(va, size)`` (create, map and set access;
gives the handle), ``mem_free()`` and ``mem_total()`` (``mem_info``'s two numbers) and
``value(x)`` (no call: a number the script computed, for a probe that recorded one).
Arguments are integer expressions of names, ``+ - * // / %``, ``==``, ``min`` and ``max``.
Nothing is ``eval``-ed: a script is parsed with :mod:`ast` and only those nodes are
accepted, so a typo is an error naming the line, never a silent no-op.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvvmm import DriverError, DriverUnavailableError, SimDriver
from kvvmm.driver.base import Driver

ROOT = Path(__file__).resolve().parents[1]

#: The four ways every rule is proven: the simulator, the host driver, and the CUDA driver
#: with its hot calls in C and in Python (the two paths are separate code, so both answer).
KINDS = ("sim", "host", "cuda-c", "cuda-python")

#: The host driver in tests: a 2 GiB cap keeps a runaway test from eating the machine's
#: memory; 2 MiB is the H100/H200 granularity, so sizes read the same on every kind.
HOST_CAPACITY_BYTES = 2 << 30
HOST_GRANULARITY = 2 << 20

OK = "ok"  #: the outcome of a call that was accepted

_cuda_problem: str | None = None


def driver_params(kinds: tuple[str, ...] = KINDS) -> list[Any]:
    """``pytest.param`` per kind, marked: ``cuda`` for the CUDA ones, Linux-only for host."""
    out = []
    for kind in kinds:
        marks: list[Any] = []
        if kind.startswith("cuda"):
            marks.append(pytest.mark.cuda)
        if kind == "host":
            marks.append(pytest.mark.skipif(not sys.platform.startswith("linux"),
                                            reason="the host driver needs Linux"))
        out.append(pytest.param(kind, marks=marks, id=kind))
    return out


def cuda_problem() -> str:
    """Why no CUDA driver opens here ('' when one does); asked once per process."""
    global _cuda_problem
    if _cuda_problem is None:
        try:
            from kvvmm.driver.cuda import CudaDriver

            CudaDriver().close()
            _cuda_problem = ""
        except (DriverUnavailableError, ImportError) as e:
            _cuda_problem = f"no usable CUDA GPU: {e}"
    return _cuda_problem


def open_driver_kind(kind: str, monkeypatch: pytest.MonkeyPatch) -> Driver:
    """A fresh driver of ``kind``; the caller closes it (:func:`close_driver`)."""
    if kind == "sim":
        return SimDriver(profile="h200")
    if kind == "host":
        from kvvmm.driver.host import HostDriver

        return HostDriver(capacity_bytes=HOST_CAPACITY_BYTES, granularity=HOST_GRANULARITY)
    if kind not in ("cuda-c", "cuda-python"):
        raise ValueError(f"Unsupported driver kind: {kind!r}")
    problem = cuda_problem()
    if problem:
        pytest.skip(problem)
    from kvvmm.driver import cuda as cuda_mod

    fast = kind == "cuda-c"
    if fast and cuda_mod._cudafast is None:
        pytest.skip("the C fast path (kvvmm/driver/_cudafast.c) is not built here")
    # Read once, when the driver is made: which path its hot calls take.
    monkeypatch.setenv("KVVMM_CUDA_FASTPATH", "1" if fast else "0")
    d = cuda_mod.CudaDriver()
    assert d.fast_path == fast, f"{kind}: fast_path is {d.fast_path}"
    return d


def close_driver(d: Driver) -> None:
    """Give back whatever the driver still holds (no-op for the simulator)."""
    d.close()


@dataclass
class Recorder:
    """What each CUDA path answered, written to ``$OUT/<name>`` as it goes when ``OUT`` is set
    (as ``tests/gpu/conftest.py`` does for its own table): the H200's answers, kept."""

    name: str
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, kind: str, rule: str, err: DriverError | None) -> None:
        out = os.environ.get("OUT")
        if not out:
            return
        got: dict[str, Any] = {"refused": err is not None}
        if err is not None:
            got["cuda_error"] = err.cuda_error
            # CudaDriver words a refusal of CUDA's own as "cuMemMap returned it: ...".
            got["by"] = "cuda" if "returned it" in err.reason else "kvvmm"
            got["reason"] = err.reason
        self.rows.setdefault(rule, {})[kind] = got
        with open(os.path.join(out, self.name), "w") as f:
            json.dump(self.rows, f, indent=1, sort_keys=True)


def find_result(name: str) -> Path:
    """A recorded result under ``bench/`` (``bench/results/`` today; found wherever it moves)."""
    direct = ROOT / "bench" / "results" / name
    if direct.exists():
        return direct
    found = sorted((ROOT / "bench").rglob(name))
    if len(found) != 1:
        raise FileNotFoundError(f"{name}: expected one file under bench/, found {found}")
    return found[0]


# -- the script language ----------------------------------------------------------------------

#: Protocol calls and the names of their arguments, as ``DriverError.call_args`` names them.
CALL_ARGS: dict[str, tuple[str, ...]] = {
    "reserve": ("size", "align"),
    "free": ("va", "size"),
    "create": ("size",),
    "release": ("handle",),
    "map": ("va", "size", "handle"),
    "unmap": ("va", "size"),
    "set_access": ("va", "size"),
}
#: Calls that are not one protocol call: their arguments.
HELPERS: dict[str, tuple[str, ...]] = {
    "mapped": ("va", "size"),
    "mem_free": (),
    "mem_total": (),
    "value": ("x",),
}
_DEFAULTS = {"reserve": {"align": 0}}

_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Div: operator.truediv, ast.Mod: operator.mod,
}
_FUNCS: dict[str, Callable[..., Any]] = {"min": min, "max": max}
_UNITS = re.compile(r"\b(\d+)([GK])\b")


def _units(text: str) -> str:
    """``4G`` -> ``(4*G)``, ``4K`` -> ``(4*K)``."""
    return _UNITS.sub(r"(\1*\2)", text)


def evaluate(node: ast.expr, names: dict[str, Any], where: str) -> Any:
    """The value of an expression of the script language (see the module docstring)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise NameError(f"{where}: {node.id!r} is not defined (have {sorted(names)})")
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](evaluate(node.left, names, where),
                                      evaluate(node.right, names, where))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand, names, where)
    if (isinstance(node, ast.Compare) and len(node.ops) == 1
            and isinstance(node.ops[0], ast.Eq)):
        return (evaluate(node.left, names, where)
                == evaluate(node.comparators[0], names, where))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS and not node.keywords):
        return _FUNCS[node.func.id](*(evaluate(a, names, where) for a in node.args))
    raise SyntaxError(f"{where}: {ast.unparse(node)!r} is not in the script language")


def expression(text: str) -> ast.expr:
    """Parse one expression (units allowed)."""
    return ast.parse(_units(text.strip()), mode="eval").body


@dataclass(frozen=True, slots=True)
class Step:
    """One call of a script."""

    text: str  #: as written
    op: str  #: a protocol call or a helper
    args: tuple[ast.expr, ...]
    kwargs: tuple[tuple[str, ast.expr], ...]
    target: str | None  #: the name its result is bound to
    label: str  #: the comment after it ('' if none)


def parse(script: str) -> list[Step]:
    """The steps of a script; raises SyntaxError naming the bad line."""
    steps: list[Step] = []
    for raw in script.strip().splitlines():
        code, _, label = raw.partition("#")
        parts = [p.strip() for p in code.split(";") if p.strip()]
        if label.strip() and len(parts) != 1:
            raise SyntaxError(f"{raw.strip()!r}: a label needs exactly one call on its line")
        for part in parts:
            tree = ast.parse(_units(part))
            stmt = tree.body[0] if len(tree.body) == 1 else None
            target = None
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(
                stmt.targets[0], ast.Name
            ):
                target, call = stmt.targets[0].id, stmt.value
            elif isinstance(stmt, ast.Expr):
                call = stmt.value
            else:
                raise SyntaxError(f"{part!r}: one call, or 'name = call', per statement")
            ops = CALL_ARGS.keys() | HELPERS.keys()
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id in ops):
                raise SyntaxError(f"{part!r}: not a call of one of {sorted(ops)}")
            kwargs = tuple((k.arg or "", k.value) for k in call.keywords)
            steps.append(Step(part, call.func.id, tuple(call.args), kwargs, target,
                              label.strip()))
    return steps


@dataclass
class Outcome:
    """What one step gave: ``OK`` and its value, or the refusal."""

    name: str  #: ``OK`` or the CUDA error name
    value: Any = None
    error: DriverError | None = None
    args: dict[str, int] = field(default_factory=dict)  #: the call's arguments, by name


class Script:
    """Runs steps against one driver, keeping the names they bind."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        g = driver.granularity()
        self.names: dict[str, Any] = {"G": g, "K": 1024, "MiB": 1 << 20, "GiB": 1 << 30}

    def arguments(self, step: Step) -> dict[str, Any]:
        spec = CALL_ARGS.get(step.op) or HELPERS[step.op]
        if len(step.args) > len(spec):
            raise SyntaxError(f"{step.text!r}: {step.op} takes {spec}")
        got = dict(_DEFAULTS.get(step.op, {}))
        positional = zip(spec[:len(step.args)], step.args, strict=True)
        got.update({k: evaluate(a, self.names, step.text) for k, a in positional})
        for k, node in step.kwargs:
            if k not in spec:
                raise SyntaxError(f"{step.text!r}: {step.op} has no argument {k!r}")
            got[k] = evaluate(node, self.names, step.text)
        missing = [k for k in spec if k not in got]
        if missing:
            raise SyntaxError(f"{step.text!r}: {step.op} needs {missing}")
        return {k: got[k] for k in spec}  # in the call's order

    def step(self, step: Step) -> Outcome:
        """Make the call; a :class:`DriverError` is an outcome, anything else a bug."""
        d = self.driver
        args = self.arguments(step)
        try:
            if step.op == "mapped":
                value: Any = d.create(args["size"])
                d.map(args["va"], args["size"], value)
                d.set_access(args["va"], args["size"])
            elif step.op == "mem_free":
                value = d.mem_info()[0]
            elif step.op == "mem_total":
                value = d.mem_info()[1]
            elif step.op == "value":
                value = args["x"]
            else:
                value = getattr(d, step.op)(*args.values())
        except DriverError as e:
            return Outcome(e.cuda_error, error=e, args=args)
        if step.target is not None:
            self.names[step.target] = value
        return Outcome(OK, value=value, args=args)

    def must(self, step: Step) -> Outcome:
        """Make a setup call, which must be accepted."""
        got = self.step(step)
        if got.error is not None:
            raise AssertionError(f"setup step {step.text!r} was refused: {got.error}")
        return got

    def run(self, script: str) -> Iterator[tuple[Step, Outcome]]:
        """Every step of ``script`` and what it gave."""
        for s in parse(script):
            yield s, self.step(s)

    def fill(self, text: str, extra: dict[str, Any] | None = None) -> str:
        """``text`` with each ``{expression}`` replaced by its value."""
        names = {**self.names, **(extra or {})}
        return re.sub(r"\{([^}]*)\}",
                      lambda m: str(evaluate(expression(m.group(1)), names, text)), text)

    def holds(self, claims: str, extra: dict[str, Any]) -> list[str]:
        """The claims (``x == y; ...``) that do not hold, each with both values."""
        names = {**self.names, **extra}
        broken = []
        for claim in (c.strip() for c in claims.split(";")):
            if not claim:
                continue
            node = expression(claim)
            if not (isinstance(node, ast.Compare) and len(node.ops) == 1
                    and isinstance(node.ops[0], ast.Eq)):
                raise SyntaxError(f"{claim!r}: a claim is 'x == y'")
            left = evaluate(node.left, names, claim)
            right = evaluate(node.comparators[0], names, claim)
            if left != right:
                broken.append(f"{claim}: {left!r} != {right!r}")
        return broken

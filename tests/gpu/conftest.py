"""GPU tests: marked ``cuda`` and skipped unless a CUDA GPU is usable here.

They need only torch, cuda-bindings, numpy and pytest (the GPU machine has nothing else).
Each rule test records what the driver answered (error name, and whether kvvmm refused the call
before CUDA saw it or CUDA refused it itself); the terminal summary prints the table, and it is
written as JSON to ``$OUT/gpu_rule_errors.json`` when ``OUT`` is set, so the simulator can be
made to refuse exactly what CUDA refuses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvvmm.errors import DriverError, DriverUnavailableError

HERE = Path(__file__).resolve().parent

#: rule -> what was observed (filled by the ``observe`` fixture, printed at the end).
OBSERVED: dict[str, dict[str, Any]] = {}

_usable: tuple[bool, str] | None = None


def cuda_usable() -> tuple[bool, str]:
    """(usable, why not): a CudaDriver opens on device 0."""
    global _usable
    if _usable is None:
        try:
            from kvvmm.driver.cuda import CudaDriver

            CudaDriver().close()
            _usable = (True, "")
        except (DriverUnavailableError, ImportError) as e:
            _usable = (False, f"no usable CUDA GPU: {e}")
    return _usable


def torch_cuda_usable() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ok, why = cuda_usable()
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.cuda)
        if not ok:
            item.add_marker(pytest.mark.skip(reason=why))


#: The two ways CudaDriver runs its hot calls: in C (``_cudafast``, the default where it is
#: built) and in Python (``KVVMM_CUDA_FASTPATH=0``). Every test on the ``cuda`` fixture runs
#: on both, so the rules, errors and bookkeeping are checked for each.
PATHS = ["c", "python"]


def open_cuda(path: str, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Any:
    from kvvmm.driver import cuda as cuda_mod

    if path == "c" and cuda_mod._cudafast is None:
        pytest.skip("the C fast path (kvvmm/driver/_cudafast.c) is not built here")
    monkeypatch.setenv("KVVMM_CUDA_FASTPATH", "1" if path == "c" else "0")
    d = cuda_mod.CudaDriver(**kw)
    assert d.fast_path == (path == "c")
    return d


@pytest.fixture(params=PATHS)
def open_cuda_on_path(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Any]:
    """``open_cuda_on_path(**kw)``: a CudaDriver with its hot calls in C, then in Python."""
    return lambda **kw: open_cuda(request.param, monkeypatch, **kw)


@pytest.fixture(params=PATHS)
def cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh CudaDriver on device 0, hot calls in C or in Python; closed after the test,
    which must leave it clean."""
    d = open_cuda(request.param, monkeypatch)
    yield d
    d.close()


@pytest.fixture
def needs_torch_cuda() -> None:
    if not torch_cuda_usable():
        pytest.skip("torch has no CUDA here")


Observe = Callable[..., DriverError | None]


@pytest.fixture
def observe() -> Observe:
    """``observe(rule, fn, *args)``: run a call that the rules forbid; record what happened.

    Returns the :class:`DriverError` it raised, or None when the call was accepted (the
    caller decides whether that is a failure, and must undo it).
    """

    def run(rule: str, fn: Callable[..., Any], *args: Any) -> DriverError | None:
        try:
            fn(*args)
        except DriverError as e:
            OBSERVED[rule] = {
                "refused": True,
                "cuda_error": e.cuda_error,
                "by": "cuda" if "returned it" in e.reason else "kvvmm",
                "reason": e.reason,
            }
            _save()
            return e
        OBSERVED[rule] = {"refused": False}
        _save()
        return None

    return run


def _save() -> None:
    # Written as it goes: a later test that aborts the process must not lose the table.
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_rule_errors.json"), "w") as f:
            json.dump(OBSERVED, f, indent=1, sort_keys=True)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Failures of tests/gpu go to $OUT/gpu_failures.txt as they happen, for the same reason.
    out = os.environ.get("OUT")
    if out and report.failed and HERE in Path(report.fspath).resolve().parents:
        with open(os.path.join(out, "gpu_failures.txt"), "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not OBSERVED:
        return
    tr = terminalreporter
    tr.section("what the CUDA driver answered (kvvmm CudaDriver)")
    for rule, got in sorted(OBSERVED.items()):
        if got["refused"]:
            tr.write_line(f"{rule:55s} refused by {got['by']:5s} {got['cuda_error']}")
        else:
            tr.write_line(f"{rule:55s} ACCEPTED")
    _save()

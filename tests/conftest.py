"""Shared fixtures: the same test runs on every driver that works without a GPU.

``driver`` is parametrized over the simulator and the host-memory driver, so each rule and
each bad input is proven on both (they share the rule book, but not their side effects).
``make_driver(kind, **options)`` opens more drivers of a kind; every host driver a test opens
is closed again afterwards, whatever the test left behind, so no memfd or mapping outlives
the test that made it. Hypothesis tests, which must not use function-scoped fixtures, take
``fresh_driver``: a context manager factory, ``with fresh_driver("host") as d: ...``.

Test modules get these through fixtures only, never ``from conftest import ...``: a second
conftest.py (``tests/gpu/``) would shadow this one under that name.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# One intra-op thread for torch (OpenMP), here and in every process the tests start (workers,
# notebook kernels, JupyterLab's), set before torch is imported. The tests' tensors are small;
# on 2 cores shared with another busy process, two threads made every op wait for the other:
# torch.full of 2 MiB took 17 ms on two threads, 0.4 ms on one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from kvvmm.driver import Driver, SimDriver
from kvvmm.units import GiB, MiB

#: Kinds every machine can run: the host driver needs Linux (memfd_create, MAP_FIXED).
DRIVER_KINDS = ("sim", "host") if sys.platform.startswith("linux") else ("sim",)

#: The host driver's defaults in tests: a 2 GiB cap keeps a runaway test from eating the
#: machine's memory; 2 MiB is the H100/H200 granularity, so sizes read the same on both.
HOST_CAPACITY_BYTES = 2 * GiB
HOST_GRANULARITY = 2 * MiB

MakeDriver = Callable[..., Driver]

# tests/conformance runs in a process of its own
# (tests/integrations/test_sglang_conformance_cpu.py starts it): its stand-ins for SGLang's
# GPU stack must not reach this one.
collect_ignore = [] if os.environ.get("KVVMM_SGLANG_CONFORMANCE") == "1" else ["conformance"]


def open_test_driver(kind: str, **options: Any) -> Driver:
    """Open a driver of ``kind`` with the test defaults; ``options`` override them.

    Callers own the result: close a host driver (``.close()``) when done. Inside a test,
    prefer the ``make_driver`` fixture, which does that for you.
    """
    if kind == "sim":
        return SimDriver(**options)
    if kind == "host":
        from kvvmm.driver.host import HostDriver

        opts: dict[str, Any] = {
            "capacity_bytes": HOST_CAPACITY_BYTES,
            "granularity": HOST_GRANULARITY,
            **options,
        }
        return HostDriver(**opts)
    raise ValueError(f"Unsupported driver kind: {kind!r}")


def close_test_driver(driver: Driver) -> None:
    """Give back everything a host driver still holds (a no-op for the simulator)."""
    driver.close()


@pytest.fixture
def make_driver() -> Iterator[MakeDriver]:
    """A factory ``make_driver(kind, **options)``; host drivers are closed after the test."""
    opened: list[Driver] = []

    def make(kind: str, **options: Any) -> Driver:
        d = open_test_driver(kind, **options)
        opened.append(d)
        return d

    yield make
    errors: list[BaseException] = []
    for d in reversed(opened):
        try:
            close_test_driver(d)
        except Exception as e:  # close the others anyway, then report
            errors.append(e)
    if errors:
        raise errors[0]


@contextlib.contextmanager
def _fresh_driver(kind: str, **options: Any) -> Iterator[Driver]:
    d = open_test_driver(kind, **options)
    try:
        yield d
    finally:
        close_test_driver(d)


@pytest.fixture(scope="session")
def fresh_driver() -> Callable[..., contextlib.AbstractContextManager[Driver]]:
    """``with fresh_driver(kind, **options) as d:`` a driver closed on the way out."""
    return _fresh_driver


@pytest.fixture(params=DRIVER_KINDS)
def driver_kind(request: pytest.FixtureRequest) -> str:
    """``"sim"`` or ``"host"``."""
    return str(request.param)


@pytest.fixture
def driver(driver_kind: str, make_driver: MakeDriver) -> Driver:
    """A fresh driver of each kind: SimDriver (H200 profile) or HostDriver (2 GiB, 2 MiB)."""
    return make_driver(driver_kind)


@pytest.fixture(scope="module")
def gloo_world_of_one() -> Iterator[None]:
    """A gloo process group of one rank (this process) for a module's collective tests: a
    DistributedOwner on one rank runs every step of its agreement without a second process."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()

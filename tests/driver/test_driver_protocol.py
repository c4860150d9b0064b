"""The driver protocol's optional calls: declared on ``Driver`` with no-op
defaults, so the arena and owner call them without looking them up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvvmm import Arena
from kvvmm.budget import BudgetedDriver, Ledger
from kvvmm.driver import Driver, FaultyDriver, SimDriver
from kvvmm.driver.base import OPTIONAL_CALLS, check_driver, work_hook
from kvvmm.driver.host import HostDriver
from kvvmm.errors import ArgumentError
from kvvmm.measure.timer import TimedDriver
from kvvmm.record import TracingDriver
from kvvmm.units import GiB, MiB


def test_every_driver_and_wrapper_has_the_optional_calls() -> None:
    host = HostDriver(capacity_bytes=GiB)
    try:
        for d in (SimDriver("h200"), host, FaultyDriver(host), TracingDriver(host),
                  TimedDriver(host)):
            for name in OPTIONAL_CALLS:
                assert hasattr(d, name), (d, name)
            assert isinstance(d.clock_us, float)
            assert d.handle_type == "posix_fd", d  # what export_handle gives on sim and host
            assert d.granularity_min == d.granularity(), d  # one granularity off CUDA
            assert d.fast_path is None, d  # no C path but CudaDriver's
    finally:
        host.close()


class _Unshared(SimDriver):
    """A driver whose handles cannot be shared (as a plain CudaDriver's)."""

    handle_type = "none"


def test_every_wrapper_says_the_handle_type_of_the_driver_it_wraps(tmp_path: Path) -> None:
    inner = _Unshared("h200")
    with Ledger(tmp_path / "ledger", budget_bytes=GiB) as led:
        budgeted = BudgetedDriver(inner, led.register("t"))
        for d in (FaultyDriver(inner), TracingDriver(inner), TimedDriver(inner), budgeted,
                  TracingDriver(budgeted)):
            assert d.handle_type == "none", d


class _CudaLike(SimDriver):
    """A driver with CudaDriver's plain attributes: a smaller minimum granularity, a C path."""

    granularity_min = 64 * 1024
    fast_path = True


def test_every_wrapper_says_the_granularity_and_fast_path_of_the_driver_it_wraps(
        tmp_path: Path) -> None:
    inner = _CudaLike("h200")
    with Ledger(tmp_path / "ledger", budget_bytes=GiB) as led:
        budgeted = BudgetedDriver(inner, led.register("t"))
        for d in (FaultyDriver(inner), TracingDriver(inner), TimedDriver(inner), budgeted,
                  TracingDriver(budgeted)):
            assert (d.granularity_min, d.fast_path) == (64 * 1024, True), d


def test_cuda_drivers_constructor_can_set_what_the_protocol_declares_as_properties() -> None:
    from kvvmm.driver.cuda import CudaDriver

    # Instance assignment in CudaDriver.__init__ needs plain class attributes to shadow the
    # protocol's read-only properties (as handle_type does); checked without a GPU.
    for name in ("handle_type", "granularity_min", "fast_path"):
        assert not isinstance(getattr(CudaDriver, name), property), name


def test_a_real_driver_has_no_work_hook_so_the_decode_path_makes_no_call() -> None:
    host = HostDriver(capacity_bytes=GiB)
    try:
        assert work_hook(host) is None
        assert work_hook(TimedDriver(host)) is None
    finally:
        host.close()


def test_the_simulator_and_its_wrappers_charge_the_library_work() -> None:
    sim = SimDriver("h200")
    for d in (sim, FaultyDriver(sim), TracingDriver(sim), TimedDriver(sim)):
        assert work_hook(d) is not None


def test_the_simulator_pins_nothing_and_closes_nothing() -> None:
    sim = SimDriver("h200")
    va = sim.reserve(2 * MiB)
    sim.pin(va)
    sim.unpin(va)
    sim.free(va, 2 * MiB)  # a pin on the simulator refuses nothing
    sim.close()
    assert sim.stats().clean


class _Bare:
    """A driver object with the protocol's required calls only, and no base class."""

    def __init__(self) -> None:
        self._sim = SimDriver("h200")
        self.kind, self.device, self.name = "sim", 0, "bare"
        self.memory = self._sim.memory

    def __getattr__(self, name: str) -> Any:
        if name in OPTIONAL_CALLS or name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._sim, name)


def test_a_driver_without_the_optional_calls_is_refused_and_told_to_subclass_driver() -> None:
    d = _Bare()
    with pytest.raises(ArgumentError, match=r"subclass kvvmm\.driver\.Driver") as info:
        check_driver(d)
    assert "clock_us" in str(info.value) and not hasattr(d, "clock_us")  # nothing was added
    with pytest.raises(ArgumentError, match="optional calls"):
        Arena(d, reserve_bytes=8 * MiB)  # type: ignore[arg-type]


def test_a_wrapper_overrides_one_method_to_see_every_call() -> None:
    from kvvmm.driver import DriverWrapper

    class Counting(DriverWrapper):
        def __init__(self, inner: Driver) -> None:
            super().__init__(inner)
            self.seen: list[str] = []

        def _call(self, call: str, fn: Any, *args: Any) -> Any:
            self.seen.append(call)
            return fn(*args)

    d = Counting(SimDriver("h200"))
    va = d.reserve(4 * MiB)
    h = d.create(2 * MiB)
    d.map(va, 2 * MiB, h)
    d.set_access(va, 2 * MiB)
    d.pin(va)
    d.unpin(va)
    d.unmap(va, 2 * MiB)
    d.release(h)
    d.free(va, 4 * MiB)
    d.mem_info()
    assert d.seen == ["reserve", "create", "map", "set_access", "pin", "unpin", "unmap",
                      "release", "free", "mem_info"]
    assert d.granularity() == 2 * MiB and d.stats().clean and d.clock_us > 0
    assert work_hook(d) == d.inner.library_work  # the simulator's own, not a forwarder

"""The pressure poll: levels from the driver's free memory and two
watermarks, what the pools could trim and what a sleep of the owners would give back."""

from __future__ import annotations

from typing import Any

import pytest

from kvvmm import ArgumentError, DriverError, Fault, FaultyDriver, KvBufferOwner, mha_token_major
from kvvmm.arena.pool import HandlePool
from kvvmm.driver.base import Driver
from kvvmm.pressure import Pressure, poll
from kvvmm.units import GiB, MiB


def owner_of(driver: Driver, **kw: Any) -> KvBufferOwner:
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=36_000,
                            page_size=16, dtype="bfloat16")
    return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16, reserved_tokens=36_000,
                         descs=descs, **kw)


def test_the_level_follows_free_memory_across_the_two_watermarks(driver: Driver) -> None:
    free, total = driver.mem_info()
    assert poll(driver, low_bytes=free - 64 * MiB).level == "ok"
    low = poll(driver, low_bytes=free + GiB, critical_bytes=free - 64 * MiB)
    assert low.level == "low" and low.short_bytes >= GiB - 64 * MiB
    crit = poll(driver, low_bytes=free + 2 * GiB, critical_bytes=free + GiB)
    assert crit.level == "critical" and crit.total_bytes == total
    assert "critical" in str(crit)


def test_the_poll_counts_what_the_pools_trim_and_what_the_owners_sleep_would_give_back(
        make_driver: Any) -> None:
    drv = make_driver("sim")
    pool = HandlePool(drv, threaded=False)
    owner = owner_of(drv, pool=pool)
    owner.ensure_prefix(20_000)
    owner.shrink(16)
    got = poll(drv, low_bytes=drv.mem_info()[0] + GiB, owners=[owner], pools=[pool])
    assert got.pool_bytes == pool.held_bytes > 0
    assert got.sleep_bytes == owner.backed_bytes > 0
    assert got.advice.startswith("trim the handle pools") and "sleep owners" in got.advice
    owner.sleep()
    assert poll(drv, low_bytes=0, owners=[owner]).sleep_bytes == 0  # asleep: nothing more
    owner.wake()
    owner.close()
    pool.close()
    assert poll(drv, low_bytes=0).advice == "nothing to do"


@pytest.mark.parametrize(("kw", "name"), [
    ({"low_bytes": -1}, "low_bytes"),
    ({"low_bytes": 1.5}, "low_bytes"),
    ({"low_bytes": GiB, "critical_bytes": 2 * GiB}, "critical_bytes"),
    ({"low_bytes": GiB, "owners": ["kv"]}, "owners[0]"),
    ({"low_bytes": GiB, "pools": [None]}, "pools[0]"),
])
def test_bad_poll_arguments_are_refused_naming_the_argument(
        driver: Driver, kw: dict[str, Any], name: str) -> None:
    with pytest.raises(ArgumentError) as info:
        poll(driver, **kw)
    assert info.value.name == name


def test_a_failing_mem_info_is_the_drivers_error(driver: Driver) -> None:
    with pytest.raises(DriverError, match="mem_info"):
        poll(FaultyDriver(driver, Fault("mem_info")), low_bytes=0)
    assert isinstance(poll(driver, low_bytes=0), Pressure)

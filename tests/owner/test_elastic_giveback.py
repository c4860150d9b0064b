"""RangeBacking.give_back: the deferred cache and reserve given back on pressure, within a
stated bound, off the decode thread, the reserve held until relax() or a time; and what
kvvmm.pressure.poll counts of it. Driver failures during a give-back are in
test_elastic_hardening.py (its "give-back" path)."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest

from kvvmm import open_driver
from kvvmm.driver.wrapper import DriverWrapper
from kvvmm.errors import ArgumentError, ClosedError
from kvvmm.layout import model_descs
from kvvmm.owner import KvBufferOwner, RangeBacking
from kvvmm.pressure import poll

G = 2 << 20  # one block of llama-3.1-8b's interleaved layout (16 slots) is one granule


def _owner(driver: Any, blocks: int = 64) -> KvBufferOwner:
    descs = model_descs("llama-3.1-8b", layout="interleaved", reserved_tokens=16 * blocks,
                        page_size=16, dtype="bfloat16")
    return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16, descs=descs)


def _cache(backing: RangeBacking, *sizes: int) -> None:
    """Lease ``sizes`` blocks each, mapped, then release them: their units are cached."""
    leases = [backing.wait(backing.admit(16 * n)) for n in sizes]
    for lease in leases:
        backing.release(lease)
    assert backing.drain()


class _Ticks:
    """A clock that advances one second per reading: deadlines become counts of readings."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_give_back_frees_the_cache_and_reserve_and_says_what_and_how_long() -> None:
    drv = open_driver("sim", profile="h200")
    owner = _owner(drv)
    backing = RangeBacking(owner, reserve_bytes=4 * G, high_bytes=40 * G, executor="inline")
    _cache(backing, 6, 3, 7)
    st = backing.stats()  # the released leases' blocks and the reserve refilled after them
    assert st.cached_bytes == st.givable_bytes == backing.givable_bytes >= 16 * G
    backed = owner.backed_bytes
    got = backing.give_back(None, deadline_s=5.0).wait()
    assert got.done and got.stopped == "empty" and got.error is None
    assert got.freed_bytes == st.cached_bytes == backed - owner.backed_bytes
    assert got.units == st.units and 0 <= got.unit_max_s <= got.elapsed_s
    assert backing.stats().cached_bytes == 0 and backing.givable_bytes == 0
    assert f"{st.units} units" in repr(got)
    backing.close()
    owner.close()


def test_give_back_stops_once_enough_went_in_whole_units_highest_first() -> None:
    owner = _owner(open_driver("sim", profile="h200"))
    backing = RangeBacking(owner, high_bytes=40 * G, executor="inline")
    _cache(backing, 6, 3, 7)  # units of 6, 3 and 7 blocks, in that order
    got = backing.give_back(5 * G, deadline_s=5.0).wait()
    assert got.stopped == "enough" and got.units == 1 and got.freed_bytes == 7 * G  # the top
    assert backing.stats().cached_bytes == 9 * G
    backing.close()
    owner.close()


def test_give_back_under_a_deadline_stops_before_the_unit_that_would_pass_it() -> None:
    owner = _owner(open_driver("sim", profile="h200"))
    backing = RangeBacking(owner, high_bytes=40 * G, executor="inline")
    _cache(backing, 6, 3, 7)
    # readings: t0=1, check 2 (1 s in), unit from 3 to 4 (1 s), check 5: 4 s in + 1 > 4.5
    got = backing.give_back(None, deadline_s=4.5, clock=_Ticks()).wait()
    assert got.stopped == "deadline" and got.units == 1 and got.freed_bytes == 7 * G
    assert got.elapsed_s == 5.0 and got.unit_max_s == 1.0
    assert backing.stats().cached_bytes == 9 * G  # the rest stays cached, usable
    none = backing.give_back(None, deadline_s=0.0).wait()  # a bound already spent: nothing
    assert none.stopped == "deadline" and none.freed_bytes == 0
    backing.close()
    owner.close()


class _SlowUnmap(DriverWrapper):
    """Each unmap waits ``delay_s``, or for ``gate`` when one is set (a slow decommit)."""

    def __init__(self, inner: Any, delay_s: float = 0.0) -> None:
        super().__init__(inner)
        self.delay_s = delay_s
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def unmap(self, va: int, size: int) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        elif self.delay_s:
            time.sleep(self.delay_s)
        self.inner.unmap(va, size)


def test_give_back_on_the_backing_thread_keeps_to_its_deadline_in_real_time() -> None:
    drv = _SlowUnmap(open_driver("sim", profile="h200"))
    owner = _owner(drv)
    backing = RangeBacking(owner, high_bytes=60 * G)
    _cache(backing, *([2] * 20))  # 20 units
    drv.delay_s = 0.02
    t0 = time.monotonic()
    got = backing.give_back(None, deadline_s=0.1)
    assert time.monotonic() - t0 < 0.05  # the caller does not wait for the decommits
    got.wait()
    assert got.stopped == "deadline" and 0 < got.units < 20
    assert got.elapsed_s <= 0.1 + got.unit_max_s  # the bound, at most one unit past it
    assert backing.stats().cached_bytes == (20 - got.units) * 2 * G
    backing.close()
    owner.close()


def test_admissions_lease_from_what_stays_cached_ready_at_once_during_a_give_back() -> None:
    drv = _SlowUnmap(open_driver("sim", profile="h200"))
    owner = _owner(drv)
    backing = RangeBacking(owner, high_bytes=60 * G)
    _cache(backing, 4, 4, 4)
    drv.gate = threading.Event()
    got = backing.give_back(None, deadline_s=30.0)
    assert drv.entered.wait(10)  # the first unit's unmap is under way, and blocked
    t0 = time.monotonic()
    lease = backing.admit(16 * 4)  # the decode thread: cached blocks, no driver call
    took = time.monotonic() - t0
    assert lease.ready and backing.ready(lease) and took < 0.05
    assert not got.done
    drv.gate.set()
    got.wait()
    assert got.stopped == "empty" and got.units == 2  # the leased unit stays: it is in use
    assert backing.ready(lease)
    backing.release(lease)
    backing.close()
    owner.close()


def test_the_reserve_is_held_after_a_give_back_until_relax() -> None:
    owner = _owner(open_driver("sim", profile="h200"))
    backing = RangeBacking(owner, reserve_bytes=6 * G, high_bytes=12 * G, executor="inline")
    assert backing.stats().cached_bytes == 6 * G  # the reserve, mapped ahead
    got = backing.give_back(None, deadline_s=5.0).wait()
    assert got.freed_bytes == 6 * G and backing.held
    lease = backing.admit(16 * 3)  # admissions go on: fresh blocks mapped for the lease
    assert lease.ready
    backing.release(lease)
    assert backing.stats().cached_bytes == 3 * G  # no refill while held
    lease = backing.admit(16 * 5)
    backing.release(lease)
    assert backing.stats().cached_bytes == 5 * G
    backing.relax()
    assert not backing.held and backing.stats().cached_bytes >= 6 * G  # refilled
    backing.close()
    owner.close()


def test_a_timed_hold_lifts_on_its_clock_and_hold_0_holds_nothing() -> None:
    owner = _owner(open_driver("sim", profile="h200"))
    backing = RangeBacking(owner, reserve_bytes=4 * G, high_bytes=8 * G, executor="inline")
    now = [100.0]
    backing.give_back(None, deadline_s=1.0, hold_s=5.0, clock=lambda: now[0]).wait()
    assert backing.held and backing.stats().cached_bytes == 0
    backing.release(backing.admit(16))  # a call: upkeep runs, still held
    assert backing.stats().cached_bytes == G
    now[0] = 105.0
    assert not backing.held
    backing.release(backing.admit(16))  # the next call refills
    assert backing.stats().cached_bytes >= 4 * G
    backing.give_back(None, deadline_s=1.0, hold_s=0).wait()
    assert not backing.held
    backing.release(backing.admit(16))
    assert backing.stats().cached_bytes >= 4 * G
    backing.close()
    owner.close()


@pytest.mark.parametrize(("kw", "name"), [
    ({"nbytes": -1, "deadline_s": 1.0}, "nbytes"),
    ({"nbytes": 1.5, "deadline_s": 1.0}, "nbytes"),
    ({"deadline_s": math.nan}, "deadline_s"),
    ({"deadline_s": -1.0}, "deadline_s"),
    ({"deadline_s": math.inf}, "deadline_s"),
    ({"deadline_s": 1.0, "hold_s": -1.0}, "hold_s"),
    ({"deadline_s": 1.0, "clock": 3}, "clock"),
])
def test_bad_give_back_arguments_are_refused_naming_them_before_anything_changes(
        kw: dict[str, Any], name: str) -> None:
    owner = _owner(open_driver("sim", profile="h200"))
    backing = RangeBacking(owner, reserve_bytes=2 * G, executor="inline")
    before = backing.stats()
    with pytest.raises(ArgumentError, match=name):
        backing.give_back(**kw)
    assert backing.stats() == before and not backing.held
    backing.close()
    with pytest.raises(ClosedError):
        backing.give_back(None, deadline_s=1.0)
    owner.close()


def test_the_pressure_poll_counts_the_cache_and_reserve_and_advises_it_first() -> None:
    drv = open_driver("sim", profile="h200")
    owner = _owner(drv)
    backing = RangeBacking(owner, reserve_bytes=4 * G, high_bytes=40 * G, executor="inline")
    _cache(backing, 6)
    low = drv.mem_info()[0] + (1 << 30)
    got = poll(drv, low_bytes=low, owners=[owner], backings=[backing])
    assert got.cache_bytes == backing.givable_bytes == backing.stats().cached_bytes >= 10 * G
    assert got.advice.startswith("give back the range backings' cache and reserve")
    assert "sleep owners" in got.advice  # 20 MiB do not cover the 1 GiB short
    enough = poll(drv, low_bytes=drv.mem_info()[0] + G, backings=[backing])
    assert "shrink" not in enough.advice  # the cache covers it: nothing that loses work
    with pytest.raises(ArgumentError, match=r"backings\[0\]"):
        poll(drv, low_bytes=0, backings=[owner])  # type: ignore[list-item]
    backing.close()
    assert poll(drv, low_bytes=low, backings=[backing]).cache_bytes == 0  # closed: none
    owner.close()

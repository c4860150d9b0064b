"""A handle one arena or pool holds is never another's: adopt and the pool refuse it.

``Arena.adopt`` and ``Arena.adopt_range`` take a handle from the caller; one that an arena of
the same driver maps (another arena's KV, or this arena's own mapping a second time), or that
a ``HandlePool`` holds idle, is refused with an ``ArgumentError`` before anything changes, on
the simulator and the host driver, through a fault-injecting wrapper too. ``HandlePool.give``
refuses a handle it holds already (two takes would hand one memory to two owners) and
arguments that are not a handle and a size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvvmm import Arena
from kvvmm.arena.pool import HandlePool
from kvvmm.driver import FaultyDriver
from kvvmm.driver.base import Driver
from kvvmm.errors import ArgumentError

ENTRIES = ("adopt", "adopt_range")


def _adopt(arena: Arena, entry: str, handle: Any, g: int) -> None:
    off = arena.allocate(2 * g) if not arena.snapshot().allocations else 0
    if entry == "adopt":
        arena.adopt(off, handle, g)
    else:
        arena.adopt_range(off, g, handle, g)


def _state(*arenas: Arena) -> list[Any]:
    return [(a.snapshot(), a.backed_bytes) for a in arenas]


@pytest.fixture(params=["sim", "host", "faulty-host"])
def drv(request: pytest.FixtureRequest, make_driver: Callable[..., Driver]) -> Driver:
    if request.param == "faulty-host":
        return FaultyDriver(make_driver("host"))
    return make_driver(request.param)


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_handle_another_arena_adopted_is_refused(drv: Driver, entry: str,
                                                    own: bool) -> None:
    g = drv.granularity()
    a, b = Arena(drv, reserve_bytes=4 * g, name="a"), Arena(drv, reserve_bytes=4 * g, name="b")
    h = drv.create(g)
    a.adopt(a.allocate(2 * g), h, g, own=own)
    b.allocate(2 * g)
    before, stats = _state(a, b), drv.stats()
    for arena in (b, a):  # another arena, and the same one a second time
        with pytest.raises(ArgumentError, match="arena 'a' maps it"):
            _adopt(arena, entry, h, g)
    assert _state(a, b) == before and drv.stats() == stats
    a.close()
    b.close()
    assert drv.stats().clean


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_handle_an_arena_made_for_its_own_commit_is_refused(drv: Driver, entry: str) -> None:
    g = drv.granularity()
    a, b = Arena(drv, reserve_bytes=4 * g, name="a"), Arena(drv, reserve_bytes=4 * g, name="b")
    off = a.allocate(2 * g)
    a.commit(off, g)
    h = a._allocs[0].maps[0].handle  # a caller that guessed the driver's id for a's KV
    b.allocate(2 * g)
    before, stats = _state(a, b), drv.stats()
    with pytest.raises(ArgumentError, match="arena 'a' maps it"):
        _adopt(b, entry, h, g)
    assert _state(a, b) == before and drv.stats() == stats
    a.close()
    b.close()
    assert drv.stats().clean


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_handle_a_pool_holds_idle_is_refused(drv: Driver, entry: str) -> None:
    g = drv.granularity()
    pool = HandlePool(drv, threaded=False)
    a = Arena(drv, reserve_bytes=4 * g, name="a", pool=pool)
    off = a.allocate(2 * g)
    a.commit(off, g)
    h = a._allocs[0].maps[0].handle
    a.decommit(off, 0)  # the handle (a's bytes) waits idle in the pool
    assert pool.holds(h)
    b = Arena(drv, reserve_bytes=4 * g, name="b")
    b.allocate(2 * g)
    before, held = _state(a, b), pool.stats()
    with pytest.raises(ArgumentError, match="HandlePool holds it"):
        _adopt(b, entry, h, g)
    assert _state(a, b) == before and pool.stats() == held
    for x in (a, b):
        x.close()
    pool.close()
    assert drv.stats().clean


def test_a_handle_once_given_back_and_released_may_be_adopted_by_another(drv: Driver) -> None:
    g = drv.granularity()
    a, b = Arena(drv, reserve_bytes=4 * g, name="a"), Arena(drv, reserve_bytes=4 * g, name="b")
    h = drv.create(g)
    off = a.allocate(2 * g)
    a.adopt(off, h, g, own=True)
    a.decommit(off, 0)  # released: the id is nobody's now
    h2 = drv.create(g)
    b.adopt(b.allocate(2 * g), h2, g)
    assert b.backed_bytes == g
    a.close()
    b.close()
    assert drv.stats().clean


def test_a_pool_refuses_a_handle_it_holds_already(drv: Driver) -> None:
    g = drv.granularity()
    pool = HandlePool(drv, threaded=False)
    h = drv.create(g)
    assert pool.give(h, g)
    held = pool.stats()
    for size in (g, 2 * g):
        with pytest.raises(ArgumentError, match="idle in the pool already"):
            pool.give(h, size)
    assert pool.stats() == held
    assert pool.take(g) == h and pool.take(g) is None  # handed out once
    assert pool.give(h, g)
    pool.close()
    assert drv.stats().clean


@pytest.mark.parametrize(("handle", "size"), [(True, 1), (1.0, 1), ("1", 1), (None, 1),
                                              (1, 0), (1, -1), (1, 1.0), (1, 3), (1, True)])
def test_a_pool_refuses_what_is_not_a_handle_and_its_size(drv: Driver, handle: Any,
                                                          size: Any) -> None:
    pool = HandlePool(drv, threaded=False)
    g = drv.granularity()
    size = size * g if type(size) is int and size != 3 else size
    held = pool.stats()
    with pytest.raises(ArgumentError):
        pool.give(handle, size)
    assert pool.stats() == held
    pool.close()


@pytest.mark.parametrize("holder", ["arena-commit", "arena-adopt", "other-pool"])
def test_a_pool_refuses_a_callers_handle_an_arena_maps_or_another_pool_holds(
        drv: Driver, holder: str) -> None:
    g = drv.granularity()
    pool, other = HandlePool(drv, threaded=False), HandlePool(drv, threaded=False)
    a = Arena(drv, reserve_bytes=4 * g, name="a", pool=other)
    off = a.allocate(2 * g)
    if holder == "arena-adopt":
        h = drv.create(g)
        a.adopt(off, h, g)
    else:
        a.commit(off, g)
        h = a._allocs[0].maps[0].handle
        if holder == "other-pool":
            a.decommit(off, 0)
            assert other.holds(h)
    before, held, held2 = _state(a), pool.stats(), other.stats()
    with pytest.raises(ArgumentError, match="arena 'a'" if holder != "other-pool" else "Pool"):
        pool.give(h, g)
    assert _state(a) == before and pool.stats() == held and other.stats() == held2
    b = Arena(drv, reserve_bytes=4 * g, name="b", pool=pool)
    b.commit(b.allocate(2 * g), g)  # a fresh handle: never a's
    assert b._allocs[0].maps[0].handle != h
    for x in (a, b):
        x.close()
    pool.close()
    other.close()
    assert drv.stats().clean


@pytest.mark.parametrize("forged", [1, 2, 7, True, "a", None])
def test_another_arenas_idle_bytes_in_a_shared_pool_are_not_taken_by_naming_its_tag(
        drv: Driver, forged: Any) -> None:
    """An arena's tag is an object only its holder can name: a number (a counter's guess), a
    bool or a string is refused, and a fresh or foreign tag takes nothing another wrote."""
    g = drv.granularity()
    pool = HandlePool(drv, threaded=False, retain_bytes=8 * g)
    a = Arena(drv, reserve_bytes=4 * g, name="a", pool=pool)
    a.commit(a.allocate(2 * g), g)
    a.decommit(0, 0)  # the handle goes idle in the pool, holding a's bytes
    assert pool.held_bytes == g
    if forged is None:  # nobody's: only fresh handles
        assert pool.take(g, None) is None
    else:
        with pytest.raises(ArgumentError, match="pool_tag"):
            pool.take(g, forged)
        h = drv.create(g)
        with pytest.raises(ArgumentError, match="pool_tag"):
            pool.give(h, g, forged)
        drv.release(h)
    b = Arena(drv, reserve_bytes=4 * g, name="b", pool=pool)
    assert pool.take(g, b.pool_tag) is None  # another arena's tag takes nothing of a's
    assert pool.held_bytes == g
    h = pool.take(g, a.pool_tag)  # a itself may take it back
    assert h is not None
    drv.release(h)
    b.close()
    a.close()
    pool.close()

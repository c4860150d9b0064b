"""The Arena on its own: reserve, allocate, commit, decommit, transactions, views, snapshots, close.

Each test runs on the simulator and the host driver (the ``driver`` fixture, ``conftest.py``)
unless it needs real bytes (host only) or meta tensors (sim only). Driver calls are counted
and failed through :class:`kvvmm.FaultyDriver`. The property tests (``test_properties.py``)
drive random operation sequences against a model, the fault matrix (``test_fault_matrix.py``)
fails every call of the owner's operations, and the bad-input table (``test_bad_inputs.py``)
holds the refused arguments; this file is the arena's own unit suite: one behaviour per test,
with the numbers worked out by hand.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Callable

import pytest

from kvvmm import (
    Arena,
    ArenaSnapshot,
    ArgumentError,
    DriverError,
    DriverOutOfMemoryError,
    Fault,
    FaultyDriver,
    ReservationExhaustedError,
)
from kvvmm.driver.base import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, Driver

MakeDriver = Callable[..., Driver]
G = 2 << 20  # the granularity of both test drivers
ERRORS = [CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_VALUE]


def held(d: Driver) -> tuple[int, int, int, int]:
    """What a driver holds, leaving out the handle count (a handle released while mapped is
    legal and keeps its memory, so a failed decommit may lower it and change nothing)."""
    s = d.stats()
    return s.reservations, s.mappings, s.mapped_bytes, s.physical_bytes


def checked(arena: Arena, d: Driver) -> ArenaSnapshot:
    """The arena's snapshot, its conservation laws, and the driver agreeing with it."""
    snap = arena.snapshot()
    snap.check()
    assert snap.backed_bytes + snap.unbacked_bytes == snap.reserved_bytes
    s = d.stats()
    assert snap.backed_bytes == s.physical_bytes == s.mapped_bytes, (snap, s)
    assert len(snap.mappings) == s.mappings
    return snap


def maps(arena: Arena) -> list[tuple[int, int, int, str]]:
    """(offset, size, handle id, allocation) of every mapping, in offset order."""
    return [(m.offset, m.size_bytes, m.handle_id, m.allocation) for m in arena.snapshot().mappings]


# -- reserve ----------------------------------------------------------------------------------


def test_the_reservation_is_rounded_up_to_whole_granules_and_costs_no_memory(
    driver: Driver,
) -> None:
    arena = Arena(driver, reserve_bytes=5 * G + 1, name="kv")
    assert arena.reserved_bytes == 6 * G
    assert arena.base % G == 0
    s = driver.stats()
    assert (s.reservations, s.reserved_bytes, s.handles, s.physical_bytes) == (1, 6 * G, 0, 0)
    snap = checked(arena, driver)
    assert (snap.name, snap.driver, snap.granularity) == ("kv", driver.kind, G)
    assert (snap.cursor_bytes, snap.slack_bytes, snap.allocations) == (0, 6 * G, ())
    arena.close()


def test_a_reservation_of_whole_granules_is_exactly_that(driver: Driver) -> None:
    arena = Arena(driver, reserve_bytes=4 * G)
    assert arena.reserved_bytes == driver.stats().reserved_bytes == 4 * G
    arena.close()


def test_a_failed_reservation_raises_and_leaves_the_driver_clean(driver: Driver) -> None:
    d = FaultyDriver(driver, fail={"reserve": 1})
    with pytest.raises(DriverOutOfMemoryError) as info:
        Arena(d, reserve_bytes=4 * G)
    assert info.value.call == "reserve"
    assert driver.stats().clean


# -- allocate ---------------------------------------------------------------------------------


def test_allocate_bumps_the_cursor_by_whole_granules_and_makes_no_driver_call(
    driver: Driver,
) -> None:
    d = FaultyDriver(driver)
    arena = Arena(d, reserve_bytes=16 * G)
    offsets = [arena.allocate(n) for n in (1, G, G + 1, 3 * G)]
    assert offsets == [0, G, 2 * G, 4 * G]
    assert arena.cursor_bytes == 7 * G
    snap = checked(arena, driver)
    assert [(a.offset, a.size_bytes, a.requested_bytes, a.backed_bytes)
            for a in snap.allocations] == [(0, G, 1, 0), (G, G, G, 0), (2 * G, 2 * G, G + 1, 0),
                                           (4 * G, 3 * G, 3 * G, 0)]
    assert snap.slack_bytes == 9 * G
    assert d.calls == ["reserve"], "allocating is bookkeeping only"
    arena.close()


def test_allocations_are_named_in_order_unless_named_and_names_are_unique(
    driver: Driver,
) -> None:
    arena = Arena(driver, reserve_bytes=8 * G)
    arena.allocate(G)
    arena.allocate(G, "keys")
    arena.allocate(G)
    assert [a.name for a in arena.snapshot().allocations] == ["alloc0", "keys", "alloc2"]
    before = arena.snapshot()
    with pytest.raises(ArgumentError, match="unique"):
        arena.allocate(G, "keys")
    assert arena.snapshot() == before
    assert arena.snapshot().allocation("keys").offset == G
    arena.close()


def test_allocate_fills_the_reservation_exactly_and_one_byte_more_is_exhaustion(
    driver: Driver,
) -> None:
    arena = Arena(driver, reserve_bytes=4 * G, name="small")
    arena.allocate(3 * G)
    with pytest.raises(ReservationExhaustedError) as info:
        arena.allocate(G + 1)
    text = str(info.value)
    assert f"needs {2 * G} bytes" in text and f"only {G} of {4 * G}" in text, text
    assert "'small'" in text and "reserve more VA" in text
    assert arena.allocate(G) == 3 * G  # exactly what is left still fits
    before = arena.snapshot()
    with pytest.raises(ReservationExhaustedError, match=f"only 0 of {4 * G}"):
        arena.allocate(1)
    assert arena.snapshot() == before
    assert arena.cursor_bytes == arena.reserved_bytes
    arena.close()


# -- commit -----------------------------------------------------------------------------------


def test_commit_backs_a_prefix_with_one_handle_rounded_up_to_the_granularity(
    driver: Driver,
) -> None:
    d = FaultyDriver(driver)
    arena = Arena(d, reserve_bytes=8 * G)
    a = arena.allocate(4 * G, "a")
    assert arena.commit(a, 1) == G
    assert arena.backed_of(a) == G
    assert maps(arena) == [(0, G, 1, "a")]
    assert d.calls[1:] == ["create", "map", "set_access"]
    assert driver.stats().handles == 1
    checked(arena, driver)
    arena.close()


def test_commit_grows_monotonically_with_one_new_handle_per_extension(driver: Driver) -> None:
    arena = Arena(driver, reserve_bytes=8 * G)
    a = arena.allocate(8 * G, "a")
    assert arena.commit(a, 2 * G) == 2 * G
    assert arena.commit(a, 5 * G + 1) == 4 * G  # to 6G: one handle of 4G
    assert maps(arena) == [(0, 2 * G, 1, "a"), (2 * G, 4 * G, 2, "a")]
    assert driver.stats().handles == 2
    checked(arena, driver)
    arena.close()


def test_commit_of_no_more_than_is_backed_does_nothing(driver: Driver) -> None:
    d = FaultyDriver(driver)
    arena = Arena(d, reserve_bytes=8 * G)
    a = arena.allocate(4 * G)
    arena.commit(a, 3 * G)
    calls, before = len(d.calls), arena.snapshot()
    assert arena.commit(a, 3 * G) == 0
    assert arena.commit(a, G) == 0  # backing never shrinks on commit
    assert arena.commit(a, 0) == 0
    assert len(d.calls) == calls and arena.snapshot() == before
    arena.close()


def test_commit_of_a_whole_allocation_backs_exactly_its_span(driver: Driver) -> None:
    arena = Arena(driver, reserve_bytes=8 * G)
    arena.allocate(G)
    b = arena.allocate(3 * G - 5, "b")
    assert arena.commit(b, 3 * G - 5) == 3 * G
    assert maps(arena) == [(G, 3 * G, 1, "b")]
    assert arena.snapshot().allocation("b").backed_bytes == 3 * G
    checked(arena, driver)
    arena.close()


def test_commits_of_several_allocations_stay_inside_each_one_and_ids_follow_commit_order(
    driver: Driver,
) -> None:
    arena = Arena(driver, reserve_bytes=16 * G)
    a, b = arena.allocate(4 * G, "a"), arena.allocate(4 * G, "b")
    arena.commit(b, G)
    arena.commit(a, 2 * G)
    arena.commit(b, 3 * G)
    assert maps(arena) == [(0, 2 * G, 2, "a"), (4 * G, G, 1, "b"), (5 * G, 2 * G, 3, "b")]
    assert arena.commit_many([(a, 4 * G), (b, 4 * G)]) == 3 * G
    assert [m[2] for m in maps(arena)] == [2, 4, 1, 3, 5]
    checked(arena, driver)
    arena.close()


# -- decommit ---------------------------------------------------------------------------------


def three_mappings(d: Driver) -> tuple[Arena, int, int]:
    """An arena with "a" = [0, 6G) backed by three 2G handles and "b" = [6G, 8G) by one."""
    arena = Arena(d, reserve_bytes=16 * G)
    a, b = arena.allocate(6 * G, "a"), arena.allocate(2 * G, "b")
    for n in (2, 4, 6):
        arena.commit(a, n * G)
    arena.commit(b, 2 * G)
    return arena, a, b


def test_decommit_gives_back_the_whole_mappings_beyond_keep_in_one_unmap(driver: Driver) -> None:
    d = FaultyDriver(driver)
    arena, a, b = three_mappings(d)
    before = len(d.calls)
    assert arena.decommit(a, 2 * G) == 4 * G
    assert d.calls[before:] == ["unmap", "release", "release"]
    assert arena.backed_of(a) == 2 * G and arena.backed_of(b) == 2 * G
    assert maps(arena) == [(0, 2 * G, 1, "a"), (6 * G, 2 * G, 4, "b")]
    s = driver.stats()
    assert (s.handles, s.physical_bytes) == (2, 4 * G)
    checked(arena, driver)
    arena.close()


def test_decommit_keeps_a_mapping_that_straddles_keep(driver: Driver) -> None:
    arena, a, _ = three_mappings(driver)
    assert arena.decommit(a, 3 * G) == 2 * G  # [2G, 4G) straddles 3G: it stays
    assert arena.backed_of(a) == 4 * G
    assert arena.decommit(a, 2 * G + 1) == 0
    checked(arena, driver)
    arena.close()


def test_decommit_to_zero_empties_one_allocation_and_leaves_the_others(driver: Driver) -> None:
    arena, a, b = three_mappings(driver)
    assert arena.decommit(a, 0) == 6 * G
    assert arena.backed_of(a) == 0 and arena.backed_of(b) == 2 * G
    assert maps(arena) == [(6 * G, 2 * G, 4, "b")]
    checked(arena, driver)
    arena.close()


def test_decommit_at_or_beyond_the_backed_prefix_makes_no_driver_call(driver: Driver) -> None:
    d = FaultyDriver(driver)
    arena, a, _ = three_mappings(d)
    before, snap = len(d.calls), arena.snapshot()
    assert arena.decommit(a, 6 * G) == 0
    assert arena.decommit_many([(a, 6 * G)]) == 0
    assert len(d.calls) == before and arena.snapshot() == snap
    arena.close()


def test_decommit_many_gives_back_from_several_allocations_with_one_unmap_each(
    driver: Driver,
) -> None:
    d = FaultyDriver(driver)
    arena, a, b = three_mappings(d)
    before = len(d.calls)
    assert arena.decommit_many([(a, 4 * G), (b, 0)]) == 4 * G
    assert d.calls[before:].count("unmap") == 2
    assert maps(arena) == [(0, 2 * G, 1, "a"), (2 * G, 2 * G, 2, "a")]
    checked(arena, driver)
    arena.close()


def test_a_commit_after_a_decommit_backs_again_under_new_handle_ids(driver: Driver) -> None:
    arena, a, _ = three_mappings(driver)
    arena.decommit(a, 2 * G)
    assert arena.commit(a, 6 * G) == 4 * G
    assert maps(arena)[:2] == [(0, 2 * G, 1, "a"), (2 * G, 4 * G, 5, "a")]
    checked(arena, driver)
    arena.close()


# -- transactions: a failure at any call leaves the arena and the driver as they were ----------


def _commit_many_setup(d: Driver) -> tuple[Arena, list[tuple[int, int]]]:
    arena = Arena(d, reserve_bytes=32 * G)
    a, b, c = (arena.allocate(8 * G, n) for n in "abc")
    arena.commit(a, 2 * G)
    return arena, [(a, 4 * G), (b, 3 * G), (c, 1)]


def _calls_of(setup: Callable[[Driver], tuple[Arena, list[tuple[int, int]]]], op: str,
              inner: Driver) -> list[str]:
    d = FaultyDriver(inner)
    arena, requests = setup(d)
    start = len(d.calls)
    getattr(arena, op)(requests)
    calls = d.calls[start:]
    arena.close()
    assert inner.stats().clean
    return calls


@pytest.mark.parametrize("error", ERRORS)
def test_commit_many_failing_at_any_call_leaks_nothing_and_leaves_the_snapshot_as_it_was(
    driver_kind: str, make_driver: MakeDriver, error: str
) -> None:
    calls = _calls_of(_commit_many_setup, "commit_many", make_driver(driver_kind))
    assert calls == ["create", "map", "set_access"] * 3
    for pos, call in enumerate(calls, start=1):
        inner = make_driver(driver_kind)
        d = FaultyDriver(inner)
        arena, requests = _commit_many_setup(d)
        snap, stats = arena.snapshot(), inner.stats()
        d.arm(Fault("*", nth=pos, error=error))
        with pytest.raises(DriverError) as info:
            arena.commit_many(requests)
        where = f"call {pos} ({call}) failing with {error}"
        assert (info.value.call, info.value.cuda_error) == (call, error), where
        assert not getattr(info.value, "__notes__", []), "the undo itself went wrong"
        assert arena.snapshot() == snap, where
        assert inner.stats() == stats, where  # every handle made was released again
        d.disarm()
        assert arena.commit_many(requests) == 6 * G, where  # and now it goes through
        checked(arena, inner)
        arena.close()
        assert inner.stats().clean, where


def _decommit_many_setup(d: Driver) -> tuple[Arena, list[tuple[int, int]]]:
    arena, a, b = three_mappings(d)
    return arena, [(a, 2 * G), (b, 0)]


@pytest.mark.parametrize("error", ERRORS)
def test_decommit_many_failing_at_an_unmap_leaves_every_mapping_and_byte_as_it_was(
    driver_kind: str, make_driver: MakeDriver, error: str
) -> None:
    calls = _calls_of(_decommit_many_setup, "decommit_many", make_driver(driver_kind))
    assert calls == ["unmap"] * 2 + ["release"] * 3  # one unmap each, then the releases
    for pos in (1, 2):
        inner = make_driver(driver_kind)
        d = FaultyDriver(inner)
        arena, requests = _decommit_many_setup(d)
        snap, stats = arena.snapshot(), inner.stats()
        d.arm(Fault("*", nth=pos, error=error))
        with pytest.raises(DriverError) as info:
            arena.decommit_many(requests)
        where = f"unmap {pos} failing with {error}"
        assert (info.value.call, info.value.cuda_error) == ("unmap", error), where
        # The first allocation's unmap is undone by mapping its handles back: they kept
        # their bytes, so nothing at all changed.
        assert arena.snapshot() == snap, where
        assert inner.stats() == stats, where
        d.disarm()
        assert arena.decommit_many(requests) == 6 * G, where
        checked(arena, inner)
        arena.close()
        assert inner.stats().clean, where


@pytest.mark.parametrize("error", ERRORS)
def test_decommit_many_failing_at_a_release_stands_and_the_arena_releases_the_rest_later(
    driver_kind: str, make_driver: MakeDriver, error: str
) -> None:
    for pos in (3, 4, 5):  # the first, second and third release
        inner = make_driver(driver_kind)
        d = FaultyDriver(inner)
        arena, requests = _decommit_many_setup(d)
        d.arm(Fault("*", nth=pos, error=error))
        with pytest.raises(DriverError) as info:
            arena.decommit_many(requests)
        where = f"call {pos} (release) failing with {error}"
        assert (info.value.call, info.value.cuda_error) == ("release", error), where
        assert any("decommit or close again" in n for n in info.value.__notes__), where
        # The VA is unmapped: the decommit stands, and the arena keeps the handles left.
        assert maps(arena) == [(0, 2 * G, 1, "a")], where
        left = (6 - pos) * 2 * G  # the failed release's handle and those after it
        assert arena.unreleased_bytes == left, where
        s = inner.stats()
        assert (s.mappings, s.physical_bytes) == (1, 2 * G + left), where
        d.disarm()
        arena.close()  # retries them
        assert arena.unreleased_bytes == 0 and inner.stats().clean, where


def test_an_undo_that_fails_too_is_attached_to_the_error_as_a_note(driver: Driver) -> None:
    d = FaultyDriver(driver)
    arena = Arena(d, reserve_bytes=8 * G)
    a = arena.allocate(4 * G)
    snap = arena.snapshot()
    d.arm([Fault("map"), Fault("release", error=CUDA_ERROR_INVALID_VALUE)])
    with pytest.raises(DriverError) as info:
        arena.commit(a, 2 * G)
    err = info.value
    assert err.call == "map", "the error raised is the first failure, not the undo's"
    notes = getattr(err, "__notes__", [])
    assert any(n.startswith("undo release(handle=") and "also failed" in n for n in notes), notes
    assert arena.snapshot() == snap
    assert driver.stats().handles == 1, "the handle the note reports as not released"


def test_a_close_whose_free_fails_leaves_the_arena_open_and_as_it_was(driver: Driver) -> None:
    d = FaultyDriver(driver)
    arena, a, _ = three_mappings(d)
    snap, before = arena.snapshot(), held(driver)
    d.arm({"free": 1})
    with pytest.raises(DriverError) as info:
        arena.close()
    assert info.value.call == "free"
    assert not arena.closed and not arena.released
    assert arena.snapshot() == snap and held(driver) == before  # both allocations mapped again
    assert arena.decommit(a, 0) == 6 * G  # still usable
    arena.close()
    assert driver.stats().clean


def test_a_release_that_fails_after_the_free_is_finished_by_a_second_close(
    driver: Driver,
) -> None:
    d = FaultyDriver(driver)
    arena, _, _ = three_mappings(d)
    d.arm({"release": 2})
    with pytest.raises(DriverError) as info:
        arena.close()
    assert any("call close() again" in n for n in info.value.__notes__)
    assert arena.closed and arena.released  # past the point of no return: the VA is freed
    s = driver.stats()
    assert (s.reservations, s.mappings, s.handles) == (0, 0, 3)
    arena.close()
    assert driver.stats().clean


# -- views: what can still reach the memory holds close() back --------------------------------


def test_a_lease_holds_close_back_until_it_ends(driver: Driver) -> None:
    arena, _, _ = three_mappings(driver)
    lease = arena.lease()
    assert arena.live_views == 1 and lease.alive
    arena.close()
    assert arena.closed and not arena.released
    assert driver.stats().physical_bytes == 8 * G, "nothing given back under a live lease"
    lease.release()
    assert arena.released and driver.stats().clean
    lease.release()  # ending it twice is harmless
    assert not lease.alive and arena.live_views == 0


def test_a_host_tensor_keeps_its_arena_alive_when_nothing_else_refers_to_it(
    make_driver: MakeDriver,
) -> None:
    d = make_driver("host")
    arena = Arena(d, reserve_bytes=4 * G)
    a = arena.allocate(2 * G)
    arena.commit(a, 2 * G)
    t = arena.tensor(a, (1024,), "float32")
    t.fill_(3.0)
    gone = weakref.ref(arena)
    del arena
    gc.collect()
    kept = gone()
    assert kept is not None, "the tensor keeps its arena"
    assert float(t.sum()) == 3072.0
    kept.close()
    del kept
    del t
    gc.collect()
    assert gone() is None
    assert d.stats().clean


def test_close_waits_for_the_last_view_of_a_host_tensor_then_gives_everything_back(
    make_driver: MakeDriver,
) -> None:
    d = make_driver("host")
    arena = Arena(d, reserve_bytes=4 * G)
    a = arena.allocate(2 * G)
    arena.commit(a, 2 * G)
    t = arena.tensor(a, (4, 256), "bfloat16")
    t.fill_(1.5)
    view = t[2:]
    arena.close()
    assert arena.closed and not arena.released
    assert d.stats().physical_bytes == 2 * G
    del t
    gc.collect()
    assert not arena.released, "a view of the tensor still reaches the memory"
    assert float(view.float().sum()) == 1.5 * 512  # still mapped: the bytes are there
    del view
    gc.collect()
    assert arena.released and arena.live_views == 0
    assert d.stats().clean
    arena.close()  # idempotent after a deferred close too


def test_sim_tensors_are_meta_tensors_and_do_not_hold_close_back() -> None:
    from kvvmm import SimDriver

    d = SimDriver(profile="h200")
    arena = Arena(d, reserve_bytes=4 * G)
    a = arena.allocate(4 * G)
    t = arena.tensor(a, (8, 128), "bfloat16")
    assert t.device.type == "meta" and tuple(t.shape) == (8, 128)
    assert arena.live_views == 0
    arena.close()
    assert arena.released and d.stats().clean


# -- snapshots --------------------------------------------------------------------------------


def test_every_snapshot_conserves_backed_plus_unbacked_as_reserved(driver: Driver) -> None:
    arena = Arena(driver, reserve_bytes=20 * G + 3)
    checked(arena, driver)
    a, b = arena.allocate(5 * G, "a"), arena.allocate(7 * G + 1, "b")
    steps: list[Callable[[], object]] = [
        lambda: arena.commit(a, 3 * G),
        lambda: arena.commit_many([(a, 5 * G), (b, 1)]),
        lambda: arena.commit(b, 8 * G),
        lambda: arena.decommit(a, G),
        lambda: arena.allocate(G, "c"),
        lambda: arena.decommit_many([(b, G), (a, 0)]),
    ]
    for step in steps:
        step()
        snap = checked(arena, driver)
        assert snap.unbacked_bytes == snap.reserved_bytes - snap.backed_bytes
    assert arena.snapshot().backed_bytes == G  # b keeps its first handle
    arena.close()
    snap = arena.snapshot()
    snap.check()
    assert snap.closed and snap.backed_bytes == 0 and snap.mappings == ()
    assert [x.name for x in snap.allocations] == ["a", "b", "c"]


def test_a_snapshot_is_frozen_and_does_not_follow_the_arena(driver: Driver) -> None:
    arena = Arena(driver, reserve_bytes=8 * G)
    a = arena.allocate(4 * G)
    snap = arena.snapshot()
    copy = dataclasses.replace(snap)
    arena.commit(a, 2 * G)
    assert snap == copy and snap.backed_bytes == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.backed_bytes = G  # type: ignore[misc]
    arena.close()


def test_the_conservation_check_catches_each_broken_law(driver: Driver) -> None:
    arena, _, _ = three_mappings(driver)
    snap = arena.snapshot()
    snap.check()
    broken = [
        dataclasses.replace(snap, backed_bytes=snap.backed_bytes + G),
        dataclasses.replace(snap, mappings=snap.mappings[1:]),
        dataclasses.replace(snap, cursor_bytes=snap.reserved_bytes + G),
        dataclasses.replace(snap, mappings=(snap.mappings[1], snap.mappings[0],
                                            *snap.mappings[2:])),
    ]
    for bad in broken:
        with pytest.raises(AssertionError):
            bad.check()
    arena.close()


# -- close ------------------------------------------------------------------------------------


def test_close_is_idempotent_and_the_arena_is_a_context_manager(driver: Driver) -> None:
    with Arena(driver, reserve_bytes=8 * G) as arena:
        arena.commit(arena.allocate(4 * G), 4 * G)
        assert driver.stats().physical_bytes == 4 * G
    assert arena.closed and arena.released and driver.stats().clean
    arena.close()
    arena.close()
    assert driver.stats().clean


def test_closing_one_arena_leaves_another_on_the_same_driver_untouched(driver: Driver) -> None:
    one, two = Arena(driver, reserve_bytes=4 * G, name="one"), Arena(driver, reserve_bytes=4 * G)
    one.commit(one.allocate(2 * G), 2 * G)
    two.commit(two.allocate(3 * G), 3 * G)
    snap = two.snapshot()
    one.close()
    assert two.snapshot() == snap
    s = driver.stats()
    assert (s.reservations, s.physical_bytes, s.mappings) == (1, 3 * G, 1)
    two.close()
    assert driver.stats().clean


def test_prefix_and_gaps_agree_with_the_mappings_under_random_commits_holes_and_decommits(
) -> None:
    """The backed prefix is read in O(1) when there is no hole and a commit starts past it:
    both must say what the mappings say, whatever mix of prefix growth, holes and
    decommits came before (a commit must back exactly the unbacked granules it covers)."""
    import itertools
    import random

    from kvvmm.driver.sim import SimDriver

    rng = random.Random(7)
    g = 2 << 20
    a = Arena(SimDriver("h200"), reserve_bytes=64 * g, name="prefix")
    off = a.allocate(64 * g)
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            a.commit(off, rng.randrange(0, 65) * g)
        elif op < 0.7:
            s = rng.randrange(0, 64)
            a.commit_range(off, s * g, rng.randrange(1, 65 - s) * g)
        elif op < 0.85:
            s = rng.randrange(0, 64)
            a.decommit_range(off, s * g, rng.randrange(1, 65 - s) * g)
        else:
            a.decommit(off, rng.randrange(0, 65) * g)
        maps = a.mappings_of(off)
        prefix = 0
        for s, e in maps:
            if s != prefix:
                break
            prefix = e
        assert a.prefix_of(off) == prefix
        assert a.backed_of(off) == sum(e - s for s, e in maps)
        assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(maps))
    a.close()

"""Elastic backing: holes anywhere, page-granular owner calls, the handle pool and
the look-ahead, on the sim and host drivers (real bytes on the host), and the arena and page
calls on the CUDA driver too (the ``driver`` fixture's ``cuda-c`` kind: real bytes through
torch on the GPU; skipped without one)."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch
from drivers import driver_params, open_driver_kind

from kvvmm import Arena, KvBufferOwner, SimDriver, mha_token_major
from kvvmm.arena.pool import HandlePool
from kvvmm.driver import FaultyDriver
from kvvmm.driver.base import Driver
from kvvmm.driver.host import HostDriver
from kvvmm.errors import AlignmentError, ArgumentError, DriverError, OutOfRangeError
from kvvmm.record.trace import Trace
from kvvmm.replay import replay_arenas
from kvvmm.units import GiB, MiB

G = 2 * MiB


@pytest.fixture(params=driver_params(("sim", "host", "cuda-c")))
def driver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Driver:
    kind = request.param
    if kind.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here: the bytes are read through torch")
    d: Driver = (SimDriver("h200") if kind == "sim" else HostDriver(capacity_bytes=GiB)
                 if kind == "host" else open_driver_kind(kind, monkeypatch))
    yield d  # type: ignore[misc]
    d.close()


def _bytes(arena: Arena, start: int, n: int) -> torch.Tensor:
    """``n`` bytes of the reservation at ``start``, no copy (host memory or the GPU's)."""
    if arena.driver.kind == "host":
        return torch.frombuffer((ctypes.c_uint8 * n).from_address(arena.base + start),
                                dtype=torch.uint8)
    return arena.tensor(start, (n,), "uint8")


def _maps(arena: Arena) -> list[tuple[int, int]]:
    return [(m.offset // G, m.size_bytes // G) for m in arena.snapshot().mappings]


def test_a_range_in_the_middle_is_backed_while_what_is_around_it_stays_unbacked(
    driver: Driver,
) -> None:
    arena = Arena(driver, reserve_bytes=32 * G)
    o = arena.allocate(16 * G, "x")
    assert arena.commit_range(o, 4 * G, 2 * G) == 2 * G
    snap = arena.snapshot()
    snap.check()
    a = snap.allocation("x")
    assert (a.backed_bytes, a.prefix_bytes, a.hole_bytes) == (2 * G, 0, 2 * G)
    if driver.kind != "sim":
        _bytes(arena, 4 * G, 2 * G).fill_(7)
        assert int(_bytes(arena, 4 * G, 2 * G).sum()) == 7 * 2 * G
    assert arena.commit(o, 6 * G) == 4 * G  # the prefix fills the hole before it
    assert _maps(arena) == [(0, 4), (4, 2)]
    assert arena.snapshot().allocation("x").prefix_bytes == 6 * G
    arena.close()
    assert driver.stats().clean


def test_a_decommit_range_gives_back_only_whole_mappings_and_names_the_ones_it_cuts(
    driver: Driver,
) -> None:
    arena = Arena(driver, reserve_bytes=32 * G)
    o = arena.allocate(16 * G, "x")
    arena.commit(o, 4 * G)
    arena.commit_range(o, 4 * G, 2 * G)
    arena.commit_range(o, 8 * G, 2 * G)
    if driver.kind != "sim":
        _bytes(arena, 0, 4 * G).fill_(1)
        _bytes(arena, 8 * G, 2 * G).fill_(3)
    r = arena.decommit_ranges_report([(o, 2 * G, 4 * G)])[0]
    assert r.given_bytes == 2 * G and r.kept_mappings == ((0, 4 * G),)
    assert r.held_bytes == 2 * G and "cuts" in str(r)
    assert _maps(arena) == [(0, 4), (8, 2)]
    if driver.kind != "sim":  # what stayed kept its bytes
        assert bool((_bytes(arena, 0, 4 * G) == 1).all())
        assert bool((_bytes(arena, 8 * G, 2 * G) == 3).all())
    arena.snapshot().check()
    arena.close()
    assert driver.stats().clean


def test_a_range_off_the_granularity_is_refused_naming_the_granularity() -> None:
    arena = Arena(SimDriver("h200"), reserve_bytes=8 * G)
    o = arena.allocate(4 * G, "x")
    with pytest.raises(AlignmentError, match="granularity"):
        arena.commit_range(o, G // 2, G)
    with pytest.raises(OutOfRangeError):
        arena.commit_range(o, 2 * G, 4 * G)
    assert arena.snapshot().backed_bytes == 0
    arena.close()


def test_out_of_order_commits_and_decommits_replay_to_the_same_snapshot() -> None:
    trace = Trace()
    arena = Arena(SimDriver("h200"), reserve_bytes=64 * G, trace=trace)
    o = arena.allocate(32 * G, "x")
    arena.commit_range(o, 20 * G, 2 * G)
    arena.commit_range(o, 4 * G, 4 * G)
    arena.commit(o, 2 * G)
    arena.decommit_range(o, 4 * G, 4 * G)
    arena.commit_range(o, 10 * G, 2 * G)
    snap = arena.snapshot()
    snap.check()
    trace.validate()
    assert {op.op for op in trace.ops} >= {"commit_range", "decommit_range"}
    [again] = replay_arenas(Trace.from_json(trace.to_json()))
    assert again.mappings == snap.mappings and again.allocations == snap.allocations
    arena.close()


def test_adopt_range_maps_a_callers_handle_in_the_middle_and_records_a_commit_range(
    driver: Driver,
) -> None:
    trace = Trace()
    arena = Arena(driver, reserve_bytes=32 * G, trace=trace)
    o = arena.allocate(16 * G, "x")
    h = driver.create(2 * G)
    assert arena.adopt_range(o, 6 * G, h, 2 * G) == 2 * G
    assert _maps(arena) == [(6, 2)]
    if driver.kind != "sim":
        _bytes(arena, 6 * G, 2 * G).fill_(3)
        assert int(_bytes(arena, 6 * G, 2 * G).sum()) == 3 * 2 * G
    assert trace.ops[-1].op == "commit_range"
    assert trace.ops[-1].args == {"offset": o, "start": 6 * G, "nbytes": 2 * G}
    trace.validate()
    snap = arena.snapshot()
    [again] = replay_arenas(Trace.from_json(trace.to_json()))
    assert again.mappings == snap.mappings
    assert arena.decommit_range(o, 6 * G, 2 * G) == 2 * G  # the arena owns it now
    arena.close()
    assert driver.stats().clean


def test_adopt_range_refuses_an_overlap_a_range_past_the_allocation_and_an_unaligned_start(
) -> None:
    d = SimDriver("h200")
    arena = Arena(d, reserve_bytes=32 * G)
    o = arena.allocate(8 * G, "x")
    arena.commit_range(o, 4 * G, 2 * G)
    h = d.create(2 * G)
    before = arena.snapshot()
    with pytest.raises(ArgumentError, match="overlaps its mapping"):
        arena.adopt_range(o, 5 * G, h, 2 * G)
    with pytest.raises(ArgumentError, match="overlaps its mapping"):
        arena.adopt_range(o, 3 * G, h, 2 * G)
    with pytest.raises(OutOfRangeError):
        arena.adopt_range(o, 7 * G, h, 2 * G)
    with pytest.raises(AlignmentError):
        arena.adopt_range(o, G // 2, h, 2 * G)
    with pytest.raises(ArgumentError, match="> 0"):
        arena.adopt_range(o, 0, h, 0)
    assert arena.snapshot() == before
    arena.adopt_range(o, 6 * G, h, 2 * G)  # the handle is still the caller's: usable
    arena.close()
    assert d.stats().clean


def test_a_failed_map_in_adopt_range_changes_nothing_and_leaves_the_handle_the_callers() -> None:
    d = FaultyDriver(SimDriver("h200"))
    arena = Arena(d, reserve_bytes=32 * G)
    o = arena.allocate(8 * G, "x")
    h = d.create(2 * G)
    before = arena.snapshot()
    d.arm({"map": 1})
    with pytest.raises(DriverError):
        arena.adopt_range(o, 2 * G, h, 2 * G)
    assert arena.snapshot() == before
    d.release(h)
    arena.close()
    assert d.stats().clean


def test_the_va_map_draws_each_hole_as_unbacked() -> None:
    pytest.importorskip("plotly")  # the GPU machine runs this file without it
    from kvvmm.viz.va_map import va_map

    arena = Arena(SimDriver("h200"), reserve_bytes=32 * G)
    o = arena.allocate(16 * G, "x")
    arena.commit_range(o, 4 * G, 2 * G)
    arena.commit_range(o, 10 * G, 2 * G)
    fig = va_map(arena.snapshot())
    unbacked = next(t for t in fig.data if t.name == "unbacked")
    assert len(unbacked.x) == 3  # before, between and after the two pieces
    arena.close()


# -- owner pages ------------------------------------------------------------------------


def _owner(driver: Driver, **kw: object) -> KvBufferOwner:
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=36_000,
                            page_size=16, dtype="bfloat16")
    return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16, reserved_tokens=36_000,
                         descs=descs, **kw)  # type: ignore[arg-type]


def test_commit_pages_backs_each_page_of_every_buffer_in_one_transaction(
    driver: Driver,
) -> None:
    owner = _owner(driver)
    # 8 KiB pages: 256 pages per 2 MiB granule; page 1000 lies in granule 3, 2000 in 7.
    assert owner.commit_pages([1000, 2000]) == 2 * 2 * G
    assert owner.committed_pages == {1000, 2000}
    snap = owner.snapshot()
    snap.arena.check()
    assert [(m.allocation, (m.offset - snap.arena.allocation(m.allocation).offset) // G)
            for m in snap.arena.mappings] == [("k0", 0), ("k0", 3), ("k0", 7), ("v0", 0),
                                              ("v0", 3), ("v0", 7)]
    if driver.kind != "sim":
        page = owner.tensors[0][1000 * 16:1001 * 16]
        page.fill_(2.0)
        assert float(page.float().sum()) == 2.0 * page.numel()
        del page  # a live view keeps the arena's memory until it goes
    assert owner.commit_pages([1001]) == 0  # same granule: already backed
    owner.close()
    assert driver.stats().clean


def test_pages_backed_from_outside_with_page_ranges_and_note_pages_match_commit_pages() -> None:
    ours, theirs = _owner(SimDriver("h200")), _owner(SimDriver("h200"))
    ours.commit_pages([1000, 2000])
    with pytest.raises(ArgumentError, match="backed in every buffer"):
        theirs.note_pages([1000])  # not backed yet: refused, nothing noted
    for off, start, n in theirs.page_ranges([1000, 2000]):
        theirs.arena.adopt_range(off, start, theirs.arena.driver.create(n), n)
    theirs.note_pages([1000, 2000])
    assert theirs.committed_pages == ours.committed_pages
    assert theirs.snapshot() == ours.snapshot()
    theirs.note_pages([2000], committed=False)  # forgotten, its memory still backed
    assert theirs.committed_pages == {1000} and theirs.backed_bytes == ours.backed_bytes
    assert theirs.decommit_pages([2000]) == ours.decommit_pages([2000]) == 2 * G
    ours.close()
    theirs.close()


def test_a_granule_shared_by_pages_stays_until_its_last_committed_page_goes() -> None:
    owner = _owner(SimDriver("h200"))
    owner.commit_pages([1000, 1001])
    assert owner.decommit_pages([1000]) == 0  # page 1001 still uses the granule
    assert owner.decommit_pages([1001]) == 2 * G  # now it goes, from both buffers
    assert owner.committed_pages == set()
    owner.close()


def test_slot_0s_page_and_pages_past_the_buffers_are_refused() -> None:
    owner = _owner(SimDriver("h200"))
    with pytest.raises(ArgumentError, match="slot 0"):
        owner.decommit_pages([0])
    with pytest.raises(OutOfRangeError, match="page ids"):
        owner.commit_pages([owner.pages])
    owner.commit_pages([3])  # shares slot 0's granule
    assert owner.decommit_pages([3]) == 0  # slot 0's granule always stays
    owner.close()


def test_ensure_prefix_fills_a_hole_that_decommit_pages_made() -> None:
    owner = _owner(SimDriver("h200"))
    owner.ensure_prefix(17_000)
    owner.commit_pages([600])  # inside the prefix: nothing new
    before = owner.backed_bytes
    # page 600's granule (2) is inside a larger prefix mapping: it stays, whole
    assert owner.decommit_pages([600]) == 0
    assert owner.backed_bytes == before
    owner.close()


def test_release_beyond_gives_back_everything_past_n_tokens_holes_included(
    driver: Driver,
) -> None:
    owner = _owner(driver)
    owner.ensure_prefix(3000)
    owner.commit_pages([1500, 2100])
    given = owner.release_beyond(16)
    assert given == 2 * 2 * G  # the two pages' granules of both buffers
    snap = owner.snapshot()
    assert all(a.backed_bytes == G for a in snap.arena.allocations)  # slot 0's granule
    assert owner.committed_pages == set()
    owner.close()
    assert driver.stats().clean


# -- the pool ---------------------------------------------------------------------------


def test_a_decommit_then_commit_cycle_reuses_the_pools_handle_two_map_calls_no_create() -> None:
    from kvvmm import FaultyDriver

    drv = FaultyDriver(SimDriver("h200"))
    pool = HandlePool(drv, threaded=False)
    arena = Arena(drv, reserve_bytes=32 * G, pool=pool)
    o = arena.allocate(16 * G, "x")
    arena.commit_range(o, 4 * G, 2 * G)
    arena.decommit_range(o, 4 * G, 2 * G)
    assert pool.held_bytes == 2 * G and arena.snapshot().pool_bytes == 2 * G
    n = len(drv.calls)
    arena.commit_range(o, 4 * G, 2 * G)
    assert drv.calls[n:] == ["map", "set_access"]
    assert pool.stats().reused == 1
    arena.close()
    pool.close()
    assert drv.stats().clean


def test_the_pool_keeps_released_handles_only_up_to_its_cap() -> None:
    drv = SimDriver("h200")
    pool = HandlePool(drv, retain_bytes=3 * G, threaded=False)
    arena = Arena(drv, reserve_bytes=32 * G, pool=pool)
    o = arena.allocate(16 * G, "x")
    arena.commit_ranges([(o, 0, 2 * G), (o, 4 * G, 2 * G)])
    arena.decommit(o, 0)
    assert pool.held_bytes == 2 * G  # the second did not fit under 3 granules
    assert drv.stats().handles == 1
    arena.close()
    pool.close()
    assert drv.stats().clean


def test_an_out_of_memory_create_draws_the_pool_down_first_and_succeeds() -> None:
    drv = SimDriver("h200", capacity_bytes=8 * G)
    pool = HandlePool(drv, ready={2 * G: 3}, threaded=False)
    pool.run_once()
    assert pool.held_bytes == 6 * G
    arena = Arena(drv, reserve_bytes=32 * G, pool=pool)
    o = arena.allocate(16 * G, "x")
    assert arena.commit_range(o, 0, 6 * G) == 6 * G  # 3 granules free: trims 2 handles
    assert pool.stats().trimmed_bytes >= 2 * G
    arena.snapshot().check()
    arena.close()
    pool.close()
    assert drv.stats().clean


def test_growth_takes_ready_handles_from_the_pool_and_only_maps() -> None:
    from kvvmm import FaultyDriver

    drv = FaultyDriver(SimDriver("h200"))
    pool = HandlePool(drv, ready={2 * G: 2}, threaded=False)
    assert pool.run_once() == 2
    arena = Arena(drv, reserve_bytes=32 * G, pool=pool)
    o = arena.allocate(16 * G, "x")
    n = len(drv.calls)
    arena.commit(o, 2 * G)
    assert "create" not in drv.calls[n:]
    arena.close()
    pool.close()
    assert drv.stats().clean


def test_the_pools_thread_refills_and_closes_within_a_timeout() -> None:
    drv = SimDriver("h200")
    pool = HandlePool(drv, ready={G: 4})
    assert pool.drain(timeout_s=10)
    assert pool.stats().held == {G: 4}
    took = [pool.take(G) for _ in range(4)]
    assert all(h is not None for h in took)
    assert pool.drain(timeout_s=10) and pool.held_bytes == 4 * G  # refilled
    for h in took:
        assert h is not None
        drv.release(h)
    t0 = time.monotonic()
    pool.close(timeout_s=10)
    assert time.monotonic() - t0 < 10
    assert drv.stats().clean


def test_a_look_ahead_backs_beyond_the_prefix_off_the_caller_and_stays_bounded() -> None:
    drv = SimDriver("h200")
    pool = HandlePool(drv, threaded=False)
    owner = _owner(drv, pool=pool, lookahead_bytes=4 * G)
    owner.ensure_prefix(100)
    pool.run_once()  # the background's work, stepped
    backed = owner.backed_bytes
    assert backed >= 2 * (4 * G)
    t0 = drv.clock_us
    calls = drv.stats()
    owner.ensure_prefix(4 * G // 512)  # inside the look-ahead: no driver call
    assert drv.stats() == calls
    # only the step's own check, which the profile charges per buffer
    from kvvmm.hardware import sim_costs

    check = sim_costs(drv.profile).work_us("owner.ensure_prefix", len(owner.descs))
    assert drv.clock_us - t0 == pytest.approx(check)
    span = [a for a in owner.snapshot().arena.allocations]
    need = 4 * G // 512 * 512
    for a in span:  # over-commit bounded by the look-ahead plus one policy extension
        assert a.backed_bytes - need <= 4 * G + 8 * MiB + G
    owner.close()
    pool.close()
    assert drv.stats().clean


def test_growth_with_a_threaded_look_ahead_is_consistent_and_closes_cleanly() -> None:
    drv = SimDriver("h200")
    pool = HandlePool(drv)
    owner = _owner(drv, pool=pool, lookahead_bytes=2 * G)
    errors: list[BaseException] = []

    def grow() -> None:
        try:
            for n in range(16, 36_000, 700):
                owner.ensure_prefix(n)
                owner.arena.snapshot().check()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=grow)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive() and not errors, errors
    assert pool.drain(timeout_s=10)
    owner.arena.snapshot().check()
    owner.close()
    pool.close(timeout_s=10)
    assert drv.stats().clean


def test_a_pool_of_another_driver_is_refused() -> None:
    pool = HandlePool(SimDriver("h200"), threaded=False)
    with pytest.raises(ArgumentError, match="pool"):
        Arena(SimDriver("h200"), reserve_bytes=4 * G, pool=pool)
    pool.close()


def test_a_stepped_pool_is_deterministic_on_the_sim() -> None:
    def run() -> tuple[object, float]:
        drv = SimDriver("h200")
        pool = HandlePool(drv, threaded=False)
        owner = _owner(drv, pool=pool, lookahead_bytes=2 * G)
        for n in range(16, 30_000, 1000):
            owner.ensure_prefix(n)
            pool.run_once()
        snap = owner.snapshot()
        owner.close()
        pool.close()
        return snap.arena.mappings, drv.clock_us

    assert run() == run()


def test_drain_returns_true_only_once_every_job_submitted_before_it_ran() -> None:
    """The thread counts a job busy in the same hold of the lock that takes it off the queue:
    a drain between the two would see "none queued, none running" and return early."""
    pool = HandlePool(SimDriver("h200"))
    for i in range(300):
        ran: list[int] = []
        pool.submit(lambda i=i, ran=ran: ran.append(i))
        assert pool.drain(timeout_s=10)
        assert ran == [i], i
    assert pool.stats().jobs == 300
    pool.close(timeout_s=10)


def test_a_look_ahead_asked_for_more_while_queued_backs_the_most_asked_for() -> None:
    drv = SimDriver("h200")
    pool = HandlePool(drv, threaded=False)
    owner = _owner(drv, pool=pool, lookahead_bytes=G)
    owner._work = None  # the call-free path, as on CUDA or the host driver
    owner.ensure_prefix(100)
    pool.run_once()
    n = owner.backed_tokens
    owner.ensure_prefix(n - 16)  # queues (the look-ahead's margin is gone) ...
    owner.ensure_prefix(n)  # ... and, queued still, asks for more: no second job
    assert len(pool._jobs) == 1
    pool.run_once()
    need = [min(d.prefix_span_bytes(n, owner.page_size) + G, lim)
            for d, lim in zip(owner.descs, owner._limits, strict=True)]
    assert all(owner.arena.prefix_of(o) >= want
               for o, want in zip(owner._offsets, need, strict=True))
    owner.close()
    pool.close()
    assert drv.stats().clean


def test_a_look_ahead_after_a_shrink_backs_beyond_the_new_prefix_not_the_old_one() -> None:
    drv = SimDriver("h200")
    pool = HandlePool(drv, threaded=False)
    owner = _owner(drv, pool=pool, lookahead_bytes=G)
    owner._work = None
    for n in range(16, 30_000, 1000):
        owner.ensure_prefix(n)
        pool.run_once()
    owner.shrink(1000)
    owner.ensure_prefix(1100)
    pool.run_once()
    # the look-ahead plus one policy extension (8 MiB at least) and a granule of rounding,
    # well under the 18 MiB the growth to 29,016 tokens had backed before the shrink
    bound = [d.prefix_span_bytes(1100, owner.page_size) + G + 8 * MiB + G
             for d in owner.descs]
    assert all(owner.arena.prefix_of(o) <= b
               for o, b in zip(owner._offsets, bound, strict=True)), owner.snapshot()
    owner.close()
    pool.close()
    assert drv.stats().clean


@pytest.mark.parametrize("seed", range(4))
def test_ensure_prefix_after_close_or_sleep_refuses_even_with_a_look_ahead_racing_it(
        seed: int) -> None:
    """The fast path's one int is -1 once the owner closes or sleeps, and a look-ahead job
    syncing on the pool's thread at that moment cannot set it back."""
    import random

    from kvvmm.errors import AsleepError, ClosedError

    rng = random.Random(seed)
    for _ in range(20):
        drv = HostDriver()
        pool = HandlePool(drv)
        owner = _owner(drv, pool=pool, lookahead_bytes=4 * G)
        top = rng.randrange(2_000, 30_000)
        for n in range(16, top, 997):
            owner.ensure_prefix(n)
        n = owner.prefix_tokens
        if rng.random() < 0.5:
            owner.sleep()
            _refused_before_and_after_the_look_ahead(owner, pool, n, AsleepError)
            owner.wake()
            owner.ensure_prefix(n)
        owner.close()
        _refused_before_and_after_the_look_ahead(owner, pool, n, ClosedError)
        pool.close(timeout_s=10)


def _refused_before_and_after_the_look_ahead(owner: KvBufferOwner, pool: HandlePool, n: int,
                                             error: type[Exception]) -> None:
    for _ in range(2):  # at once, and once the pool's thread has synced
        with pytest.raises(error):
            owner.ensure_prefix(n)
        assert pool.drain(timeout_s=10)


# -- the decode step's O(1) check: what it trusts is never more than the arena backs ------


def _covered_by_arena(owner: KvBufferOwner, n: int) -> bool:
    return all(owner.arena.prefix_of(o) >= d.prefix_span_bytes(n, owner.page_size)
               for o, d in zip(owner._offsets, owner.descs, strict=True))


@pytest.mark.parametrize("real", [False, True], ids=["sim-charged", "uncharged"])
@pytest.mark.parametrize("seed", range(8))
def test_ensure_prefix_never_answers_from_a_mirror_ahead_of_the_arena(seed: int,
                                                                      real: bool) -> None:
    """Random growth, shrinks, release_beyond, page commits, stepped look-ahead jobs and
    injected driver failures: after every operation, ensure_prefix(n) for any n either
    backs n (it returns with every buffer's span backed) or raises with nothing changed."""
    import random

    from kvvmm.driver import Fault

    rng = random.Random(seed)
    drv = FaultyDriver(SimDriver("h200"))
    pool = HandlePool(drv, threaded=False)
    owner = _owner(drv, pool=pool, lookahead_bytes=rng.choice([0, G, 4 * G]))
    if real:  # as on CUDA or the host driver: no simulator to charge, the call-free path
        owner._work = None
    top = owner.reserved_tokens
    for _ in range(120):
        op = rng.randrange(6)
        if rng.random() < 0.15:
            drv.arm(Fault(rng.choice(["create", "map", "set_access", "unmap", "release"])))
        try:
            if op == 0:
                owner.ensure_prefix(rng.randrange(0, top + 1))
            elif op == 1:
                owner.shrink(rng.randrange(0, top + 1))
            elif op == 2:
                owner.release_beyond(rng.randrange(0, top + 1))
            elif op == 3:
                pool.run_once()  # the look-ahead's job publishes what it backed
            elif op == 4:
                p = rng.randrange(1, owner.pages)
                owner.commit_pages([p]) if rng.random() < 0.6 else owner.decommit_pages([p])
            else:
                n = rng.randrange(0, top + 1)
                if owner.ensure_prefix(n) == 0:
                    assert _covered_by_arena(owner, n), n
        except DriverError:
            pass
        except ArgumentError:
            pass  # e.g. decommit_pages inside the prefix
        drv.disarm()
        for n in (owner.prefix_tokens, rng.randrange(0, top + 1)):
            before = owner.arena.snapshot()
            try:
                owner.ensure_prefix(n)
            except DriverError:
                assert owner.arena.snapshot().mappings == before.mappings
                continue
            assert _covered_by_arena(owner, n), (seed, n)
    owner.close()
    pool.close()
    assert drv.stats().clean

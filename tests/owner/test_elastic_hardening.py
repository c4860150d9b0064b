"""RangeBacking under hostile use: every driver call of every path failing, leases that are
not this backing's, close() under waiters, executors that raise, sizes past the device.

The rule checked throughout: a failed step leaves the backing's books equal to the driver's
own mappings (cached blocks and ready leases mapped, fresh blocks unmapped, every unit
mapped), nothing leaks (a close leaves the driver clean), and every later lease's memory is
mapped: on the host driver it is written and read back through its VA.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvvmm import open_driver
from kvvmm.driver.base import Driver
from kvvmm.driver.faults import Fault, FaultyDriver
from kvvmm.driver.host import HostDriver
from kvvmm.errors import (
    ArgumentError,
    AsleepError,
    ClosedError,
    DriverError,
    KvvmmError,
    OutOfRangeError,
    WrongTypeError,
)
from kvvmm.layout import RangesFullError, model_descs
from kvvmm.owner import KvBufferOwner, Lease, RangeBacking

G = 2 << 20
BLOCKS = 48  # blocks of 16 slots (one 2 MiB granule each): small, so every case is fast


def _inner(kind: str) -> Driver:
    if kind == "host":
        return HostDriver(capacity_bytes=1 << 30)
    return open_driver("sim", profile="h200")


def _owner(driver: Any, blocks: int = BLOCKS) -> KvBufferOwner:
    descs = model_descs("llama-3.1-8b", layout="interleaved", reserved_tokens=16 * blocks,
                        page_size=16, dtype="bfloat16")
    return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16, descs=descs)


@contextlib.contextmanager
def _setup(kind: str, executor: Any = "inline", reserve: int = 0, high: int | None = None,
           blocks: int = BLOCKS) -> Iterator[tuple[FaultyDriver, KvBufferOwner, RangeBacking]]:
    drv = FaultyDriver(_inner(kind))
    owner = _owner(drv, blocks)
    backing = RangeBacking(owner, reserve_bytes=reserve * G,
                           high_bytes=None if high is None else high * G, executor=executor)
    try:
        yield drv, owner, backing
    finally:
        drv.disarm()
        backing.close()
        owner.close()
    stats = drv.stats()
    assert stats.handles == 0 and stats.mappings == 0, stats  # nothing leaked
    if isinstance(drv.inner, HostDriver):
        drv.inner.close()


# -- the driver's own view -----------------------------------------------------------------


def _driver_maps(drv: FaultyDriver) -> list[tuple[int, int]]:
    book = drv.inner._book  # type: ignore[attr-defined]
    with drv.inner._lock:  # type: ignore[attr-defined]
        return sorted((va, size) for va, (size, _) in book.maps.items())


def _covered(maps: list[tuple[int, int]], lo: int, hi: int) -> int:
    return sum(max(0, min(hi, va + n) - max(lo, va)) for va, n in maps)


def _va(owner: KvBufferOwner, backing: RangeBacking, s: int, n: int) -> tuple[int, int]:
    bt = backing.block_tokens
    ((off, lo, nbytes),) = owner.slot_ranges([(s * bt, (s + n) * bt)])
    va = owner.arena.base + off + lo
    return va, va + nbytes


def _books_equal_mappings(drv: FaultyDriver, owner: KvBufferOwner, backing: RangeBacking,
                          live: list[Lease]) -> None:
    """Cached blocks, units and ready leases mapped; fresh blocks unmapped; the stats add
    up; nothing mapped beyond slot 0's granule and the units."""
    assert backing.drain()
    maps = _driver_maps(drv)
    with backing._lock:
        cached = list(backing._cached.extents)
        fresh = list(backing._fresh.extents)
        units = dict(backing._units_over(backing.first, backing.blocks))
    for s, n in cached:
        lo, hi = _va(owner, backing, s, n)
        assert _covered(maps, lo, hi) == hi - lo, f"cached blocks [{s}, {s + n}) unmapped"
    for s, n in units.items():
        lo, hi = _va(owner, backing, s, n)
        assert _covered(maps, lo, hi) == hi - lo, f"unit [{s}, {s + n}) unmapped"
    for s, n in fresh:
        lo, hi = _va(owner, backing, s, n)
        assert _covered(maps, lo, hi) == 0, f"fresh blocks [{s}, {s + n}) mapped"
    for lease in live:
        if lease.ready:
            for s, n in lease.pieces:
                lo, hi = _va(owner, backing, s, n)
                assert _covered(maps, lo, hi) == hi - lo, f"{lease} is ready on unmapped VA"
    st = backing.stats()
    total = (backing.blocks - backing.first) * backing.block_bytes
    assert st.pending_bytes == 0
    assert st.leased_bytes + st.cached_bytes + st.fresh_bytes == total, st
    assert sum(n for _, n in maps) == G + sum(units.values()) * backing.block_bytes


def _every_later_lease_is_mapped(drv: FaultyDriver, owner: KvBufferOwner,
                                 backing: RangeBacking, live: list[Lease]) -> None:
    """With the fault gone: lease every free block, each lease mapped (written and read
    back on the host driver), then give everything back."""
    drv.disarm()
    for lease in live:
        with contextlib.suppress(KvvmmError):
            backing.wait(lease)
    got: list[Lease] = []
    while backing.stats().cached_bytes + backing.stats().fresh_bytes:
        with contextlib.suppress(RangesFullError):
            got.append(backing.wait(backing.admit(16 * 5)))
            continue
        got.append(backing.wait(backing.admit(16)))
    maps = _driver_maps(drv)
    host = isinstance(drv.inner, HostDriver)
    for i, lease in enumerate(live + got):
        if not lease.ready:
            continue
        for s, n in lease.pieces:
            lo, hi = _va(owner, backing, s, n)
            assert _covered(maps, lo, hi) == hi - lo, f"{lease} is ready on unmapped VA"
            if host:  # the bytes themselves: a write to unmapped VA would fault here
                for at in (lo, hi - 8):
                    ctypes.memset(at, 0x40 + i % 64, 8)
                    assert ctypes.string_at(at, 8) == bytes([0x40 + i % 64]) * 8
    for lease in live + got:
        backing.release(lease)
    assert backing.drain()
    backing.reclaim(0)
    assert backing.stats().units == 0 and owner.backed_bytes == G


# -- the paths, each a step that makes driver calls ------------------------------------------


def _path_reclaim(backing: RangeBacking, live: list[Lease]) -> None:
    backing.reclaim(0)


def _path_release_over_high(backing: RangeBacking, live: list[Lease]) -> None:
    backing.release(live.pop(0))  # above the high mark: the reclamation runs now or queued


def _path_reclaim_scattered(backing: RangeBacking, live: list[Lease]) -> None:
    backing.release(live.pop(2))  # the units cached now lie apart: one unmap each
    backing.release(live.pop(0))
    backing.reclaim(0)


def _path_admit(backing: RangeBacking, live: list[Lease]) -> None:
    live.append(backing.admit(16 * 9))


def _path_grow(backing: RangeBacking, live: list[Lease]) -> None:
    backing.grow(live[0], live[0].tokens + 16 * 9)


def _path_give_back(backing: RangeBacking, live: list[Lease]) -> None:
    backing.give_back(None, deadline_s=30.0).wait()  # one decommit per unit, on the thread


#: name -> (executor, reserve blocks, high blocks, lease sizes made first and released
#: where the path gives back, the step)
PATHS: dict[str, tuple[Any, int, int | None, bool, Callable[[RangeBacking, list[Lease]],
                                                              None]]] = {
    "reclaim": ("inline", 4, 30, True, _path_reclaim),
    "reclaim-scattered": ("inline", 0, 40, False, _path_reclaim_scattered),
    "release-inline": ("inline", 0, None, False, _path_release_over_high),
    "release-thread": (None, 2, 2, False, _path_release_over_high),
    "admit-inline": ("inline", 0, None, False, _path_admit),
    "admit-thread": (None, 0, None, False, _path_admit),
    "refill": (None, 12, 12, False, _path_admit),
    "grow": ("inline", 0, None, False, _path_grow),
    "give-back": (None, 4, 30, True, _path_give_back),
}


def _prepare(backing: RangeBacking, release_first: bool) -> list[Lease]:
    live = [backing.wait(backing.admit(16 * n)) for n in (6, 3, 7)]
    assert backing.drain()
    if release_first:
        for lease in live:
            backing.release(lease)
        live = []
        assert backing.drain()
    return live


def _calls_of(kind: str, path: str) -> int:
    executor, reserve, high, first, step = PATHS[path]
    with _setup(kind, executor, reserve, high) as (drv, _, backing):
        live = _prepare(backing, first)
        n = len(drv.calls)
        step(backing, live)
        assert backing.drain()
        made = len(drv.calls) - n
        for lease in live:
            backing.release(lease)
    assert made > 0, path
    return made


FAULTS = ["nth", "every release", "every unmap", "every map", "every create"]


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("kind", ["sim", "host"])
def test_a_driver_call_failing_in_any_path_leaves_the_books_equal_to_the_mappings(
        kind: str, path: str) -> None:
    executor, reserve, high, first, step = PATHS[path]
    cases: list[list[Fault]] = [[Fault("*", nth=k)] for k in range(1, _calls_of(kind, path) + 1)]
    cases += [[Fault(c, nth=None)] for c in ("release", "unmap", "map", "create", "set_access")]
    cases += [[Fault("unmap", nth=1), Fault("map", nth=1)],  # an undo failing in turn
              [Fault("map", nth=1), Fault("unmap", nth=1)],
              [Fault("unmap", nth=2), Fault("map", nth=1)],  # the map-back of a unit apart
              [Fault("unmap", nth=2), Fault("set_access", nth=1)]]
    for faults in cases:
        with _setup(kind, executor, reserve, high) as (drv, owner, backing):
            live = _prepare(backing, first)
            drv.arm(faults)
            try:
                step(backing, live)
            except DriverError as e:
                assert any("RangeBacking" in n or "arena" in n for n in
                           getattr(e, "__notes__", [])) or path.startswith(("admit", "grow")), e
            assert backing.drain()
            drv.disarm()
            _books_equal_mappings(drv, owner, backing, live)
            _every_later_lease_is_mapped(drv, owner, backing, live)


def test_a_release_failing_past_the_unmaps_says_what_was_left_and_how_to_recover() -> None:
    with _setup("sim", "inline", 0, 30) as (drv, owner, backing):
        for lease in _prepare(backing, False):
            backing.release(lease)
        drv.arm([Fault("release", nth=None)])
        with pytest.raises(DriverError) as got:
            backing.reclaim(0)
        notes = "\n".join(got.value.__notes__)
        assert "3 are unmapped" in notes and "reclaim() or owner.close()" in notes
        s = backing.stats()
        assert s.cached_bytes == 0 and s.units == 0  # nothing listed as mapped that is not
        drv.disarm()
        backing.reclaim(0)  # (nothing cached: the arena releases its handles at close)
        _books_equal_mappings(drv, owner, backing, [])


# -- a lease belongs to the backing that made it --------------------------------------------


def _pair() -> tuple[KvBufferOwner, RangeBacking, KvBufferOwner, RangeBacking]:
    a_owner, b_owner = _owner(open_driver("sim")), _owner(open_driver("sim"))
    return (a_owner, RangeBacking(a_owner, executor="inline"),
            b_owner, RangeBacking(b_owner, executor="inline"))


def _calls(backing: RangeBacking) -> dict[str, Callable[[Any], object]]:
    return {"release": backing.release, "wait": backing.wait, "ready": backing.ready,
            "grow": lambda lease: backing.grow(lease, 16 * 30)}


@pytest.mark.parametrize("call", ["release", "wait", "ready", "grow"])
def test_a_lease_from_another_backing_is_refused_before_anything_changes(call: str) -> None:
    a_owner, a, b_owner, b = _pair()
    mine = a.admit(16 * 4)
    theirs = b.admit(16 * 4)
    before = (a.stats(), b.stats(), list(theirs.pieces), theirs.ready)
    with pytest.raises(ArgumentError, match="another backing's lease"):
        _calls(a)[call](theirs)
    assert (a.stats(), b.stats(), list(theirs.pieces), theirs.ready) == before
    assert not theirs.released and a.ready(mine)
    b.release(theirs)  # still its own backing's to give back
    for x in (a, b):
        x.close()
    a_owner.close()
    b_owner.close()


@pytest.mark.parametrize("call", ["release", "wait", "ready", "grow"])
def test_a_released_copied_or_forged_lease_is_refused(call: str) -> None:
    owner = _owner(open_driver("sim"))
    backing = RangeBacking(owner, executor="inline")
    live = backing.admit(16 * 4)
    gone = backing.admit(16 * 2)
    backing.release(gone)
    forged = Lease(backing.block_tokens)
    forged._pieces = list(live.pieces)
    before = backing.stats()
    for bad in (gone, copy.copy(live), forged):
        with pytest.raises(ArgumentError):
            _calls(backing)[call](bad)
        assert backing.stats() == before
    with pytest.raises(ArgumentError, match="after release"):
        backing.release(gone)
    backing.release(live)
    backing.close()
    owner.close()


@pytest.mark.parametrize("field", ["pieces", "released", "ready", "pending", "error",
                                   "tokens", "block_tokens"])
def test_a_leases_fields_cannot_be_rewritten_by_its_holder(field: str) -> None:
    owner = _owner(open_driver("sim"))
    backing = RangeBacking(owner, executor="inline")
    mine = backing.admit(16 * 4)
    other = backing.admit(16 * 4)
    before = (mine.pieces, mine.released, mine.ready, mine.pending, mine.error, mine.tokens,
              mine.block_tokens)
    with pytest.raises(AttributeError):
        setattr(mine, field, other.pieces if field == "pieces" else True)
    mine.pieces.append((1, 40))  # a copy: the lease's own stay as they were
    assert (mine.pieces, mine.released, mine.ready, mine.pending, mine.error, mine.tokens,
            mine.block_tokens) == before
    backing.release(mine)  # gives back its own blocks, never the other lease's
    assert backing.ready(other) and backing.stats().leased_bytes == other.blocks * G
    backing.release(other)
    backing.close()
    owner.close()


@pytest.mark.parametrize("call", ["release", "wait", "ready", "grow"])
@pytest.mark.parametrize("bad", [None, 7, "lease", (1, 2), object()])
def test_an_argument_that_is_not_a_lease_is_a_type_error(call: str, bad: object) -> None:
    owner = _owner(open_driver("sim"))
    backing = RangeBacking(owner, executor="inline")
    before = backing.stats()
    with pytest.raises(WrongTypeError) as got:
        _calls(backing)[call](bad)
    assert isinstance(got.value, TypeError) and isinstance(got.value, KvvmmError)
    assert backing.stats() == before
    backing.close()
    owner.close()


def test_two_threads_releasing_one_lease_give_it_back_once() -> None:
    owner = _owner(open_driver("sim"))
    backing = RangeBacking(owner, reserve_bytes=4 * G, high_bytes=40 * G)
    for _ in range(30):
        lease = backing.wait(backing.admit(16 * 3))
        errors: list[BaseException] = []
        go = threading.Barrier(2)

        def rel(lease: Lease = lease, go: threading.Barrier = go,
                errors: list[BaseException] = errors) -> None:
            go.wait()
            try:
                backing.release(lease)
            except ArgumentError as e:
                errors.append(e)

        ts = [threading.Thread(target=rel) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert len(errors) == 1
        assert backing.drain()
        s = backing.stats()
        assert s.leased_bytes == 0
        assert s.cached_bytes + s.fresh_bytes == (backing.blocks - backing.first) * G
    backing.close()
    owner.close()


# -- the smaller gaps ------------------------------------------------------------------------


def test_releases_during_a_reclamation_end_at_or_below_the_high_mark() -> None:
    from kvvmm.driver.wrapper import DriverWrapper

    gate, inside = threading.Event(), threading.Event()

    class Held(DriverWrapper):
        def _call(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
            if call == "unmap" and threading.current_thread().name == "kvvmm-range-backing":
                inside.set()
                assert gate.wait(30)
            return fn(*args)

    owner = _owner(Held(open_driver("sim")))  # type: ignore[abstract]
    backing = RangeBacking(owner, high_bytes=4 * G)
    try:
        leases = [backing.wait(backing.admit(16 * 5)) for _ in range(6)]
        backing.release(leases.pop())  # 5 cached > 4: a reclamation, held at its unmap
        assert inside.wait(30)
        for lease in leases:  # these come while it runs
            backing.release(lease)
        gate.set()
        assert backing.drain()
        assert backing.stats().cached_bytes <= 4 * G, backing.stats()
    finally:
        gate.set()
        backing.close()
        owner.close()


def test_a_wait_on_a_commit_close_dropped_raises_closed_at_once() -> None:
    held: list[Callable[[], None]] = []
    owner = _owner(open_driver("sim"))
    backing = RangeBacking(owner, executor=lambda job, waited: held.append(job))
    lease = backing.admit(16 * 5)  # its commit held by the executor, never run
    other = backing.admit(16 * 3)
    assert not lease.ready
    woke: list[BaseException] = []

    def waiter() -> None:
        try:
            backing.wait(other, timeout_s=20)
        except BaseException as e:
            woke.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    backing.close()
    t.join(5)
    assert not t.is_alive() and isinstance(woke[0], ClosedError)
    done = threading.Event()
    with pytest.raises(ClosedError, match="close"):
        threading.Timer(5, done.set).start()
        backing.wait(lease, timeout_s=20)
    assert not done.is_set()  # at once, not at the timeout
    for job in held:
        job()  # an executor that runs them after all: nothing happens
    assert owner.backed_bytes == G
    backing.release(lease)
    backing.release(other)
    s = backing.stats()
    assert s.leased_bytes == 0 and s.pending_bytes == 0 and s.cached_bytes == 0
    owner.close()


class _Boom(RuntimeError):
    pass


def _refusing(job: Callable[[], None], waited: bool) -> None:
    raise _Boom("the executor is full")


def _runs_then_raises(job: Callable[[], None], waited: bool) -> None:
    job()
    raise _Boom("the executor broke after the job")


@pytest.mark.parametrize("executor", [_refusing, _runs_then_raises])
def test_an_executor_that_raises_leaks_nothing_and_is_reported(executor: Any) -> None:
    owner = _owner(open_driver("sim"))
    refuse = [True]

    def ex(job: Callable[[], None], waited: bool) -> None:
        if refuse[0]:
            executor(job, waited)
        else:
            job()

    backing = RangeBacking(owner, executor=ex)
    total = (backing.blocks - backing.first) * G
    with pytest.raises(_Boom) as got:
        backing.admit(16 * 5)
    assert any("RangeBacking" in n for n in got.value.__notes__)
    s = backing.stats()
    assert s.leased_bytes == 0 and s.pending_bytes == 0
    assert s.cached_bytes + s.fresh_bytes == total
    backing.reclaim(0)
    assert owner.backed_bytes == G
    refuse[0] = False
    lease = backing.admit(16 * 5)
    assert lease.ready
    refuse[0] = True
    before = list(lease.pieces)
    with pytest.raises(_Boom):
        backing.grow(lease, 16 * 12)
    if executor is _refusing:
        assert lease.pieces == before and lease.ready and lease.tokens == 16 * 5
    with pytest.raises(_Boom) as got:  # the release stands; its reclamation was refused
        backing.release(lease)
    assert "released all the same" in "".join(got.value.__notes__)
    assert lease.released
    s = backing.stats()
    assert s.leased_bytes == 0 and s.pending_bytes == 0
    assert s.cached_bytes + s.fresh_bytes == total
    backing.close()
    owner.close()


def test_a_refill_that_keeps_failing_does_not_retry_in_a_loop() -> None:
    drv = FaultyDriver(open_driver("sim"))
    owner = _owner(drv)
    drv.arm([Fault("create", nth=None)])
    backing = RangeBacking(owner, reserve_bytes=8 * G, executor="inline")
    assert drv.injected == ["create"]  # one refill tried, none after its failure
    assert isinstance(backing.upkeep_error, DriverError)
    lease = backing.admit(16 * 2)  # its own commit fails; one more refill is tried
    assert lease.error is not None and len(drv.injected) <= 3
    drv.disarm()
    backing.release(lease)  # a new call: the refill is tried again, and goes
    assert backing.stats().cached_bytes == 8 * G
    backing.close()
    owner.close()


@pytest.mark.parametrize("name", ["reserve_bytes", "high_bytes"])
@pytest.mark.parametrize("over", [2 ** 50, G, 1])
def test_sizes_past_the_buffers_or_the_device_are_refused_naming_the_limit(
        name: str, over: int) -> None:
    owner = _owner(open_driver("sim"))
    probe = RangeBacking(owner, executor="inline")
    cap = (probe.blocks - probe.first) * probe.block_bytes  # every block it can lease
    probe.close()
    value = over if over > cap else cap + over
    with pytest.raises(OutOfRangeError, match=f"{name}=.* <= {cap} bytes"):
        RangeBacking(owner, **{name: value}, executor="inline")  # type: ignore[arg-type]
    ok = RangeBacking(owner, reserve_bytes=cap, executor="inline")  # the whole of it: fine
    assert ok.stats().cached_bytes == cap
    ok.close()
    owner.close()


def test_a_reserve_past_the_device_memory_is_refused() -> None:
    drv = HostDriver(capacity_bytes=64 << 20)  # smaller than the buffers' 96 MiB
    owner = _owner(drv)
    with pytest.raises(OutOfRangeError, match="device's 67108864 bytes"):
        RangeBacking(owner, reserve_bytes=80 << 20)
    owner.close()
    drv.close()


def test_an_owner_asleep_or_closed_under_the_backing_leases_nothing_as_ready() -> None:
    drv = HostDriver(capacity_bytes=1 << 30)
    owner = _owner(drv)
    backing = RangeBacking(owner, reserve_bytes=4 * G, executor="inline")
    lease = backing.admit(16 * 2)
    assert backing.ready(lease)
    owner.sleep()  # every mapping given back, the cached blocks' too
    assert not backing.ready(lease)
    with pytest.raises(AsleepError):
        backing.admit(16 * 2)  # it would be "ready" from the cache, on unmapped VA
    owner.wake()
    again = backing.admit(16 * 2)
    assert backing.ready(again)
    for s, n in again.pieces:
        lo, hi = _va(owner, backing, s, n)
        ctypes.memset(lo, 7, hi - lo)
        assert ctypes.string_at(hi - 8, 8) == b"\x07" * 8
    owner.close()
    assert not backing.ready(again)
    with pytest.raises(ClosedError):
        backing.admit(16)
    backing.close()
    drv.close()


def test_a_second_backing_over_an_owner_another_leases_from_is_refused() -> None:
    owner = _owner(open_driver("sim"))
    first = RangeBacking(owner, executor="inline")  # nothing committed yet
    with pytest.raises(ArgumentError, match="close the other one first"):
        RangeBacking(owner, executor="inline")  # it would lease the same slots again
    lease = first.admit(16 * 4)
    first.release(lease)
    first.close()
    second = RangeBacking(owner, executor="inline")  # once the first is closed: fine
    assert second.admit(16 * 4).ready
    second.close()
    owner.close()

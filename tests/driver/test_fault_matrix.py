"""Fault matrix: every driver call of commit, decommit, ensure_prefix, finalize, shrink,
close, (holes) commit_range, decommit_range, commit_pages, decommit_pages and
release_beyond, and sleep and wake, failing.

It runs on the simulator and the host driver, and where a GPU is usable on the CUDA driver
with its hot calls in C (``cuda-c``) and in Python (``cuda-python``): the kinds of
``tests/drivers.py``, skipped where they cannot open.

For each operation we first count the driver calls it makes, then run it again once per
call position and error kind with that call failing. Each time: the error names the call,
the owner's snapshot is as it was, the driver holds exactly what it held (by its own
accounting, handle count included), every byte backed before the call still reads what was
written there (a pattern over every backed byte: through ctypes on the host driver, through
torch on the GPU), and after the fault is gone the same operation goes through and a close
leaves the driver clean. On the GPU the device's free memory is, after the whole row, what it
was before it (within one granule of noise from other allocations).

A release that fails after every unmap of a decommit succeeded is past the point of no
return (the VA no longer reaches the handle): the decommit stands, the arena keeps the handle
and a later close releases it. The matrix checks exactly that.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pytest
import torch
from drivers import driver_params, open_driver_kind

from kvvmm import (
    ArgumentError,
    Chunked,
    DriverError,
    DriverOutOfMemoryError,
    Exact,
    Fault,
    FaultyDriver,
    Geometric,
    KvBufferOwner,
    SimDriver,
    mha_token_major,
)
from kvvmm.arena.reclaim import HeldMemoryReleaser
from kvvmm.driver.base import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, Driver
from kvvmm.driver.host import HostDriver
from kvvmm.policy import default_policy
from kvvmm.units import GiB, MiB

ERRORS = [CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_VALUE]
PAGE = 16
RESERVED = 36_000
G = 2 << 20  # the GPU's and the simulator's granularity
#: The host driver's granularity here: an eighth of the GPU's, with an eighth of the bytes
#: per token (HEAD_DIM), so every buffer has the same granules, mappings, holes and driver
#: calls as on 2 MiB granules, and an eighth of the bytes to write, copy and compare (on
#: 2 MiB granules the host rows took over 5 minutes of CI's 2 cores).
HOST_SCALE = 8
HEAD_DIM = {"host": 64 // HOST_SCALE}


def inner_driver(kind: str) -> Driver:
    """A fresh driver of ``kind`` (``sim``, ``host``, ``cuda-c``, ``cuda-python``); a CUDA
    kind skips the test where it cannot open, or where torch cannot read the GPU's bytes."""
    if kind == "sim":
        return SimDriver("h200")
    if kind == "host":
        return HostDriver(capacity_bytes=2 * GiB, granularity=G // HOST_SCALE)
    with pytest.MonkeyPatch.context() as mp:  # the path is read once, when the driver is made
        d = open_driver_kind(kind, mp)
    if not torch.cuda.is_available():
        d.close()
        pytest.skip("torch has no CUDA here: the bytes are read through torch")
    return d


def device_free_bytes(kind: str) -> int | None:
    """The GPU's free memory with torch's cache emptied (None off the GPU: there the
    driver's own accounting, ``stats().clean``, is all the memory there is)."""
    if not kind.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


#: Pages far past the ensured prefix (granules 6, 7 and 8 of each buffer): holes.
HOLE_PAGES = (1500, 1800, 2100)
#: Operations that start from an owner with HOLE_PAGES committed.
WITH_HOLES = {"decommit_range", "decommit_pages", "release_beyond", "decommit_slots"}
#: Operations that start from an owner asleep (its bytes in a host backup).
ASLEEP = {"wake", "wake_host"}
#: HOLE_PAGES as token-slot ranges, for the slot-range calls.
HOLE_SLOTS = [(p * PAGE, (p + 1) * PAGE) for p in HOLE_PAGES]


def make_owner(kind: str, policy: object, op: str = "") -> tuple[KvBufferOwner, FaultyDriver]:
    drv = FaultyDriver(inner_driver(kind))
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=HEAD_DIM.get(kind, 64),
                            reserved_tokens=RESERVED,
                            page_size=PAGE, dtype="bfloat16")
    # No retry after an out-of-memory create (on CUDA torch's cache would be emptied and the
    # create tried again, past the injected fault): the retry has rows of its own below.
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PAGE,
                          reserved_tokens=RESERVED, descs=descs, policy=policy,  # type: ignore[arg-type]
                          retry_on_oom=False)
    # Several mappings per buffer, so shrink and close have several calls to fail.
    for n in (3000, 9000, 17000):
        owner.ensure_prefix(n)
    if op in WITH_HOLES or op in ASLEEP or op.startswith("sleep"):
        owner.commit_pages(HOLE_PAGES)  # a sleep remembers holes and the prefix alike
    if op in ASLEEP:
        owner.sleep("host" if op == "wake_host" else None)
    return owner, drv


def _grow_each(owner: KvBufferOwner) -> int:
    # Arena level: every allocation three granules further, one transaction.
    snap, g = owner.arena.snapshot(), owner.arena.granularity
    return owner.arena.commit_many([(a.offset, min(a.backed_bytes + 3 * g, a.size_bytes))
                                    for a in snap.allocations])


def _trim_each(owner: KvBufferOwner) -> int:
    # Arena level: keep one granule of each allocation (its first mapping straddles it).
    snap, g = owner.arena.snapshot(), owner.arena.granularity
    return owner.arena.decommit_many([(a.offset, g) for a in snap.allocations])


def _range_each(owner: KvBufferOwner) -> int:
    # Arena level: back granules 8 and 9 ([14, 18) MiB on 2 MiB granules) of every
    # allocation, past a hole after the prefix.
    snap, g = owner.arena.snapshot(), owner.arena.granularity
    return owner.arena.commit_ranges([(a.offset, 7 * g, 2 * g) for a in snap.allocations])


def _unrange_each(owner: KvBufferOwner) -> int:
    # Arena level: from the second mapping of each allocation to its end: several runs
    # (the prefix's tail and the holes' pages), one unmap each.
    snap = owner.arena.snapshot()
    reqs = []
    for a in snap.allocations:
        ms = [m for m in snap.mappings if m.allocation == a.name]
        reqs.append((a.offset, ms[1].offset - a.offset, a.size_bytes - ms[1].offset + a.offset))
    return owner.arena.decommit_ranges(reqs)


OPS: dict[str, Callable[[KvBufferOwner], object]] = {
    "commit": _grow_each,
    "decommit": _trim_each,
    "ensure_prefix": lambda o: o.ensure_prefix(30_000),
    "finalize": lambda o: o.finalize(33_000),
    "shrink": lambda o: o.shrink(2_000),
    "close": lambda o: o.close(),
    "commit_range": _range_each,
    "decommit_range": _unrange_each,
    "commit_pages": lambda o: o.commit_pages(HOLE_PAGES),
    "decommit_pages": lambda o: o.decommit_pages(HOLE_PAGES),
    "release_beyond": lambda o: o.release_beyond(2_000),
    "commit_slots": lambda o: o.commit_slots([(24_000, 25_024), (28_800, 29_824)]),
    "decommit_slots": lambda o: o.decommit_slots(HOLE_SLOTS),
    # A failed sleep leaves the owner awake with its bytes; a failed wake leaves it
    # asleep, its backup intact (tests/arena/test_sleep.py checks the backup's bytes after it)
    "sleep": lambda o: o.sleep(),
    "sleep_host": lambda o: o.sleep("host"),
    "wake": lambda o: o.wake(),
    "wake_host": lambda o: o.wake(),
}
#: Operations whose releases come after every unmap succeeded (past the point of no return).
GIVING_BACK = {"decommit", "shrink", "close", "decommit_range", "decommit_pages",
               "release_beyond", "decommit_slots", "sleep", "sleep_host"}


# -- bytes: a pattern over every backed byte (host driver and GPU) -------------------------


def _backed_ranges(owner: KvBufferOwner) -> list[tuple[int, int]]:
    # One range per mapping: with holes, what is backed is not a prefix.
    snap = owner.arena.snapshot()
    return [(snap.base + m.offset, m.size_bytes) for m in snap.mappings]


def _view(owner: KvBufferOwner, va: int, size: int) -> torch.Tensor:
    """``size`` bytes at ``va``, no copy: host memory through ctypes, device memory through
    the arena's own tensor (DLPack)."""
    if owner.arena.driver.kind == "host":
        return torch.frombuffer((ctypes.c_uint8 * size).from_address(va), dtype=torch.uint8)
    return owner.arena.tensor(va - owner.arena.base, (size,), "uint8")


def _pattern(i: int, size: int, gran: int, device: torch.device) -> torch.Tensor:
    # One byte value per allocation, and each granule stamped with (allocation, granule) in
    # its first 8 bytes: a handle mapped back at the wrong place, or fresh zeros, differ.
    p = torch.full((size,), (i * 37 + 11) % 251, dtype=torch.uint8)
    stamps = torch.arange(size // gran, dtype=torch.int64) + (i << 32)
    p.view(torch.int64)[:: gran // 8] = stamps
    return p.to(device)


def write_pattern(owner: KvBufferOwner) -> list[tuple[int, int]]:
    """Write the pattern over every backed byte (nothing on the simulator: no memory)."""
    if owner.arena.driver.kind == "sim":
        return []
    ranges = _backed_ranges(owner)
    for i, (va, size) in enumerate(ranges):
        view = _view(owner, va, size)
        view.copy_(_pattern(i, size, owner.arena.granularity, view.device))
    return ranges


def pattern_intact(owner: KvBufferOwner, ranges: list[tuple[int, int]],
                   keep: dict[int, int] | None = None) -> bool:
    """Every byte written is still there (only the first ``keep[va]`` bytes, if given)."""
    for i, (va, size) in enumerate(ranges):
        n = size if keep is None else min(size, keep.get(va, 0))
        if n:
            view = _view(owner, va, n)
            if not torch.equal(view, _pattern(i, size, owner.arena.granularity,
                                              view.device)[:n]):
                return False
    return True


# -- the matrix ------------------------------------------------------------------------


def same_as_done(snap: object, done: object) -> bool:
    """Equal snapshots up to the reservation's address (``done`` came from another driver:
    on the host driver mmap may place the reservation elsewhere)."""
    import dataclasses

    from kvvmm.snapshot import OwnerSnapshot

    assert isinstance(snap, OwnerSnapshot) and isinstance(done, OwnerSnapshot)
    return dataclasses.replace(snap, arena=dataclasses.replace(snap.arena, base=0)) == \
        dataclasses.replace(done, arena=dataclasses.replace(done.arena, base=0))


def count_calls(kind: str, op: str, policy: object) -> tuple[list[str], object]:
    """The driver calls ``op`` makes, and the owner's snapshot after it succeeded."""
    owner, drv = make_owner(kind, policy, op)
    # The bytes' own work once, before the matrix reads the GPU's free memory: torch loads
    # the kernels that write and compare the pattern lazily, ~100 MiB of device memory at the
    # first use in a process, which is no leak of kvvmm's.
    assert pattern_intact(owner, write_pattern(owner))
    before = len(drv.calls)
    OPS[op](owner)
    calls, after = drv.calls[before:], owner.snapshot()
    owner.close()
    assert drv.stats().clean
    drv.inner.close()  # type: ignore[attr-defined]
    return calls, after


def _case(kind: str, policy: object, name: str) -> object:
    (param,) = driver_params((kind,))  # its marks: cuda for the CUDA kinds, Linux for host
    return pytest.param(kind, policy, marks=param.marks, id=f"{kind}-{name}")


# Every policy on the sim; on the host driver (real bytes, slower) the two that shape the
# mappings most differently: one handle per extension, and the default's doubling handles
# (its sizes an eighth, as the host's granules: HOST_SCALE);
# on the GPU, the C path with one handle per extension and with 8 MiB chunks (what the GPU
# twin of this matrix ran), the Python path with the first.
CASES = [_case("sim", Exact(), "exact"),
         _case("sim", Chunked(8 << 20), "chunked"),
         _case("sim", default_policy(), "default"),
         _case("host", Exact(), "exact"),
         _case("host", Geometric(2.0, 256 * MiB // HOST_SCALE, 8 * MiB // HOST_SCALE),
               "default"),
         _case("cuda-c", Exact(), "exact"),
         _case("cuda-c", Chunked(8 << 20), "chunked"),
         _case("cuda-python", Exact(), "exact")]


@pytest.mark.parametrize(("kind", "policy"), CASES)
@pytest.mark.parametrize("op", list(OPS))
def test_a_failure_at_any_call_leaves_nothing_leaked_every_byte_and_the_snapshot_as_they_were(
    kind: str, op: str, policy: object
) -> None:
    calls, done = count_calls(kind, op, policy)
    free0 = device_free_bytes(kind)
    assert len(calls) >= 2, f"{op} made too few calls to test: {calls}"
    if op in GIVING_BACK:  # unmap everything first, release after
        assert calls.index("release") > max(i for i, c in enumerate(calls) if c == "unmap")
    for pos, call in enumerate(calls, start=1):
        for error in ERRORS:
            owner, drv = make_owner(kind, policy, op)
            snap, held = owner.snapshot(), drv.stats()
            ranges = write_pattern(owner)
            drv.arm(Fault("*", nth=pos, error=error))
            with pytest.raises(DriverError) as info:
                OPS[op](owner)
            err = info.value
            where = f"{op}: call {pos}/{len(calls)} ({call}) failing with {error}"
            assert err.call == call, where
            assert err.cuda_error == error, where
            assert str(err).startswith(f"{call}("), where
            assert isinstance(err, DriverOutOfMemoryError) == (error == CUDA_ERROR_OUT_OF_MEMORY)
            drv.disarm()
            if call == "release" and op in GIVING_BACK:
                # Past the point of no return: the VA no longer reaches the handle. The
                # operation stands, the arena keeps the handles it could not release.
                assert drv.stats().handles > 0, where
                if op == "close":
                    assert owner.arena.released, where
                else:
                    assert same_as_done(owner.snapshot(), done), where
                    assert owner.arena.unreleased_bytes > 0, where
                    assert any("close again" in n for n in err.__notes__), where
                    after = owner.snapshot().arena
                    kept = {after.base + m.offset: m.size_bytes for m in after.mappings}
                    assert pattern_intact(owner, ranges, kept), where
            else:
                assert owner.snapshot() == snap, where
                assert drv.stats() == held, where
                assert not getattr(err, "__notes__", []), f"{where}: the undo failed too"
                assert not owner.closed, where
                assert pattern_intact(owner, ranges), \
                    f"{where}: bytes changed under a failed call"
                OPS[op](owner)  # the same operation now succeeds
                assert same_as_done(owner.snapshot(), done), where
            owner.close()
            assert drv.stats().clean, where
            drv.inner.close()  # type: ignore[attr-defined]
    if free0 is not None:  # the GPU got its memory back
        free = device_free_bytes(kind)
        assert free is not None and abs(free - free0) <= G, (free0, free)


def test_a_failed_finalize_keeps_the_bytes_already_written_on_the_host_driver() -> None:
    owner, drv = make_owner("host", Exact())
    for i, t in enumerate(owner.tensors):
        t[:17000].fill_(i + 1)
    drv.arm(Fault("set_access", nth=2))
    with pytest.raises(DriverError, match="set_access"):
        owner.finalize(33_000)
    for i, t in enumerate(owner.tensors):
        assert bool((t[:17000] == i + 1).all())
    owner.close()


def test_a_shrink_whose_second_unmap_fails_keeps_every_byte_of_every_buffer() -> None:
    # Buffer 0's range was unmapped before the failure and used to come
    # back with fresh memory (zeros under a prefix the owner still reported). Now the same
    # handles are mapped back: every byte of every buffer is as written.
    owner, drv = make_owner("host", Exact())
    for i, t in enumerate(owner.tensors):
        t[:17000].fill_(i + 1)
    drv.arm(Fault("unmap", nth=2))
    with pytest.raises(DriverError, match="unmap"):
        owner.shrink(2_000)
    for i, t in enumerate(owner.tensors):
        assert bool((t[:17000] == i + 1).all())
    drv.disarm()
    owner.shrink(2_000)
    for i, t in enumerate(owner.tensors):
        assert bool((t[:2000] == i + 1).all())
    owner.close()


class _Boom(Exception):
    """Not a DriverError: what a driver bug, an OSError or a KeyboardInterrupt looks like."""


def test_a_commit_interrupted_by_any_exception_is_undone() -> None:
    # Review finding: only DriverError used to unwind a commit; an OSError (the host
    # driver's memfd_create out of descriptors) left handles behind with no id.
    inner = SimDriver("h200")

    class Flaky(FaultyDriver):
        def set_access(self, va: int, size: int, devices: object = None) -> None:
            if len([c for c in self.calls if c == "set_access"]) >= 2:
                raise _Boom("interrupted")
            super().set_access(va, size)

    drv = Flaky(inner)
    from kvvmm import Arena

    arena = Arena(drv, reserve_bytes=64 << 20)
    offs = [arena.allocate(8 << 20, f"b{i}") for i in range(4)]
    before = arena.snapshot()
    with pytest.raises(_Boom):
        arena.commit_many([(o, 8 << 20) for o in offs])
    assert arena.snapshot() == before
    assert inner.stats().handles == 0 and inner.stats().mappings == 0
    arena.close()
    assert inner.stats().clean


def test_a_policy_that_answers_short_of_the_span_is_refused_before_any_commit() -> None:
    class Short:
        def target_bytes(self, backed: int, need: int, limit: int, gran: int) -> int:
            return backed + gran  # less than asked

    drv = SimDriver("h200")
    descs = mha_token_major(layers=1, kv_heads=8, head_dim=128, reserved_tokens=100_000,
                            page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=100_000,
                          descs=descs, policy=Short())  # type: ignore[arg-type]
    snap = owner.snapshot()
    with pytest.raises(ArgumentError, match="policy"):
        owner.ensure_prefix(50_000)
    assert owner.snapshot() == snap
    owner.close()


def test_a_tensor_alive_at_interpreter_exit_is_not_unmapped_under_it() -> None:
    # Review finding: weakref.finalize's atexit hook tore a closed arena down at exit while
    # a tensor was still reachable from a later exit hook (segfault on the host driver).
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import atexit
        hook = []
        atexit.register(lambda: hook[0]())  # runs after weakref's own exit hook
        from kvvmm.arena import Arena
        from kvvmm.driver.host import HostDriver
        G = 2 << 20
        d = HostDriver(capacity_bytes=1 << 30)
        a = Arena(d, reserve_bytes=4 * G)
        o = a.allocate(G, "x")
        a.commit(o, G)
        t = a.tensor(o, (16,), "float32")
        t.fill_(1.0)
        hook.append(lambda: print("at exit:", float(t.sum()), flush=True))
        a.close()  # deferred: t is alive
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "at exit: 16.0" in proc.stdout


def test_two_threads_allocating_never_get_the_same_offset() -> None:
    # Review finding: torch's pool callbacks and finalizers reach an arena from any thread.
    import sys
    import threading

    from kvvmm import Arena

    g = 2 << 20
    arena = Arena(SimDriver("h200"), reserve_bytes=20_000 * g)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=lambda t=t: [arena.allocate(g, f"{t}{i}")
                                                        for i in range(5000)])
                   for t in "ab"]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old)
    snap = arena.snapshot()
    assert len({a.offset for a in snap.allocations}) == 10_000
    snap.check()
    arena.close()


# -- a commit retried after a cache released its memory ---------------------------------------


class _LateCache:
    """The cache releaser of an owner whose memory a fake cache fills after slot 0."""

    cache: HeldMemoryReleaser | None = None
    calls = 0

    def release_cached(self, need_bytes: int) -> int:
        self.calls += 1
        return 0 if self.cache is None else self.cache.release_cached(need_bytes)


RETRIED: dict[str, Callable[[KvBufferOwner], object]] = {
    "ensure_prefix": lambda o: o.ensure_prefix(30_000),
    "commit_pages": lambda o: o.commit_pages(HOLE_PAGES),
    "commit_slots": lambda o: o.commit_slots([(24_000, 25_024), (28_800, 29_824)]),
    "wake": lambda o: o.wake(),
}
CAPACITY = 64 << 20


def _full_owner(kind: str, op: str) -> tuple[KvBufferOwner, FaultyDriver, _LateCache]:
    inner: Driver = (SimDriver("h200", capacity_bytes=CAPACITY) if kind == "sim"
                     else HostDriver(capacity_bytes=CAPACITY))
    drv = FaultyDriver(inner)
    late = _LateCache()
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=RESERVED,
                            page_size=PAGE, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PAGE,
                          reserved_tokens=RESERVED, descs=descs, policy=Exact(),
                          cache_releaser=late)
    for n in (3000, 9000, 17000):
        owner.ensure_prefix(n)
    if op == "wake":
        owner.sleep()
    # The cache takes all the memory left, on the inner driver (its calls are not the op's).
    late.cache = HeldMemoryReleaser(inner, CAPACITY - inner.stats().physical_bytes)
    return owner, drv, late


def _holds_only_what_is_mapped_and_cached(owner: KvBufferOwner, drv: FaultyDriver,
                                          late: _LateCache) -> bool:
    """Nothing leaked: the driver holds the owner's mappings and the cache's handles."""
    snap, st = owner.snapshot().arena, drv.stats()
    assert late.cache is not None
    cached = late.cache.held_bytes
    return (st.handles == len(snap.mappings) + cached // G
            and st.physical_bytes == snap.backed_bytes + cached)


@pytest.mark.parametrize("kind", [p for p in driver_params(("sim", "host"))])
@pytest.mark.parametrize("op", list(RETRIED))
def test_a_failure_at_any_call_of_a_commit_retried_after_the_cache_released_is_undone(
    kind: str, op: str
) -> None:
    owner, drv, late = _full_owner(kind, op)
    before = len(drv.calls)
    RETRIED[op](owner)  # the first create runs out, the cache releases, the create again
    calls, done = drv.calls[before:], owner.snapshot()
    assert late.calls == 1 and done.arena.oom_retries == 1
    assert calls[:2] == ["create", "create"], calls
    owner.close()
    assert late.cache is not None and late.cache.close() == 0
    assert drv.stats().clean
    for pos, call in enumerate(calls, start=1):
        for error in ERRORS:
            owner, drv, late = _full_owner(kind, op)
            snap = owner.snapshot()
            drv.arm(Fault("*", nth=pos, error=error))
            where = f"{op}: call {pos}/{len(calls)} ({call}) failing with {error}"
            failed = True
            try:
                RETRIED[op](owner)
                failed = False
            except DriverError as err:
                assert err.call == call, where
                assert owner.snapshot().arena.mappings == snap.arena.mappings, where
                assert owner.snapshot().arena.asleep_bytes == snap.arena.asleep_bytes, where
                assert _holds_only_what_is_mapped_and_cached(owner, drv, late), where
                # once per create that ran out (the first, and an injected one), never a loop
                assert late.calls <= 1 + (call == "create" and error == CUDA_ERROR_OUT_OF_MEMORY)
            else:  # only an out-of-memory create that the release and the retry covered
                assert pos <= 2 and error == CUDA_ERROR_OUT_OF_MEMORY, where
                assert late.calls == 1, where
                assert owner.snapshot().arena.mappings == done.arena.mappings, where
            drv.disarm()
            if failed:
                RETRIED[op](owner)  # the same operation now succeeds
            assert owner.snapshot().arena.mappings == done.arena.mappings, where
            assert late.calls <= 2, where  # the redo asks only if nothing was released yet
            owner.close()
            assert late.cache is not None
            late.cache.close()
            assert drv.stats().clean, where

"""A commit that runs out of memory while a cache holds free memory: released, tried once more.

On the simulator and the host driver a :class:`HeldMemoryReleaser` stands in for torch's
cache (handles nobody maps, released on request); tests/gpu/test_gpu_captures.py runs the
same with torch's real cache on CUDA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from kvvmm import Arena, ArgumentError, DriverOutOfMemoryError, KvBufferOwner, SimDriver
from kvvmm import mha_token_major as mha
from kvvmm.arena.reclaim import (
    HeldMemoryReleaser,
    ReclaimStats,
    TorchAllocatorCap,
    TorchCacheReleaser,
    releaser_for,
)
from kvvmm.driver.base import Driver
from kvvmm.driver.host import HostDriver
from kvvmm.errors import OutOfRangeError
from kvvmm.units import MiB

G = 2 * MiB
CAPACITY = 64 * MiB


def _driver(kind: str) -> Driver:
    if kind == "sim":
        return SimDriver("h200", capacity_bytes=CAPACITY)
    return HostDriver(capacity_bytes=CAPACITY)


KINDS = [pytest.param("sim"), pytest.param("host", marks=pytest.mark.skipif(
    not hasattr(__import__("os"), "memfd_create"), reason="host driver: Linux only"))]


def _full(kind: str, free_bytes: int = 0) -> tuple[Driver, HeldMemoryReleaser]:
    """A driver whose memory a fake cache holds, all but ``free_bytes``."""
    d = _driver(kind)
    return d, HeldMemoryReleaser(d, CAPACITY - free_bytes)


class Lying:
    """A releaser that says it freed memory and freed nothing."""

    def __init__(self) -> None:
        self.calls = 0

    def release_cached(self, need_bytes: int) -> int:
        self.calls += 1
        return need_bytes


@pytest.mark.parametrize("kind", KINDS)
def test_a_commit_that_needs_the_cached_memory_succeeds_after_one_release(kind: str) -> None:
    d, cache = _full(kind)
    arena = Arena(d, reserve_bytes=32 * MiB, cache_releaser=cache)
    off = arena.allocate(16 * MiB)
    assert arena.commit(off, 16 * MiB) == 16 * MiB
    assert cache.calls == 1 and cache.held_bytes == 0
    assert arena.reclaim_stats == ReclaimStats(releases=1, released_bytes=CAPACITY, retries=1)
    assert arena.snapshot().oom_retries == 1
    arena.close()
    assert d.stats().clean


@pytest.mark.parametrize("kind", KINDS)
def test_with_the_retry_opted_out_the_commit_fails_as_before(kind: str) -> None:
    d, cache = _full(kind)
    arena = Arena(d, reserve_bytes=32 * MiB, cache_releaser=cache, retry_on_oom=False)
    off = arena.allocate(16 * MiB)
    before = arena.snapshot()
    with pytest.raises(DriverOutOfMemoryError):
        arena.commit(off, 16 * MiB)
    assert cache.calls == 0 and cache.held_bytes == CAPACITY
    assert arena.snapshot() == before and arena.reclaim_stats == ReclaimStats()
    arena.close()
    cache.close()
    assert d.stats().clean


@pytest.mark.parametrize("kind", KINDS)
def test_the_retry_happens_once_and_its_failure_undoes_the_whole_commit(kind: str) -> None:
    # Room for the first allocation's handle, none for the second: the second's create runs
    # out, the releaser (which frees nothing) is asked once, the create tried once more, and
    # the first allocation's mapping is undone with it.
    d, cache = _full(kind, free_bytes=4 * MiB)
    liar = Lying()
    arena = Arena(d, reserve_bytes=32 * MiB, cache_releaser=liar)
    a, b = arena.allocate(4 * MiB), arena.allocate(4 * MiB)
    before, held = arena.snapshot(), d.stats()
    with pytest.raises(DriverOutOfMemoryError) as info:
        arena.commit_many([(a, 4 * MiB), (b, 4 * MiB)])
    assert liar.calls == 1
    assert any("tried once more" in n for n in info.value.__notes__)
    assert arena.reclaim_stats == ReclaimStats(releases=1, released_bytes=4 * MiB, retries=1,
                                               retries_failed=1)
    assert arena.snapshot() == dataclasses.replace(before, oom_retries=1)
    assert d.stats() == held
    arena.close()
    cache.close()
    assert d.stats().clean


@pytest.mark.parametrize("kind", KINDS)
def test_a_releaser_that_frees_nothing_brings_no_retry(kind: str) -> None:
    d, cache = _full(kind)

    class Nothing:
        calls = 0

        def release_cached(self, need_bytes: int) -> int:
            Nothing.calls += 1
            return 0

    arena = Arena(d, reserve_bytes=32 * MiB, cache_releaser=Nothing())
    off = arena.allocate(4 * MiB)
    with pytest.raises(DriverOutOfMemoryError):
        arena.commit(off, 4 * MiB)
    assert Nothing.calls == 1
    assert arena.reclaim_stats == ReclaimStats(releases=1)
    arena.close()
    cache.close()
    assert d.stats().clean


class Later:
    """A releaser whose cache is filled after the owner made its slot 0."""

    cache: HeldMemoryReleaser | None = None

    def release_cached(self, need_bytes: int) -> int:
        return 0 if self.cache is None else self.cache.release_cached(need_bytes)


def _owner(d: Driver, cache: Later | None, **kw: object) -> KvBufferOwner:
    descs = mha(layers=1, kv_heads=4, head_dim=64, reserved_tokens=36_000, page_size=16,
                dtype="bfloat16")
    return KvBufferOwner(driver=d, dtype="bfloat16", page_size=16, reserved_tokens=36_000,
                         descs=descs, cache_releaser=cache, **kw)  # type: ignore[arg-type]


OWNER_COMMITS: dict[str, Callable[[KvBufferOwner], object]] = {
    "ensure_prefix": lambda o: o.ensure_prefix(20_000),
    "finalize": lambda o: o.finalize(20_000),
    "commit_pages": lambda o: o.commit_pages([1500, 1800]),
    "commit_slots": lambda o: o.commit_slots([(24_000, 25_024)]),
    "wake": lambda o: o.wake(),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", list(OWNER_COMMITS))
def test_every_owner_commit_path_gets_the_retry(kind: str, op: str) -> None:
    d = _driver(kind)
    later = Later()
    owner = _owner(d, later)
    if op == "wake":
        owner.ensure_prefix(9_000)
        owner.sleep()
    later.cache = cache = HeldMemoryReleaser(d, CAPACITY - d.stats().physical_bytes)
    OWNER_COMMITS[op](owner)
    assert cache.calls == 1
    assert owner.snapshot().arena.oom_retries == 1
    owner.close()
    assert d.stats().clean


@pytest.mark.parametrize("kind", KINDS)
def test_an_owner_that_opts_out_fails_its_growth_and_keeps_its_state(kind: str) -> None:
    d = _driver(kind)
    owner = _owner(d, None, retry_on_oom=False)
    cache = HeldMemoryReleaser(d, CAPACITY - d.stats().physical_bytes)
    snap = owner.snapshot()
    with pytest.raises(DriverOutOfMemoryError):
        owner.ensure_prefix(20_000)
    assert owner.snapshot() == snap and cache.calls == 0
    owner.close()
    cache.close()
    assert d.stats().clean


def test_the_default_releaser_is_torch_s_cache_on_device_memory_only() -> None:
    d = SimDriver("h200")
    assert releaser_for(d, None, True) is None  # the simulator shares no cache with torch

    class Device:
        memory = __import__("kvvmm.driver.base", fromlist=["MemoryKind"]).MemoryKind.DEVICE
        device = 3

    r = releaser_for(Device(), None, True)  # type: ignore[arg-type]
    assert isinstance(r, TorchCacheReleaser) and r.device == 3
    assert releaser_for(Device(), None, False) is None  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="cache_releaser"):
        Arena(d, reserve_bytes=G, cache_releaser=object())  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="retry_on_oom"):
        Arena(d, reserve_bytes=G, retry_on_oom=1)  # type: ignore[arg-type]
    assert d.stats().clean


def test_torch_s_releaser_frees_nothing_where_torch_has_not_initialised_cuda() -> None:
    import torch

    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process")
    assert TorchCacheReleaser(0).release_cached(G) == 0


def test_the_torch_cap_follows_the_kv_budget_and_refuses_one_that_leaves_torch_nothing() -> None:
    set_calls: list[tuple[float, int]] = []
    cap = TorchAllocatorCap(1, total_bytes=100 * G, headroom_bytes=10 * G,
                            set_fraction=lambda f, dev: set_calls.append((f, dev)))
    assert cap.follow(40 * G) == pytest.approx(0.5)
    assert cap.follow(60 * G) == pytest.approx(0.3)  # the budget grew: torch gets less
    assert set_calls == [(pytest.approx(0.5), 1), (pytest.approx(0.3), 1)]
    with pytest.raises(OutOfRangeError, match="kv_bytes"):
        cap.follow(90 * G)
    assert len(set_calls) == 2 and cap.fraction == pytest.approx(0.3)
    with pytest.raises(ArgumentError, match="headroom_bytes"):
        TorchAllocatorCap(0, total_bytes=G, headroom_bytes=-1)

"""What was captured over an owner's buffers refuses every operation that would unmap it.

Every operation that moves or removes mapped memory (a shrink, ``release_beyond``, page and
slot decommits, a request range given back, the arena's decommits, a sleep, a close) is run
under a live capture on the simulator and the host driver: refused before any driver call,
naming the capture, nothing changed; after the release it goes through. Growth past the
capture is allowed unless its capacity is fixed. tests/gpu/test_gpu_captures.py captures a
real CUDA graph.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from kvvmm import (
    ArgumentError,
    CaptureConflictError,
    FaultyDriver,
    KvBufferOwner,
    SimDriver,
    mha_token_major,
)
from kvvmm.driver.host import HostDriver
from kvvmm.owner.elastic import RangeBacking
from kvvmm.units import GiB

PAGE = 16
RESERVED = 36_000
HOLES = (1500, 1800)  # pages far past the prefix
G = 2 << 20

KINDS = [pytest.param("sim"), pytest.param("host", marks=pytest.mark.skipif(
    not hasattr(os, "memfd_create"), reason="host driver: Linux only"))]


def make_owner(kind: str, pages: bool = True) -> tuple[KvBufferOwner, FaultyDriver]:
    inner = SimDriver("h200") if kind == "sim" else HostDriver(capacity_bytes=2 * GiB)
    drv = FaultyDriver(inner)
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=RESERVED,
                            page_size=PAGE, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PAGE,
                          reserved_tokens=RESERVED, descs=descs)
    owner.ensure_prefix(9000)
    if pages:
        owner.commit_pages(HOLES)
    return owner, drv


def _arena_decommit(o: KvBufferOwner) -> object:
    snap = o.arena.snapshot()
    return o.arena.decommit_many([(a.offset, G) for a in snap.allocations])


def _arena_decommit_range(o: KvBufferOwner) -> object:
    snap = o.arena.snapshot()
    return o.arena.decommit_ranges([(a.offset, G, a.size_bytes - G) for a in snap.allocations])


#: Every operation that unmaps memory the capture covers.
UNMAPS: dict[str, Callable[[KvBufferOwner], object]] = {
    "shrink": lambda o: o.shrink(2_000),
    "release_beyond": lambda o: o.release_beyond(2_000),
    "decommit_pages": lambda o: o.decommit_pages(HOLES),
    "decommit_slots": lambda o: o.decommit_slots([(p * PAGE, (p + 1) * PAGE) for p in HOLES]),
    "arena_decommit": _arena_decommit,
    "arena_decommit_range": _arena_decommit_range,
    "sleep": lambda o: o.sleep(),
    "sleep_host": lambda o: o.sleep("host"),
    "close": lambda o: o.close(),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", list(UNMAPS))
def test_an_unmap_under_a_live_capture_is_refused_naming_it_and_changes_nothing(
    kind: str, op: str
) -> None:
    owner, drv = make_owner(kind)
    snap, held, calls = owner.snapshot(), drv.stats(), len(drv.calls)
    with owner.capturing("decode-bs8") as cap:
        with pytest.raises(CaptureConflictError, match="decode-bs8") as info:
            UNMAPS[op](owner)
        assert info.value.capture == "decode-bs8"
        assert len(drv.calls) == calls, "refused after a driver call"
        assert owner.snapshot().arena.captures == ("decode-bs8",)
        assert owner.arena.captures == (cap,) and cap.live
        assert not owner.closed and not owner.asleep
    assert owner.snapshot() == snap and drv.stats() == held
    assert not cap.live and owner.arena.captures == ()
    UNMAPS[op](owner)  # released: the same operation goes through
    owner.close()
    assert drv.stats().clean


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_range_given_back_under_a_capture_is_refused_and_stays_cached(
    kind: str
) -> None:
    owner, drv = make_owner(kind, pages=False)
    owner.shrink(PAGE)  # slot 0 only: a RangeBacking leases every other page
    upkeep: list[Callable[[], object]] = []  # the backing thread's queue, run by hand
    backing = RangeBacking(owner, executor=lambda job, waited: upkeep.append(job))
    lease = backing.admit(4096)
    while upkeep:
        upkeep.pop(0)()
    assert lease.ready
    cap = owner.record_capture("nccl:kv")  # registered over the request's range
    backing.release(lease)
    assert backing.stats().cached_bytes > 0
    cached, backed = backing.stats(), owner.backed_bytes
    with pytest.raises(CaptureConflictError, match="nccl:kv"):
        backing.reclaim(0)
    assert backing.stats() == cached and owner.backed_bytes == backed
    owner.release_capture(cap)
    assert backing.reclaim(0) > 0
    backing.close()
    owner.close()
    assert drv.stats().clean


@pytest.mark.parametrize("kind", KINDS)
def test_unmapping_memory_grown_after_the_capture_is_allowed(kind: str) -> None:
    owner, drv = make_owner(kind)
    end = max(m.offset + m.size_bytes for m in owner.arena.snapshot().mappings
              if m.allocation == "k0")  # 16 MiB: the hole page 1800's granule
    with owner.capturing("decode-bs8"):
        owner.ensure_prefix(33_000)  # growth past what the graph baked in
        assert owner.release_beyond(end // 512) == 2 * G  # only what grew after it
        with pytest.raises(CaptureConflictError):
            owner.release_beyond(2_000)
    owner.close()
    assert drv.stats().clean


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grow", ["ensure_prefix", "commit_pages", "commit_slots"])
def test_a_fixed_capacity_refuses_growth_past_it_but_not_inside_it(kind: str,
                                                                    grow: str) -> None:
    owner, drv = make_owner(kind)
    snap, calls = owner.snapshot(), len(drv.calls)
    ops: dict[str, Callable[[], object]] = {
        "ensure_prefix": lambda: owner.ensure_prefix(33_000),
        "commit_pages": lambda: owner.commit_pages([2100]),
        "commit_slots": lambda: owner.commit_slots([(2100 * PAGE, 2101 * PAGE)]),
    }
    with owner.capturing("prefill-graph", fixed_capacity=True):
        with pytest.raises(CaptureConflictError, match=r"prefill-graph.*fixed capacity"):
            ops[grow]()
        assert owner.snapshot().arena.mappings == snap.arena.mappings
        assert len(drv.calls) == calls
        owner.commit_pages([800])  # a hole inside the captured extent: no growth
    ops[grow]()
    owner.close()
    assert drv.stats().clean


@pytest.mark.parametrize("kind", KINDS)
def test_a_capture_that_survives_sleep_lets_the_sleep_through_but_not_a_shrink(
    kind: str
) -> None:
    owner, drv = make_owner(kind)
    with owner.capturing("decode-bs8", survives_sleep=True):
        owner.sleep("host")
        owner.wake()
        with pytest.raises(CaptureConflictError):
            owner.shrink(2_000)
    owner.close()
    assert drv.stats().clean


@pytest.mark.parametrize("kind", KINDS)
def test_a_consumer_that_re_registers_lets_the_operation_through(kind: str) -> None:
    owner, drv = make_owner(kind)
    seen: list[tuple[str, int]] = []

    def narrow(cap: object, op: str, spans: tuple[tuple[int, int], ...]) -> list[
            tuple[int, int]]:
        # An NCCL registration: deregister, keep only what the shrink leaves.
        seen.append((op, len(spans)))
        assert cap is reg
        lo = min(s for s, _ in spans)
        return [(a, min(b, lo)) for a, b in reg.ranges if a < lo]

    reg = owner.record_capture("nccl:kv", on_conflict=narrow)
    owner.release_beyond(2_000)
    assert seen and seen[0][0] == "decommit"
    assert reg.live and all(b <= min(s for s, _ in reg.ranges) + 8 * G for _, b in reg.ranges)
    owner.release_capture(reg)
    owner.close()
    assert drv.stats().clean


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("answer", ["refuse", "drop", "same"])
def test_a_consumer_that_cannot_re_register_keeps_the_refusal(kind: str, answer: str) -> None:
    owner, drv = make_owner(kind)
    ranges = {"refuse": None, "drop": [], "same": "same"}[answer]

    def hook(cap: object, op: str, spans: object) -> object:
        return reg.ranges if ranges == "same" else ranges

    reg = owner.record_capture("rdma:kv", on_conflict=hook)  # type: ignore[arg-type]
    if answer == "drop":  # it ends its registration: the shrink goes through
        owner.shrink(2_000)
        assert not reg.live and owner.arena.captures == ()
    else:
        snap = owner.snapshot()
        with pytest.raises(CaptureConflictError, match="rdma:kv"):
            owner.shrink(2_000)
        assert owner.snapshot() == snap
        owner.release_capture(reg)
    owner.close()
    assert drv.stats().clean


def test_only_the_owner_that_recorded_a_capture_may_release_it() -> None:
    owner, drv = make_owner("sim")
    other, odrv = make_owner("sim")
    cap = owner.record_capture("decode-bs8")
    with pytest.raises(ArgumentError, match="live capture of arena"):
        other.release_capture(cap)
    with pytest.raises(ArgumentError, match="recorded capture 'decode-bs8'"):
        owner.arena.release_capture(cap, by=other)
    with pytest.raises(ArgumentError, match="recorded capture"):
        owner.arena.release_capture(cap, by=None)
    assert cap.live
    owner.release_capture(cap)
    with pytest.raises(ArgumentError, match="live capture"):
        owner.release_capture(cap)  # released once
    for o, d in ((owner, drv), (other, odrv)):
        o.close()
        assert d.stats().clean


def test_the_context_manager_releases_on_an_error_and_keeps_the_capture_when_asked() -> None:
    owner, drv = make_owner("sim")
    with pytest.raises(RuntimeError), owner.capturing("failed-capture"):
        raise RuntimeError("capture failed")
    assert owner.arena.captures == ()
    with owner.capturing("decode-bs8", keep=True) as cap:
        pass
    assert cap.live  # a graph replayed after the block
    with pytest.raises(CaptureConflictError):
        owner.close()
    assert not owner.closed
    owner.release_capture(cap)
    owner.close()
    assert drv.stats().clean


@pytest.mark.parametrize(("kw", "match"), [
    ({"name": ""}, "name"),
    ({"name": 3}, "name"),
    ({"ranges": []}, "ranges"),
    ({"ranges": [(0, 1)]}, "ranges"),
    ({"ranges": "ab"}, "ranges"),
    ({"ranges": [(1, 1)]}, "ranges"),
    ({"fixed_capacity": 1}, "fixed_capacity"),
    ({"survives_sleep": "yes"}, "survives_sleep"),
    ({"on_conflict": 5}, "on_conflict"),
])
def test_a_bad_capture_is_refused_before_anything_is_recorded(kw: dict[str, object],
                                                              match: str) -> None:
    owner, drv = make_owner("sim")
    args: dict[str, object] = {"name": "g", **kw}
    if "ranges" in args and args["ranges"] == [(1, 1)]:
        args["ranges"] = [(owner.arena.base + 1, owner.arena.base + 1)]
    with pytest.raises(ArgumentError, match=match):
        owner.record_capture(**args)  # type: ignore[arg-type]
    assert owner.arena.captures == ()
    cap = owner.record_capture("g")
    with pytest.raises(ArgumentError, match="unique"):
        owner.record_capture("g")
    owner.release_capture(cap)
    owner.close()
    assert drv.stats().clean

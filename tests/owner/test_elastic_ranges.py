"""Request-granular elastic backing (0.3): the interleaved layout, slot ranges, SlotRanges,
RangeBacking, and the workload lab's range strategies. On the sim and host drivers."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvvmm import open_driver
from kvvmm.driver.faults import Fault, FaultyDriver
from kvvmm.driver.wrapper import DriverWrapper
from kvvmm.errors import ArgumentError, DriverError, KvvmmError, OutOfRangeError
from kvvmm.layout import (
    RangesFullError,
    SlotRanges,
    layer_interleaved,
    model_descs,
)
from kvvmm.owner import KvBufferOwner, RangeBacking, layer_views, paged_layer_views
from kvvmm.record import Trace, TracingDriver
from kvvmm.workload import generate, run_workload

G = 2 << 20


# -- SlotRanges: against a bitmap --------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_slot_ranges_agree_with_a_bitmap(seed: int) -> None:
    rng = random.Random(seed)
    units, first = 300, 1
    r = SlotRanges(units, first=first)
    used = [False] * units
    held: list[tuple[int, int]] = []
    for _ in range(600):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 40)
            free_runs = _runs(used, first)
            if not any(k >= n for _, k in free_runs):
                with pytest.raises(RangesFullError):
                    r.alloc(n)
                continue
            s = r.alloc(n)
            best = min(k for _, k in free_runs if k >= n)  # best fit: the smallest that holds n
            assert any(a == s and k == best for a, k in free_runs)
            assert not any(used[s:s + n])
            used[s:s + n] = [True] * n
            held.append((s, n))
        elif op < 0.55 and sum(not u for u in used[first:]) >= 5:
            pieces = r.alloc_pieces(5)
            assert sum(k for _, k in pieces) == 5
            for s, k in pieces:
                assert not any(used[s:s + k])
                used[s:s + k] = [True] * k
                held.append((s, k))
        elif op < 0.65 and held:
            i = rng.randrange(len(held))
            s, n = held[i]
            more = rng.randint(1, 5)
            grew = r.grow(s, n, more)
            assert grew == (s + n + more <= units and not any(used[s + n:s + n + more]))
            if grew:
                used[s + n:s + n + more] = [True] * more
                held[i] = (s, n + more)
        elif held:
            s, n = held.pop(rng.randrange(len(held)))
            r.free(s, n)
            used[s:s + n] = [False] * n
        assert r.free_units == sum(not u for u in used[first:])
        assert r.extents == _runs(used, first)  # freed neighbours always joined
    for s, n in held:
        r.free(s, n)
    assert r.extents == [(first, units - first)] and r.fragmentation == 0.0


def _runs(used: list[bool], first: int) -> list[tuple[int, int]]:
    out, i = [], first
    while i < len(used):
        if used[i]:
            i += 1
            continue
        j = i
        while j < len(used) and not used[j]:
            j += 1
        out.append((i, j - i))
        i = j
    return out


def test_slot_ranges_refuse_bad_input_and_double_free() -> None:
    r = SlotRanges(10, first=1)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ArgumentError):
            r.alloc(bad)  # type: ignore[arg-type]
    s = r.alloc(3)
    r.free(s, 3)
    with pytest.raises(ArgumentError, match="overlap"):
        r.free(s, 3)
    with pytest.raises(OutOfRangeError):
        r.free(8, 5)
    with pytest.raises(ArgumentError):
        r.take(0, 1)  # below first
    with pytest.raises(OutOfRangeError):
        SlotRanges(4, first=4)
    assert r.extents == [(1, 9)]


# -- the interleaved layout --------------------------------------------------------------


def test_layer_interleaved_shape_and_models() -> None:
    (d,) = layer_interleaved(layers=32, kv_heads=8, head_dim=128, reserved_tokens=1024,
                             page_size=16, dtype="bfloat16")
    assert d.shape == (1040, 32, 2, 8, 128) and d.row_bytes == 32 * 2 * 8 * 128 * 2
    assert d.tokens_per_row == 1
    (tp8,) = model_descs("llama-3.1-70b", layout="interleaved", reserved_tokens=1024,
                         page_size=16, dtype="bfloat16", tp=8)
    assert tp8.shape == (1040, 80, 2, 1, 128)
    # bytes per token agree with the per-layer layout's
    per_layer = model_descs("llama-3.1-70b", reserved_tokens=1024, page_size=16,
                            dtype="bfloat16", tp=8)
    assert sum(x.row_bytes for x in per_layer) == tp8.row_bytes
    with pytest.raises(ArgumentError, match="kv"):
        layer_interleaved(layers=2, kv_heads=1, head_dim=8, reserved_tokens=64, page_size=16,
                          dtype="bfloat16", kv=3)


def test_layer_views_read_and_write_the_owners_bytes_and_feed_sdpa() -> None:
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    descs = layer_interleaved(layers=4, kv_heads=2, head_dim=64, reserved_tokens=4096,
                              page_size=16, dtype="float32")
    with KvBufferOwner(driver=open_driver("host"), dtype="float32", page_size=16,
                       descs=descs) as owner:
        owner.finalize(1024)
        views = layer_views(owner)
        assert len(views) == 4 and views[2][1].shape == (4096 + 16, 2, 64)
        t = owner.tensors[0]
        for layer, (k, v) in enumerate(views):
            k[:1024].fill_(layer + 1)
            v[:1024].fill_(-(layer + 1))
        assert float(t[100, 3, 0, 1, 5]) == 4.0 and float(t[100, 3, 1, 0, 0]) == -4.0
        # a layer's strided views give what contiguous copies give
        q = torch.randn(1, 4, 1, 64)
        k, v = views[1]
        k[:1024].normal_()
        v[:1024].normal_()
        kk, vv = k[:1024].permute(1, 0, 2)[None], v[:1024].permute(1, 0, 2)[None]
        a = F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
        b = F.scaled_dot_product_attention(q, kk.contiguous(), vv.contiguous(), enable_gqa=True)
        assert torch.allclose(a, b)
        pk, _ = paged_layer_views(owner, 16)[1]
        assert pk.shape == (257, 16, 2, 64) and torch.equal(pk[3, 5], k[3 * 16 + 5])
        with pytest.raises(ArgumentError):
            paged_layer_views(owner, 7)
        del views, k, v, pk, kk, vv, t


# -- the owner's slot ranges -------------------------------------------------------------


def _xl_owner(driver: object, tokens: int = 64 * 1024) -> KvBufferOwner:
    descs = model_descs("llama-3.1-8b", layout="interleaved", reserved_tokens=tokens,
                        page_size=16, dtype="bfloat16")
    return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16,  # type: ignore[arg-type]
                         descs=descs)


def test_commit_slots_is_one_handle_per_range_and_decommit_gives_it_back() -> None:
    owner = _xl_owner(open_driver("sim", profile="h200"))
    assert owner.slot_block_tokens() == 16  # 16 slots x 128 KiB = one 2 MiB granule
    before = len(owner.arena.snapshot().mappings)
    assert owner.commit_slots([(16, 16 * 40), (16 * 40, 16 * 50), (16 * 100, 16 * 130)]) \
        == (49 + 30) * G
    snap = owner.arena.snapshot()
    assert len(snap.mappings) == before + 2  # touching ranges join: two handles
    assert owner.committed_pages == frozenset(range(1, 50)) | frozenset(range(100, 130))
    assert owner.decommit_slots([(16 * 100, 16 * 130)]) == 30 * G
    assert owner.decommit_slots([(16, 16 * 50)]) == 49 * G
    assert owner.backed_bytes == G and owner.committed_pages == frozenset()
    owner.close()


def test_decommit_slots_keeps_granules_a_committed_neighbour_shares() -> None:
    descs = model_descs("llama-3.1-70b", layout="interleaved", reserved_tokens=16 * 1024,
                        page_size=16, dtype="bfloat16", tp=8)  # 640 KiB pages: 3.2 a granule
    owner = KvBufferOwner(driver=open_driver("sim", profile="h200"), dtype="bfloat16",
                          page_size=16, descs=descs)
    assert owner.slot_block_tokens() == 256
    owner.commit_slots([(16 * 10, 16 * 20)])
    owner.commit_slots([(16 * 20, 16 * 30)])
    given = owner.decommit_slots([(16 * 10, 16 * 20)])
    # the granule holding pages 19 and 20 stays: page 20 is still committed
    for p in range(20, 30):
        assert p in owner.committed_pages
    lo = 20 * 16 * 40960 // G * G
    assert any(m.offset <= lo < m.offset + m.size_bytes for m in owner.arena.snapshot().mappings)
    assert given >= 0
    owner.close()


@pytest.mark.parametrize("bad", [[(1, 32)], [(0, 16)], [(32, 32)], [(16, 10 ** 9)],
                                 "ab", [(16,)], [(16.0, 32)], [(True, 32)]])
def test_slot_calls_refuse_bad_ranges_changing_nothing(bad: object) -> None:
    owner = _xl_owner(open_driver("sim", profile="h200"))
    snap = owner.arena.snapshot()
    with pytest.raises(ArgumentError):
        owner.decommit_slots(bad)  # type: ignore[arg-type]
    if bad != [(0, 16)]:
        with pytest.raises(ArgumentError):
            owner.commit_slots(bad)  # type: ignore[arg-type]
    assert owner.arena.snapshot() == snap
    owner.close()


# -- RangeBacking --------------------------------------------------------------------------


def _check(backing: RangeBacking, owner: KvBufferOwner, live: list) -> None:
    s = backing.stats()
    bb = backing.block_bytes
    total = (backing.blocks - backing.first) * bb
    assert s.leased_bytes + s.cached_bytes + s.fresh_bytes + \
        (s.pending_bytes if s.pending_bytes else 0) >= total - s.pending_bytes
    assert s.leased_bytes + s.cached_bytes + s.fresh_bytes == total - (
        s.pending_bytes - sum(bb * k for lease in live for p in lease._pend for k in [p[1]]))
    snap = owner.arena.snapshot()
    spans = [(m.offset - snap.allocations[0].offset, m.size_bytes) for m in snap.mappings]

    def mapped(a: int, b: int) -> bool:
        at = a
        for s0, n in sorted(spans):
            if s0 <= at < s0 + n:
                at = s0 + n
        return at >= b

    bt = backing.block_tokens
    row = owner.descs[0].row_bytes
    for lease in live:
        if lease.ready:
            for a, b in lease.slots:
                assert mapped(a * row, b * row), (lease, a, b)
    for start, n in backing._cached.extents:
        assert mapped(start * bt * row, (start + n) * bt * row)
    # what is backed is slot 0's granule and the units, nothing else
    assert owner.backed_bytes == G + sum(n for n in _units(backing).values()) * bb


@pytest.mark.parametrize("executor", ["inline", None])
@pytest.mark.parametrize("seed", range(3))
def test_range_backing_random_operations_keep_every_book_true(executor: object,
                                                               seed: int) -> None:
    rng = random.Random(seed)
    owner = _xl_owner(open_driver("sim", profile="h200"), tokens=16 * 600)
    backing = RangeBacking(owner, reserve_bytes=8 * G, high_bytes=24 * G,
                           executor=executor)  # type: ignore[arg-type]
    live: list = []
    try:
        for _ in range(300):
            op = rng.random()
            if op < 0.45:
                with contextlib.suppress(RangesFullError):
                    live.append(backing.admit(rng.randint(1, 16 * 60)))
            elif op < 0.6 and live:
                lease = rng.choice(live)
                with contextlib.suppress(RangesFullError):
                    backing.grow(lease, lease.tokens + rng.randint(1, 64))
            elif op < 0.95 and live:
                backing.release(live.pop(rng.randrange(len(live))))
            else:
                backing.drain()
                backing.reclaim(rng.choice([0, 4 * G]))
            if executor == "inline" or rng.random() < 0.2:
                backing.drain()
                for lease in live:
                    backing.wait(lease)
                _check(backing, owner, live)
        backing.drain()
        for lease in live:
            backing.wait(lease)
            backing.release(lease)
        backing.drain()
        backing.reclaim(0)
        assert owner.backed_bytes == G and backing.stats().units == 0
    finally:
        backing.close()
        owner.close()


def test_range_backing_admits_from_cache_without_driver_calls() -> None:
    tracer = TracingDriver(open_driver("sim", profile="h200"), Trace())
    owner = _xl_owner(tracer)
    upkeep: list = []  # the backing thread's queue, run by hand

    def executor(job: object, waited: bool) -> None:
        assert not waited  # nothing here waits: every lease comes from the cache
        upkeep.append(job)

    backing = RangeBacking(owner, reserve_bytes=64 * G, high_bytes=64 * G, executor=executor)
    upkeep.pop()()  # the reserve, mapped ahead
    n = len(tracer.trace.events)
    lease = backing.admit(16 * 30)  # 30 of the 64 cached blocks
    assert lease.ready and backing.stats().admits_ready == 1
    assert len(tracer.trace.events) == n  # no driver call on the admitting thread
    upkeep.pop()()  # the refill it queued: one handle
    assert [e.op for e in tracer.trace.events[n:]] == ["create", "map", "set_access"]
    backing.release(lease)  # 94 cached > 64: a reclamation queued, nothing done here
    assert len(upkeep) == 1 and len(tracer.trace.events) == n + 3
    upkeep.pop()()
    assert backing.stats().cached_bytes <= 64 * G
    backing.close()
    owner.close()


def test_a_failed_commit_fails_the_lease_and_leaks_nothing() -> None:
    drv = FaultyDriver(open_driver("sim", profile="h200"))
    owner = _xl_owner(drv)
    backing = RangeBacking(owner, executor="inline")  # no reserve: admit commits
    drv.arm([Fault("map", nth=1)])
    lease = backing.admit(16 * 20)
    assert not lease.ready and lease.error is not None
    with pytest.raises(DriverError):
        backing.wait(lease)
    assert owner.backed_bytes == G and owner.committed_pages == frozenset()
    backing.release(lease)
    s = backing.stats()
    assert s.cached_bytes == 0 and s.leased_bytes == 0 and s.units == 0
    ok = backing.admit(16 * 20)
    assert ok.ready and owner.backed_bytes == G + 20 * G
    backing.close()
    owner.close()


def test_an_admit_or_grow_the_free_blocks_cannot_hold_changes_nothing() -> None:
    owner = _xl_owner(open_driver("sim", profile="h200"), tokens=16 * 64)
    backing = RangeBacking(owner, executor="inline")
    lease = backing.admit(16 * 40)
    before = backing.stats()
    with pytest.raises(RangesFullError, match="tokens=1600"):
        backing.admit(16 * 100)
    with pytest.raises(RangesFullError, match=f"tokens={16 * 90}"):
        backing.grow(lease, 16 * 90)
    assert lease.tokens == 16 * 40 and lease.blocks == 40 and backing.stats() == before
    assert backing.grow(lease, 16 * 50) and lease.tokens == 16 * 50
    backing.close()
    owner.close()


def test_range_backing_refuses_bad_arguments() -> None:
    owner = _xl_owner(open_driver("sim", profile="h200"))
    owner.commit_pages([5])
    with pytest.raises(ArgumentError, match="1 committed"):
        RangeBacking(owner)  # it would lease page 5's slots as if they were unbacked
    owner.decommit_pages([5])
    with pytest.raises(ArgumentError):
        RangeBacking(owner, reserve_bytes=-1)
    with pytest.raises(ArgumentError):
        RangeBacking(owner, reserve_bytes=4 * G, high_bytes=G)
    with pytest.raises(ArgumentError):
        RangeBacking(owner, executor="later")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError):
        RangeBacking("owner")  # type: ignore[arg-type]
    b = RangeBacking(owner, executor="inline")
    for bad in (0, -5, True, 2.0):
        with pytest.raises(ArgumentError):
            b.admit(bad)  # type: ignore[arg-type]
    with pytest.raises(RangesFullError):
        b.admit(10 ** 9)
    b.close()
    with pytest.raises(KvvmmError):
        b.admit(16)
    owner.close()


def test_range_backing_on_host_memory_holds_real_bytes() -> None:
    torch = pytest.importorskip("torch")
    owner = _xl_owner(open_driver("host"), tokens=16 * 256)
    backing = RangeBacking(owner, reserve_bytes=4 * G, high_bytes=8 * G)
    try:
        leases = [backing.wait(backing.admit(n)) for n in (100, 700, 33, 1200)]
        views = layer_views(owner)
        for i, lease in enumerate(leases):
            for a, b in lease.slots:
                for k, v in views:
                    k[a:b].fill_(i + 1)  # unbacked VA would fault here
                    v[a:b].fill_(i + 1)
        for i, lease in enumerate(leases):
            a, _ = lease.slots[0]
            assert float(views[7][1][a, 3, 9]) == i + 1
        backing.release(leases[1])
        again = backing.wait(backing.admit(650))  # from the cache: the same bytes, still mapped
        assert again.ready
        del views
        assert torch is not None
    finally:
        backing.close()
        owner.close()


# -- the workload lab's strategies ---------------------------------------------------------


def test_range_strategies_serve_a_workload_with_every_page_backed() -> None:
    wl = generate(seed=3, duration_s=60)
    cmp = run_workload(wl, ["prefix", "xl-page-elastic", "request-ranges",
                            "request-ranges+deferred"], model="llama-3.1-8b", tp=1,
                       pool_tokens=16 * 8192)
    by = {r.strategy: r for r in cmp.results}
    for r in cmp.results:
        assert r.used_over_backed == 0 and r.conservation_errors == 0, r.strategy
        assert r.serving.completed == by["prefix"].serving.completed
    assert by["request-ranges"].layout == "interleaved"
    deferred, plain = by["request-ranges+deferred"], by["request-ranges"]
    assert deferred.background_driver_s > 0.0
    assert deferred.decode_driver_s < plain.decode_driver_s
    # off the decode path at about prefix growth's cost (the sim is deterministic: 0.89x;
    # charging a refill the commit queues to the decode path made it 1.97x)
    assert deferred.decode_driver_s <= 1.25 * by["prefix"].decode_driver_s
    assert plain.mean_backed_bytes < by["prefix"].mean_backed_bytes


def test_the_labs_backing_thread_runs_a_job_a_job_queues_after_it_on_its_own_clock() -> None:
    """The lab's executor as a backing thread: a job queued while one runs (the reserve's
    refill when an admission's commit ends) runs after it, charged to the thread, never to
    the decode step that waits for the first."""
    from kvvmm.workload.run import _Hooks

    hooks = _Hooks.__new__(_Hooks)
    hooks.waited_s = hooks.background_s = hooks.worker_until = 0.0
    hooks._in_job, hooks._later, hooks.pause, hooks._issued = False, [], None, []
    costs: list[float] = []
    order: list[str] = []

    class _Clock:
        now_s = 10.0
        queued_s = None

    hooks.allocator = _Clock()
    pending = [0.0]  # the driver time the jobs ran since the last account()

    def account() -> float:
        t, pending[0] = pending[0], 0.0
        costs.append(t)
        return t

    hooks.account = account  # type: ignore[method-assign]

    def refill() -> None:
        order.append("refill")
        pending[0] += 0.004

    def commit() -> None:
        order.append("commit")
        pending[0] += 0.001
        hooks.executor(refill, False)  # queued from inside: not run yet
        order.append("commit ends")

    hooks.executor(commit, True)
    assert order == ["commit", "commit ends", "refill"]
    assert hooks.waited_s == pytest.approx(0.001)  # the decode step waits for its commit
    assert hooks.background_s == pytest.approx(0.005)
    assert hooks.worker_until == pytest.approx(10.005)


def test_range_strategies_on_host_memory_touch_every_page() -> None:
    """Both range strategies on real bytes, every page handed out written to.

    Six seconds of traffic into a pool of 8,192 tokens: small enough to run in seconds (20 s
    into 32,768 tokens took 86 s in CI, mostly fallocate and fill_), tight enough that each
    strategy still preempts and splits admissions, the paths the longer run reached.
    """
    pytest.importorskip("torch")
    wl = generate(seed=5, duration_s=6)
    cmp = run_workload(wl, ["request-ranges", "request-ranges+deferred"],
                       model="llama-3.1-8b", tp=1, pool_tokens=16 * 512, driver="host",
                       touch=True)
    for r in cmp.results:
        assert r.used_over_backed == 0 and r.serving.completed > 0
        row = r.summary()
        assert row["preemptions"] > 0 and row["ranges_split_admits"] > 0, r.strategy


def test_the_range_strategies_report_how_their_allocator_fared() -> None:
    wl = generate(seed=3, duration_s=30)
    cmp = run_workload(wl, ["request-ranges", "request-ranges+deferred", "prefix"],
                       model="llama-3.1-8b", gpu="h200", driver="sim")
    by = {r.strategy: r.summary() for r in cmp.results}
    for name in ("request-ranges", "request-ranges+deferred"):
        row = by[name]
        assert row["ranges_admits"] == row["completed"] + row["preemptions"] > 0
        assert 0 <= row["ranges_split_admits"] <= row["ranges_admits"]
        assert 0.0 <= row["ranges_fragmentation_mean"] <= row["ranges_fragmentation_max"] < 1
        assert row["ranges_units_max"] >= 1
        assert 0 <= row["ranges_grows_moved"] <= row["ranges_grows"]
    assert not any(k.startswith("ranges_") for k in by["prefix"])


@pytest.mark.parametrize("defer", [True, False], ids=["admit-when-ready", "step-waits"])
@pytest.mark.parametrize("reserve_mib", [0, 8, 48])
def test_deferred_ranges_say_which_call_each_decode_stall_waited_for(reserve_mib: int,
                                                                     defer: bool) -> None:
    """With every driver call on the backing thread, a decode step stalls only by waiting
    for an admission's or a growth's commit: each stalled step counts at least one, and a
    wait is counted only where a step stalled. Admitted when ready, no step waits for an
    admission: the request waits for a later boundary instead, and every one is served."""
    from kvvmm.units import MiB
    from kvvmm.workload.strategies import RequestRanges

    wl = generate(seed=4, duration_s=30)
    cmp = run_workload(wl, [lambda: RequestRanges(
        deferred=True, reserve_bytes=reserve_mib * MiB, defer_admissions=defer)],
        model="llama-3.1-8b", gpu="h200", driver="sim", pause_scale=1.0)
    (r,) = cmp.results
    row = r.summary()
    waits = row["ranges_stalled_admits"] + row["ranges_stalled_grows"] \
        + row["ranges_waited_admits"] + row["ranges_spun_out"]  # (bounded spins on a lease)
    assert row["stalled_steps"] <= waits <= 2 * row["ranges_admits"] + row["ranges_grows"]
    assert (waits == 0) == (row["stalled_steps"] == 0)
    assert row["completed"] + row["rejected"] == len(wl)
    assert r.used_over_backed == 0 and r.conservation_errors == 0
    if defer:
        assert row["ranges_stalled_admits"] == 0
        assert (row["ranges_deferred_admits"] > 0) == (row["ranges_deferred_ms"] > 0)
        assert row["ranges_deferred_max_ms"] <= row["ranges_deferred_ms"]
        if reserve_mib == 0:  # nothing mapped ahead: every fresh admission maps first,
            # within the bounded wait (the step spins) or a step later (put off)
            assert row["ranges_deferred_admits"] + row["ranges_waited_admits"] > 0
    else:
        assert row["ranges_deferred_admits"] == 0
        if reserve_mib == 0:  # nothing mapped ahead: admissions wait for their own commits
            assert row["ranges_stalled_admits"] > 0


def test_request_ranges_arguments_are_checked() -> None:
    from kvvmm.workload.strategies import RequestRanges

    with pytest.raises(ArgumentError, match="defer_admissions"):
        RequestRanges(defer_admissions=True)  # without deferred: nothing to defer
    with pytest.raises(ArgumentError, match="defer_admissions"):
        RequestRanges(deferred=True, defer_admissions=1)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="deferred"):
        RequestRanges(deferred=1)  # type: ignore[arg-type]
    assert RequestRanges(deferred=True).defer_admissions is True
    assert RequestRanges().defer_admissions is False


class _GatedDriver(DriverWrapper):
    """Creates on the backing thread wait for ``gate``; records which thread created."""

    def __init__(self, inner: object, gate: threading.Event) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.gate = gate
        self.creators: list[str] = []

    def _call(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        if call == "create":
            me = threading.current_thread().name
            self.creators.append(me)
            if me == "kvvmm-range-backing":
                assert self.gate.wait(30)
        return fn(*args)


@contextlib.contextmanager
def _busy_backing(reserve_blocks: int = 8, inner: object = None,
                  arm: Callable[[], None] | None = None,
                  ) -> Iterator[tuple[_GatedDriver, KvBufferOwner, RangeBacking]]:
    """A gated driver, an owner and a RangeBacking whose first reserve refill has begun on
    the backing thread and waits there for ``drv.gate`` (a refill in flight, none of it
    leased); ``arm`` runs once the owner is made (faults from the refill on)."""
    drv = _GatedDriver(inner or open_driver("sim", profile="h200"), threading.Event())
    owner = _xl_owner(drv, tokens=16 * 600)
    drv.creators.clear()  # slot 0's handle, made here
    if arm is not None:
        arm()
    backing = RangeBacking(owner, reserve_bytes=reserve_blocks * G)
    try:
        for _ in range(2000):
            if "kvvmm-range-backing" in drv.creators:
                break
            threading.Event().wait(0.005)
        assert drv.creators == ["kvvmm-range-backing"]
        yield drv, owner, backing
    finally:
        drv.gate.set()
        backing.close()
        owner.close()


def _all_given_back(backing: RangeBacking, owner: KvBufferOwner, leases: list) -> None:
    """Release ``leases``, reclaim every cached block: slot 0's granule alone stays backed."""
    for lease in leases:
        backing.release(lease)
    backing.drain()
    backing.reclaim(0)
    assert owner.backed_bytes == G and backing.stats().units == 0


def _units(backing: RangeBacking) -> dict[int, int]:
    with backing._lock:
        return dict(backing._units_over(backing.first, backing.blocks))


def test_a_waiting_caller_maps_its_lease_itself_while_the_backing_thread_is_busy() -> None:
    with _busy_backing() as (drv, owner, backing):  # 8 blocks of the reserve in flight, held
        lease = backing.admit(16 * 40)  # the 8 in flight, 32 fresh: a queued commit
        assert not lease.ready and lease.pieces == [(1, 8), (9, 32)]
        # the waiter takes its own commit off the queue and runs it as soon as the owner
        # is free (the refill holds it until the gate opens): the thread never maps it
        threading.Timer(0.2, drv.gate.set).start()
        assert backing.wait(lease, timeout_s=10) is lease and lease.ready
        assert drv.creators[:2] == ["kvvmm-range-backing", threading.main_thread().name]
        # (the next refill is queued when the lease's own commit ends, not ahead of it)
        assert backing.drain()
        s = backing.stats()
        assert s.commits == 3 and s.pending_bytes == 0  # refill, own, the next refill
        _check(backing, owner, [lease])
        _all_given_back(backing, owner, [lease])


def test_an_admission_the_refill_in_flight_covers_waits_for_it_and_maps_nothing() -> None:
    with _busy_backing(reserve_blocks=16) as (drv, owner, backing):
        a = backing.admit(16 * 5)  # 5 + 7 of the refill's 16 blocks: no commit of their own
        b = backing.admit(16 * 7)
        assert not a.ready and not b.ready
        assert a.pieces == [(1, 5)] and b.pieces == [(6, 7)]
        assert backing.stats().pending_bytes == 16 * G
        with pytest.raises(KvvmmError, match="not mapped within"):
            backing.wait(a, timeout_s=0.1)
        assert drv.creators == ["kvvmm-range-backing"]  # nothing mapped by the callers
        drv.gate.set()
        assert backing.wait(a).ready and backing.wait(b).ready
        assert backing.drain()
        # one unit of 16 (the refill, leased in part), then the refill of what they took
        units = _units(backing)
        assert units[1] == 16 and len(units) == 2 and sum(units.values()) == 16 + 12
        assert backing.stats().commits == 2
        _check(backing, owner, [a, b])
        grown = backing.grow(b, 16 * 9)  # in place: the refill's cached 4 blocks after it
        assert grown and b.ready and b.pieces == [(6, 9)]
        _all_given_back(backing, owner, [a, b])


def test_a_lease_released_while_the_refill_it_claimed_runs_gives_its_blocks_back() -> None:
    with _busy_backing(reserve_blocks=16) as (drv, owner, backing):
        lease = backing.admit(16 * 10)
        backing.release(lease)  # its 10 blocks come back when the refill ends
        assert backing.stats().leased_bytes == 0
        drv.gate.set()
        assert backing.drain()
        s = backing.stats()
        assert s.pending_bytes == 0 and s.cached_bytes == 16 * G and s.leased_bytes == 0
        _check(backing, owner, [])
        _all_given_back(backing, owner, [])


def test_a_refill_that_fails_fails_the_leases_that_claimed_it_and_leaks_nothing() -> None:
    faulty = FaultyDriver(open_driver("sim", profile="h200"))
    with _busy_backing(  # the refill's map fails, after its (held) create
            reserve_blocks=16, inner=faulty,
            arm=lambda: faulty.arm([Fault("map", nth=1)])) as (drv, owner, backing):
        a = backing.admit(16 * 4)
        b = backing.admit(16 * 20)  # 12 of the refill, 8 fresh (mapped by its waiter)
        drv.gate.set()
        for lease in (a, b):
            with pytest.raises(DriverError):
                backing.wait(lease)
            assert not lease.ready and lease.error is not None
        assert backing.drain()
        _check(backing, owner, [])
        for lease in (a, b):
            backing.release(lease)
        backing.drain()
        s = backing.stats()
        assert s.leased_bytes == 0 and s.pending_bytes == 0
        ok = backing.admit(16 * 20)  # the failed blocks are fresh again: admissions go on
        assert backing.wait(ok).ready
        _all_given_back(backing, owner, [ok])
        assert drv.stats().handles == 1 and drv.stats().mappings == 1  # slot 0's alone


def test_a_wait_after_the_thread_began_the_commit_does_not_run_it_twice() -> None:
    owner = _xl_owner(open_driver("sim", profile="h200"), tokens=16 * 600)
    backing = RangeBacking(owner)
    try:
        leases = [backing.admit(16 * k) for k in (10, 20, 30)]
        backing.drain()  # the thread ran every commit
        for lease in leases:
            assert backing.wait(lease).ready
        assert backing.stats().commits == 3
        assert owner.backed_bytes == G + 60 * G
        for lease in leases:
            backing.release(lease)
    finally:
        backing.close()
        owner.close()

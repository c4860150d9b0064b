"""``kvvmm calibrate``'s driver-call sections: µs per call by size, reserve and free, one call
over several mappings, the first map into a region, the cold premium, creates after a large
release.

Each takes a :class:`~kvvmm.measure.plan.Ctx` and calls the driver itself, not the timing
wrapper: the calls alone, as the simulator charges them, timed by the context's clock, so the
quick refresh (:mod:`kvvmm.measure.refresh`) measures a card or a simulator with them.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvvmm.driver.base import Driver
from kvvmm.hardware.schema import COLD_CALLS
from kvvmm.measure.plan import Ctx
from kvvmm.measure.stats import mean_us, median_us, trimmed_mean
from kvvmm.measure.timer import HANDLE_CALLS, CallTimes, time_handle_calls
from kvvmm.units import GiB, MiB

__all__ = ["COLD_CALLS", "access_multi", "call_times", "cold_premium", "first_touch", "per_call",
           "post_release", "reserve_free", "reserve_times", "touch_times"]


def call_times(ctx: Ctx) -> CallTimes:
    """Every create, map, set_access, unmap and release timed by handle size, each size at its
    own place in ONE reservation (as an owner's calls are; CudaDriver's map check keeps the last
    reservation's range), a rep at a time (:func:`time_handle_calls`). The plan's
    ``call_limit_s`` stops the reps early (each size timed at least 5 times).
    """
    d, p = ctx.td.inner, ctx.plan
    sizes = [s * MiB for s in p.call_sizes_mib]
    total = sum(sizes)
    base = d.reserve(total)
    places = dict(zip(sizes, itertools.accumulate(sizes, initial=base), strict=False))
    left = dict(zip(sizes, p.call_reps, strict=True))
    times = CallTimes(sizes)
    rng = random.Random(14)
    stop = time.monotonic() + p.call_limit_s if p.call_limit_s > 0 else math.inf
    try:
        for _ in range(2):  # warm-up: the first calls of a size cost more
            time_handle_calls(d, places, ctx.clock, rng, None)
        while any(left.values()):
            now = {s: va for s, va in places.items() if left[s] > 0}
            for s in now:
                left[s] -= 1
            time_handle_calls(d, now, ctx.clock, rng, times)
            if time.monotonic() > stop and min(map(times.reps, sizes)) >= 5:
                break
    finally:
        d.free(base, total)
    return times


def per_call(ctx: Ctx) -> dict[str, Any]:
    """µs per call by handle size (:func:`call_times`): the trimmed mean, the reps, the
    median."""
    times = call_times(ctx)
    out: dict[str, Any] = {}
    for mib in ctx.plan.call_sizes_mib:
        ms = {op: times.measurement(op, mib * MiB) for op in HANDLE_CALLS}
        out[f"{mib}MiB"] = ({op: m.mean_us() for op, m in ms.items()}
                            | {"reps": times.reps(mib * MiB)}
                            | {"median": {op: m.median_us() for op, m in ms.items()}})
    return out


def reserve_times(ctx: Ctx) -> dict[str, dict[int, list[float]]]:
    """Every reserve and free timed, by op and reservation size in GiB (the plan's
    ``reserve_gib``, in a fresh seeded order each rep)."""
    d, p, clock = ctx.td.inner, ctx.plan, ctx.clock
    t: dict[str, dict[int, list[float]]] = {op: {g: [] for g in p.reserve_gib}
                                            for op in ("reserve", "free")}
    rng = random.Random(15)
    d.free(d.reserve(GiB), GiB)  # warm-up
    for _ in range(p.reserve_reps):
        order = list(p.reserve_gib)
        rng.shuffle(order)
        for g in order:
            t0 = clock()
            va = d.reserve(g * GiB)
            t1 = clock()
            d.free(va, g * GiB)
            t2 = clock()
            t["reserve"][g].append(t1 - t0)
            t["free"][g].append(t2 - t1)
    return t


def reserve_free(ctx: Ctx) -> dict[str, Any]:
    """µs per reserve and per free by reservation size (:func:`reserve_times`), and per
    mem_info."""
    t = reserve_times(ctx)
    mem = []
    for _ in range(200):
        t0 = ctx.clock()
        ctx.td.inner.mem_info()
        mem.append(ctx.clock() - t0)
    return {"sizes": {f"{g}GiB": {op: mean_us(by[g]) for op, by in t.items()}
                      for g in ctx.plan.reserve_gib},
            "mem_info_us": mean_us(mem)}


def access_multi(ctx: Ctx) -> dict[str, Any]:
    """One set_access over k mappings against k calls, one per mapping (fresh maps each rep)."""
    d = ctx.td.inner
    out: dict[str, Any] = {}
    for mib, k in ctx.plan.access_cases:
        size = mib * MiB
        va = d.reserve(size * k)
        hs = [d.create(size) for _ in range(k)]
        one: list[float] = []
        many: list[float] = []
        unmaps: list[float] = []
        try:
            for rep in range(ctx.plan.access_reps * 2):
                for i, h in enumerate(hs):
                    d.map(va + i * size, size, h)
                t0 = ctx.clock()
                if rep % 2 == 0:
                    d.set_access(va, size * k)
                else:
                    for i in range(k):
                        d.set_access(va + i * size, size)
                dt = ctx.clock() - t0
                (one if rep % 2 == 0 else many).append(dt)
                t0 = ctx.clock()
                d.unmap(va, size * k)  # one call over the k mappings (synchronizes once)
                unmaps.append(ctx.clock() - t0)
        finally:
            for h in hs:
                d.release(h)
            d.free(va, size * k)
        o, m = trimmed_mean(one), trimmed_mean(many)
        out[f"{mib}MiBx{k}"] = {"mapping_mib": mib, "mappings": k,
                                "one_call_us": round(o * 1e6, 2),
                                "one_call_per_mapping_us": round(o * 1e6 / k, 3),
                                "call_per_mapping_us": round(m * 1e6, 2),
                                "ratio_one_over_calls": round(o / m, 4),
                                "unmap_one_call_us": round(trimmed_mean(unmaps) * 1e6, 2),
                                "unmap_per_mapping_us": round(
                                    trimmed_mean(unmaps) * 1e6 / k, 3)}
    return out


def _calls_round(d: Driver, n: int, clock: Callable[[], float]) -> dict[str, list[float]]:
    """reserve 64 GiB, ``n`` x (create a granule, map it a GiB apart, set_access), unmap and
    release each, free: every call's time, by kind (:data:`COLD_CALLS`), in order."""
    g = d.granularity()
    t: dict[str, list[float]] = {op: [] for op in COLD_CALLS}

    def timed(op: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = clock()
        out = fn(*args)
        t[op].append(clock() - t0)
        return out

    va = timed("reserve", d.reserve, 64 * GiB, GiB)
    hs: list[int] = []
    mapped: list[int] = []
    try:
        for i in range(n):
            hs.append(timed("create", d.create, g))
            timed("map", d.map, va + i * GiB, g, hs[-1])
            mapped.append(va + i * GiB)
            timed("set_access", d.set_access, va + i * GiB, g)
        while mapped:
            timed("unmap", d.unmap, mapped[0], g)
            mapped.pop(0)
        while hs:
            timed("release", d.release, hs[0])
            hs.pop(0)
    except BaseException:
        for m in mapped:
            d.unmap(m, g)
        for h in hs:
            d.release(h)
        d.free(va, 64 * GiB)
        raise
    timed("free", d.free, va, 64 * GiB)
    return t


def cold_premium(ctx: Ctx) -> dict[str, Any]:
    """The first call of each kind after a pause against the calls after it: the cold premium.

    Each of ``cold_rounds`` rounds: a ``cold_gap_s`` pause, one round of calls (reserve,
    4 x create / map / set_access, unmaps, releases, free), then at once a warm round. A kind's
    premium is the median of its cold rounds' first calls minus the median of its later calls in
    both rounds (reserve and free: the warm rounds'). Then the same after each shorter pause of
    ``cold_partial_s`` (``partial_us``).
    """
    p = ctx.plan
    out = _cold_rounds(ctx, p.cold_gap_s)
    out["partial_us"] = {f"{gap * 1e3:g}": _cold_rounds(ctx, gap)["premium_us"]
                         for gap in p.cold_partial_s if gap < p.cold_gap_s}
    return out


def _cold_rounds(ctx: Ctx, gap_s: float) -> dict[str, Any]:
    """``cold_rounds`` times: a ``gap_s`` pause, a round of calls, at once a warm one."""
    d, rounds = ctx.td.inner, ctx.plan.cold_rounds
    first: dict[str, list[float]] = {op: [] for op in COLD_CALLS}
    later: dict[str, list[float]] = {op: [] for op in COLD_CALLS}
    for _ in range(rounds):
        ctx.pause(gap_s)
        cold = _calls_round(d, 4, ctx.clock)
        warm = _calls_round(d, 4, ctx.clock)
        for op in COLD_CALLS:
            first[op].append(cold[op][0])
            later[op] += cold[op][1:] + (warm[op] if op in ("reserve", "free") else warm[op][1:])
    out: dict[str, Any] = {"gap_ms": round(gap_s * 1e3, 3), "rounds": rounds,
                           "first_us": {op: median_us(v) for op, v in first.items()},
                           "later_us": {op: median_us(v) for op, v in later.items()},
                           "first_all_us": {op: [round(x * 1e6, 2) for x in v]
                                            for op, v in first.items()}}
    out["premium_us"] = {op: round(out["first_us"][op] - out["later_us"][op], 3)
                         for op in COLD_CALLS}
    return out


def _map_timed(d: Driver, clock: Callable[[], float], va: int, size: int, h: int,
               into: dict[str, list[float]]) -> None:
    """Map ``h`` at ``va`` and give it access, each call's time appended to ``into``."""
    t0 = clock()
    d.map(va, size, h)
    t1 = clock()
    d.set_access(va, size)
    t2 = clock()
    into["map"].append(t1 - t0)
    into["set_access"].append(t2 - t1)


def touch_times(ctx: Ctx) -> tuple[dict[str, dict[str, list[float]]], list[float]]:
    """map and set_access of one granule handle into a reservation's untouched 1 GiB region
    (``fresh``), beside a mapping of the same region (``beside``) and half a region away
    (``half_away``), in ``touch_regions`` regions of ``touch_reps`` fresh reservations. By case
    and op, every call's time; and every unmap's.
    """
    d, clock = ctx.td.inner, ctx.clock
    g = d.granularity()
    n = ctx.plan.touch_regions
    cases = {"fresh": 0, "beside": g, "half_away": GiB // 2}
    got: dict[str, dict[str, list[float]]] = {c: {"map": [], "set_access": []} for c in cases}
    unmaps: list[float] = []
    for _ in range(ctx.plan.touch_reps):
        va0 = d.reserve(n * GiB, GiB)
        hs: list[int] = []
        try:
            for case, off in cases.items():
                for i in range(n):
                    hs.append(d.create(g))
                    _map_timed(d, clock, va0 + i * GiB + off, g, hs[-1], got[case])
            for off in cases.values():
                for i in range(n):
                    t0 = clock()
                    d.unmap(va0 + i * GiB + off, g)
                    unmaps.append(clock() - t0)
        finally:
            for h in hs:
                d.release(h)
            d.free(va0, n * GiB)
    return got, unmaps


def first_touch(ctx: Ctx) -> dict[str, Any]:
    """The first-touch extra (:func:`touch_times`, means per case), and whether a large mapping
    pays it per region it enters or once: 2 GiB handles mapped into fresh VA, then again where
    they were.
    """
    d = ctx.td.inner
    got, unmaps = touch_times(ctx)
    big = 2 * GiB
    big_t: dict[str, dict[str, list[float]]] = {c: {"map": [], "set_access": []}
                                                for c in ("fresh", "again")}
    for _ in range(ctx.plan.touch_reps):
        va0 = d.reserve(4 * big, GiB)
        hs: list[int] = []
        try:
            hs = [d.create(big) for _ in range(2)]
            for case in big_t:
                for i, h in enumerate(hs):
                    _map_timed(d, ctx.clock, va0 + 2 * i * big, big, h, big_t[case])
                for i in range(len(hs)):
                    d.unmap(va0 + 2 * i * big, big)
        finally:
            for h in hs:
                d.release(h)
            d.free(va0, 4 * big)
    out: dict[str, Any] = {case: {op: mean_us(v) for op, v in row.items()}
                           for case, row in got.items()}
    out["unmap_us"] = mean_us(unmaps)
    out["samples_per_case"] = ctx.plan.touch_regions * ctx.plan.touch_reps
    out["big_mib"] = big // MiB
    out["big"] = {case: {op: mean_us(v) for op, v in row.items()} for case, row in big_t.items()}
    return out


def post_release(ctx: Ctx) -> dict[str, Any]:
    """Creates right after releasing a lot of memory, against the same creates settled."""
    plan, d = ctx.plan, ctx.td.inner
    free, _ = d.mem_info()
    big = min(512 * MiB, plan.release_bytes)  # handles of the released memory
    release = max(big, min(plan.release_bytes, (free // 2) // big * big))
    size = plan.slow_create_mib * MiB
    n = min(plan.slow_creates, max(1, int(free // 4 // size)))

    def creates() -> list[float]:
        hs, ts = [], []
        for _ in range(n):
            t0 = ctx.clock()
            hs.append(d.create(size))
            ts.append(ctx.clock() - t0)
        for h in hs:
            d.release(h)
        return ts

    reps = []
    for _ in range(plan.slow_repeats):
        ctx.pause(plan.settle_s)
        settled = creates()
        ctx.pause(plan.settle_s)
        # Backed and mapped as an owner's memory is, then given back as its close does.
        va = d.reserve(release)
        hs = [d.create(big) for _ in range(release // big)]
        for i, h in enumerate(hs):
            d.map(va + i * big, big, h)
        d.set_access(va, release)
        ctx.sync()
        for i, h in enumerate(hs):
            d.unmap(va + i * big, big)
            d.release(h)
        d.free(va, release)
        after = creates()
        reps.append({"settled_mean_us": round(statistics.fmean(settled) * 1e6, 3),
                     "after_mean_us": round(statistics.fmean(after) * 1e6, 3),
                     "settled_median_us": median_us(settled), "after_median_us": median_us(after),
                     "ratio_of_means": round(statistics.fmean(after) / statistics.fmean(settled),
                                             4)})
    ctx.pause(plan.settle_s)
    return {"released_bytes": release, "create_bytes": size, "creates": n, "repeats": reps}


"""``kvvmm calibrate``'s driver-call sections: µs per call by size, reserve and free, one call
over several mappings, the first map into a region, the first call of each kind after a
pause, creates after a large release.

Each takes a :class:`~kvvmm.measure.plan.Ctx` and calls the driver itself (not the timing
wrapper): these are the calls alone, as the simulator charges them.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from kvvmm.driver.base import Driver
from kvvmm.hardware.schema import COLD_CALLS as SCHEMA_COLD_CALLS
from kvvmm.measure.plan import Ctx
from kvvmm.measure.stats import mean_us, median_us, trimmed_mean
from kvvmm.measure.timer import HANDLE_CALLS, CallTimes, time_handle_calls
from kvvmm.units import GiB, MiB

__all__ = ["access_multi", "cold_calls", "first_touch", "per_call", "post_release",
           "reserve_free"]


def per_call(ctx: Ctx) -> dict[str, Any]:
    """µs per call by handle size, in ONE reservation (as an owner's calls are), each size at
    its own place in it; per rep, every size is created, mapped and given access, then every
    size unmapped, then every size released, each phase in a fresh seeded random order.

    One reservation: CudaDriver keeps the last reservation's range for its map check, so
    maps spread over several reservations (as before) timed a miss an owner never pays
    (9.3 µs against 1.8 µs). Phases: an owner's decommit and close unmap a run, then
    release, so a release is timed after other unmaps, not right after its own.
    """
    d = ctx.td.inner
    p = ctx.plan
    sizes = [s * MiB for s in p.call_sizes_mib]
    places: dict[int, int] = {}
    total = 0
    for s in sizes:
        places[s] = total
        total += s
    base = d.reserve(total)
    places = {s: base + off for s, off in places.items()}
    left = dict(zip(sizes, p.call_reps, strict=True))
    times = CallTimes(sizes)
    pc = time.perf_counter
    rng = random.Random(14)
    try:
        for _ in range(2):  # warm-up: the first calls of a size cost more
            time_handle_calls(d, places, pc, rng, None)
        while any(left.values()):
            now = {s: va for s, va in places.items() if left[s] > 0}
            for s in now:
                left[s] -= 1
            time_handle_calls(d, now, pc, rng, times)
    finally:
        d.free(base, total)
    out: dict[str, Any] = {}
    for s in sizes:
        ms = {op: times.measurement(op, s) for op in HANDLE_CALLS}
        out[f"{s // MiB}MiB"] = ({op: m.mean_us() for op, m in ms.items()}
                                 | {"reps": times.reps(s)}
                                 | {"median": {op: m.median_us() for op, m in ms.items()}})
    return out


def reserve_free(ctx: Ctx) -> dict[str, Any]:
    """µs per reserve and per free by reservation size (sizes in a seeded random order)."""
    d = ctx.td.inner
    p = ctx.plan
    t: dict[int, dict[str, list[float]]] = {g: {"reserve": [], "free": []} for g in p.reserve_gib}
    rng = random.Random(15)
    d.free(d.reserve(GiB), GiB)  # warm-up
    for _ in range(p.reserve_reps):
        order = list(p.reserve_gib)
        rng.shuffle(order)
        for g in order:
            t0 = time.perf_counter()
            va = d.reserve(g * GiB)
            t1 = time.perf_counter()
            d.free(va, g * GiB)
            t2 = time.perf_counter()
            t[g]["reserve"].append(t1 - t0)
            t[g]["free"].append(t2 - t1)
    mem = []
    for _ in range(200):
        t0 = time.perf_counter()
        d.mem_info()
        mem.append(time.perf_counter() - t0)
    return {"sizes": {f"{g}GiB": {k: mean_us(v) for k, v in row.items()} for g, row in t.items()},
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
                t0 = time.perf_counter()
                if rep % 2 == 0:
                    d.set_access(va, size * k)
                else:
                    for i in range(k):
                        d.set_access(va + i * size, size)
                dt = time.perf_counter() - t0
                (one if rep % 2 == 0 else many).append(dt)
                t0 = time.perf_counter()
                d.unmap(va, size * k)  # one call over the k mappings (synchronizes once)
                unmaps.append(time.perf_counter() - t0)
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


#: The calls of one round of :func:`cold_calls`, in the order they are made (the calls a
#: profile's cold premium may name).
COLD_CALLS = SCHEMA_COLD_CALLS


def _calls_round(d: Any, n: int) -> dict[str, list[float]]:
    """reserve 64 GiB, ``n`` x (create a granule, map it a GiB apart, set_access), unmap and
    release each, free: every call's seconds, by kind, in order."""
    g = d.granularity()
    pc = time.perf_counter
    t: dict[str, list[float]] = {op: [] for op in COLD_CALLS}
    t0 = pc()
    va = d.reserve(64 * GiB, GiB)
    t["reserve"].append(pc() - t0)
    hs: list[int] = []
    mapped: list[int] = []
    try:
        for i in range(n):
            t0 = pc()
            h = d.create(g)
            t1 = pc()
            hs.append(h)
            d.map(va + i * GiB, g, h)
            t2 = pc()
            mapped.append(va + i * GiB)
            d.set_access(va + i * GiB, g)
            t3 = pc()
            t["create"].append(t1 - t0)
            t["map"].append(t2 - t1)
            t["set_access"].append(t3 - t2)
        while mapped:
            t0 = pc()
            d.unmap(mapped[0], g)
            t["unmap"].append(pc() - t0)
            mapped.pop(0)
        while hs:
            t0 = pc()
            d.release(hs[0])
            t["release"].append(pc() - t0)
            hs.pop(0)
        t0 = pc()
        d.free(va, 64 * GiB)
        t["free"].append(pc() - t0)
    except BaseException:
        for m in mapped:
            d.unmap(m, g)
        for h in hs:
            d.release(h)
        d.free(va, 64 * GiB)
        raise
    return t


def cold_calls(ctx: Ctx) -> dict[str, Any]:
    """The first call of each kind after a pause against the calls after it.

    Each of ``cold_rounds`` rounds: a ``cold_gap_s`` sleep, one round of calls (reserve,
    4 x create / map / set_access, unmaps, releases, free), then at once a second, warm round.
    A call kind's premium is the median of its cold rounds' first calls minus the median of
    every later call of that kind in both rounds; reserve and free, one per round, are set
    against the warm rounds' ones. On an H200 back to back no call is cold and after a pause
    every kind is, on a fresh driver or an old one (``probe_cold_calls.py``, a probe since
    removed: bench/results/README.md).
    Then the same for each shorter pause of ``cold_partial_s`` (``partial_us``: the premiums
    after it), which the profile keeps as shares of the premium (on an H200 after 1 / 5 /
    20 ms a create pays 0.19 / 0.41 / 0.81 of it: bench/results/h200-cold-gaps.json).
    """
    p = ctx.plan
    out = _cold_rounds(ctx.td.inner, p.cold_rounds, p.cold_gap_s)
    out["partial_us"] = {f"{gap * 1e3:g}": _cold_rounds(ctx.td.inner, p.cold_rounds, gap)
                         ["premium_us"] for gap in p.cold_partial_s if gap < p.cold_gap_s}
    return out


def _cold_rounds(d: Driver, rounds: int, gap_s: float) -> dict[str, Any]:
    """``rounds`` times: a ``gap_s`` sleep, a round of calls, at once a warm one."""
    first: dict[str, list[float]] = {op: [] for op in COLD_CALLS}
    later: dict[str, list[float]] = {op: [] for op in COLD_CALLS}
    for _ in range(rounds):
        time.sleep(gap_s)
        cold = _calls_round(d, 4)
        warm = _calls_round(d, 4)
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


def first_touch(ctx: Ctx) -> dict[str, Any]:
    """map and set_access of one granule handle into VA of a reservation that no mapping has
    touched yet (the first in its 1 GiB region) against one beside a mapping of the same
    region, and one half a region away (is the region smaller?). A fresh reservation each
    rep: whatever the driver sets up for a region may last until the reservation is freed.

    An owner's construction maps slot 0 of every buffer, each buffer in its own gigabytes
    of VA, and page commits far apart land in untouched regions too; decode growth mostly
    maps beside what it mapped before.
    """
    d = ctx.td.inner
    g = d.granularity()
    n, reps = 32, 3
    pc = time.perf_counter
    got: dict[str, dict[str, list[float]]] = {
        case: {"map": [], "set_access": []} for case in ("fresh", "beside", "half_away")}
    unmaps: list[float] = []
    for _ in range(reps):
        va0 = d.reserve(n * GiB, GiB)
        hs: list[int] = []
        try:
            for case, off in (("fresh", 0), ("beside", g), ("half_away", GiB // 2)):
                for i in range(n):
                    h = d.create(g)
                    hs.append(h)
                    va = va0 + i * GiB + off
                    t0 = pc()
                    d.map(va, g, h)
                    t1 = pc()
                    d.set_access(va, g)
                    t2 = pc()
                    got[case]["map"].append(t1 - t0)
                    got[case]["set_access"].append(t2 - t1)
            for case_off in (0, g, GiB // 2):
                for i in range(n):
                    t0 = pc()
                    d.unmap(va0 + i * GiB + case_off, g)
                    unmaps.append(pc() - t0)
        finally:
            for h in hs:
                d.release(h)
            d.free(va0, n * GiB)
    # A large mapping enters several regions: is the extra paid per region or per mapping?
    # The same 2 GiB handles mapped into fresh VA, then again where they were (touched).
    big = 2 * GiB
    big_t: dict[str, dict[str, list[float]]] = {
        case: {"map": [], "set_access": []} for case in ("fresh", "again")}
    for _ in range(reps):
        va0 = d.reserve(4 * big, GiB)
        hs = []
        try:
            hs = [d.create(big) for _ in range(2)]
            for case in ("fresh", "again"):
                for i, h in enumerate(hs):
                    va = va0 + 2 * i * big
                    t0 = pc()
                    d.map(va, big, h)
                    t1 = pc()
                    d.set_access(va, big)
                    t2 = pc()
                    big_t[case]["map"].append(t1 - t0)
                    big_t[case]["set_access"].append(t2 - t1)
                for i in range(len(hs)):
                    d.unmap(va0 + 2 * i * big, big)
        finally:
            for h in hs:
                d.release(h)
            d.free(va0, 4 * big)
    out: dict[str, Any] = {case: {op: mean_us(v) for op, v in row.items()}
                           for case, row in got.items()}
    out["unmap_us"] = mean_us(unmaps)
    out["samples_per_case"] = n * reps
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
            t0 = time.perf_counter()
            hs.append(d.create(size))
            ts.append(time.perf_counter() - t0)
        for h in hs:
            d.release(h)
        return ts

    reps = []
    for _ in range(plan.slow_repeats):
        time.sleep(plan.settle_s)
        settled = creates()
        time.sleep(plan.settle_s)
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
    time.sleep(plan.settle_s)
    return {"released_bytes": release, "create_bytes": size, "creates": n, "repeats": reps}


"""``kvvmm calibrate --quick --profile EXISTING``: refresh a full profile in about a minute.

A full calibration takes minutes and measures what rarely changes (bandwidth, the shape of
each curve by size); what drifts between sessions and days is the level of the per-call
costs, the first-touch extra and the library's own work (docs/FIDELITY.md). This measures
those, on the driver at hand, and rescales the existing profile:

- **per call** (create, map, set_access, unmap, release) at a few handle sizes, all in one
  reservation already touched (no first-touch extra in them), interleaved in a seeded order,
  and reserve and free of 1 and 64 GiB; each group's factor is the median over the sizes
  of measured / profile;
- **first touch**: one granule into each of several untouched regions, then one beside each;
  the extra (fresh minus beside) over the profile's;
- **library work**: an arena's open, commit of 8 handles, decommit and close, timed whole;
  the work is that time minus what the *refreshed* call costs charge for the same calls
  (the same operations run on a simulator with the refreshed calls and no library work),
  over the same for the old profile.

Measured groups take their factor; the rest follow their call (``set_access_per_mapping``
with ``set_access``, ``unmap_per_mapping`` with ``unmap``) or the median factor (older
profiles' per-call residuals). The old figures join ``spread.history``, and the spread is recomputed
from that history and this run's rounds, so the bands of the refreshed profile still carry
where the card was before. A new card still needs the full calibrate (the curves' shapes).

Works on any driver given a clock: CUDA's wall time, or a simulator's clock (the tests
refresh a profile against a simulator whose costs were scaled, and recover the scaling).
"""

from __future__ import annotations

import datetime
import random
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvvmm.arena import Arena
from kvvmm.driver.base import Driver
from kvvmm.driver.sim import SimDriver
from kvvmm.errors import ArgumentError
from kvvmm.hardware import DeviceProfile, profile_from_data
from kvvmm.hardware.spread import figures_of, median_factor, ratios, scaled, spread_section
from kvvmm.units import MiB

__all__ = ["CALL_SIZES_MIB", "MEASURED", "library_probe", "quick_refresh"]

#: Handle sizes the per-call section times (MiB).
CALL_SIZES_MIB = (2, 8, 32, 128, 512)
#: Reservation sizes reserve and free are timed at (MiB: 1 GiB and 64 GiB).
RESERVE_SIZES_MIB = (1024, 65536)
#: The groups measured (every other group is rescaled).
MEASURED = ("call_costs.create", "call_costs.map", "call_costs.set_access",
            "call_costs.unmap", "call_costs.release", "call_costs.reserve", "call_costs.free",
            "first_touch", "library_work_us")
#: Groups that follow a measured one: the same driver call over several mappings.
FOLLOWS = {"set_access_per_mapping": "call_costs.set_access",
           "unmap_per_mapping": "call_costs.unmap"}
_OPS = ("create", "map", "set_access", "unmap", "release", "reserve", "free")
_HANDLE_OPS = _OPS[:5]

Clock = Callable[[], float]  #: µs, monotonic


def _trimmed(xs: list[float]) -> float:
    """Mean of the middle 80% (a few slow calls of a busy host are not the card's cost)."""
    s = sorted(xs)
    k = len(s) // 10
    mid = s[k:len(s) - k] or s
    return sum(mid) / len(mid)


def _per_call(d: Driver, clock: Clock, sizes: tuple[int, ...], reps: int,
              deadline: float) -> tuple[dict[str, dict[int, float]], dict[str, list[float]]]:
    """µs per call by op and size; and per op, each block of reps' mean over the whole's."""
    total = sum(sizes) * MiB
    base = d.reserve(total)
    place, off = {}, 0
    for s in sizes:
        place[s] = base + off
        off += s * MiB
    t: dict[str, dict[int, list[float]]] = {op: {s: [] for s in sizes} for op in _HANDLE_OPS}
    rng = random.Random(27)
    try:
        for r in range(reps + 1):  # the first round warms up and touches every region
            order = list(sizes)
            rng.shuffle(order)
            handles = {}
            for s in order:
                t0 = clock()
                h = d.create(s * MiB)
                t1 = clock()
                d.map(place[s], s * MiB, h)
                t2 = clock()
                d.set_access(place[s], s * MiB)
                t3 = clock()
                handles[s] = h
                if r:
                    t["create"][s].append(t1 - t0)
                    t["map"][s].append(t2 - t1)
                    t["set_access"][s].append(t3 - t2)
            rng.shuffle(order)
            for s in order:
                t0 = clock()
                d.unmap(place[s], s * MiB)
                t1 = clock()
                d.release(handles.pop(s))
                t2 = clock()
                if r:
                    t["unmap"][s].append(t1 - t0)
                    t["release"][s].append(t2 - t1)
            if r >= 5 and time.monotonic() > deadline:
                break
    finally:
        d.free(base, total)
    for op in ("reserve", "free"):
        t[op] = {s: [] for s in RESERVE_SIZES_MIB}
    for _ in range(max(3, reps // 4)):
        for s in RESERVE_SIZES_MIB:
            t0 = clock()
            va = d.reserve(s * MiB)
            t1 = clock()
            d.free(va, s * MiB)
            t2 = clock()
            t["reserve"][s].append(t1 - t0)
            t["free"][s].append(t2 - t1)
    means = {op: {s: _trimmed(v) for s, v in by.items() if v} for op, by in t.items()}
    rounds: dict[str, list[float]] = {}
    for op, by in t.items():
        n = min(len(v) for v in by.values())
        blocks = max(1, min(5, n // 4))
        size = n // blocks
        for b in range(blocks):
            part = [sum(v[b * size:(b + 1) * size]) for v in by.values()]
            whole = [sum(v[:blocks * size]) / blocks for v in by.values()]
            if sum(whole) > 0:
                rounds.setdefault(f"call_costs.{op}", []).append(
                    round(sum(part) / sum(whole), 4))
    return means, rounds


def _first_touch(d: Driver, clock: Clock, region_bytes: int, regions: int) -> dict[str, float]:
    """µs more for a map and a set_access into an untouched region than beside one."""
    g = d.granularity()
    total = 2 * regions * region_bytes
    base = d.reserve(total)
    fresh: dict[str, list[float]] = {"map": [], "set_access": []}
    beside: dict[str, list[float]] = {"map": [], "set_access": []}
    made: list[tuple[int, int]] = []
    try:
        for i in range(regions):
            start = base + 2 * i * region_bytes
            for va, into in ((start, fresh), (start + g, beside)):
                h = d.create(g)
                made.append((va, h))
                t0 = clock()
                d.map(va, g, h)
                t1 = clock()
                d.set_access(va, g)
                t2 = clock()
                into["map"].append(t1 - t0)
                into["set_access"].append(t2 - t1)
    finally:
        for va, h in reversed(made):
            try:
                d.unmap(va, g)
            finally:
                d.release(h)
        d.free(base, total)
    return {f"{op}_us": max(0.0, statistics.median(fresh[op]) - statistics.median(beside[op]))
            for op in ("map", "set_access")}


def library_probe(d: Driver, clock: Clock, reps: int = 5, handles: int = 8) -> dict[str, float]:
    """Median µs of an arena's open, commit of ``handles`` handles, decommit and close."""
    g = d.granularity()
    got: dict[str, list[float]] = {"open": [], "commit": [], "decommit": [], "close": []}
    for _ in range(reps):
        t0 = clock()
        arena = Arena(d, reserve_bytes=2 * handles * g, name="refresh")
        t1 = clock()
        try:
            offs = [arena.allocate(2 * g, f"b{i}") for i in range(handles)]
            t2 = clock()
            arena.commit_many([(o, g) for o in offs])
            t3 = clock()
            arena.decommit_many([(o, 0) for o in offs])
            t4 = clock()
        finally:
            t5 = clock()
            arena.close()
            t6 = clock()
        got["open"].append(t1 - t0)
        got["commit"].append(t3 - t2)
        got["decommit"].append(t4 - t3)
        got["close"].append(t6 - t5)
    return {k: statistics.median(v) for k, v in got.items()}


def _sim_probe(data: Mapping[str, Any], where: str) -> dict[str, float]:
    prof = profile_from_data(data, where=where)
    d = SimDriver(prof)
    return library_probe(d, lambda: float(d.clock_us), reps=1)


def _no_work(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items()
            if k not in ("library_work_us", "library_overhead_us")}


def _curve_factor(old: Mapping[str, float], new_by_size: Mapping[int, float]) -> float | None:
    """Median over the measured sizes of measured / the old curve at that size."""
    back = ratios({"g": {str(s): v for s, v in new_by_size.items()}}, {"g": old})
    got = [1 / r for r in back.get("g", []) if r > 0]
    return statistics.median(got) if got else None


def quick_refresh(driver: Driver, old: Mapping[str, Any], *, clock: Clock,
                  sizes_mib: tuple[int, ...] = CALL_SIZES_MIB, reps: int = 30,
                  regions: int = 16, time_limit_s: float = 45.0,
                  date: str | None = None) -> dict[str, Any]:
    """Measure the drift-prone figures on ``driver`` and return ``old`` refreshed.

    Args:
        driver: the card's driver (CUDA), or any driver with a ``clock`` (a simulator).
        old: the full profile's data (:func:`~kvvmm.hardware.profile_data`).
        clock: µs now (CUDA: the wall clock; a simulator: its ``clock_us``).
        sizes_mib, reps: the per-call section's handle sizes and rounds (it stops early,
            after 5 rounds at least, once ``time_limit_s`` is spent).
        regions: untouched regions the first-touch section maps into.
        date: the refreshed profile's date (default: now, UTC).
    Returns:
        The refreshed profile's data (schema-checked): the old figures times each group's
        factor, ``refreshed`` saying what was measured and the factors, ``spread`` recomputed
        with the old figures in its history.
    Raises:
        ArgumentError: ``old`` has no call costs to refresh (a new card: run the full
            calibrate).
        DriverError: a driver call failed (what this made is given back first).
    """
    base = figures_of(old)
    if not any(g.startswith("call_costs.") for g in base):
        raise ArgumentError("profile", old.get("key", "?"),
                            "a full profile with call_costs (a new card needs the full "
                            "kvvmm calibrate first)")
    started = time.monotonic()
    deadline = started + time_limit_s
    means, rounds = _per_call(driver, clock, tuple(sizes_mib), reps, deadline)
    factors: dict[str, float] = {}
    for op in _OPS:
        g = f"call_costs.{op}"
        if g in base and means.get(op):
            f = _curve_factor(base[g], means[op])
            if f is not None and f > 0:
                factors[g] = f
    ft_old = base.get("first_touch", {})
    ft_new: dict[str, float] = {}
    if ft_old:
        region = int(old["first_touch"].get("region_mib", 512)) * MiB
        ft_new = _first_touch(driver, clock, region, regions)
        fs = [ft_new[k] / v for k, v in ft_old.items() if v > 0 and ft_new.get(k, 0) > 0]
        if fs:
            factors["first_touch"] = statistics.median(fs)
    calls_common = median_factor(factors)
    for g in base:
        if g not in factors and g not in ("library_work_us", "library_overhead_us"):
            factors[g] = factors.get(FOLLOWS.get(g, ""), calls_common)
    # Library work: the probe's time less what the refreshed calls charge for its calls.
    lib: dict[str, Any] = {}
    if "library_work_us" in base:
        measured = library_probe(driver, clock)
        calls_now = _sim_probe(_no_work(scaled(old, factors)), "refreshed calls")
        old_full = _sim_probe(old, "old profile")
        old_calls = _sim_probe(_no_work(old), "old calls")
        fs = []
        for k, t in measured.items():
            work_new, work_old = t - calls_now[k], old_full[k] - old_calls[k]
            if work_old > 0 and work_new > 0:
                fs.append(work_new / work_old)
        lib = {"measured_us": measured, "calls_us": calls_now}
        if fs:
            factors["library_work_us"] = statistics.median(fs)
    common = median_factor(factors)
    for g in base:
        if g not in factors:
            factors[g] = factors.get(FOLLOWS.get(g, ""), common)
    new = scaled(old, factors)
    when = date or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    old_spread = old.get("spread")
    kept = old_spread.get("history", []) if isinstance(old_spread, Mapping) else []
    history = [*list(kept),
               {"date": str(old.get("date", "")), "source": "before kvvmm calibrate --quick "
                f"--profile ({old.get('key', '?')})", "figures": base}]
    seconds = round(time.monotonic() - started, 2)
    new["date"] = when[:10]
    new["refreshed"] = {
        "date": when, "from_date": str(old.get("date", "")), "seconds": seconds,
        "measured": list(MEASURED), "factors": {g: round(f, 4) for g, f in factors.items()},
        "raw": {"per_call_us": {op: {str(s): round(v, 3) for s, v in by.items()}
                                for op, by in means.items()},
                "first_touch_us": ft_new, "library": lib},
        "how": "kvvmm calibrate --quick --profile: the measured groups times measured / "
               "profile (median over sizes), the rest times the call they follow or the "
               "median factor",
    }
    new["spread"] = spread_section(
        new, history=history, rounds=rounds,
        source=f"kvvmm calibrate --quick --profile, {when}: ratios of the {len(history)} "
               "calibrations kept (the profile before each refresh) to these figures, and "
               "of this run's blocks of rounds to their mean, pooled")
    profile_from_data(new, where="refreshed profile")  # it meets the schema, or this fails
    return new


def refreshed_profile(driver: Driver, old: Mapping[str, Any], *, clock: Clock,
                      **kw: Any) -> DeviceProfile:
    """:func:`quick_refresh` as a profile (for code that uses it at once)."""
    return profile_from_data(quick_refresh(driver, old, clock=clock, **kw),
                             where="refreshed profile")

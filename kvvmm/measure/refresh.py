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
from functools import partial
from typing import Any

from kvvmm.arena import Arena
from kvvmm.checks import number_arg
from kvvmm.driver.base import Driver
from kvvmm.driver.sim import SimDriver
from kvvmm.errors import ArgumentError
from kvvmm.hardware import DeviceProfile, profile_from_data
from kvvmm.hardware.spread import figures_of, scaled
from kvvmm.measure.fit import MIN_CONTEXT_CALLS, net_in_context
from kvvmm.measure.plan import Plan
from kvvmm.measure.stats import Measurement, median_factor, ratios, spread_section
from kvvmm.measure.timer import CallTimes, time_handle_calls
from kvvmm.units import MiB

__all__ = ["CALL_SIZES_MIB", "MEASURED", "REFERENCES", "library_probe", "quick_refresh",
           "refresh_from", "touch_model"]

#: Handle sizes the per-call section times (MiB).
CALL_SIZES_MIB = (2, 8, 32, 128, 512)
#: Reservation sizes reserve and free are timed at (MiB: 1 GiB and 64 GiB).
RESERVE_SIZES_MIB = (1024, 65536)
#: The groups measured (every other group is rescaled).
MEASURED = ("call_costs.create", "call_costs.map", "call_costs.set_access",
            "call_costs.unmap", "call_costs.release", "call_costs.reserve", "call_costs.free",
            "first_touch", "cold_calls", "library_work_us")
#: Groups that follow a measured one: the same driver call over several mappings.
FOLLOWS = {"set_access_per_mapping": "call_costs.set_access",
           "unmap_per_mapping": "call_costs.unmap"}
#: What a refresh's tight loop is compared with (:func:`refresh_from`).
REFERENCES = ("isolated", "points")
_OPS = ("create", "map", "set_access", "unmap", "release", "reserve", "free")
_HANDLE_OPS = _OPS[:5]

Clock = Callable[[], float]  #: µs, monotonic


def _per_call(d: Driver, clock: Clock, sizes: tuple[int, ...], reps: int,
              deadline: float) -> tuple[dict[str, dict[int, float]], dict[str, list[float]]]:
    """µs per call by op and size; and per op, each block of reps' mean over the whole's."""
    total = sum(sizes) * MiB
    base = d.reserve(total)
    places, off = {}, 0
    for s in sizes:
        places[s * MiB] = base + off
        off += s * MiB
    times = CallTimes(places)
    rng = random.Random(27)
    try:
        # the first round warms up and touches every region
        time_handle_calls(d, places, clock, rng, None)
        for r in range(1, reps + 1):
            time_handle_calls(d, places, clock, rng, times)
            if r >= 5 and time.monotonic() > deadline:
                break
    finally:
        d.free(base, total)
    t: dict[str, dict[int, list[float]]] = {
        op: {s // MiB: v for s, v in by.items()} for op, by in times.samples.items()}
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
    # the middle 80%: a few slow calls of a busy host are not the card's cost
    means = {op: {s: Measurement.of(v).trimmed_mean(high=0.1, low=0.1) for s, v in by.items() if v}
             for op, by in t.items()}
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


def _cold_calls(d: Driver, clock: Clock, pause: Callable[[float], None], rounds: int,
                gap_s: float) -> dict[str, float]:
    """µs more for the first call of each kind after a ``gap_s`` pause (``pause(gap_s)``)
    than for the calls after it (reserve and free: than in a round made at once after):
    ``rounds`` pauses."""
    g = d.granularity()
    first: dict[str, list[float]] = {op: [] for op in _OPS}
    later: dict[str, list[float]] = {op: [] for op in _OPS}
    for _ in range(rounds):
        pause(gap_s)
        for warm in (False, True):
            t: dict[str, list[float]] = {op: [] for op in _OPS}
            t0 = clock()
            va = d.reserve(4 * g * 512, 0)
            t["reserve"].append(clock() - t0)
            made: list[tuple[int, int]] = []
            try:
                for i in range(4):
                    at = va + i * 512 * g
                    t0 = clock()
                    h = d.create(g)
                    t1 = clock()
                    made.append((at, h))
                    d.map(at, g, h)
                    t2 = clock()
                    d.set_access(at, g)
                    t3 = clock()
                    t["create"].append(t1 - t0)
                    t["map"].append(t2 - t1)
                    t["set_access"].append(t3 - t2)
                while made:
                    at, h = made[0]
                    t0 = clock()
                    d.unmap(at, g)
                    t1 = clock()
                    d.release(h)
                    t2 = clock()
                    made.pop(0)
                    t["unmap"].append(t1 - t0)
                    t["release"].append(t2 - t1)
            finally:
                for at, h in made:
                    try:
                        d.unmap(at, g)
                    finally:
                        d.release(h)
                t0 = clock()
                d.free(va, 4 * g * 512)
                t["free"].append(clock() - t0)
            for op in _OPS:
                if warm:
                    later[op] += t[op] if op in ("reserve", "free") else t[op][1:]
                else:
                    first[op].append(t[op][0])
                    later[op] += t[op][1:]
    return {op: max(0.0, statistics.median(first[op]) - statistics.median(later[op]))
            for op in _OPS}


def library_probe(d: Driver, clock: Clock, reps: int = 5, handles: int = 8,
                  time_calls: bool = False) -> dict[str, Any]:
    """Median µs of an arena's open, commit of ``handles`` handles, decommit and close.

    With ``time_calls`` the driver calls made inside each operation are timed too, by
    ``clock`` (:class:`~kvvmm.measure.timer.TimedDriver`, less its own cost per call), and
    the answer is ``{"wall": {op: µs}, "calls": {op: µs}}``: the work is the difference,
    measured where it happens. Without, ``{op: µs}`` of wall time only.
    """
    from kvvmm.measure.timer import TimedDriver, wrapper_cost_s

    td = TimedDriver(d, clock=lambda: clock() / 1e6) if time_calls else None
    drv: Driver = td if td is not None else d
    per_call_s = wrapper_cost_s(td, n=500) if td is not None else 0.0
    g = d.granularity()
    got: dict[str, list[float]] = {"open": [], "commit": [], "decommit": [], "close": []}
    calls: dict[str, list[float]] = {k: [] for k in got}

    def timed(op: str, fn: Callable[[], Any]) -> Any:
        if td is None:
            t0 = clock()
            out = fn()
            got[op].append(clock() - t0)
            return out
        with td.record() as made:
            t0 = clock()
            out = fn()
            wall = clock() - t0
        got[op].append(wall)
        calls[op].append(1e6 * (sum(c[2] for c in made) + per_call_s * len(made)))
        return out

    for _ in range(reps):
        arena = timed("open", lambda: Arena(drv, reserve_bytes=2 * handles * g, name="refresh"))
        try:
            offs = [arena.allocate(2 * g, f"b{i}") for i in range(handles)]
            runs = [(o, g) for o in offs]
            timed("commit", partial(arena.commit_many, runs))
            timed("decommit", partial(arena.decommit_many, [(o, 0) for o in offs]))
        finally:
            timed("close", arena.close)
    wall = {k: statistics.median(v) for k, v in got.items()}
    if td is None:
        return wall
    return {"wall": wall, "calls": {k: statistics.median(v) for k, v in calls.items()}}


#: The growths whose calls the in-context section times (the calibration's own way).
CONTEXT_POLICIES = ("default", "exact")


def in_context_calls(driver: Driver, clock: Clock, *, sync: Callable[[], None] = lambda: None,
                     policies: tuple[str, ...] = CONTEXT_POLICIES, rounds: int = 2,
                     settle_s: float = 0.3) -> dict[str, list[list[float]]]:
    """µs per call by op and handle size as kvvmm's own operations make them: the full
    calibration's growth section (``kvvmm.measure.operations.growth``: bench's decode growth
    per policy and each grown owner's close, every call timed inside), shortened to
    ``policies`` and ``rounds``. ``{op: [[MiB, µs, calls], ...]}``: what the profile's
    points are (in-context costs), so these compare with them like for like.
    """
    from kvvmm.measure.operations import growth
    from kvvmm.measure.plan import Ctx
    from kvvmm.measure.timer import TimedDriver

    plan = _context_plan(policies, rounds=rounds, settle_s=settle_s)
    td = TimedDriver(driver, clock=lambda: clock() / 1e6)
    got = growth(Ctx(td, plan, sync, cuda=False))
    return dict(got["in_context"]["points"])


def _context_plan(policies: tuple[str, ...], rounds: int = 2, settle_s: float = 0.0) -> Plan:
    """The full calibration's plan shortened to what :func:`in_context_calls` grows."""
    from dataclasses import replace

    from kvvmm.measure.plan import FULL

    return replace(FULL, policies=tuple(policies), rounds=rounds, settle_s=settle_s,
                   finalize_tokens=0)


def touch_model(old: Mapping[str, Any], first_touch_us: Mapping[str, float],
                ) -> dict[str, Any]:
    """``old`` with its first-touch model at what a refresh measured (``first_touch_us``:
    ``{"map_us", "set_access_us"}``; empty: ``old``'s own figures): the extra a refresh's
    in-context calls paid, to take out of them (:func:`~kvvmm.measure.fit.net_in_context`)."""
    ft = old.get("first_touch")
    if not isinstance(ft, Mapping):
        return dict(old)
    now = {k: float(v) for k, v in first_touch_us.items() if k in ("map_us", "set_access_us")}
    return dict(old) | {"first_touch": dict(ft) | now}


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


def _references(old: Mapping[str, Any], reference: str) -> dict[str, dict[str, float]]:
    """Per call group, the figures a tight loop of the refresh is compared with.

    ``"isolated"``: the profile's ``isolated_points`` (what the calibration's own tight loop
    measured, before the in-context ratio made the points), where it has them. ``"points"``:
    the points themselves.
    """
    base = figures_of(old)
    refs = {g: v for g, v in base.items() if g.startswith("call_costs.")}
    if reference == "isolated":
        iso = (old.get("call_costs") or {}).get("isolated_points")
        if isinstance(iso, Mapping):
            for op, pts in iso.items():
                if f"call_costs.{op}" in refs and pts:
                    refs[f"call_costs.{op}"] = {str(int(m) if float(m).is_integer() else m):
                                                float(u) for m, u in pts}
    return refs


def quick_refresh(driver: Driver, old: Mapping[str, Any], *, clock: Clock,
                  pause: Callable[[float], None] = time.sleep, settle_s: float = 0.3,
                  reference: str = "isolated", sizes_mib: tuple[int, ...] = CALL_SIZES_MIB,
                  reps: int = 30, regions: int = 16, time_limit_s: float = 45.0,
                  date: str | None = None, in_context: bool = True,
                  sync: Callable[[], None] = lambda: None,
                  ) -> dict[str, Any]:
    """Measure the drift-prone figures on ``driver`` and return ``old`` refreshed.

    Args:
        driver: the card's driver (CUDA), or any driver with a ``clock`` (a simulator).
        old: the full profile's data (:func:`~kvvmm.hardware.profile_data`).
        clock: µs now (CUDA: the wall clock; a simulator: its ``clock_us``).
        pause: lets ``seconds`` pass outside the driver, for the cold calls (CUDA:
            ``time.sleep``; a simulator: its ``pause``, since it does not sleep).
        settle_s: the pause before each in-context growth (a simulator has nothing to
            settle: 0).
        reference: what the per-call timings are compared with (see :func:`refresh_from`):
            ``"isolated"`` (a card's tight loop) or ``"points"`` (a simulator charges the
            points).
        sizes_mib, reps: the per-call section's handle sizes and rounds (it stops early,
            after 5 rounds at least, once ``time_limit_s`` is spent).
        regions: untouched regions the first-touch section maps into.
        date: the refreshed profile's date (default: now, UTC).
        in_context: also time the calls inside two short decode growths and their closes
            (:func:`in_context_calls`, a few seconds on an H200): where a size was called
            often enough there, that is its group's factor (like for like with the points).
        sync: waits for the device (CUDA: ``torch.cuda.synchronize``).
    Returns:
        The refreshed profile's data (schema-checked), as :func:`refresh_from` makes it.
    Raises:
        ArgumentError: ``old`` has no call costs to refresh (a new card: run the full
            calibrate), an unknown ``reference``, or a ``settle_s`` below 0.
        DriverError: a driver call failed (what this made is given back first).
    """
    base = figures_of(old)
    if not any(g.startswith("call_costs.") for g in base):
        raise ArgumentError("profile", old.get("key", "?"),
                            "a full profile with call_costs (a new card needs the full "
                            "kvvmm calibrate first)")
    if reference not in REFERENCES:
        raise ArgumentError("reference", reference, f"one of {', '.join(REFERENCES)}")
    number_arg("settle_s", settle_s, lo=0.0, unit="seconds")
    started = time.monotonic()
    deadline = started + time_limit_s
    means, rounds = _per_call(driver, clock, tuple(sizes_mib), reps, deadline)
    ft_new: dict[str, float] = {}
    if base.get("first_touch"):
        region = int(old["first_touch"].get("region_mib", 512)) * MiB
        ft_new = _first_touch(driver, clock, region, regions)
    cold: dict[str, float] = {}
    if base.get("cold_calls"):
        cold = _cold_calls(driver, clock, pause, rounds=4,
                           gap_s=float(old["cold_calls"].get("gap_ms", 50.0)) / 1e3)
    library: dict[str, Any] = {}
    if "library_work_us" in base:  # the calls inside the probe timed where they run
        lp = library_probe(driver, clock, time_calls=True)
        library = {"measured_us": lp["wall"], "calls_timed_us": lp["calls"]}
    ic = in_context_calls(driver, clock, sync=sync, settle_s=settle_s) if in_context else {}
    raw = {"per_call_us": {op: {str(s): round(v, 3) for s, v in by.items()}
                           for op, by in means.items()},
           "in_context_us": ic, "in_context_policies": list(CONTEXT_POLICIES) if ic else [],
           "first_touch_us": ft_new, "cold_calls_us": cold, "library": library,
           "rounds": rounds, "reference": reference}
    return refresh_from(old, raw, date=date, seconds=round(time.monotonic() - started, 2))


def refresh_from(old: Mapping[str, Any], raw: Mapping[str, Any], *, date: str | None = None,
                 seconds: float = 0.0) -> dict[str, Any]:
    """``old`` rescaled by what a refresh measured (``raw``: a refreshed profile's
    ``refreshed.raw``), with no driver: a refresh's arithmetic, repeatable from its record.

    Per call group the factor is the median over the measured sizes of measured / the
    reference curve at that size. The reference (``raw["reference"]``) is what the same tight
    loop gave on the calibration's day: on a card, the profile's ``isolated_points`` (its
    points are in-context costs, a ``context_factor`` above the tight loop's: set_access
    1.4x on the H200, so comparing a tight loop with them read every day as 0.55-0.7x);
    on a simulator, the points (it charges a call its points whatever surrounds it).
    Groups not measured follow their call (``FOLLOWS``) or take the median factor.
    """
    base = figures_of(old)
    reference = str(raw.get("reference", "points"))
    refs = _references(old, reference)
    factors: dict[str, float] = {}
    per_call = raw.get("per_call_us", {})
    ic_measured = raw.get("in_context_us") or {}
    ft_new = dict(raw.get("first_touch_us") or {})
    # The growth calls that entered fresh VA paid the first-touch extra, which the profile's
    # points are net of (the sim charges it on its own): net these the same way, at the
    # extra this refresh measured, or every such call reads as the calls having slowed.
    policies = tuple(raw.get("in_context_policies") or CONTEXT_POLICIES)
    ic, touch = net_in_context(ic_measured, touch_model(old, ft_new), _context_plan(policies))
    how: dict[str, str] = {}
    for op in _OPS:
        g = f"call_costs.{op}"
        if g not in base:
            continue
        seen = {int(m): float(u) for m, u, n in ic.get(op, []) if n >= MIN_CONTEXT_CALLS}
        if seen:  # in context, like the points: the figure the sim charges
            f = _curve_factor(base[g], seen)
            if f is not None and f > 0:
                factors[g], how[g] = f, "in context"
                continue
        by = {int(float(s)): float(v) for s, v in (per_call.get(op) or {}).items()}
        if by:
            f = _curve_factor(refs.get(g, base[g]), by)
            if f is not None and f > 0:
                factors[g], how[g] = f, f"tight loop vs {reference}"
    seen_upm = {int(m): float(u) for m, u, n in ic.get("unmap_per_mapping", [])
                if n >= MIN_CONTEXT_CALLS}
    if seen_upm and "unmap_per_mapping" in base:
        f = _curve_factor(base["unmap_per_mapping"], seen_upm)
        if f is not None and f > 0:
            factors["unmap_per_mapping"], how["unmap_per_mapping"] = f, "in context"
    ft_old = base.get("first_touch", {})
    if ft_old and ft_new:
        fs = [ft_new[k] / v for k, v in ft_old.items() if v > 0 and ft_new.get(k, 0) > 0]
        if fs:
            factors["first_touch"] = statistics.median(fs)
    cold_old = base.get("cold_calls", {})
    cold_new = dict(raw.get("cold_calls_us") or {})
    if cold_old and cold_new:
        fs = [cold_new[k] / v for k, v in cold_old.items() if v > 0 and cold_new.get(k, 0) > 0]
        if fs:
            factors["cold_calls"], how["cold_calls"] = statistics.median(fs), "measured"
    calls_common = median_factor(factors)
    for g in base:
        if g not in factors and g not in ("library_work_us", "library_overhead_us"):
            factors[g] = factors.get(FOLLOWS.get(g, ""), calls_common)
    # Library work: the probe's time less what the refreshed calls charge for its calls.
    lib: dict[str, Any] = {}
    measured = dict((raw.get("library") or {}).get("measured_us") or {})
    timed = dict((raw.get("library") or {}).get("calls_timed_us") or {})
    if "library_work_us" in base and measured:
        # The calls inside the probe: as timed there, else (a record from before they
        # were timed) as the refreshed profile charges them.
        calls_now = timed or _sim_probe(_no_work(scaled(old, factors)), "refreshed calls")
        old_full = _sim_probe(old, "old profile")
        old_calls = _sim_probe(_no_work(old), "old calls")
        fs = []
        for k, t in measured.items():
            work_new, work_old = t - calls_now[k], old_full[k] - old_calls[k]
            if work_old > 0 and work_new > 0:
                fs.append(work_new / work_old)
        lib = {"measured_us": measured, "calls_timed_us": timed, "calls_us": calls_now,
               "calls_from": "timed inside the probe" if timed else "the refreshed profile"}
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
    new["date"] = when[:10]
    new["refreshed"] = {
        "date": when, "from_date": str(old.get("date", "")), "seconds": seconds,
        "measured": list(MEASURED), "factors": {g: round(f, 4) for g, f in factors.items()},
        "factor_from": how,
        "raw": {"per_call_us": per_call, "in_context_us": ic_measured,
                "in_context_policies": list(policies) if ic_measured else [],
                "first_touch_us": ft_new,
                "cold_calls_us": cold_new, "library": lib,
                "rounds": raw.get("rounds", {}), "reference": reference},
        "first_touch_in_context_us": {op: {str(m): us for m, us in by.items()}
                                      for op, by in touch.items()},
        "how": "kvvmm calibrate --quick --profile: the measured groups times measured / "
               f"reference ({reference}; median over sizes), the rest times the call they "
               "follow or the median factor; calls timed in context net of the first-touch "
               "extra in them (first_touch_in_context_us), as the profile's points are",
    }
    new["spread"] = spread_section(
        new, history=history, rounds=dict(raw.get("rounds") or {}),
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

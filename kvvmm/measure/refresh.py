"""``kvvmm calibrate --quick --profile EXISTING``: refresh a full profile in about a minute.

What drifts between sessions is the level of the per-call costs, the first-touch extra, the
cold premium and the library's own work. These are measured with the full calibration's own
sections (:mod:`kvvmm.measure.calls`) on a plan cut to a minute (:func:`refresh_plan`), and
the existing profile is rescaled: each measured group by the median over sizes of measured /
profile; the library work by an arena's open, commit, decommit and close timed whole
(:func:`library_probe`) less its calls; every other group by the call it follows
(:data:`FOLLOWS`) or the median factor. The old figures join ``spread.history`` and the spread
is recomputed. A new card still needs the full calibrate (the curves' shapes).

A profile of capacity only (no call costs of its own) is refreshed from :data:`COSTS_FROM`'s
costs under its own capacity and granularity (:func:`with_costs`). Works on any driver given a
clock: CUDA's wall time, or a simulator's clock.
"""

from __future__ import annotations

import copy
import datetime
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

from kvvmm.arena import Arena
from kvvmm.checks import number_arg
from kvvmm.driver.base import Driver
from kvvmm.driver.sim import SimDriver
from kvvmm.errors import ArgumentError
from kvvmm.hardware import profile_from_data
from kvvmm.hardware.profiles import COSTS_FROM, shipped_data
from kvvmm.hardware.schema import COLD_SECTION
from kvvmm.hardware.spread import CALLS, figures_of, scaled
from kvvmm.measure.calls import call_times, cold_premium, reserve_times, touch_times
from kvvmm.measure.fit import MIN_CONTEXT_CALLS, net_in_context
from kvvmm.measure.plan import FULL, Ctx, Plan
from kvvmm.measure.stats import Measurement, mean_us, median_factor, ratios, spread_section
from kvvmm.measure.timer import TimedDriver, wrapper_cost_s
from kvvmm.units import MiB

__all__ = ["CALL_SIZES_MIB", "COSTS_FROM", "MEASURED", "REFERENCES", "library_probe",
           "quick_refresh", "refresh_from", "refresh_plan", "touch_model", "with_costs"]

#: Handle sizes the per-call section times (MiB).
CALL_SIZES_MIB = (2, 8, 32, 128, 512)
#: Reservation sizes reserve and free are timed at (GiB).
RESERVE_SIZES_GIB = (1, 64)
#: The figure groups of named numbers a refresh measures, each kept in its ``raw`` record as
#: ``<group>_us``.
_NAMED = ("first_touch", COLD_SECTION)
#: The groups measured (every other group is rescaled).
MEASURED = ("call_costs.create", "call_costs.map", "call_costs.set_access",
            "call_costs.unmap", "call_costs.release", "call_costs.reserve", "call_costs.free",
            *_NAMED, "library_work_us")
#: Groups that follow a measured one: the same driver call over several mappings.
FOLLOWS = {"set_access_per_mapping": "call_costs.set_access",
           "unmap_per_mapping": "call_costs.unmap"}
#: What a refresh's tight loop is compared with (:func:`refresh_from`).
REFERENCES = ("isolated", "points")
#: A profile's own fields, kept when it borrows another's costs.
_IDENTITY = ("format", "version", "key", "name", "capacity_bytes", "granularity_bytes", "source")
_WORK = ("library_work_us", "library_overhead_us")

Clock = Callable[[], float]  #: µs, monotonic


def with_costs(old: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``old`` with call costs to refresh, and whose costs they are.

    A profile with call costs: itself, and its key. One without (capacity only: the shipped
    b200, gb300): :data:`COSTS_FROM`'s figures (its date, the date the figures were
    measured) under ``old``'s own name, capacity, granularity and source.
    """
    if any(g.startswith("call_costs.") for g in figures_of(old)):
        return copy.deepcopy(dict(old)), str(old.get("key", "?"))
    lender = shipped_data()[COSTS_FROM]
    costs = {k: copy.deepcopy(v) for k, v in lender.items()
             if k not in (*_IDENTITY, "note", "calibrated_from")}
    return costs | {k: old[k] for k in _IDENTITY if k in old}, COSTS_FROM


def refresh_plan(data: Mapping[str, Any], *, sizes_mib: tuple[int, ...] = CALL_SIZES_MIB,
                 reps: int = 30, regions: int = 16, time_limit_s: float = 45.0) -> Plan:
    """The full calibration's plan cut to a refresh of ``data``: ``reps`` rounds of the
    per-call loop at ``sizes_mib`` (stopped after ``time_limit_s``, 5 rounds at least),
    reserve and free of 1 and 64 GiB, first touch in ``regions`` regions of one reservation,
    4 cold rounds after the profile's own pause (no shorter pauses)."""
    cold = data.get(COLD_SECTION)
    gap_ms = float(cold.get("gap_ms", 50.0)) if isinstance(cold, Mapping) else 50.0
    return replace(FULL, call_sizes_mib=tuple(sizes_mib), call_reps=(reps,) * len(sizes_mib),
                   call_limit_s=time_limit_s, reserve_gib=RESERVE_SIZES_GIB,
                   reserve_reps=max(3, reps // 4), touch_regions=regions, touch_reps=1,
                   cold_rounds=4, cold_gap_s=gap_ms / 1e3, cold_partial_s=())


def _middle_us(samples: list[float]) -> float:
    """µs of the mean of the middle 80% of ``samples`` (seconds): a few slow calls of a busy
    host are not the card's cost."""
    return round(Measurement.of(samples).trimmed_mean(high=0.1, low=0.1) * 1e6, 3)


def _blocks(samples: Mapping[str, Mapping[int, list[float]]]) -> dict[str, list[float]]:
    """Per call group, each block of rounds' sum over the sizes over the mean block's (up
    to 5 blocks of at least 4 rounds): how far the calls moved within this run."""
    out: dict[str, list[float]] = {}
    for op, by in samples.items():
        n = min(len(v) for v in by.values())
        blocks = max(1, min(5, n // 4))
        size = n // blocks
        whole = sum(sum(v[:blocks * size]) / blocks for v in by.values())
        if whole > 0:
            out[f"call_costs.{op}"] = [
                round(sum(sum(v[b * size:(b + 1) * size]) for v in by.values()) / whole, 4)
                for b in range(blocks)]
    return out


def _measure(ctx: Ctx, data: Mapping[str, Any], clock: Clock, *, settle_s: float,
             in_context: bool) -> dict[str, Any]:
    """What a refresh of ``data`` measures on ``ctx``'s driver (a refresh's ``raw``)."""
    base = figures_of(data)
    times = call_times(ctx).samples
    samples = ({op: {s // MiB: v for s, v in by.items()} for op, by in times.items()}
               | {op: {g * 1024: v for g, v in by.items()}
                  for op, by in reserve_times(ctx).items()})
    touch: dict[str, float] = {}
    if base.get("first_touch"):
        got, _ = touch_times(ctx)
        touch = {f"{op}_us": max(0.0, mean_us(got["fresh"][op]) - mean_us(got["beside"][op]))
                 for op in ("map", "set_access")}
    cold: dict[str, float] = {}
    if base.get(COLD_SECTION):
        cold = {op: max(0.0, v) for op, v in cold_premium(ctx)["premium_us"].items()}
    library: dict[str, Any] = {}
    if "library_work_us" in base:  # the calls inside the probe timed where they run
        lp = library_probe(ctx.td.inner, clock, time_calls=True)
        library = {"measured_us": lp["wall"], "calls_timed_us": lp["calls"]}
    ic = in_context_calls(ctx.td.inner, clock, sync=ctx.sync, settle_s=settle_s) \
        if in_context else {}
    return {"per_call_us": {op: {str(s): _middle_us(v) for s, v in by.items() if v}
                            for op, by in samples.items()},
            "in_context_us": ic, "in_context_policies": list(CONTEXT_POLICIES) if ic else [],
            "first_touch_us": touch, f"{COLD_SECTION}_us": cold, "library": library,
            "rounds": _blocks(samples)}


def library_probe(d: Driver, clock: Clock, reps: int = 5, handles: int = 8,
                  time_calls: bool = False) -> dict[str, Any]:
    """Median µs of an arena's open, commit of ``handles`` handles, decommit and close.

    With ``time_calls`` the driver calls made inside each operation are timed too, by
    ``clock`` (:class:`~kvvmm.measure.timer.TimedDriver`, less its own cost per call), and
    the answer is ``{"wall": {op: µs}, "calls": {op: µs}}``: the work is the difference,
    measured where it happens. Without, ``{op: µs}`` of wall time only.
    """
    td = TimedDriver(d, clock=lambda: clock() / 1e6)
    per_call_s = wrapper_cost_s(td, n=500) if time_calls else 0.0
    drv: Driver = td if time_calls else d
    g = d.granularity()
    wall: dict[str, list[float]] = {"open": [], "commit": [], "decommit": [], "close": []}
    calls: dict[str, list[float]] = {k: [] for k in wall}

    def timed(op: str, fn: Callable[[], Any]) -> Any:
        with td.record() as made:
            t0 = clock()
            out = fn()
            wall[op].append(clock() - t0)
        calls[op].append(1e6 * (sum(c[2] for c in made) + per_call_s * len(made)))
        return out

    for _ in range(reps):
        arena = timed("open", lambda: Arena(drv, reserve_bytes=2 * handles * g, name="refresh"))
        try:
            offs = [arena.allocate(2 * g, f"b{i}") for i in range(handles)]
            timed("commit", partial(arena.commit_many, [(o, g) for o in offs]))
            timed("decommit", partial(arena.decommit_many, [(o, 0) for o in offs]))
        finally:
            timed("close", arena.close)
    medians = {k: statistics.median(v) for k, v in wall.items()}
    if not time_calls:
        return medians
    return {"wall": medians, "calls": {k: statistics.median(v) for k, v in calls.items()}}


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

    plan = _context_plan(policies, rounds=rounds, settle_s=settle_s)
    td = TimedDriver(driver, clock=lambda: clock() / 1e6)
    got = growth(Ctx(td, plan, sync, cuda=False))
    return dict(got["in_context"]["points"])


def _context_plan(policies: tuple[str, ...], rounds: int = 2, settle_s: float = 0.0) -> Plan:
    """The full calibration's plan shortened to what :func:`in_context_calls` grows."""
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
        old: the profile's data (:func:`~kvvmm.hardware.profile_data`).
        clock: µs now (CUDA: the wall clock; a simulator: its ``clock_us``).
        pause: lets ``seconds`` pass outside the driver, for the cold premium (CUDA:
            ``time.sleep``; a simulator: its ``pause``).
        settle_s: the pause before each in-context growth (s, >= 0).
        reference: what the per-call timings are compared with (:data:`REFERENCES`, see
            :func:`refresh_from`).
        sizes_mib, reps, regions, time_limit_s: the plan (:func:`refresh_plan`).
        date: the refreshed profile's date (default: now, UTC).
        in_context: also time the calls inside two short decode growths and their closes
            (:func:`in_context_calls`); a size called often enough there takes its factor from them.
        sync: waits for the device (CUDA: ``torch.cuda.synchronize``).
    Returns:
        The refreshed profile's data (schema-checked), as :func:`refresh_from` makes it.
    Raises:
        ArgumentError: an unknown ``reference``, or a ``settle_s`` below 0.
        DriverError: a driver call failed (what this made is given back first).
    """
    if reference not in REFERENCES:
        raise ArgumentError("reference", reference, f"one of {', '.join(REFERENCES)}")
    number_arg("settle_s", settle_s, lo=0.0, unit="seconds")
    data, _ = with_costs(old)
    started = time.monotonic()
    plan = refresh_plan(data, sizes_mib=tuple(sizes_mib), reps=reps, regions=regions,
                        time_limit_s=time_limit_s)
    def seconds() -> float:
        return clock() / 1e6

    ctx = Ctx(TimedDriver(driver, clock=seconds), plan, sync, cuda=False, clock=seconds,
              pause=pause)
    raw = _measure(ctx, data, clock, settle_s=settle_s, in_context=in_context)
    return refresh_from(old, raw | {"reference": reference}, date=date,
                        seconds=round(time.monotonic() - started, 2))


def _ratio_factor(old: Mapping[str, float], new: Mapping[str, float]) -> float | None:
    """The median over the figures both have (above 0) of new / old."""
    fs = [new[k] / v for k, v in old.items() if v > 0 and new.get(k, 0) > 0]
    return statistics.median(fs) if fs else None


def _call_factors(data: Mapping[str, Any], ic: Mapping[str, Any], per_call: Mapping[str, Any],
                  reference: str) -> tuple[dict[str, float], dict[str, str]]:
    """Per call group (and ``unmap_per_mapping``), its factor and how it was had: in context
    where the growths called a size often enough (like the points), else the tight loop
    against ``reference``'s curve."""
    base = figures_of(data)
    refs = _references(data, reference)
    factors: dict[str, float] = {}
    how: dict[str, str] = {}
    groups = [(f"call_costs.{op}", op) for op in CALLS] + [("unmap_per_mapping",) * 2]
    for g, op in groups:
        if g not in base:
            continue
        seen = {int(m): float(u) for m, u, n in ic.get(op, []) if n >= MIN_CONTEXT_CALLS}
        loop = {int(float(s)): float(v) for s, v in (per_call.get(op) or {}).items()}
        for way, curve, got in (("in context", base[g], seen),
                                (f"tight loop vs {reference}", refs.get(g, base[g]), loop)):
            f = _curve_factor(curve, got) if got else None
            if f is not None and f > 0:
                factors[g], how[g] = f, way
                break
    return factors, how


def _library_factor(old: Mapping[str, Any], factors: Mapping[str, float],
                    library: Mapping[str, Any]) -> tuple[dict[str, Any], float | None]:
    """The library probe's record, and the work's factor: the probe's time less its calls
    (as timed inside it, else as the refreshed profile charges them), over the same on the
    old profile."""
    measured = dict(library.get("measured_us") or {})
    timed = dict(library.get("calls_timed_us") or {})
    if "library_work_us" not in figures_of(old) or not measured:
        return {}, None
    calls_now = timed or _sim_probe(_no_work(scaled(old, factors)), "refreshed calls")
    old_full = _sim_probe(old, "old profile")
    old_calls = _sim_probe(_no_work(old), "old calls")
    fs = [(t - calls_now[k]) / (old_full[k] - old_calls[k]) for k, t in measured.items()
          if old_full[k] - old_calls[k] > 0 and t - calls_now[k] > 0]
    lib = {"measured_us": measured, "calls_timed_us": timed, "calls_us": calls_now,
           "calls_from": "timed inside the probe" if timed else "the refreshed profile"}
    return lib, statistics.median(fs) if fs else None


def _fill(factors: dict[str, float], groups: Mapping[str, Any], skip: tuple[str, ...] = ()
          ) -> None:
    """Each group without a factor takes the one of the call it follows, else the median."""
    common = median_factor(factors)
    for g in groups:
        if g not in factors and g not in skip:
            factors[g] = factors.get(FOLLOWS.get(g, ""), common)


def refresh_from(old: Mapping[str, Any], raw: Mapping[str, Any], *, date: str | None = None,
                 seconds: float = 0.0) -> dict[str, Any]:
    """``old`` rescaled by what a refresh measured (``raw``: a refreshed profile's
    ``refreshed.raw``), with no driver: a refresh's arithmetic, repeatable from its record.

    Per call group the factor is the median over the measured sizes of measured / the reference
    curve (``raw["reference"]``): on a card, the profile's ``isolated_points`` (what the same
    tight loop gave on the calibration's day; the points are in-context costs); on a simulator,
    the points it charges. Groups not measured follow their call (:data:`FOLLOWS`) or take the
    median factor.
    """
    data, costs_from = with_costs(old)
    base = figures_of(data)
    reference = str(raw.get("reference", "points"))
    named = {g: dict(raw.get(f"{g}_us") or {}) for g in _NAMED}
    ft_new = named["first_touch"]
    # The growth calls that entered fresh VA paid the first-touch extra, which the profile's
    # points are net of (the sim charges it on its own): net these the same way, at the
    # extra this refresh measured, or every such call reads as the calls having slowed.
    policies = tuple(raw.get("in_context_policies") or CONTEXT_POLICIES)
    ic, touch = net_in_context(raw.get("in_context_us") or {}, touch_model(data, ft_new),
                               _context_plan(policies))
    factors, how = _call_factors(data, ic, raw.get("per_call_us", {}), reference)
    for g, new in named.items():
        f = _ratio_factor(base.get(g, {}), new) if new else None
        if f is not None:
            factors[g], how[g] = f, "measured"
    _fill(factors, base, skip=_WORK)
    lib, f = _library_factor(data, factors, raw.get("library") or {})
    if f is not None:
        factors["library_work_us"] = f
    _fill(factors, base)
    new = scaled(data, factors)
    when = date or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    new["date"] = when[:10]
    new["refreshed"] = {
        "date": when, "from_date": str(data.get("date", "")), "seconds": seconds,
        "costs_from": costs_from,
        "sources": f"costs: {costs_from}, measured; capacity: {data.get('key', '?')}",
        "measured": list(MEASURED), "factors": {g: round(f, 4) for g, f in factors.items()},
        "factor_from": how,
        "raw": {"per_call_us": raw.get("per_call_us", {}),
                "in_context_us": raw.get("in_context_us") or {},
                "in_context_policies": list(policies) if raw.get("in_context_us") else [],
                **{f"{g}_us": new for g, new in named.items()},
                "library": lib, "rounds": raw.get("rounds", {}), "reference": reference},
        "first_touch_in_context_us": {op: {str(m): us for m, us in by.items()}
                                      for op, by in touch.items()},
        "how": "kvvmm calibrate --quick --profile: the measured groups times measured / "
               f"reference ({reference}; median over sizes), the rest times the call they "
               "follow or the median factor; calls timed in context net of the first-touch "
               "extra in them (first_touch_in_context_us), as the profile's points are",
    }
    new["spread"] = _spread(data, new, raw, when, costs_from)
    profile_from_data(new, where="refreshed profile")  # it meets the schema, or this fails
    return new


def _spread(data: Mapping[str, Any], new: Mapping[str, Any], raw: Mapping[str, Any],
            when: str, costs_from: str) -> dict[str, Any]:
    """The refreshed profile's spread: ``data``'s history and its figures before this refresh,
    and this run's blocks of rounds."""
    old_spread = data.get("spread")
    kept = old_spread.get("history", []) if isinstance(old_spread, Mapping) else []
    history = [*list(kept),
               {"date": str(data.get("date", "")), "source": "before kvvmm calibrate --quick "
                f"--profile ({costs_from})", "figures": figures_of(data)}]
    return spread_section(
        new, history=history, rounds=dict(raw.get("rounds") or {}),
        source=f"kvvmm calibrate --quick --profile, {when}: ratios of the {len(history)} "
               "calibrations kept (the profile before each refresh) to these figures, and "
               "of this run's blocks of rounds to their mean, pooled")

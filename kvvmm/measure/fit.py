"""From measurements to a ``kvvmm-hardware-profile`` (pure: tests run these on CPU).

What ``kvvmm calibrate`` measured becomes the simulator's figures here: call costs by size
(in-context where kvvmm's operations made the calls), the library's overhead per call fitted
against the same calls replayed on the simulator, the post-release verdict, and the profile.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kvvmm.hardware.interp import Log2Curve
from kvvmm.hardware.overhead import sim_costs
from kvvmm.hardware.profiles import FORMAT, profile_from_data
from kvvmm.measure import coldtail
from kvvmm.measure.plan import Plan, plan_from_dict
from kvvmm.measure.stats import mean_us, trimmed_mean
from kvvmm.measure.timer import TimedDriver
from kvvmm.policy import parse_policy
from kvvmm.units import GiB, MiB

__all__ = ["MIN_CONTEXT_CALLS", "VERSION", "build_profile", "first_touch_in_context",
           "fit_library_overhead", "net_calibration", "net_first_touch", "net_in_context",
           "slowdown_verdict", "with_context"]


#: Written into every profile this module makes.
VERSION = 2


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``us = fixed + per_unit * units`` over ``(units, us)``; both >= 0."""
    xs = [float(u) for u, _ in points]
    ys = [float(v) for _, v in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def _in_context(rounds: Sequence[Mapping[str, Mapping[int, Sequence[float]]]],
                drift: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]],
                ) -> dict[str, Any]:
    """Per op and size, the median over rounds of each round's trimmed mean (one slow round
    does not move it), with the calls seen in all rounds; and the drift within a growth."""
    points: dict[str, list[list[float]]] = {}
    ops = sorted({op for got in rounds for op in got})
    for op in ops:
        sizes = sorted({mib for got in rounds for mib in got.get(op, {})})
        pts = []
        for mib in sizes:
            per_round = [trimmed_mean(got[op][mib]) for got in rounds if got.get(op, {}).get(mib)]
            n = sum(len(got[op][mib]) for got in rounds if got.get(op, {}).get(mib))
            pts.append([mib, round(statistics.median(per_round) * 1e6, 3), n])
        points[op] = pts
    return {
        "unit": ("[[MiB, µs, calls], ...] per op by handle size (unmap_per_mapping: per "
                 "mapping covered): the median over rounds of each round's trimmed mean"),
        "points": points,
        "rounds": len(rounds),
        "drift": {spec: {op: {"first_quarter_us": mean_us(v["first"]) if v["first"] else None,
                              "last_quarter_us": mean_us(v["last"]) if v["last"] else None}
                         for op, v in row.items()}
                  for spec, row in drift.items()},
    }


def slowdown_verdict(m: Mapping[str, Any], *, min_ratio: float = 1.15,
                     max_spread: float = 0.5) -> dict[str, Any]:
    """Whether the post-release slowdown is real and stable enough to model, and its figures.

    Real: every repeat's ratio (mean create after the release / settled) is at least
    ``min_ratio``. Stable: the repeats' range is at most ``max_spread`` of their median.
    """
    ratios = [float(r["ratio_of_means"]) for r in m.get("repeats", [])]
    base = {"measured": dict(m), "ratios": ratios,
            "source": (f"kvvmm calibrate: mean of {m.get('creates')} creates of "
                       f"{int(m.get('create_bytes', 0)) // MiB} MiB right after releasing "
                       f"{int(m.get('released_bytes', 0)) / GiB:.0f} GiB, over the same "
                       f"creates after a {'settled'} pause, {len(ratios)} repeats")}
    if len(ratios) < 2:
        return base | {"modelled": False, "why_not_modelled": "fewer than 2 repeats"}
    med = statistics.median(ratios)
    if min(ratios) < min_ratio:
        return base | {"modelled": False, "why_not_modelled":
                       f"not in every repeat (ratios {ratios}, below {min_ratio} in some)"}
    if (max(ratios) - min(ratios)) > max_spread * med:
        return base | {"modelled": False, "why_not_modelled":
                       f"repeats disagree (ratios {ratios}: range over {max_spread:.0%} of "
                       f"the median)"}
    return base | {"modelled": True, "factor": round(med, 4), "creates": int(m["creates"]),
                   "min_released_bytes": int(m["released_bytes"]) // 2}


def _points(per_call_m: Mapping[str, Any], op: str) -> list[list[float]]:
    return sorted([[int(k.removesuffix("MiB")), float(row[op])] for k, row in per_call_m.items()])


#: In-context sizes with fewer calls than this are too noisy to be a point of their own.
MIN_CONTEXT_CALLS = 16


def with_context(isolated: Sequence[Sequence[float]], context: Sequence[Sequence[float]],
                 ) -> tuple[list[list[float]], float | None]:
    """One op's call costs: the in-context points (``[MiB, µs, calls]``, those with enough
    calls) where kvvmm's operations made calls of that size; elsewhere the isolated points
    (``[MiB, µs]``) times the median ratio in-context/isolated at the in-context sizes.

    Returns the points and that ratio (None: no usable in-context point).
    """
    ctx_pts = [[float(m), float(u)] for m, u, *n in context
               if (n[0] if n else MIN_CONTEXT_CALLS) >= MIN_CONTEXT_CALLS]
    if not ctx_pts:
        return [[float(m), float(u)] for m, u in isolated], None
    if not isolated:
        return sorted(ctx_pts), 1.0
    curve = Log2Curve.from_points([(int(m * MiB), float(u)) for m, u in isolated])
    ratios = [u / curve(int(m * MiB)) for m, u in ctx_pts if curve(int(m * MiB)) > 0]
    factor = statistics.median(ratios) if ratios else 1.0
    lo, hi = min(m for m, _ in ctx_pts), max(m for m, _ in ctx_pts)
    rest = [[float(m), round(float(u) * factor, 3)] for m, u in isolated
            if m < lo / 1.5 or m > hi * 1.5]
    return sorted(ctx_pts + rest), round(factor, 4)


def first_touch_in_context(data: Mapping[str, Any], plan: Plan) -> dict[str, dict[int, float]]:
    """µs per call, by op and handle size in MiB, of the first-touch extra inside the growth
    steps calibrate times in context (``operations.growth``): what ``data``'s ``first_touch``
    model charges those calls on top of their cost.

    The simulator charges the extra on its own, so an in-context point must be net of it or it is
    charged twice. The growths are replayed on the simulator with and without the section; per
    size, the calls of every policy pooled and the extra taken as the points are
    (:func:`~kvvmm.measure.stats.trimmed_mean` with it, without it). Empty when the profile does
    not model first touch.
    """

    ft = data.get("first_touch")
    if not isinstance(ft, Mapping) or ft.get("modelled") is not True:
        return {}
    base = {k: data[k] for k in ("format", "version", "key", "name", "capacity_bytes",
                                 "granularity_bytes", "source", "date") if k in data}

    def grow_calls(with_touch: bool, spec: str) -> list[tuple[str, int, float]]:
        touch = {"first_touch": dict(ft)} if with_touch else {}
        return list(_sim_calls(base | touch, plan, spec)["grow"])

    got: dict[str, dict[int, tuple[list[float], list[float]]]] = {}
    for spec in plan.policies:
        for (op, size, on), (_, _, off) in zip(grow_calls(True, spec), grow_calls(False, spec),
                                               strict=True):
            if op in ("map", "set_access"):
                row = got.setdefault(op, {}).setdefault(size // MiB, ([], []))
                row[0].append(on)
                row[1].append(off)
    # The points' own estimator (trimmed_mean: the slowest 2% left out), not the plain mean: where
    # fewer than 2% of a size's calls enter fresh VA (Exact's 8 MiB steps, 1 in 64), the
    # point left those calls out, and taking their extra out again under-counted the size.
    out = {op: {mib: round(max(0.0, trimmed_mean(on) - trimmed_mean(off)) * 1e6, 3)
                for mib, (on, off) in by.items()} for op, by in got.items()}
    return {op: {mib: us for mib, us in by.items() if us > 0} for op, by in out.items()}


def net_first_touch(context: Sequence[Sequence[float]], extra: Mapping[int, float],
                    ) -> list[list[float]]:
    """In-context points (``[MiB, µs, calls]``) less the first-touch extra per call at each
    size (:func:`first_touch_in_context`): what the simulator charges besides it."""
    return [[m, round(float(u) - extra.get(int(m), 0.0), 3), *n] for m, u, *n in context]


def net_in_context(points: Mapping[str, Sequence[Sequence[float]]], data: Mapping[str, Any],
                   plan: Plan) -> tuple[dict[str, list[list[float]]], dict[str, dict[int, float]]]:
    """In-context points by op (``{op: [[MiB, µs, calls], ...]}``, the growth section's, made
    on ``plan``'s growths) net of the first-touch extra ``data``'s model puts in them
    (:func:`first_touch_in_context`, :func:`net_first_touch`); and that extra, by op and MiB.
    What calibrate, the quick refresh and the spread's older calibrations all take out."""
    out = {op: [list(p) for p in pts] for op, pts in points.items()}
    touch = first_touch_in_context(data, plan) if out else {}
    for op, extra in touch.items():
        if out.get(op):
            out[op] = net_first_touch(out[op], extra)
    return out, touch


def net_calibration(data: Mapping[str, Any],
                    first_touch: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A calibrated profile with its map and set_access points and context factors re-derived
    as :func:`build_profile` derives them: from the in-context points it recorded
    (``calibration.raw.growth.in_context``) net of the first-touch extra (:func:`net_in_context`,
    on the plan it records), and its isolated points. ``first_touch``: the model to net with
    (default: the profile's own). Unchanged (a copy) without in-context or isolated points.
    """
    import copy

    out = copy.deepcopy(dict(data))
    raw = ((out.get("calibration") or {}).get("raw") or {}).get("growth") or {}
    ic = (raw.get("in_context") or {}).get("points") or {}
    cc = out.get("call_costs") or {}
    iso = cc.get("isolated_points") or {}
    if not ic or not iso:
        return out
    model = out if first_touch is None else out | {"first_touch": dict(first_touch)}
    netted, touch = net_in_context(ic, model,
                                   plan_from_dict((out.get("calibration") or {}).get("plan")))
    for op in touch:
        if op in iso and netted.get(op):
            pts, factor = with_context(iso[op], netted[op])
            cc["points"][op] = pts
            cc.setdefault("context_factor", {})[op] = factor
    return out


def _sim_calls(data: Mapping[str, Any], plan: Plan, spec: str,
               grow: bool = True) -> dict[str, Any]:
    """The driver calls of one growth scenario (``grow=False``: an owner made and closed),
    replayed on the simulator: the same sequence as on the GPU, each timed by its clock."""
    from kvvmm.driver.sim import SimDriver

    sim = SimDriver(profile_from_data(data, where="calibration in progress"))
    td = TimedDriver(sim, clock=lambda: sim.clock_us / 1e6)
    with td.record() as ctor_calls:
        owner = plan.workload.owner(td, parse_policy(spec))
    with td.record() as grow_calls:
        for n in plan.workload.decode_steps() if grow else ():
            owner.ensure_prefix(n)
    fin_calls: list[tuple[str, int, float]] = []
    if grow and spec == plan.policies[0] and plan.finalize_tokens:
        with td.record() as fin_calls:
            owner.finalize(plan.finalize_tokens)
    with td.record() as close_calls:
        owner.close()
    return {"construct": list(ctor_calls), "grow": list(grow_calls),
            "finalize": list(fin_calls), "close": list(close_calls)}


def _charge(data: Mapping[str, Any], calls: Sequence[tuple[str, int, float]]) -> float:
    """µs the profile's call costs (no library overhead) charge for these calls."""
    costs = sim_costs(profile_from_data(data, where="calibration in progress")).calls
    return sum(costs.mem_info_us if op == "mem_info" else costs(op, size)
               for op, size, _ in calls if op in costs.curves or op == "mem_info")


def _merge_sizes(points: Mapping[float, Sequence[float]], within: float = 1.5
                 ) -> list[list[float]]:
    """``{MiB: [us, ...]}`` -> ``[[MiB, us], ...]``, sizes within ``within`` x merged (their
    geometric mean size, their mean µs): two policies whose handles are about one size
    (Chunked(32 MiB)'s 30 and 32 MiB) measure one point, not a cliff between two."""
    groups: list[list[tuple[float, float]]] = []
    for mib in sorted(points):
        for us in points[mib]:
            if groups and mib <= groups[-1][0][0] * within:
                groups[-1].append((mib, us))
            else:
                groups.append([(mib, us)])
    return [[round(statistics.geometric_mean([m for m, _ in g]), 3),
             round(statistics.fmean([u for _, u in g]), 3)] for g in groups]


def _residual_row(data: Mapping[str, Any], plan: Plan, spec: str,
                  row: Mapping[str, Any]) -> dict[str, Any] | None:
    """One policy's growth (or a fresh owner's close) against its calls replayed on the
    simulator: µs per create (per unmap) measured beyond what the calls charge, each at
    the median handle size; None when there is nothing to fit."""
    fresh = bool(row.get("fresh"))
    if not row.get("close_us") if fresh else not row.get("grow_us"):
        return None
    sim = _sim_calls(data, plan, plan.policies[0] if fresh else spec, grow=not fresh)
    r: dict[str, Any] = {"policy": row["policy"]}
    parts = (("close", "unmap", "close_us"),) if fresh else (
        ("grow", "create", "grow_us"), ("close", "unmap", "close_us"))
    for part, op, key in parts:
        sizes = [c[1] for c in sim[part] if c[0] == op]
        meas, pred = statistics.median(row[key]), _charge(data, sim[part])
        r[f"{op}s"] = len(sizes)
        r[f"{part}_measured_us"] = meas
        if not fresh:
            r[f"{part}_calls_us"] = round(pred, 1)
        if sizes:
            r[f"us_per_{op}"] = round((meas - pred) / len(sizes), 3)
            r[f"{op}_median_mib"] = statistics.median(sizes) / MiB
    return r if not fresh or r["unmaps"] else None


def fit_library_overhead(data: Mapping[str, Any], growth_m: Mapping[str, Any],
                         library_m: Mapping[str, Any] | None, plan: Plan) -> dict[str, Any]:
    """``library_overhead_us``: µs per create and per unmap the sim adds for kvvmm's own work.

    Fitted per policy as (measured growth - what the profile's call costs charge for the
    same calls, replayed on the simulator) / creates, and likewise (measured close - calls)
    / unmaps; the median over the policies is what the sim charges. The arena's and owner's
    work per operation (``library_m``) is kept beside it as measured.
    """
    rows = {spec: r for spec, row in growth_m.items()
            if (r := _residual_row(data, plan, spec, row)) is not None}
    per_call: dict[str, float] = {}
    by_size: dict[str, dict[float, list[float]]] = {"create": {}, "unmap": {}}
    for op in by_size:
        for r in rows.values():
            if f"us_per_{op}" in r:
                by_size[op].setdefault(r[f"{op}_median_mib"], []).append(r[f"us_per_{op}"])
        # a fresh owner's close is a size of the curve, not a policy's residual
        grown = [r[f"us_per_{op}"] for spec, r in rows.items()
                 if f"us_per_{op}" in r and not growth_m[spec].get("fresh")]
        if grown:
            per_call[op] = round(statistics.median(grown), 3)
    # Each policy's handles lie around one size (Exact: a step's bytes; Chunked: its chunk),
    # so the residuals give the overhead by handle size: what the calls cost more in a growth
    # than alone depends on the size, as the calls themselves do.
    merged = {op: _merge_sizes(pts) for op, pts in by_size.items()}
    curves = {op: pts for op, pts in merged.items() if len(pts) >= 2}
    return {
        "unit": "µs of kvvmm's own work charged with each call of that kind",
        "per_call": per_call,
        "by_size": curves,
        "by_size_unit": ("µs per call by the handle size in MiB, [[MiB, us], ...]: each "
                         "policy's residual at its median handle size; where present it "
                         "replaces per_call for that call"),
        "source": ("kvvmm calibrate: settled decode growth (and the close of the grown "
                   "owner) per policy on the measured driver, minus what this profile's call costs "
                   "charge for the same calls replayed on the simulator, per create (per "
                   "unmap); the median over the policies. It holds the arena's and owner's "
                   "work per extension and what the calls cost more in a growth than alone"),
        "fit": rows,
        "measured": dict(library_m) if library_m else {},
        "measured_source": ("kvvmm calibrate: wall time of each operation minus its driver "
                            "calls timed inside a wrapper driver, less the wrapper's own cost "
                            "per call; not charged by the sim where no driver call carries it "
                            "(owner construction's tensors, steps with nothing to back)"),
    }


def _first_touch_section(ft: Mapping[str, Any], how: str) -> dict[str, Any]:
    """``first_touch``: the extra of a map (set_access) into an untouched region, the region's
    size, and whether a large mapping pays it per region it enters or once."""
    extra = {op: round(ft["fresh"][op] - ft["beside"][op], 3) for op in ("map", "set_access")}
    half = sum(ft["half_away"][op] - ft["beside"][op] for op in extra)
    whole = sum(extra.values())
    region = GiB // 2 if whole > 0 and half > 0.5 * whole else GiB
    per = "region"
    if "big" in ft:  # per region entered, or once per mapping? the closer of the two
        big_extra = sum(ft["big"]["fresh"][op] - ft["big"]["again"][op] for op in extra)
        regions = ft["big_mib"] * MiB // region
        if abs(big_extra - whole) < abs(big_extra - whole * regions):
            per = "mapping"
    return {
        "unit": "µs more for a map (set_access) whose mapping is the first in its region",
        "region_mib": region // MiB,
        "per": per,
        "map_us": max(0.0, extra["map"]), "set_access_us": max(0.0, extra["set_access"]),
        "modelled": whole > 0.2 * sum(ft["beside"][op] for op in extra),
        "source": (f"{how}: one granule mapped into each of 32 untouched 1 GiB regions of a "
                   f"fresh reservation, then one beside each, then one half a region away "
                   f"({ft['samples_per_case']} per case, means); the extra is fresh minus "
                   f"beside; the region is 512 MiB when half a region away costs over half "
                   f"the extra; modelled when the extra is over 20% of the calls. Paid per "
                   f"region a mapping enters or once per mapping: whichever is closer to "
                   f"what 2 GiB handles cost more mapped into fresh VA than mapped again"),
        "measured": dict(ft),
    }


def _call_costs_section(meas: Mapping[str, Any], data: Mapping[str, Any],
                        ic: Mapping[str, Any], plan: Plan, how: str,
                        driver_kind: object) -> dict[str, Any]:
    """``call_costs``: the isolated points by size, and in-context ones (net of first touch:
    :func:`first_touch_in_context`) where kvvmm's operations made calls of a size."""
    pc, rf = meas.get("per_call"), meas.get("reserve_free")
    points: dict[str, Any] = {}
    if pc:
        for op in ("create", "map", "set_access", "unmap", "release"):
            points[op] = _points(pc, op)
    if rf:
        for op in ("reserve", "free"):
            points[op] = sorted([int(k.removesuffix("GiB")) * 1024, float(row[op])]
                                for k, row in rf["sizes"].items())
    # The growth calls that entered fresh VA paid the first-touch extra, which the sim
    # charges on its own: the points are net of it (first_touch_in_context).
    ic_points, touch = net_in_context(ic.get("points", {}), data, plan)
    factors: dict[str, float | None] = {}
    isolated = {op: list(pts) for op, pts in points.items()}
    if ic_points:
        for op in list(points):
            points[op], factors[op] = with_context(points[op], ic_points.get(op, []))
    reps = dict(zip(plan.call_sizes_mib, plan.call_reps, strict=True))
    source = (f"{how}: mean per call (slowest 2% left out) through the "
              f"{driver_kind} driver (unmap with the synchronize CudaDriver "
              f"does first), all sizes in one reservation, interleaved in a fresh seeded "
              f"order each rep; reps per size {reps}")
    if ic_points:
        source += (f". Where kvvmm's own operations made calls of a size (an owner's "
                   f"construction, decode growth and close per policy, calls timed inside "
                   f"them, at least {MIN_CONTEXT_CALLS} per size), those are the points; "
                   f"other sizes are the isolated ones times the op's in-context ratio "
                   f"(context_factor)"
                   + ("; map and set_access points net of the first-touch extra the "
                      "growth calls that entered fresh VA paid (the sim charges it on "
                      "its own: first_touch_in_context)" if touch else ""))
    cc: dict[str, Any] = {
        "unit": "microseconds per call by handle size in MiB: [[MiB, us], ...]",
        "source": source, "points": points, "isolated_points": isolated,
        "context_factor": factors,
    }
    if rf:
        cc["mem_info_us"] = float(rf["mem_info_us"])
        cc["mem_info_source"] = f"{how}: median of 200 mem_info calls"
    return cc


def _per_mapping_sections(am: Mapping[str, Any], ic: Mapping[str, Any], plan: Plan,
                          how: str) -> dict[str, Any]:
    """``set_access_per_mapping`` and (where measured) ``unmap_per_mapping``: one call over
    k mappings, per mapping; the unmaps in context where grown owners' closes made them."""
    out: dict[str, Any] = {"set_access_per_mapping": {
        "unit": "µs per mapping covered by one set_access call, by mapping size in MiB",
        "points": sorted([int(r["mapping_mib"]), float(r["one_call_per_mapping_us"])]
                         for r in am.values()),
        "source": (f"{how}: one set_access over k fresh mappings, divided by k (median of "
                   f"{plan.access_reps} reps), beside k calls of one mapping each"),
        "measured": dict(am),
    }}
    if not all("unmap_per_mapping_us" in r for r in am.values()):
        return out
    iso = sorted([int(r["mapping_mib"]), float(r["unmap_per_mapping_us"])] for r in am.values())
    pts, factor = with_context(iso, ic.get("points", {}).get("unmap_per_mapping", []))
    out["unmap_per_mapping"] = {
        "unit": "µs per mapping covered by one unmap call, by mapping size in MiB",
        "points": pts,
        "isolated_points": iso,
        "context_factor": factor,
        "source": (f"{how}: one unmap (with CudaDriver's synchronize) over k fresh "
                   f"mappings, divided by k (mean of {2 * plan.access_reps} reps)"
                   + ("; where the closes of grown owners unmapped runs of one mapping "
                      "size, those per mapping, the other sizes times their ratio"
                      if factor is not None else "")),
    }
    return out


def _library_sections(meas: Mapping[str, Any], data: Mapping[str, Any], plan: Plan,
                      how: str) -> dict[str, Any]:
    """``library_work_us`` (per operation), ``library_overhead_us`` (the per-call residual
    fitted to the growths) and ``growth_measured``, from what was measured of them."""
    out: dict[str, Any] = {}
    lib = meas.get("library")
    if lib and isinstance(lib.get("work"), Mapping):
        out["library_work_us"] = {
            **{op: dict(row) for op, row in lib["work"].items()},
            "unit": ("µs of kvvmm's own work per arena/owner operation: fixed + per_unit x "
                     "units (the unit named per operation)"),
            "source": (f"{how}: wall time of each operation minus the driver calls it made "
                       f"(timed inside a wrapper driver, less the wrapper's cost per call), "
                       f"fitted over 1, 8 and 32 handles or mappings for the arena's; the "
                       f"owner's per buffer beyond the arena operations it makes (the arena "
                       f"charges those), median over reps"),
            "samples": dict(lib.get("samples", {})),
        }
    if meas.get("growth"):
        lo = fit_library_overhead({**data, **out}, meas["growth"], lib, plan)
        out["library_overhead_us"] = lo | {"source": f"{how}. " + lo["source"]}
        out["growth_measured"] = dict(meas["growth"])
    elif lib:
        out["library_overhead_us"] = {"per_call": {}, "measured": dict(lib),
                                      "source": f"{how}: growth not measured, nothing fitted"}
    return out


def build_profile(meas: Mapping[str, Any], meta: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
    """The ``kvvmm-hardware-profile`` JSON from what has been measured so far.

    Sections not measured (yet) are left out: the sim then uses the H200's, and says so.
    """
    date = str(meta["date"])
    card = str(meta["card"])
    how = (f"measured by kvvmm calibrate on {card}, {date} (driver {meta.get('driver')}, "
           f"torch {meta.get('torch')}, cuda-bindings {meta.get('cuda_bindings')}, kvvmm "
           f"{meta.get('kvvmm')})")
    data: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "key": str(meta["key"]), "name": card,
        "capacity_bytes": int(meta["capacity_bytes"]),
        "granularity_bytes": int(meta["granularity_bytes"]),
        "source": f"{how}: capacity from cuMemGetInfo, granularity cuMemGetAllocationGranularity",
        "date": date[:10],
        "measured_on": dict(meta),
    }
    ic = (meas.get("growth") or {}).get("in_context") or {}
    ic = ic if isinstance(ic, Mapping) else {}
    ft = meas.get("first_touch")
    if ft and "fresh" in ft:
        data["first_touch"] = _first_touch_section(ft, how)
    if meas.get("per_call") or meas.get("reserve_free"):
        data["call_costs"] = _call_costs_section(meas, data, ic, plan, how,
                                                 meta.get("driver_kind"))
    if meas.get("access_multi"):
        data |= _per_mapping_sections(meas["access_multi"], ic, plan, how)
    cold = meas.get("cold_premium")
    if cold and isinstance(cold.get("premium_us"), Mapping):
        data[coldtail.SECTION] = coldtail.section(cold, how)
    data |= _library_sections(meas, data, plan, how)
    bw = meas.get("bandwidth")
    if bw and "runs" in bw:
        data["bandwidth"] = {"unit": "TB/s of a 1 GiB bf16 copy, one entry per run",
                             "tensor_bytes": int(bw["tensor_bytes"]),
                             "source": (f"{how}: copy of a bf16 tensor by how its memory was "
                                        f"mapped (kvvmm.measure.copy_tb_s: median of 30 copies "
                                        f"per run)"),
                             "runs": bw["runs"]}
    pr = meas.get("post_release")
    if pr and pr.get("repeats"):
        v = slowdown_verdict(pr)
        data["post_release_slowdown"] = v | {"source": f"{how}: " + v["source"]}
    return data

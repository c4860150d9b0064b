"""A profile's spread: where each cost figure fell over rounds and over the calibrations kept.

A profile may carry a ``spread`` section saying how far each *figure group*
(:data:`GROUPS`: each driver call's curve, the per-mapping curves, the first-touch extra, the
cold premium, the idle release, the library's work) moved, as multiples of its figure:

- ``spread.figures.<group>``: ``{"p10", "p50", "p90", "samples"}``, quantiles of the ratios
  (another measurement / this profile's figure) over the rounds and calibrations kept;
- ``spread.history``: the figures of other calibrations of the card, each
  ``{"date", "source", "figures": {group: {label: value}}}``;
- ``spread.level``: per scenario group (:data:`LEVEL_GROUPS`), the quantiles over sessions of
  each session's factor measured / the sim's point. The sim never charges it; a band is
  widened by it afterwards (:func:`compose_level`).

A group without a spread is a point (factor 1 at every quantile: :func:`spread_notes`).
:func:`scaled` multiplies a profile's figures by a factor per group; :func:`at_quantile` puts
every group at its own quantile at once (comonotone, not a joint distribution:
docs/FIDELITY.md).
"""

from __future__ import annotations

import copy
import itertools
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvvmm.hardware.schema import COLD_SECTION, SPREAD_GROUPS

__all__ = ["CALLS", "GROUPS", "LEVEL_GROUPS", "QUANTILES", "WORKLOAD_LEVEL", "at_quantile",
           "compose_level", "factor_at", "figures_of", "level_notes", "level_of", "scaled",
           "spread_notes"]

#: The driver calls whose curves a profile carries (``call_costs.points.<call>``).
CALLS = ("create", "map", "set_access", "unmap", "release", "reserve", "free")
#: Every figure group a spread may name, in a fixed order (the schema's list).
GROUPS = SPREAD_GROUPS
#: The groups whose figures are named numbers in one object of the profile: the group's own
#: section, or the named object inside it, and the numbers' names (None: all of them).
_NAMED: dict[str, tuple[str | None, tuple[str, ...] | None]] = {
    "first_touch": (None, ("map_us", "set_access_us")),
    COLD_SECTION: ("premium_us", None),
    "idle_release": (None, ("create_us_per_gib",)),
}
#: The quantiles a spread stores, by name.
QUANTILES = (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))


def _fmt_mib(mib: float) -> str:
    return f"{mib:g}"


def _pairs_to_labels(points: Iterable[Sequence[float]]) -> dict[str, float]:
    return {_fmt_mib(float(mib)): float(v) for mib, v in points}


def _named(data: Mapping[str, Any], group: str) -> Any:
    """The object holding a :data:`_NAMED` group's numbers in ``data`` (``{}``: none)."""
    inner, _ = _NAMED[group]
    sec = data.get(group)
    if inner is not None and isinstance(sec, Mapping):
        sec = sec.get(inner)
    return sec if isinstance(sec, Mapping) else {}


def _names(named: Mapping[str, Any], group: str) -> list[str]:
    """The names of a :data:`_NAMED` group's numbers that ``named`` holds, in its order
    (declared names in the declared order)."""
    keys = _NAMED[group][1]
    return list(named) if keys is None else [k for k in keys if k in named]


def figures_of(data: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """A profile's cost figures by group: ``{group: {label: value}}``.

    Labels are handle sizes in MiB for curves (``"2"``, ``"512"``), field names otherwise
    (``"map_us"``, ``"arena.commit.fixed"``). Groups the profile lacks are left out.
    """
    out: dict[str, dict[str, float]] = {}
    cc = data.get("call_costs")
    if isinstance(cc, Mapping) and isinstance(cc.get("points"), Mapping):
        for op, pts in cc["points"].items():
            if op in CALLS and pts:
                out[f"call_costs.{op}"] = _pairs_to_labels(pts)
    for name in ("set_access_per_mapping", "unmap_per_mapping"):
        sec = data.get(name)
        if isinstance(sec, Mapping) and sec.get("points"):
            out[name] = _pairs_to_labels(sec["points"])
    for group in _NAMED:
        named = _named(data, group)
        vals = {str(k): float(named[k]) for k in _names(named, group)}
        if vals:
            out[group] = vals
    lw = data.get("library_work_us")
    if isinstance(lw, Mapping):
        vals = {}
        for op, row in lw.items():
            if isinstance(row, Mapping) and "fixed" in row:
                vals[f"{op}.fixed"] = float(row["fixed"])
                vals[f"{op}.per_unit"] = float(row.get("per_unit", 0.0))
        if vals:
            out["library_work_us"] = vals
    lo = data.get("library_overhead_us")
    if isinstance(lo, Mapping) and isinstance(lo.get("per_call"), Mapping):
        vals = {f"per_call.{k}": float(v) for k, v in lo["per_call"].items()}
        by = lo.get("by_size")
        if isinstance(by, Mapping):
            for op, pts in by.items():
                vals |= {f"by_size.{op}.{_fmt_mib(float(m))}": float(v) for m, v in pts}
        if vals:
            out["library_overhead_us"] = vals
    return out


def factor_at(row: Mapping[str, float], q: float) -> float:
    """A group's factor at quantile ``q``: linear between p10, p50 and p90, flat beyond."""
    pts = [(qq, float(row[name])) for name, qq in QUANTILES]
    if q <= pts[0][0]:
        return pts[0][1]
    for (q0, f0), (q1, f1) in itertools.pairwise(pts):
        if q <= q1:
            return f0 + (q - q0) / (q1 - q0) * (f1 - f0)
    return pts[-1][1]


def _scale_pairs(points: Any, f: float) -> list[list[float]]:
    return [[mib, round(float(v) * f, 4)] for mib, v in points]


def scaled(data: Mapping[str, Any], factors: Mapping[str, float]) -> dict[str, Any]:
    """A copy of ``data`` with each group's figures times its factor (others as they are).

    A fitted residual (``library_overhead_us``, which may be negative) is scaled as it is:
    a slower card's library is slower by the same factor either way.
    """
    out = copy.deepcopy(dict(data))
    for group, f in factors.items():
        if f == 1.0:
            continue
        if group.startswith("call_costs."):
            op = group.split(".", 1)[1]
            for key in ("points", "isolated_points"):  # a tight loop's figures move too
                pts = out.get("call_costs", {}).get(key, {})
                if isinstance(pts, dict) and op in pts:
                    pts[op] = _scale_pairs(pts[op], f)
        elif group in ("set_access_per_mapping", "unmap_per_mapping"):
            sec = out.get(group)
            if isinstance(sec, dict):
                for key in ("points", "isolated_points"):
                    if sec.get(key):
                        sec[key] = _scale_pairs(sec[key], f)
        elif group in _NAMED:
            named = _named(out, group)
            for k in _names(named, group):
                named[k] = round(float(named[k]) * f, 4)
        elif group == "library_work_us":
            sec = out.get(group)
            if isinstance(sec, dict):
                for row in sec.values():
                    if isinstance(row, dict) and "fixed" in row:
                        row["fixed"] = round(float(row["fixed"]) * f, 4)
                        if "per_unit" in row:
                            row["per_unit"] = round(float(row["per_unit"]) * f, 4)
        elif group == "library_overhead_us":
            sec = out.get(group)
            if isinstance(sec, dict) and isinstance(sec.get("per_call"), dict):
                sec["per_call"] = {k: round(float(v) * f, 4) for k, v in sec["per_call"].items()}
                if isinstance(sec.get("by_size"), dict):
                    sec["by_size"] = {k: _scale_pairs(v, f) for k, v in sec["by_size"].items()}
    return out


def at_quantile(data: Mapping[str, Any], q: float) -> dict[str, Any]:
    """``data`` with every figure group at its quantile ``q`` of the spread (a copy).

    Groups without a spread keep their figures (a point). The spread section itself is kept
    unchanged (its factors stay relative to the profile's own figures).
    """
    sp = data.get("spread")
    figs = sp.get("figures", {}) if isinstance(sp, Mapping) else {}
    return scaled(data, {g: factor_at(row, q) for g, row in figs.items()})


def spread_notes(data: Mapping[str, Any]) -> list[str]:
    """What a band made from ``data`` covers: which groups have a spread, which are points."""
    sp = data.get("spread")
    figs = dict(sp.get("figures", {})) if isinstance(sp, Mapping) else {}
    have = figures_of(data)
    points = [g for g in GROUPS if g in have and g not in figs]
    if not figs:
        return ["no spread measured: every figure is a point (the band has no width)"]
    notes = [f"spread of {len(figs)} figure groups over "
             f"{max(int(r.get('samples', 0)) for r in figs.values())} samples at most"]
    if points:
        notes.append("a point (no spread measured): " + ", ".join(points))
    return notes


# -- the session level ---------------------------------------------------------------------

#: The scenario groups a session level is fitted for, in a fixed order (docs/FIDELITY.md says
#: why these: on the H200 all of them moved with the session, each by its own amount).
LEVEL_GROUPS = ("construct", "growth", "finalize", "close", "elastic", "startup", "decode")
#: The workload replay's figures (``summary()`` keys) that have a level group; the others
#: (background time, stalls) were never measured across sessions and have none.
WORKLOAD_LEVEL = {"startup_driver_ms": "startup", "decode_driver_ms": "decode"}


def level_of(data: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """A profile's level rows by group (``{}``: no ``spread.level``, no level)."""
    sp = data.get("spread")
    lv = sp.get("level") if isinstance(sp, Mapping) else None
    groups = lv.get("groups") if isinstance(lv, Mapping) else None
    return {g: dict(row) for g, row in groups.items()} if isinstance(groups, Mapping) else {}


def compose_level(low: float, mid: float, high: float, row: Mapping[str, float] | None,
                  ) -> tuple[float, float, float]:
    """A per-call band ``(low, mid, high)`` widened by a group's level row: ``low`` times its
    p10 and ``high`` times its p90, where they reach past 1 (a level never narrows the
    per-call band: sessions that all ran faster than the sim say nothing against the
    per-call spread measured above it). No row: the band as it is.

    ``low <= mid <= high`` stays as it was.
    """
    if not row:
        return low, mid, high
    return (low * min(float(row["p10"]), 1.0), mid, high * max(float(row["p90"]), 1.0))


def level_notes(data: Mapping[str, Any]) -> list[str]:
    """What the session level adds to a band made from ``data`` (one line)."""
    rows = level_of(data)
    if not rows:
        return ["no session level measured: the band is the per-call spread only"]
    n = max(int(r.get("sessions", 0)) for r in rows.values())
    parts = ", ".join(f"{g} {r['p10']:.2f}-{r['p90']:.2f}" for g, r in rows.items())
    return textwrap.wrap(f"widened by the session level over {n} sessions (p10-p90 of "
                         f"measured / sim, where past 1): {parts}", 96)

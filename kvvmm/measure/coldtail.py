"""The profile's cold-call section (:data:`SECTION`), as ``kvvmm calibrate`` and
``kvvmm calibrate rebuild`` write it.

- :func:`section`: the premiums a calibration measured (:func:`kvvmm.measure.calls.cold_premium`),
  whether they are modelled, and the shares after shorter pauses.
- :func:`with_second_shares` (the rebuild): the share of a cold call's premium the next call
  of its kind still pays, from the committed startup probes (:data:`RUNS`). Per round, the
  second call's excess over the profile's warm cost of it, over the profile's premium; per
  kind, the median over the rounds. A run's maps are taken over that run's own warm map
  (its prefix startups' median), since the host may map slower than the profile says.
"""

from __future__ import annotations

import copy
import json
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvvmm.hardware import get_profile, profile_from_data, sim_costs
from kvvmm.hardware.schema import COLD_SECTION
from kvvmm.measure.results import results_dir

#: The profile section the premiums and the shares live in.
SECTION = COLD_SECTION
#: The startup probes' results, inside the results folder.
RUNS = ("h200-startup.json", "h200-startup-cold.json")
STARTUP = "request-ranges+deferred"
OPS = ("create", "map", "set_access")


def _warm_map_us(run: dict[str, Any]) -> float:
    """The run's own warm map: the median map of its prefix startups (160 maps each)."""
    meds = [m["by_op"]["map"]["median_us"] for order in run["orders"].values()
            for m in order["prefix"]["measured"]]
    return float(statistics.median(meds))


def second_shares(profile: Any = "h200", results: Path | None = None,
                  runs: tuple[str, ...] = RUNS) -> dict[str, Any]:
    """Per kind, the median over the rounds of (second call - its warm cost) / premium.

    Args:
        profile: the profile whose warm costs and premiums the excess is taken over (a key,
            a path or a :class:`~kvvmm.hardware.DeviceProfile`).
        results: the results folder (default: the checkout's).
        runs: the probe files inside it.
    Returns:
        ``{"second": {kind: share}, "rounds": {kind: [share per round]}}``.
    """
    results = results_dir() if results is None else results
    prof = get_profile(profile)
    costs = sim_costs(prof)
    cold = costs.cold
    assert cold is not None, "the profile models no cold calls"
    rows: dict[str, list[float]] = {op: [] for op in OPS}
    for path in runs:
        run = json.loads((results / path).read_text(encoding="utf-8"))
        map_warm = _warm_map_us(run)
        for order in run["orders"].values():
            for m in order[STARTUP]["measured"]:
                seen: dict[str, int] = {}
                for c in m["first_calls"]:
                    op = c["op"]
                    seen[op] = seen.get(op, 0) + 1
                    if op not in rows or seen[op] != 2:
                        continue
                    warm = costs.calls(op, int(c["size"]))
                    if op == "map":
                        warm = max(warm, map_warm)
                    rows[op].append(round((float(c["us"]) - warm) / cold.premium_us[op], 4))
    return {"second": {op: round(max(0.0, min(1.0, statistics.median(v))), 3)
                       for op, v in rows.items() if v},
            "rounds": {op: v for op, v in rows.items()}}


SOURCE = ("kvvmm calibrate rebuild (kvvmm.measure.coldtail) on bench/results/h200-startup.json "
          "and h200-startup-cold.json (a startup probe on an H200, 2026-12-03, 12 rounds): "
          "request-ranges+deferred's startup makes a cold create, map and set_access, then a "
          "second of each at once (a 50 MiB handle); per kind, the median over the rounds of the "
          "second call's excess over this profile's warm cost of it (the map: over the run's "
          "own warm map) over this profile's premium; the other kinds were not measured "
          "(nothing)")


def with_second(section: Mapping[str, Any], second: Mapping[str, float]) -> dict[str, Any]:
    """The cold premium's section (:data:`SECTION`) with ``second`` (and its source) after
    ``partial_source``, the rest in its order; old shares are replaced, never kept beside the
    new ones."""
    new: dict[str, Any] = {}
    for k, v in section.items():
        if k in ("second", "second_source"):
            continue
        new[k] = v
        if k == "partial_source":
            new["second"], new["second_source"] = dict(second), SOURCE
    if "second" not in new:
        new["second"], new["second_source"] = dict(second), SOURCE
    return new


def with_second_shares(data: Mapping[str, Any], results: Path) -> dict[str, Any]:
    """A copy of the profile ``data`` with its second-call shares remade from ``results``,
    over ``data``'s own warm costs and premiums (:func:`second_shares`)."""
    shares = second_shares(profile_from_data(data, where="the rebuilt profile"), results)
    out = copy.deepcopy(dict(data))
    out[SECTION] = with_second(out[SECTION], shares["second"])
    return out


def _shares(premium: Mapping[str, float],
            partial_us: Mapping[str, Mapping[str, float]]) -> dict[str, list[list[float]]]:
    """Each call's premium after each shorter pause as a share of its full premium, kept
    rising with the pause (a noisy round must not make a longer pause cheaper) and in [0, 1];
    calls whose full premium is 0 have none."""
    out: dict[str, list[list[float]]] = {}
    for op, full in premium.items():
        if full <= 0:
            continue
        pts, top = [], 0.0
        for ms, prem in sorted((float(k), v) for k, v in partial_us.items()):
            top = min(1.0, max(top, float(prem.get(op, 0.0)) / full))
            pts.append([ms, round(top, 3)])
        if pts:
            out[op] = pts
    return out


def section(cold: Mapping[str, Any], how: str) -> dict[str, Any]:
    """The profile's cold premium: µs more per call kind after a pause, modelled when the
    premiums sum to over 20% of the warm calls, with the shares after shorter pauses."""
    prem = {op: max(0.0, float(v)) for op, v in cold["premium_us"].items()}
    warm = sum(float(v) for v in cold["later_us"].values())
    sec: dict[str, Any] = {
        "unit": ("µs more for the first call of each kind after a pause (on a simulated "
                 "device: its first call of each kind, and the first after "
                 "SimDriver.pause of at least gap_ms; after shorter pauses, the share "
                 "partial gives)"),
        "gap_ms": float(cold["gap_ms"]),
        "premium_us": prem,
        "modelled": sum(prem.values()) > 0.2 * warm,
        "source": (f"{how}: {cold['rounds']} rounds of a {cold['gap_ms']:g} ms sleep, one "
                   f"round of calls (reserve, 4 x create / map / set_access, unmaps, releases, "
                   f"free), then a warm round at once; the premium is the cold rounds' "
                   f"first call's median minus the median of the later calls (reserve, "
                   f"free: the warm rounds'); modelled when the premiums sum to over 20% "
                   f"of the calls' warm costs"),
        "measured": dict(cold),
    }
    partial = _shares(prem, cold.get("partial_us") or {})
    if partial:
        sec["partial"] = partial
        sec["partial_source"] = (
            f"{how}: the same rounds after each shorter pause, its premium over the "
            f"{cold['gap_ms']:g} ms one's, per call: [[pause ms, share], ...]")
    return sec

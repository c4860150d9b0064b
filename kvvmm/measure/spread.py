"""A profile's spread and session level, fitted from the committed measurements (never typed).

Reads, from the committed results (:mod:`kvvmm.measure.results`; no GPU):

- the calibrations kept: ``fidelity-runs/*-profile.json`` (three ``kvvmm calibrate`` runs of
  one hour, 2026-12-01 12:20, 12:39, 12:43; the shipped ``h200`` carries the 12:20 run's
  costs) — each with its map and set_access points re-derived net of the first-touch extra
  its growth calls paid, as the shipped ones are (:func:`kvvmm.measure.fit.net_calibration`,
  at its own first-touch figures); every calibration whose figures then differ from the
  shipped ones joins ``spread.history``;
- the rounds: ``h200-growth-variance.json`` (16 growths of one process, every call timed by
  kind, 2026-11-29), its *settled* rounds only (the fresh one and those after a pause: the
  fidelity benchmark times settled rounds; back-to-back rounds run creates up to 3.6x slower
  and are a different scenario), each round's mean per call over the median of those rounds:
  the card's round-to-round spread of create, map and set_access.

Each figure group's p10 / p50 / p90 are the quantiles of the ratios (calibration / shipped
figure at the shipped sizes, and round / median), pooled (:func:`spread_section`).

The **session level** (``spread.level``) is taken per scenario group: the quantiles over
sessions of each session's *measured / the sim's point*, from every committed fidelity run
(:mod:`kvvmm.measure.level`, which also scores it leaving each session out). The sim side runs
the whole fidelity workload (seconds of CPU).

``kvvmm calibrate rebuild`` (:mod:`kvvmm.measure.rebuild`) writes both into the shipped
profile; ``--check`` says whether they drifted.
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvvmm.errors import ArgumentError
from kvvmm.hardware.spread import LEVEL_GROUPS, figures_of
from kvvmm.measure.stats import quantiles, spread_section

#: The kept calibrations and the growth rounds, inside the results folder.
RUNS = "fidelity-runs"
VARIANCE = "h200-growth-variance.json"
#: The growth-variance rounds that started settled (a pause, or a fresh process).
SETTLED = ("fresh", "pause")


def level_group(scenario: str) -> str | None:
    """The level group of a fidelity scenario (``bench/bench_fidelity.py``'s names:
    ``construct``, ``growth:<policy>``, ``finalize``, ``close_grown:<policy>``,
    ``close_fresh``, ``elastic:*``, ``workload:<strategy>:startup|decode``), or None
    (a count, or a name no group covers)."""
    head, _, rest = scenario.partition(":")
    if scenario in ("construct", "finalize"):
        return scenario
    if head == "growth" and rest:
        return "growth"
    if head in ("close_grown", "close_fresh"):
        return "close"
    if head == "elastic" and rest:
        return "elastic"
    if head == "workload":
        tail = rest.rpartition(":")[2]
        return tail if tail in ("startup", "decode") and ":" in rest else None
    return None


def session_levels(ratios_by_run: Mapping[str, Mapping[str, float]],
                   session_of: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """Each session's level factor per group: the median, over the session's runs and the
    group's scenarios, of *measured / predicted*.

    Args:
        ratios_by_run: per run, per scenario, measured median / the sim's point.
        session_of: each run's session (runs of one session pool their ratios).
    Returns:
        ``{session: {group: factor}}``, groups with at least one finite ratio > 0.
    """
    pooled: dict[str, dict[str, list[float]]] = {}
    for run, rows in ratios_by_run.items():
        by = pooled.setdefault(session_of[run], {})
        for scenario, r in rows.items():
            g = level_group(scenario)
            if g is not None and isinstance(r, (int, float)) and math.isfinite(r) and r > 0:
                by.setdefault(g, []).append(float(r))
    return {s: {g: round(statistics.median(rs), 4) for g, rs in by.items()}
            for s, by in pooled.items()}


def level_section(sessions: Mapping[str, Mapping[str, float]], *, source: str,
                  runs: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """A ``spread.level`` section: per group, the quantiles of the sessions' factors.

    Args:
        sessions: ``{session: {group: factor}}`` (:func:`session_levels`).
        source: how the factors were taken, for the section's ``source``.
        runs: per session, the runs it pooled (kept beside its factors).
    Raises:
        ArgumentError: a group that is not one of :data:`LEVEL_GROUPS`, or a factor that is
            not a finite number > 0.
    """
    by: dict[str, list[float]] = {}
    for factors in sessions.values():
        for g, f in factors.items():
            if g not in LEVEL_GROUPS:
                raise ArgumentError("group", g, "one of " + ", ".join(LEVEL_GROUPS))
            by.setdefault(g, []).append(f)
    groups = {g: quantiles(by[g]) | {"sessions": len(by[g])} for g in LEVEL_GROUPS if g in by}
    return {
        "unit": "per scenario group, the quantiles (p10, p50, p90) over sessions of each "
                "session's factor measured / the sim's point on this profile; a band is "
                "widened by them (low times min(p10, 1), high times max(p90, 1)); a group "
                "not listed has no level",
        "source": source,
        "groups": groups,
        "sessions": [{"session": s, "runs": list((runs or {}).get(s, ())),
                      "factors": {g: sessions[s][g] for g in LEVEL_GROUPS
                                  if g in sessions[s]}}
                     for s in sessions],
    }


def _load(path: Path | str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def history(shipped: Mapping[str, Any], results: Path) -> list[dict[str, Any]]:
    """Every kept calibration whose figures are not the shipped ones, oldest first."""
    from kvvmm.measure.fit import net_calibration

    mine = figures_of(shipped)
    model = shipped.get("first_touch") or {}
    out = []
    for path in sorted(glob.glob(str(results / RUNS / "*-profile.json"))):
        # Net of first touch as the shipped points are (its model where one did not say
        # per region or per mapping), or every calibration's map/set_access read high.
        data = _load(path)
        ft = data.get("first_touch")
        if isinstance(ft, dict):
            ft = {k: v for k, v in model.items() if k in ("per", "region_mib")} | ft
        data = net_calibration(data, ft)
        figs = figures_of(data)
        shared = [g for g in mine if g in figs]
        if shared and all(figs[g] == mine[g] for g in shared):
            # the calibration the profile carries: its figures, the profile maybe more
            # groups (measured since: cold_calls, idle_release) or the file more
            continue
        out.append({"date": str(data.get("measured_on", {}).get("date", data.get("date", ""))),
                    "source": f"bench/results/fidelity-runs/{os.path.basename(path)}",
                    "figures": figs})
    return out


def round_ratios(results: Path) -> dict[str, list[float]]:
    """Per call group, each settled round's mean µs per call over those rounds' median
    (rounds of one policy together)."""
    rounds = [r for r in _load(results / VARIANCE)["rounds"] if r["label"].startswith(SETTLED)]
    out: dict[str, list[float]] = {}
    for policy in sorted({r["policy"] for r in rounds}):
        mine = [r for r in rounds if r["policy"] == policy]
        if len(mine) < 3:  # one or two rounds say nothing of a spread
            continue
        for op in ("create", "map", "set_access"):
            means = [r["calls"][op]["mean_us"] for r in mine if op in r["calls"]]
            med = statistics.median(means)
            out.setdefault(f"call_costs.{op}", []).extend(round(m / med, 4) for m in means)
    return out


#: Groups whose spread their own probes measured (the cold-call premiums' rounds, the idle
#: release's premiums per GiB), written with their sections: this script has neither the
#: calibrations nor the rounds of them, and keeps the shipped rows as they are.
KEPT = ("cold_calls", "idle_release")


def compute(shipped: Mapping[str, Any], results: Path) -> dict[str, Any]:
    """The ``spread`` section (without its level) for ``shipped`` from the committed files."""
    hist = history(shipped, results)
    rr = round_ratios(results)
    n_rounds = len(next(iter(rr.values()), []))
    kept = {g: row for g, row in (shipped.get("spread") or {}).get("figures", {}).items()
            if g in KEPT}
    sec = spread_section(
        shipped, history=hist, rounds=rr,
        source=("kvvmm calibrate rebuild (kvvmm.measure.spread): ratios to this profile's "
                f"figures of the "
                f"{len(hist)} other kvvmm calibrate runs kept (bench/results/fidelity-runs/, "
                f"2026-12-01, at this profile's sizes) and of {n_rounds} settled growth "
                f"rounds' mean per call to their median (bench/results/"
                f"h200-growth-variance.json, 2026-11-29; create, map, set_access), pooled"
                + (f"; {', '.join(kept)}: as their probes measured them (kept)" if kept
                   else "")))
    if kept:  # in the shipped section's order (spread_section's groups)
        sec["figures"] = {g: kept.get(g, row) for g, row in sec["figures"].items()} | {
            g: row for g, row in kept.items() if g not in sec["figures"]}
    return sec


def compute_level(profile: Mapping[str, Any], results: Path) -> dict[str, Any]:
    """The ``spread.level`` section for ``profile`` from every committed fidelity run, the
    sim predicting from ``profile`` itself."""
    from kvvmm.hardware import profile_from_data
    from kvvmm.measure import fidelity as bf
    from kvvmm.measure import level as fl

    runs = fl.load_runs(fl.COMMITTED, results)
    session_of = fl.sessions_of(runs)
    mid = bf.predict(profile_from_data(profile, where="the rebuilt profile"), bf.Workload())
    ratios = {r.name: fl.run_ratios(mid, r.measured) for r in runs}
    files = ", ".join(r.path for r in runs)
    return fl.fitted_level(
        ratios, session_of,
        source=f"kvvmm calibrate rebuild (kvvmm.measure.spread): {len(runs)} committed H200 "
               f"fidelity runs in {len(set(session_of.values()))} sessions (runs under "
               f"{fl.SESSION_GAP_S:g} s apart share one): bench/results/{{{files}}}; each "
               "session's level per group is the median of its runs' measured median / the "
               "sim's point on this profile over the group's scenarios; p10/p50/p90 over "
               "sessions (few sessions: docs/FIDELITY.md)")

"""The card's session level: fitted from the committed H200 fidelity runs, and scored
leaving each session out (no GPU: the sim side of :mod:`kvvmm.measure.fidelity` only).

The per-call bands (a profile's ``spread.figures``) hold what the calibrations kept saw, all
of one hour; across sessions the H200 moved further, most scenarios together (2026-12-03 ran
0.64-0.8x the sim, 2026-12-04 up to 1.5x). This script

1. reads the committed fidelity runs (:data:`COMMITTED`; a file whose bytes repeat another's
   counts once), and groups them into **sessions**: runs less than :data:`SESSION_GAP_S`
   apart share one (the device machine is held 30 minutes at most, so runs further apart
   were measured on different loans of it);
2. tabulates each run's *measured median / the sim's point* per scenario, the sim at the
   profile (``--profile``, the shipped ``h200``) through ``bench_fidelity.predict``;
3. takes each session's level per group (:data:`kvvmm.hardware.spread.LEVEL_GROUPS`, the
   median of its runs' ratios in the group: :func:`kvvmm.measure.spread.session_levels`);
4. scores **leaving one session out**: for each session, the level is fitted
   (:func:`kvvmm.measure.spread.level_section`: p10/p50/p90 over sessions) from the *other*
   sessions only, the per-call band is widened by it (``bench_fidelity.with_level``: low
   times the group's p10, high times its p90, where they pass 1), and that session's runs
   are scored: in band
   before (per-call band) and after (composed), per run and overall, and over the runs of
   sessions other than the calibration's (the target: >= 90% of a run's scenarios);
5. compares every scenario's band width, ``(high - low) / mid``, with the card's own spread
   across runs (``(p90 - p10) / p50`` of the runs' medians) plus 0.10, beside the narrowest
   band that holds both the sim's point and the runs' p10-p90 (the point's offset from the
   card makes part of any band's width);
6. says how much of this rests on the choices made: one level for every group, the sessions'
   min-max instead of p10-p90, the level multiplied in even where it narrows the band, the
   level alone around the point, and the two spreads composed in quadrature (log) instead
   of end to end;
7. scores compositions that do not count the within-session spread twice (``composition``:
   the wider of the per-call band and the level per side; the level fitted on each ratio's
   excess beyond its per-call band), coverage left out in turn and width against the card's
   spread + 0.10 side by side; one would replace the end-to-end composition only if it
   held as many medians in band (on the committed runs none does: ``replaced``).

The level fitted on every session is what ``kvvmm calibrate rebuild`` puts in
the shipped profile (:func:`fitted_level`).

    python -m kvvmm.measure.level                 # writes bench/results/fidelity-level.json
    python -m kvvmm.measure.level --out X.json RUN.json ...
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvvmm.hardware import get_profile, profile_label
from kvvmm.hardware.spread import LEVEL_GROUPS
from kvvmm.measure import fidelity as bf
from kvvmm.measure.results import results_dir
from kvvmm.measure.spread import level_group, level_section, session_levels
from kvvmm.measure.stats import quantiles

#: Every committed H200 fidelity run with measured medians per scenario (bench/results/README.md).
#: ``bench/results/h200-fidelity.json`` is the same file as ``fidelity-runs/1222-fidelity.json``.
#: Paths inside the results folder (:mod:`kvvmm.measure.results`).
COMMITTED = (
    "fidelity-runs/1222-fidelity.json",
    "fidelity-runs/1240-fidelity.json",
    "fidelity-runs/1244-fidelity.json",
    "h200-fidelity-refreshed.json",
    "h200-fidelity-refreshed-cold.json",
    "h200-fidelity-refreshed-idle.json",
    "h200-fidelity-refreshed-1204pm.json",
)
#: Runs closer than this share a session: the device machine is held 30 minutes at most.
SESSION_GAP_S = 1800.0
#: When the shipped h200's costs were measured (its ``note``: kvvmm calibrate, 2026-12-01 12:20
#: UTC): the session holding it is the calibration's.
CALIBRATED_AT = "2026-12-01T12:20:00+00:00"
TARGET_SHARE = 0.9
WIDTH_SLACK = 0.10


@dataclass(frozen=True, slots=True)
class Run:
    """One committed fidelity run: its file, its date, each scenario's measured rounds."""

    name: str
    path: str
    date: datetime.datetime
    measured: dict[str, list[float]]


def load_runs(paths: Sequence[str], results: Path | None = None) -> list[Run]:
    """The runs, oldest first; a file whose bytes repeat an earlier one's is left out.

    A relative path is read inside ``results`` (default: the checkout's results folder).
    """
    seen: set[str] = set()
    out = []
    for p in paths:
        if not os.path.isabs(p) and results is None:
            results = results_dir()
        raw = Path(p if os.path.isabs(p) else (results or Path()) / p).read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        got = json.loads(raw)
        out.append(Run(os.path.basename(p), p, datetime.datetime.fromisoformat(got["date"]),
                       bf.measured_of(got["scenarios"])))
    return sorted(out, key=lambda r: r.date)


def sessions_of(runs: Sequence[Run], gap_s: float = SESSION_GAP_S) -> dict[str, str]:
    """Each run's session (named by its first run's date, to the minute): a run less than
    ``gap_s`` after the one before it joins that one's session."""
    out: dict[str, str] = {}
    label, last = "", None
    for r in sorted(runs, key=lambda r: r.date):
        if last is None or (r.date - last).total_seconds() >= gap_s:
            label = r.date.strftime("%Y-%m-%dT%H:%M")
        out[r.name] = label
        last = r.date
    return out


def calibration_session(runs: Sequence[Run], session_of: Mapping[str, str],
                        calibrated_at: str, gap_s: float = SESSION_GAP_S) -> str | None:
    """The session of the first run less than ``gap_s`` after the calibration, if any."""
    when = datetime.datetime.fromisoformat(calibrated_at)
    for r in sorted(runs, key=lambda r: r.date):
        if 0 <= (r.date - when).total_seconds() < gap_s:
            return session_of[r.name]
    return None


def run_ratios(mid: Mapping[str, list[float]], measured: Mapping[str, list[float]],
               ) -> dict[str, float]:
    """Per timed scenario both sides have (not a count, not 0 on either), measured median
    over the sim's point."""
    out = {}
    for name, pred in mid.items():
        if name.endswith(":calls") or not measured.get(name):
            continue
        p, m = statistics.median(pred), statistics.median(measured[name])
        if p > 0 and m > 0:
            out[name] = round(m / p, 4)
    return out


def _width(b: Sequence[float]) -> float:
    return (b[2] - b[0]) / b[1] if b[1] > 0 else 0.0


def _count(flags: Sequence[bool]) -> dict[str, Any]:
    return {"in_band": f"{sum(flags)} of {len(flags)}",
            "share": round(sum(flags) / len(flags), 4) if flags else 0.0}


def fitted_level(ratios: Mapping[str, Mapping[str, float]], session_of: Mapping[str, str],
                 *, leave_out: str | None = None, source: str) -> dict[str, Any]:
    """The ``spread.level`` section from the runs' ratios, leaving out one session's runs."""
    keep = {r: v for r, v in ratios.items() if session_of[r] != leave_out}
    levels = session_levels(keep, session_of)
    runs: dict[str, list[str]] = {}
    for r in keep:
        runs.setdefault(session_of[r], []).append(r)
    return level_section(levels, source=source, runs=runs)


# -- the sensitivity checks: the same leave-one-session-out with one choice changed ----------

Bounds = Callable[[Sequence[float]], tuple[float, float]]
Compose = Callable[[Sequence[float], tuple[float, float]], tuple[float, float]]


def _p10_p90(xs: Sequence[float]) -> tuple[float, float]:
    q = quantiles(xs)
    return q["p10"], q["p90"]


def _widen(b: Sequence[float], lv: tuple[float, float]) -> tuple[float, float]:
    return b[0] * min(lv[0], 1.0), b[2] * max(lv[1], 1.0)


def _level_alone(b: Sequence[float], lv: tuple[float, float]) -> tuple[float, float]:
    return b[1] * min(lv[0], 1.0), b[1] * max(lv[1], 1.0)


def _product(b: Sequence[float], lv: tuple[float, float]) -> tuple[float, float]:
    return min(b[0] * lv[0], b[1]), max(b[2] * lv[1], b[1])


def _min_max(xs: Sequence[float]) -> tuple[float, float]:
    return min(xs), max(xs)


def _quadrature(b: Sequence[float], lv: tuple[float, float]) -> tuple[float, float]:
    lo = math.hypot(math.log(b[0] / b[1]), math.log(min(lv[0], 1.0)))
    hi = math.hypot(math.log(b[2] / b[1]), math.log(max(lv[1], 1.0)))
    return b[1] * math.exp(-lo), b[1] * math.exp(hi)


def _wider_per_side(b: Sequence[float], lv: tuple[float, float]) -> tuple[float, float]:
    """The wider of the per-call band and the level around the point, each side on its own:
    the level's sessions already carry the within-session spread, so the two are not stacked."""
    return min(b[0], b[1] * min(lv[0], 1.0)), max(b[2], b[1] * max(lv[1], 1.0))


def _excess(r: float, b: Sequence[float]) -> float:
    """How far a ratio lies beyond the per-call band, as a factor on the end it passed (1:
    inside it)."""
    lo, hi = b[0] / b[1], b[2] / b[1]
    return r / hi if r > hi else r / lo if r < lo else 1.0


def _group_levels(ratios: Mapping[str, Mapping[str, float]], session_of: Mapping[str, str],
                  bands: Mapping[str, Sequence[float]], group: Callable[[str], str | None],
                  held: str | None, residual: bool) -> dict[str, list[float]]:
    """Per group, each session's level (the median of its runs' ratios in the group; with
    ``residual``, of their excess beyond the per-call band), the session ``held`` left out."""
    per: dict[tuple[str, str], list[float]] = {}
    for run, rows in ratios.items():
        if session_of[run] == held:
            continue
        for n, r in rows.items():
            if (g := group(n)) is not None:
                per.setdefault((session_of[run], g), []).append(
                    _excess(r, bands[n]) if residual else r)
    lv: dict[str, list[float]] = {}
    for (_, g), rs in sorted(per.items()):
        lv.setdefault(g, []).append(statistics.median(rs))
    return lv


def _loso_variant(ratios: Mapping[str, Mapping[str, float]], session_of: Mapping[str, str],
                  bands: Mapping[str, Sequence[float]], group: Callable[[str], str | None],
                  bounds: Bounds, compose: Compose, only: set[str] | None = None,
                  residual: bool = False, card: Mapping[str, float] | None = None,
                  ) -> dict[str, Any]:
    flags = []
    widths = []
    by_run: dict[str, list[bool]] = {}
    for held in sorted(set(session_of.values())):
        lv = _group_levels(ratios, session_of, bands, group, held, residual)
        for run, rows in ratios.items():
            if session_of[run] != held or (only is not None and run not in only):
                continue
            for n, r in rows.items():
                b = bands[n]
                g = group(n)
                lo, hi = compose(b, bounds(lv[g])) if g in lv else (b[0], b[2])
                flags.append(lo <= r * b[1] <= hi)
                by_run.setdefault(run, []).append(flags[-1])
                widths.append((hi - lo) / b[1])
    out = _count(flags) | {"median_width": round(statistics.median(widths), 4),
                           "per_run": {k: _count(v)["in_band"] for k, v in by_run.items()}}
    if card is not None:  # widths of the bands with the level fitted on every session
        lv = _group_levels(ratios, session_of, bands, group, None, residual)
        within = []
        for n, c in card.items():
            b, g = bands[n], group(n)
            lo, hi = compose(b, bounds(lv[g])) if g in lv else (b[0], b[2])
            within.append((hi - lo) / b[1] <= c + WIDTH_SLACK)
        out["widths_within_target_every_session"] = f"{sum(within)} of {len(within)}"
    return out


def _correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    try:
        return round(statistics.correlation(xs, ys), 3)
    except statistics.StatisticsError:  # a constant series
        return None


def score(profile: str = "h200", paths: Sequence[str] = COMMITTED,
          wl: bf.Workload | None = None, *, calibrated_at: str = CALIBRATED_AT,
          gap_s: float = SESSION_GAP_S) -> dict[str, Any]:
    """The whole report (module docstring), as JSON-ready data."""
    wl = wl or bf.Workload()
    prof = get_profile(profile)
    runs = load_runs(paths)
    session_of = sessions_of(runs, gap_s)
    calib = calibration_session(runs, session_of, calibrated_at, gap_s)
    mid = bf.predict(prof, wl)
    bands = bf.predict_bands(prof, wl, mid)
    ratios = {r.name: {n: x for n, x in run_ratios(mid, r.measured).items() if n in bands}
              for r in runs}
    sessions = sorted(set(session_of.values()))
    levels = session_levels(ratios, session_of)

    per_run: dict[str, Any] = {}
    loso: dict[str, Any] = {}
    before_all: list[bool] = []
    after_all: list[bool] = []
    before_other: list[bool] = []
    after_other: list[bool] = []
    loso_widths: dict[str, list[float]] = {}
    for held in sessions:
        sec = fitted_level(ratios, session_of, leave_out=held,
                           source=f"leave-one-session-out: every session but {held}")
        loso[held] = sec["groups"]
        lbands = bf.with_level({n: list(b) for n, b in bands.items()}, sec["groups"])
        for run in (r for r in runs if session_of[r.name] == held):
            rows: dict[str, dict[str, Any]] = {}
            for n, x in ratios[run.name].items():
                meas = x * bands[n][1]
                b, lb = bands[n], lbands[n]
                rows[n] = {"group": level_group(n), "ratio": x,
                           "measured_us": round(meas, 1),
                           "band_us": [round(v, 1) for v in b],
                           "band_level_us": [round(v, 1) for v in lb],
                           "in_band": b[0] <= meas <= b[2], "in_band_level": lb[0] <= meas <= lb[2]}
                loso_widths.setdefault(n, []).append(_width(lb))
            fb = [r["in_band"] for r in rows.values()]
            fa = [r["in_band_level"] for r in rows.values()]
            before_all += fb
            after_all += fa
            if held != calib:
                before_other += fb
                after_other += fa
            per_run[run.name] = {
                "date": run.date.isoformat(), "session": held,
                "calibration_session": held == calib,
                "before": _count(fb), "after": _count(fa),
                "target_met": (sum(fa) / len(fa)) >= TARGET_SHARE if fa else False,
                "outside_after": sorted(n for n, r in rows.items() if not r["in_band_level"]),
                "scenarios": rows}

    shipped = fitted_level(ratios, session_of, source="every session")
    sbands = bf.with_level({n: list(b) for n, b in bands.items()}, shipped["groups"])
    in_sample = [sbands[n][0] <= x * bands[n][1] <= sbands[n][2]
                 for rows in ratios.values() for n, x in rows.items()]

    widths: dict[str, Any] = {}
    for n, b in bands.items():
        meds = [ratios[r.name][n] for r in runs if n in ratios[r.name]]
        if len(meds) < 2:
            continue
        q = quantiles(meds)
        spread = (q["p90"] - q["p10"]) / q["p50"]
        w0, w1 = _width(b), _width(sbands[n])
        # No band around the sim's point holds the card's p10-p90 narrower than this.
        floor = max(q["p90"], 1.0) - min(q["p10"], 1.0)
        widths[n] = {"group": level_group(n), "runs": len(meds), "card_spread": round(spread, 4),
                     "card_median_over_sim": q["p50"], "width_floor_with_point": round(floor, 4),
                     "band_width": round(w0, 4), "band_level_width": round(w1, 4),
                     "band_level_width_loso_median": round(statistics.median(loso_widths[n]), 4),
                     "within_target_before": w0 <= spread + WIDTH_SLACK,
                     "within_target_after": w1 <= spread + WIDTH_SLACK}

    others = {r.name for r in runs if session_of[r.name] != calib}
    sens_args = (ratios, session_of, bands)
    variants: dict[str, tuple[Callable[[str], str | None], Bounds, Compose]] = {
        "per_call_band_only": (level_group, _p10_p90, lambda b, _: (b[0], b[2])),
        "as_chosen": (level_group, _p10_p90, _widen),
        "one_level_for_every_group": (lambda n: "all" if level_group(n) else None, _p10_p90,
                                      _widen),
        "sessions_min_max": (level_group, _min_max, _widen),
        "product_may_narrow": (level_group, _p10_p90, _product),
        "level_alone_around_the_point": (level_group, _p10_p90, _level_alone),
        "log_quadrature": (level_group, _p10_p90, _quadrature),
        "wider_per_side": (level_group, _p10_p90, _wider_per_side),
        "per_scenario_level": (lambda n: n if level_group(n) else None, _p10_p90, _widen),
        "per_scenario_level_wider_per_side": (lambda n: n if level_group(n) else None,
                                              _p10_p90, _wider_per_side),
    }
    card = {n: w["card_spread"] for n, w in widths.items()}
    sensitivity = {"all_runs": {k: _loso_variant(*sens_args, *v, card=card)
                                for k, v in variants.items()}
                   | {"level_on_excess": _loso_variant(*sens_args, level_group, _p10_p90,
                                                       _widen, residual=True, card=card)},
                   "other_sessions": {k: _loso_variant(*sens_args, *v, only=others)
                                      for k, v in variants.items()}
                   | {"level_on_excess": _loso_variant(*sens_args, level_group, _p10_p90,
                                                       _widen, only=others, residual=True)}}

    kept = "as_chosen"
    composition: dict[str, Any] = {
        "kept": "end to end (compose_level): low times min(p10, 1), high times max(p90, 1)",
        "candidates": {k: {"in_band_all": sensitivity["all_runs"][k]["in_band"],
                           "in_band_other_sessions": sensitivity["other_sessions"][k]["in_band"],
                           "median_width": sensitivity["all_runs"][k]["median_width"],
                           "widths_within_target": sensitivity["all_runs"][k][
                               "widths_within_target_every_session"]}
                       for k in (kept, "wider_per_side", "level_on_excess", "log_quadrature",
                                 "per_call_band_only")},
        "rule": "a composition that does not count the within-session spread twice replaces "
                "the kept one only if it holds as many medians in band (left out in turn)",
    }
    composition["replaced"] = any(
        int(c["in_band_all"].split()[0]) >= int(composition["candidates"][kept]
                                                ["in_band_all"].split()[0])
        for k, c in composition["candidates"].items()
        if k in ("wider_per_side", "level_on_excess"))

    logs = {g: [math.log(levels[s][g]) for s in sessions] for g in LEVEL_GROUPS
            if all(g in levels[s] for s in sessions)}
    evidence = {
        "levels_by_session": {s: levels[s] for s in sessions},
        "range_over_sessions": {g: [round(min(math.exp(x) for x in v), 4),
                                    round(max(math.exp(x) for x in v), 4)]
                                for g, v in logs.items()},
        "correlation_across_sessions": {g: {h: _correlation(logs[g], logs[h]) for h in logs}
                                        for g in logs},
        "note": "log of each group's session level, correlated over the sessions "
                f"({len(sessions)} points each: few)",
    }

    return {
        "benchmark": "bench/fidelity_level.py",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": bf._versions(),
        "profile": {"key": prof.key, "label": profile_label(prof), "path": prof.path,
                    "date": prof.date},
        "runs": [{"file": r.path, "date": r.date.isoformat(), "session": session_of[r.name]}
                 for r in runs],
        "sessions": {s: {"runs": [r.name for r in runs if session_of[r.name] == s],
                         "calibration": s == calib} for s in sessions},
        "session_rule": f"runs less than {gap_s:g} s apart share a session (the device "
                        "machine is held 30 minutes at most)",
        "calibration_session": calib,
        "method": "ratio = measured median / the sim's point at the profile; a session's level "
                  "per group = the median of its runs' ratios in the group; the level = "
                  "p10/p50/p90 over sessions (kvvmm.hardware.spread.level_section); band with "
                  "the level = per-call band's low times min(p10, 1), high times max(p90, 1) "
                  "(compose_level: it only widens); scored leaving each session out of the fit",
        "groups": {n: level_group(n) for n in bands},
        "ratios": {r.name: ratios[r.name] for r in runs},
        "evidence": evidence,
        "leave_one_session_out": {"levels": loso, "runs": per_run},
        "overall": {"before": _count(before_all), "after": _count(after_all)},
        "other_sessions_than_calibration": {"runs": sorted(others),
                                            "before": _count(before_other),
                                            "after": _count(after_other)},
        "target": {"share_per_run": TARGET_SHARE,
                   "runs_meeting_it_after": sorted(n for n, r in per_run.items()
                                                   if r["target_met"]),
                   "width": f"band width <= the card's spread across runs + {WIDTH_SLACK}"},
        "level_every_session": shipped,
        "in_sample_with_that_level": _count(in_sample),
        "widths": widths,
        "widths_within_target": {
            "before": f"{sum(w['within_target_before'] for w in widths.values())} of "
                      f"{len(widths)}",
            "after": f"{sum(w['within_target_after'] for w in widths.values())} of "
                     f"{len(widths)}"},
        "sensitivity": sensitivity | {
            "what": "the same leave-one-session-out score with one choice changed (and the "
                    "per-call band alone, for its width): one level for every group; the "
                    "sessions' min and max for p10 and p90; the level multiplied into both "
                    "ends even where that narrows the band (p10 > 1 or p90 < 1); the level "
                    "alone around the sim's point (no per-call band); the two spreads added "
                    "in quadrature in log space (independent) instead of end to end; the wider "
                    "of the per-call band and the level around the point, per side (no "
                    "stacking); the level fitted on each ratio's excess beyond its per-call "
                    "band (level_on_excess: what the band misses, so nothing is counted "
                    "twice), stacked; a level per scenario instead of per group (not a "
                    "profile's section: the schema has the seven groups), stacked and wider "
                    "per side; median_width: of the bands scored; "
                    "widths_within_target_every_session: of the 31 bands with that "
                    "variant's level fitted on every session, how many are no wider than "
                    "the card's spread across runs + 0.10"},
        "composition": composition,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", default=list(COMMITTED),
                    help="fidelity result files (default: every committed H200 run)")
    ap.add_argument("--profile", default="h200", help="the profile the sim predicts from")
    ap.add_argument("--out", default=None,
                    help="default: fidelity-level.json in the checkout's bench/results")
    ap.add_argument("--calibrated-at", default=CALIBRATED_AT,
                    help="when the profile's costs were measured (ISO 8601)")
    args = ap.parse_args(argv)
    res = score(args.profile, args.runs or COMMITTED, calibrated_at=args.calibrated_at)
    args.out = args.out or str(results_dir() / "fidelity-level.json")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1, allow_nan=False)
        f.write("\n")
    print(json.dumps({"overall": res["overall"],
                      "other_sessions": res["other_sessions_than_calibration"],
                      "per_run": {n: {k: r[k] for k in ("session", "before", "after")}
                                  for n, r in res["leave_one_session_out"]["runs"].items()},
                      "widths_within_target": res["widths_within_target"],
                      "sensitivity": res["sensitivity"]}, indent=1))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

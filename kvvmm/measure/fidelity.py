"""Fidelity: the same scenarios predicted by the simulator and measured on CUDA, in one run.

The simulator's clock is what the lab shows for a card nobody has at hand; this says how far
it is from the card. Each scenario runs through one function on both drivers (so they are the
same scenario by construction): on a ``SimDriver`` with the given profile (a fresh one per
scenario: nothing freed just before, as the settled GPU rounds) its clock is the prediction;
on ``CudaDriver`` the wall time (device synchronized) is the measurement, median of rounds,
each round started a settle pause after the previous owner closed (docs/MEASUREMENTS.md §3).

Scenarios (the ``kvvmm bench`` workload: 64 buffers of a Llama-3-8B-like model, bf16, page 64,
2M reserved tokens, 4096-token decode steps to 500k tokens, 122 steps):

- ``construct``: KvBufferOwner construction (reserve, 64 tensors, slot 0 backed);
- ``growth:<policy>``: the decode-growth loop per policy;
- ``finalize``: finalize to 1M tokens after the default policy's growth;
- ``close_grown:<policy>``: closing the grown owner;
- ``close_fresh``: closing an owner right after construction;
- ``elastic:commit_pages`` / ``elastic:decommit_pages``: 64 pages far apart (holes), one per
  call, then given back in another order;
- ``workload:<strategy>:startup|decode|calls``: the workload replay's first 2 minutes of
  generated traffic (llama-3.1-70b TP8's rank-0 pool), driver time as the workload module
  counts it (calls only, so predicted from the profile's call costs without the library's
  overhead), and the driver-call count (the same on both, or a bug).

A scenario whose API is not in the checkout is listed under ``skipped``. Sim/CUDA
accept-reject parity on random operation sequences (``tests/gpu/test_gpu_parity.py``'s Twin)
is counted too.

Run on a GPU, after calibrating, in one command::

    kvvmm calibrate --out /tmp/h200.json && python bench/bench_fidelity.py --profile /tmp/h200.json

``--sim-only`` runs the sim side alone (no GPU: a smoke test). The JSON (``--out``) has the
card, versions, date, the profile used, and per scenario predicted and measured µs, the
ratio predicted/measured, whether it is within 0.9-1.1, the predicted band (``band_us``:
the sim at the profile's p10, as it is, and at its p90) and whether the measured median is
in it (``in_band``); for a profile with a session level (``spread.level``), the band
composed with it too (``band_level_us``, ``in_band_level``).

``--score RESULT...`` scores ``--profile``'s bands against committed runs from other
sessions and days (no GPU): per scenario whether each run's measured median is in the band,
the share in band, and each band's width against the card's own spread over those runs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvvmm.driver.base import Driver
from kvvmm.hardware import get_profile, profile_label, sim_costs
from kvvmm.measure import rotated
from kvvmm.measure.workload import BENCH_WORKLOAD
from kvvmm.measure.workload import Workload as KvWorkload
from kvvmm.policy import parse_policy

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its bench/results

LOW, HIGH = 0.9, 1.1


@dataclass(frozen=True, slots=True)
class Workload:
    """The scenarios' KV cache and decode steps (default: ``kvvmm bench``'s), and what else
    they run; the buffers are :class:`kvvmm.measure.workload.Workload`'s (:attr:`kv`)."""

    layers: int = BENCH_WORKLOAD.layers
    reserved_tokens: int = BENCH_WORKLOAD.reserved_tokens
    step_tokens: int = BENCH_WORKLOAD.step_tokens
    grow_to_tokens: int = BENCH_WORKLOAD.grow_to_tokens
    finalize_tokens: int = BENCH_WORKLOAD.finalize_tokens
    policies: tuple[str, ...] = ("default", "exact", "chunked:32", "chunked:128",
                                 "geometric:2:1024")
    elastic_pages: int = 64  #: pages committed one by one far apart, then decommitted
    workload_s: float = 120.0  #: seconds of generated traffic served per strategy (0: none)

    @property
    def kv(self) -> KvWorkload:
        """The decode growth these scenarios time, as kvvmm bench and calibrate define it."""
        return replace(BENCH_WORKLOAD, layers=self.layers, reserved_tokens=self.reserved_tokens,
                       step_tokens=self.step_tokens, grow_to_tokens=self.grow_to_tokens,
                       finalize_tokens=self.finalize_tokens)


#: A workload small enough for a CPU test (seconds, not minutes, on the sim).
SMALL = Workload(layers=2, reserved_tokens=131072, step_tokens=4096, grow_to_tokens=65536,
                 finalize_tokens=131072, policies=("default", "exact"), elastic_pages=8,
                 workload_s=20.0)


def _owner(drv: Driver, wl: Workload, spec: str) -> Any:
    return wl.kv.owner(drv, parse_policy(spec))


Clock = Callable[[Driver], float]  # µs, monotonic: the sim's clock or the wall (synchronized)


def run_scenarios(make_driver: Callable[[], Driver], clock: Clock, wl: Workload, *,
                  rounds: int, settle_s: float, progress: Callable[[str], None] | None = None,
                  ) -> dict[str, list[float]]:
    """Every scenario ``rounds`` times (policies' order rotated each round); µs per round.

    ``make_driver`` is called for each owner (the sim: a fresh device each time; CUDA: the
    same driver), ``clock`` reads the time in µs. ``settle_s`` is slept before each owner.
    """
    out: dict[str, list[float]] = {}

    def add(name: str, us: float) -> None:
        out.setdefault(name, []).append(round(us, 1))

    specs = list(wl.policies)
    steps = wl.kv.decode_steps()
    for r in range(rounds):
        for spec in rotated(specs, r):
            if progress is not None:
                progress(f"round {r + 1}/{rounds} {spec}")
            time.sleep(settle_s)
            d = make_driver()
            t0 = clock(d)
            owner = _owner(d, wl, spec)
            t1 = clock(d)
            for n in steps:
                owner.ensure_prefix(n)
            t2 = clock(d)
            add("construct", t1 - t0)
            add(f"growth:{spec}", t2 - t1)
            if spec == "default" and wl.finalize_tokens:
                owner.finalize(wl.finalize_tokens)
                t3 = clock(d)
                add("finalize", t3 - t2)
                t2 = t3
            owner.close()
            add(f"close_grown:{spec}", clock(d) - t2)
        time.sleep(settle_s)
        d = make_driver()
        owner = _owner(d, wl, "default")
        t0 = clock(d)
        owner.close()
        add("close_fresh", clock(d) - t0)
        if wl.elastic_pages and hasattr(owner, "commit_pages"):
            time.sleep(settle_s)
            _elastic(make_driver(), clock, wl, add)
    return out


def _elastic(d: Driver, clock: Clock, wl: Workload, add: Callable[[str, float], None]) -> None:
    """Page commits far apart (holes: one granule per buffer each), then decommits in another
    order: the elastic-backing owner calls, one page per call."""
    owner = _owner(d, wl, "default")
    try:
        rng = random.Random(19)
        pages = rng.sample(range(1, owner.pages), wl.elastic_pages)
        t0 = clock(d)
        for p in pages:
            owner.commit_pages([p])
        t1 = clock(d)
        rng.shuffle(pages)
        for p in pages:
            owner.decommit_pages([p])
        t2 = clock(d)
    finally:
        owner.close()
    add("elastic:commit_pages", t1 - t0)
    add("elastic:decommit_pages", t2 - t1)


#: The GPU side's pause before each owner (``--settle-s``), which the sim side models.
SETTLE_S = 1.5


def settled(d: Driver, settle_s: float) -> Callable[[], Driver]:
    """The sim side's ``make_driver``: one device throughout, as on the GPU, paused for
    ``settle_s`` each time the GPU side sleeps (cold calls, idle releases)."""
    def make() -> Driver:
        d.pause(settle_s)  # type: ignore[attr-defined]
        return d
    return make


def predict(profile: Any, wl: Workload, settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """The sim side: every scenario once (the sim is deterministic), µs of simulated time,
    on one simulated device paused ``settle_s`` where the GPU side sleeps."""
    from kvvmm.driver.sim import SimDriver

    prof = get_profile(profile)
    out = run_scenarios(settled(SimDriver(prof), settle_s),
                        lambda d: float(d.clock_us),
                        wl, rounds=1, settle_s=0.0)
    if wl.workload_s and not _skipped().get("workload"):
        # The workload module counts driver calls only (on CUDA, each call's wall time), so
        # its prediction is the profile's call costs without the library's overhead.
        # The pool is planned for an H200 (as on the GPU side): the sim gets its capacity,
        # whatever card the profile describes; its costs are the profile's.
        bare, cap = _without_overhead(profile), get_profile("h200").capacity_bytes
        out |= workload_scenarios(settled(SimDriver(bare, capacity_bytes=cap), settle_s),
                                  wl.workload_s, "sim")
    return out


def predict_bands(profile: Any, wl: Workload, mid: dict[str, list[float]] | None = None,
                  settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """Every timed scenario's band: the sim at the profile's p10, as it is, and at its p90
    (:mod:`kvvmm.workload.bands`), ``[low, mid, high]`` µs. Counts have no band."""
    from kvvmm.workload.bands import band_profiles

    lo_p, mid_p, hi_p = band_profiles(profile)
    m = predict(mid_p, wl, settle_s) if mid is None else mid
    lo = predict(lo_p, wl, settle_s) if lo_p is not mid_p else m
    hi = predict(hi_p, wl, settle_s) if hi_p is not mid_p else m
    out = {}
    for name, v in m.items():
        if name.endswith(":calls"):
            continue
        x = statistics.median(v)
        out[name] = [min(lo[name][0], x), x, max(hi[name][0], x)]
    return out


def with_level(bands: dict[str, list[float]], rows: dict[str, dict[str, float]],
               ) -> dict[str, list[float]]:
    """Each scenario's band composed with its group's session level row (``rows``: ``{group:
    {"p10", "p50", "p90"}}``, :func:`kvvmm.hardware.spread.level_of`); a scenario whose
    group has no row keeps its band."""
    from kvvmm.hardware.spread import compose_level
    from kvvmm.measure.spread import level_group

    out = {}
    for name, (lo, mid, hi) in bands.items():
        g = level_group(name)
        out[name] = list(compose_level(lo, mid, hi, rows.get(g) if g else None))
    return out


def _skipped() -> dict[str, str]:
    """Scenarios of other issues that this checkout cannot run, and why."""
    from kvvmm.owner import KvBufferOwner

    out = {}
    if not hasattr(KvBufferOwner, "commit_pages"):
        out["elastic"] = "KvBufferOwner has no commit_pages (elastic backing not in this checkout)"
    try:
        import kvvmm.workload  # noqa: F401
    except ImportError:
        out["workload"] = "kvvmm.workload is not in this checkout"
    return out


def _without_overhead(profile: str) -> Any:
    """The profile with no library overhead: what a count of driver-call time predicts."""
    from kvvmm.hardware import profile_data, profile_from_data

    prof = get_profile(profile)
    data = {k: v for k, v in profile_data(prof).items() if k != "library_overhead_us"}
    return profile_from_data(data, where=f"{prof.key} without library overhead") if data else prof


def workload_scenarios(make_driver: Callable[[], Driver], seconds: float,
                       kind: str, settle_s: float = 0.0) -> dict[str, list[float]]:
    """The workload replay's first ``seconds`` per strategy (generated traffic, seed 0).

    µs of driver time before serving (``startup``) and during it (``decode``), as the
    workload module counts them: the sim's clock per call, CUDA's wall time per call (calls
    only: the library's work between them is not in it).
    """
    from kvvmm.workload import STRATEGIES, run_workload
    from kvvmm.workload.generator import generate

    wl = generate(seed=0, duration_s=seconds)
    out: dict[str, list[float]] = {}
    for name in STRATEGIES:
        time.sleep(settle_s)  # the previous strategy gave its pool back (§3)
        r = run_workload(wl, [name], model="llama-3.1-70b", gpu="h200", tp=8,
                         driver=make_driver).results[0]
        out[f"workload:{name}:startup"] = [round(r.startup_driver_s * 1e6, 1)]
        out[f"workload:{name}:decode"] = [round(r.decode_driver_s * 1e6, 1)]
        out[f"workload:{name}:calls"] = [float(r.driver_calls)]
    return out


def parity(steps_per_seed: int = 2000, seeds: Sequence[int] = (1, 2, 3)) -> dict[str, Any]:
    """tests/gpu/test_gpu_parity.py's Twin on random operation sequences: steps, mismatches."""
    from kvvmm.driver.cuda import CudaDriver
    from kvvmm.driver.sim import SimDriver
    # The test's own Twin (imported by name: it is a test module, not part of the package).
    twin_cls = importlib.import_module("tests.gpu.test_gpu_parity").Twin

    total = mism = refused = 0
    examples: list[str] = []
    for seed in seeds:
        cuda = CudaDriver()
        twin = twin_cls(SimDriver("h200"), cuda)
        rng = random.Random(seed)
        try:
            while twin.steps < steps_per_seed:
                twin.step(rng)
            twin.teardown()
        finally:
            cuda.close()
        total += twin.steps
        refused += twin.refused
        mism += len(twin.mismatches)
        examples += twin.mismatches[:5]
    return {"operations": total, "refused": refused, "mismatches": mism,
            "identical": mism == 0, "examples": examples, "seeds": list(seeds)}


def _versions() -> dict[str, Any]:
    import importlib.metadata as md

    from kvvmm._version import __version__

    def v(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "none"

    return {"kvvmm": __version__, "torch": v("torch"), "cuda_bindings": v("cuda-bindings"),
            "python": platform.python_version()}


def compare(predicted: dict[str, list[float]],
            measured: dict[str, list[float]] | None,
            bands: dict[str, list[float]] | None = None,
            level_bands: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """Per scenario: predicted and measured µs (median of rounds), ratio, within 0.9-1.1;
    with ``bands`` (:func:`predict_bands`), the band and whether the measured median is in
    it (``in_band``); with ``level_bands`` (:func:`with_level`), the same composed with the
    session level (``band_level_us``, ``in_band_level``)."""
    out: dict[str, Any] = {}
    for name, pred in predicted.items():
        row: dict[str, Any]
        if name.endswith(":calls"):  # a count, not a time: the same on both, or a bug
            row = {"predicted": pred[0]}
            if measured is not None and measured.get(name):
                row |= {"measured": measured[name][0], "within": pred[0] == measured[name][0]}
            out[name] = row
            continue
        row = {"predicted_us": statistics.median(pred)}
        if measured is not None and measured.get(name):
            meas = statistics.median(measured[name])
            if meas == 0 and row["predicted_us"] == 0:  # nothing to do on either (static)
                out[name] = row | {"measured_us": 0.0, "ratio": None, "within": True}
                continue
            rounds = measured[name]
            row |= {"measured_us": meas, "measured_rounds_us": rounds,
                    "ratio": round(row["predicted_us"] / meas, 4) if meas > 0 else None}
            row["within"] = row["ratio"] is not None and LOW <= row["ratio"] <= HIGH
            if len(rounds) >= 3 and meas > 0:
                # The card's own spread: a prediction inside the rounds' range is as close
                # as the card comes to itself, whatever the ratio to their median.
                row["spread"] = round((max(rounds) - min(rounds)) / meas, 4)
                row["in_rounds"] = min(rounds) <= row["predicted_us"] <= max(rounds)
        if bands is not None and name in bands:
            lo, _, hi = bands[name]
            row["band_us"] = [round(x, 1) for x in bands[name]]
            if "measured_us" in row:
                row["in_band"] = bool(lo <= row["measured_us"] <= hi)
        if level_bands is not None and name in level_bands:
            lo, _, hi = level_bands[name]
            row["band_level_us"] = [round(x, 1) for x in level_bands[name]]
            if "measured_us" in row:
                row["in_band_level"] = bool(lo <= row["measured_us"] <= hi)
        out[name] = row
    return out


def summarize(res: dict[str, Any]) -> None:
    """The summary fields of a result (``ratios``, ``outside``, ...) from its scenarios."""
    sc = res["scenarios"]
    res["ratios"] = {k: v["ratio"] for k, v in sc.items() if "ratio" in v}
    res["all_within"] = all(v.get("within") for v in sc.values())
    res["outside"] = sorted(k for k, v in sc.items() if not v.get("within"))
    res["outside_but_in_rounds"] = sorted(k for k, v in sc.items()
                                          if not v.get("within") and v.get("in_rounds"))
    timed = [v for v in sc.values() if v.get("ratio") is not None]
    res["within_count"] = f"{sum(1 for v in timed if v['within'])} of {len(timed)} timed"
    banded = [v for v in timed if "in_band" in v]
    if banded:
        n = sum(1 for v in banded if v["in_band"])
        res["in_band_count"] = f"{n} of {len(banded)} timed"
        res["in_band_share"] = round(n / len(banded), 4)
        res["outside_band"] = sorted(k for k, v in sc.items()
                                     if v.get("ratio") is not None and not v.get("in_band"))
    leveled = [v for v in timed if "in_band_level" in v]
    if leveled:
        n = sum(1 for v in leveled if v["in_band_level"])
        res["in_band_level_count"] = f"{n} of {len(leveled)} timed"
        res["in_band_level_share"] = round(n / len(leveled), 4)


def measured_of(scenarios: dict[str, Any]) -> dict[str, list[float]]:
    """A result's measurements as :func:`compare` takes them: each scenario's rounds (a
    count, or a time measured once, as one round)."""
    out: dict[str, list[float]] = {}
    for name, row in scenarios.items():
        if "measured_rounds_us" in row:
            out[name] = row["measured_rounds_us"]
        elif "measured_us" in row:
            out[name] = [row["measured_us"]]
        elif "measured" in row:
            out[name] = [row["measured"]]
    return out


def rescore(path: str) -> dict[str, Any]:
    """Recompute a result file's comparison from the figures it holds (no new measurement):
    for a result written before a field was added."""
    with open(path, encoding="utf-8") as f:
        res: dict[str, Any] = json.load(f)
    sc = res["scenarios"]
    predicted = {name: [row["predicted"] if name.endswith(":calls") else row["predicted_us"]]
                 for name, row in sc.items()}
    res["scenarios"] = compare(predicted, measured_of(sc))
    summarize(res)
    return res


def _share(xs: Sequence[bool]) -> float:
    return round(sum(xs) / len(xs), 4) if xs else 0.0


def score(profile: str, results: Sequence[str], wl: Workload | None = None,
          ) -> dict[str, Any]:
    """A profile's bands against committed measured runs (no GPU: the sim side only).

    Per result file and scenario: the band, the measured median, whether it falls in the
    band (``in_band``); the share in band per file and over all; and per scenario the
    band's width (``(high - low) / mid``) beside the card's own spread over every scored
    run's rounds (``(p90 - p10) / p50`` of them all), against the target: no wider than the
    card's spread + 0.10. A profile with a session level (``spread.level``) is scored with
    its bands composed with it as well (``in_band_level``; in sample when its level was
    fitted to these runs: ``bench/fidelity_level.py`` scores it leaving each session out).
    """
    from kvvmm.hardware import profile_data
    from kvvmm.hardware.spread import level_of
    from kvvmm.measure.stats import quantiles

    wl = wl or Workload()
    prof = get_profile(profile)
    mid = predict(prof, wl)
    bands = predict_bands(prof, wl, mid)
    rows_level = level_of(profile_data(prof))
    lbands = with_level(bands, rows_level) if rows_level else None
    runs: dict[str, Any] = {}
    rounds: dict[str, list[float]] = {}
    all_in: list[bool] = []
    all_level: list[bool] = []
    for path in results:
        with open(path, encoding="utf-8") as f:
            got = json.load(f)
        meas = measured_of(got["scenarios"])
        c = compare(mid, meas, bands, lbands)
        rows = {n: {"band_us": v["band_us"], "measured_us": v["measured_us"],
                    "in_band": v["in_band"], "ratio": v["ratio"]}
                   | {k: v[k] for k in ("band_level_us", "in_band_level") if k in v}
                for n, v in c.items() if v.get("ratio") is not None and "in_band" in v}
        for n in rows:
            rounds.setdefault(n, []).extend(x for x in meas[n] if x > 0)
        flags = [r["in_band"] for r in rows.values()]
        all_in += flags
        runs[os.path.basename(path)] = {
            "date": got.get("date"), "in_band_count": f"{sum(flags)} of {len(flags)} timed",
            "in_band_share": _share(flags),
            "outside_band": sorted(n for n, r in rows.items() if not r["in_band"]),
            "scenarios": rows}
        if lbands is not None:
            lf = [r["in_band_level"] for r in rows.values()]
            all_level += lf
            runs[os.path.basename(path)] |= {
                "in_band_level_count": f"{sum(lf)} of {len(lf)} timed",
                "in_band_level_share": _share(lf)}
    widths: dict[str, Any] = {}
    for n, band in bands.items():
        if n not in rounds or band[1] <= 0:
            continue
        q = quantiles(rounds[n])
        card = (q["p90"] - q["p10"]) / q["p50"]
        width = (band[2] - band[0]) / band[1]
        widths[n] = {"band_width": round(width, 4), "card_spread": round(card, 4),
                     "rounds": len(rounds[n]), "within_target": width <= card + 0.10}
        if lbands is not None:
            lw = (lbands[n][2] - lbands[n][0]) / lbands[n][1]
            widths[n] |= {"band_level_width": round(lw, 4),
                          "level_within_target": lw <= card + 0.10}
    level = ({"in_band_level_count": f"{sum(all_level)} of {len(all_level)} timed",
              "in_band_level_share": _share(all_level),
              "band_level": "the band composed with the profile's session level "
                            "(spread.level: low times its group's p10, high times its p90)"}
             if lbands is not None else {})
    return {"benchmark": "bench_fidelity --score",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": _versions(),
            "profile": {"key": prof.key, "label": profile_label(prof), "path": prof.path,
                        "date": prof.date},
            "band": "the sim at every cost figure's p10 and p90 of the profile's spread "
                    "(kvvmm.workload.bands): not a joint distribution",
            "results": [os.path.basename(p) for p in results],
            "in_band_count": f"{sum(all_in)} of {len(all_in)} timed",
            "in_band_share": _share(all_in), "target_share": 0.9,
            "widths_within_target": f"{sum(1 for w in widths.values() if w['within_target'])}"
                                    f" of {len(widths)}",
            "widths": widths, "runs": runs} | level


def crossval(profiles: Sequence[str], results: Sequence[str],
             wl: Workload | None = None) -> dict[str, Any]:
    """Every profile's predictions against every result file's measured rounds.

    A profile calibrated in one run and scored on that run's measurement is scored on the
    card's state in those minutes; scored on other runs' measurements it says how far the
    sim is from the card in general (the H200's state drifts by ~25% over minutes).
    Returns per (profile, result) the ratios, how many are within 0.9-1.1, how many within
    or inside the measured rounds, and the median |log ratio|; and per profile the mean of
    that median over the results (lower is better).
    """
    wl = wl or Workload()
    measured: dict[str, dict[str, list[float]]] = {}
    for path in results:
        with open(path, encoding="utf-8") as f:
            measured[path] = measured_of(json.load(f)["scenarios"])
    pairs: dict[str, Any] = {}
    score: dict[str, float] = {}
    for prof in profiles:
        pred = predict(prof, wl)
        logs = []
        for path, meas in measured.items():
            c = compare(pred, meas)
            timed = {n: v for n, v in c.items() if v.get("ratio")}
            med = statistics.median(abs(math.log(v["ratio"])) for v in timed.values())
            logs.append(med)
            pairs[f"{os.path.basename(prof)} on {os.path.basename(path)}"] = {
                "within": sum(1 for v in timed.values() if v["within"]),
                "within_or_in_rounds": sum(1 for v in timed.values()
                                           if v["within"] or v.get("in_rounds")),
                "timed": len(timed), "median_abs_log_ratio": round(med, 4),
                "ratios": {n: v["ratio"] for n, v in timed.items()}}
        score[os.path.basename(prof)] = round(statistics.fmean(logs), 4)
    return {"benchmark": "bench_fidelity --crossval", "profiles": list(profiles),
            "results": list(results), "pairs": pairs,
            "mean_median_abs_log_ratio": score}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h200",
                    help="profile the sim predicts from: a key (h200) or a calibrated .json")
    ap.add_argument("--out", default=None,
                    help="JSON result (default bench/results/<card>-fidelity.json)")
    ap.add_argument("--sim-only", action="store_true", help="the sim side only (no GPU)")
    ap.add_argument("--small", action="store_true", help="a small workload (smoke test)")
    ap.add_argument("--rounds", type=int, default=3, help="GPU rounds per scenario")
    ap.add_argument("--settle-s", type=float, default=SETTLE_S,
                    help="pause before each measured owner (s)")
    ap.add_argument("--no-parity", action="store_true", help="skip the sim/CUDA parity run")
    ap.add_argument("--rescore", metavar="RESULT",
                    help="recompute the comparison of a result file in place (no new run)")
    ap.add_argument("--score", nargs="+", metavar="RESULT",
                    help="score --profile's bands against measured result files (no GPU): "
                         "per scenario whether the measured median is in the band, the "
                         "share in band, band width against the card's spread; to --out")
    ap.add_argument("--crossval", nargs=2, metavar=("PROFILES", "RESULTS"),
                    help="comma-separated profiles and result files: every profile's "
                         "predictions against every result's measurements (no GPU); "
                         "written to --out")
    args = ap.parse_args(argv)
    if args.crossval:
        res = crossval(args.crossval[0].split(","), args.crossval[1].split(","))
        out = args.out or "fidelity-crossval.json"
        with open(out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "ratios"}
                          for k, v in res["pairs"].items()}, indent=1))
        print(json.dumps(res["mean_median_abs_log_ratio"]))
        return 0
    if args.score:
        res = score(args.profile, args.score, SMALL if args.small else None)
        out = args.out or os.path.join(str(ROOT), "bench", "results", "fidelity-bands.json")
        with open(out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        print(json.dumps({k: res[k] for k in ("in_band_count", "in_band_share",
                                              "widths_within_target")}
                         | {name: {k: r[k] for k in ("in_band_count", "outside_band")}
                            for name, r in res["runs"].items()}, indent=1))
        print("wrote", out)
        return 0
    if args.rescore:
        res = rescore(args.rescore)
        with open(args.rescore, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        print(json.dumps({k: res[k] for k in ("outside", "outside_but_in_rounds",
                                              "within_count")}, indent=1))
        return 0
    wl = SMALL if args.small else Workload()
    prof = get_profile(args.profile)
    started = time.perf_counter()
    res = {
        "benchmark": "bench_fidelity",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": _versions(),
        "profile": {"key": prof.key, "label": profile_label(prof), "path": prof.path,
                    "date": prof.date, "notes": list(sim_costs(prof).notes)},
        "workload": asdict(wl), "target": [LOW, HIGH],
        "skipped": _skipped(),
    }
    predicted = predict(args.profile, wl, args.settle_s)
    bands = predict_bands(prof, wl, predicted, args.settle_s)
    res["band"] = "band_us: the sim at every cost figure's p10, as it is, and at its p90"
    from kvvmm.hardware import profile_data
    from kvvmm.hardware.spread import level_of

    rows_level = level_of(profile_data(prof))
    lbands = with_level(bands, rows_level) if rows_level else None
    if lbands is not None:
        res["band_level"] = ("band_level_us: band_us composed with the profile's session "
                             "level (low times its group's p10, high times its p90)")
    measured: dict[str, list[float]] | None = None
    card = prof.name
    if not args.sim_only:
        try:
            import torch

            from kvvmm.driver.cuda import CudaDriver
            from kvvmm.errors import DriverUnavailableError

            if not torch.cuda.is_available():
                raise DriverUnavailableError("torch.cuda.is_available() is False")
            torch.empty(1, device="cuda")
            cd = CudaDriver()
        except Exception as e:  # one line, whatever the cause
            print(f"bench_fidelity: needs a CUDA GPU (or --sim-only): {e}", file=sys.stderr)
            return 2
        card = torch.cuda.get_device_name(0)
        # finalize backs every buffer to finalize_tokens: refuse a card that cannot hold it
        # before any scenario runs, not with an out-of-memory error a minute in (an 80 GB
        # H100 against the H200-sized default, 2026-12-07)
        kv = wl.kv
        need = sum(d.final_span_bytes(kv.finalize_tokens, kv.page_size) for d in kv.descs())
        free = torch.cuda.mem_get_info()[0]
        if need > free:
            cd.close()
            print(f"bench_fidelity: finalize backs {need / 2**30:.1f} GiB "
                  f"({kv.finalize_tokens:,} tokens of {kv.layers} layers), more than the "
                  f"{free / 2**30:.1f} GiB free on {card}: the default scenarios are sized "
                  f"for a 141 GB H200 (--small runs on any card, scored against --small runs "
                  f"only)", file=sys.stderr)
            return 2

        def wall_us(_: Driver) -> float:
            torch.cuda.synchronize()
            return time.perf_counter() * 1e6

        try:
            from tqdm import tqdm  # type: ignore[import-untyped]
        except ImportError:
            tqdm = None
        total = args.rounds * len(wl.policies) + 1
        bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True) if tqdm else None

        def progress(label: str) -> None:
            if bar is not None:
                bar.set_description_str(label)
                bar.update()

        try:
            measured = run_scenarios(lambda: cd, wall_us, wl, rounds=args.rounds,
                                     settle_s=args.settle_s, progress=progress)
            if wl.workload_s and not _skipped().get("workload"):
                progress("workload replay")
                try:
                    measured |= workload_scenarios(lambda: cd, wl.workload_s, "cuda",
                                                   args.settle_s)
                except Exception as e:  # reported; the other scenarios still count
                    res["workload_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        finally:
            if bar is not None:
                bar.close()
        cd.close()
        if not args.no_parity:
            try:
                res["parity"] = parity()
            except Exception as e:  # reported; the ratios still count
                res["parity"] = {"error": f"{type(e).__name__}: {e}"}
    res["card"] = card
    res["mode"] = "sim-only" if args.sim_only else "sim vs cuda"
    res["rounds"] = 1 if args.sim_only else args.rounds
    res["settle_s"] = args.settle_s
    res["scenarios"] = compare(predicted, measured, bands, lbands)
    if measured is not None:
        summarize(res)
    res["wall_s"] = round(time.perf_counter() - started, 1)
    slug = card.lower().replace("nvidia ", "").strip().replace(" ", "-")
    out = args.out or os.path.join(str(ROOT), "bench", "results", f"{slug}-fidelity.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    summary = {k: res.get(k) for k in ("card", "mode", "profile", "ratios", "outside",
                                       "outside_but_in_rounds", "within_count", "all_within",
                                       "in_band_count", "in_band_level_count",
                                       "outside_band", "wall_s")}
    summary["parity"] = {k: v for k, v in res.get("parity", {}).items() if k != "examples"}
    print(json.dumps(summary, indent=1))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

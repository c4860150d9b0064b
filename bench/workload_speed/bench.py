"""Time ``kvvmm replay`` of Azure's conversation trace: every strategy on the sim, bands too.

    PYTHONPATH=. python bench/workload_speed/bench.py [--seconds S] [--no-bands] [--workers N]

Runs what ``kvvmm replay TRACE`` runs (:func:`kvvmm.workload.run_workload` over every
strategy, then :func:`kvvmm.workload.bands.workload_bands` for the p10 / p90 bands) and
writes, to ``bench/results/cpu-workload-speed.json`` (``--out``): wall and CPU seconds of
each strategy's run and of the bands, the machine (CPU model, cores, load average before and
after: the machine may be shared), versions and the date. A figure, not a test: nothing here
fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kvvmm
from kvvmm.workload import STRATEGIES, find_trace, load_workload, run_workload
from kvvmm.workload.bands import workload_bands

ROOT = Path(__file__).resolve().parents[2]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None, help="default: Azure's conversation trace")
    ap.add_argument("--seconds", type=float, default=None, help="only the first SECONDS")
    ap.add_argument("--no-bands", action="store_true")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes for the band runs (default: workload_bands' choice)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu-workload-speed.json"))
    args = ap.parse_args(argv)
    path = args.trace or find_trace()
    if path is None:
        print("the conversation trace is not here: give --trace", file=sys.stderr)
        return 2
    load0 = _load()
    t0, c0 = time.perf_counter(), time.process_time()
    wl = load_workload(path)
    if args.seconds is not None:
        wl = wl.first(args.seconds)
    load_s = time.perf_counter() - t0
    runs: list[dict[str, Any]] = []
    results = []
    for name in STRATEGIES:  # one at a time, to time each (the same runs as all at once)
        w, c = time.perf_counter(), time.process_time()
        cmp = run_workload(wl, [name])
        results.extend(cmp.results)
        runs.append({"strategy": name, "wall_s": round(time.perf_counter() - w, 3),
                     "cpu_s": round(time.process_time() - c, 3),
                     "driver_calls": cmp.results[0].driver_calls,
                     "steps": cmp.results[0].serving.steps})
        print(f"{name:26s} {runs[-1]['wall_s']:8.2f} s", flush=True)
    replay_wall = time.perf_counter() - t0
    bands_wall = bands_cpu = None
    if not args.no_bands:
        from kvvmm.workload.run import WorkloadComparison

        mid = WorkloadComparison(setup=cmp.setup, results=tuple(results))
        w, c = time.perf_counter(), time.process_time()
        workload_bands(wl, list(STRATEGIES), mid=mid, workers=args.workers)
        bands_wall, bands_cpu = time.perf_counter() - w, time.process_time() - c
        print(f"{'bands (p10, p90)':26s} {bands_wall:8.2f} s", flush=True)
    total = time.perf_counter() - t0
    out = {
        "benchmark": "workload_speed",
        "what": "kvvmm replay of the trace: every strategy on the sim (llama-3.1-70b TP8, "
                "h200), then the p10/p90 bands",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpu": _cpu_model(), "cpu_count": os.cpu_count(),
                    "load_before": load0, "load_after": _load()},
        "versions": {"kvvmm": getattr(kvvmm, "__version__", "?"), "commit": _commit(),
                     "python": platform.python_version(), "platform": platform.platform()},
        "trace": Path(path).name, "seconds": args.seconds, "requests": len(wl),
        "load_s": round(load_s, 3), "runs": runs,
        "replay_wall_s": round(replay_wall, 3),
        "bands_wall_s": None if bands_wall is None else round(bands_wall, 3),
        "bands_cpu_s_here": None if bands_cpu is None else round(bands_cpu, 3),
        "total_wall_s": round(total, 3),
        "total_cpu_s_here": round(time.process_time() - c0, 3),
        "note": "cpu_s counts this process only (a band run in a second process is not in "
                "it); wall time on a shared machine moves with its load (load_before/after)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"total {total:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Time ``kvvmm replay`` of Azure's conversation trace: every strategy on the sim, bands too.

    PYTHONPATH=. python bench/workload_speed/bench.py [--seconds S] [--no-bands] [--workers N]
        [--repeat N] [--before REV]

Runs what ``kvvmm replay TRACE`` runs (:func:`kvvmm.workload.run_workload` over every
strategy, then :func:`kvvmm.workload.bands.workload_bands` for the p10 / p90 bands) and
writes, to ``bench/results/cpu-workload-speed.json`` (``--out``): wall and CPU seconds of
each strategy's run and of the bands, the machine (CPU model, cores, load average before and
after: the machine may be shared), versions and the date. ``--repeat N`` makes every
measurement N times and keeps the least (a shared machine only ever adds time);
``--before REV`` first measures git revision ``REV`` the same way (its ``kvvmm`` exported to
a temporary folder, run by this script in a second process) and writes both side by side
(``before``, ``after``). A figure, not a test: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import kvvmm
from kvvmm.measure.machine import commit, cpu_model, load_average
from kvvmm.workload import STRATEGIES, find_trace, load_workload, run_workload
from kvvmm.workload.bands import workload_bands

ROOT = Path(__file__).resolve().parents[2]


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (a band run's second process)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _timed(fn: Any) -> tuple[Any, float, float]:
    """``fn()``, its wall and CPU seconds (this process's)."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def measure(path: str, seconds: float | None, bands: bool, workers: int | None,
            repeat: int) -> dict[str, Any]:
    """One measurement of this ``kvvmm`` (the least of ``repeat`` of each figure)."""
    load0 = load_average()
    t0 = time.perf_counter()
    wl = load_workload(path)
    if seconds is not None:
        wl = wl.first(seconds)
    load_s = time.perf_counter() - t0
    runs: list[dict[str, Any]] = []
    results = []
    setup = None
    # as `kvvmm replay` runs it: with bands, the replay prices its calls at the band's
    # quantiles (where this kvvmm can: a revision from before it cannot)
    from kvvmm.workload.run import RunOptions, WorkloadComparison

    priced = {"band_prices": True} if bands and "band_prices" in RunOptions.__dataclass_fields__ \
        else {}
    for name in STRATEGIES:  # one at a time, to time each (the same runs as all at once)
        best: dict[str, Any] | None = None
        for _ in range(repeat):
            cmp, wall, cpu = _timed(lambda n=name: run_workload(wl, [n], **priced))
            if best is None or cpu < best["cpu_s"]:
                best = {"strategy": name, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                        "driver_calls": cmp.results[0].driver_calls,
                        "steps": cmp.results[0].serving.steps}
            elif wall < best["wall_s"]:
                best["wall_s"] = round(wall, 3)
        assert best is not None
        results.append(cmp.results[0])
        setup = cmp.setup
        runs.append(best)
        print(f"{name:26s} {best['wall_s']:8.2f} s wall {best['cpu_s']:7.2f} s CPU", flush=True)
    out: dict[str, Any] = {
        "kvvmm": os.path.dirname(kvvmm.__file__), "requests": len(wl),
        "band_prices": bool(priced),
        "load_s": round(load_s, 3), "runs": runs,
        "replay_wall_s": round(sum(r["wall_s"] for r in runs), 3),
        "replay_cpu_s": round(sum(r["cpu_s"] for r in runs), 3),
        "bands_wall_s": None, "bands_cpu_s": None}
    if bands:
        assert setup is not None
        mid = WorkloadComparison(setup=setup, results=tuple(results))
        for _ in range(repeat):
            kids = _children_cpu()
            _, wall, cpu = _timed(lambda: workload_bands(wl, list(STRATEGIES), mid=mid,
                                                         workers=workers))
            cpu += _children_cpu() - kids
            if out["bands_wall_s"] is None or wall < out["bands_wall_s"]:
                out["bands_wall_s"] = round(wall, 3)
            if out["bands_cpu_s"] is None or cpu < out["bands_cpu_s"]:
                out["bands_cpu_s"] = round(cpu, 3)
        print(f"{'bands (p10, p90)':26s} {out['bands_wall_s']:8.2f} s wall "
              f"{out['bands_cpu_s']:7.2f} s CPU", flush=True)
        out["total_wall_s"] = round(out["replay_wall_s"] + out["bands_wall_s"], 3)
        out["total_cpu_s"] = round(out["replay_cpu_s"] + out["bands_cpu_s"], 3)
    out["load_before"], out["load_after"] = load0, load_average()
    return out


def _before(rev: str, argv: list[str]) -> dict[str, Any]:
    """:func:`measure` of git revision ``rev``: its ``kvvmm`` exported to a temporary folder
    and imported by this script in a second process."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tar = subprocess.run(["git", "archive", commit, "kvvmm"], cwd=ROOT,
                             capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
        out = Path(tmp) / "before.json"
        env = dict(os.environ, PYTHONPATH=tmp)
        subprocess.run([sys.executable, __file__, *argv, "--measure-only", str(out)],
                       env=env, check=True)
        got: dict[str, Any] = json.loads(out.read_text())
    got["commit"] = commit
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None, help="default: Azure's conversation trace")
    ap.add_argument("--seconds", type=float, default=None, help="only the first SECONDS")
    ap.add_argument("--no-bands", action="store_true")
    ap.add_argument("--workers", type=int, default=None,
                    help="processes for the band runs (default: workload_bands' choice)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each figure N times, keep the least (default 1)")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="also measure git revision REV first, side by side")
    ap.add_argument("--measure-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu-workload-speed.json"))
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    path = args.trace or find_trace()
    if path is None:
        print("the conversation trace is not here: give --trace", file=sys.stderr)
        return 2
    if args.measure_only is not None:  # the second process of --before
        got = measure(str(path), args.seconds, not args.no_bands, args.workers, args.repeat)
        Path(args.measure_only).write_text(json.dumps(got))
        return 0
    same = ["--trace", str(path), "--repeat", str(args.repeat)]
    if args.seconds is not None:
        same += ["--seconds", str(args.seconds)]
    if args.no_bands:
        same.append("--no-bands")
    if args.workers is not None:
        same += ["--workers", str(args.workers)]
    before = None
    if args.before is not None:
        print(f"before: {args.before}", flush=True)
        before = _before(args.before, same)
        print("after: this checkout", flush=True)
    after = measure(str(path), args.seconds, not args.no_bands, args.workers, args.repeat)
    after["commit"] = commit(ROOT)
    out: dict[str, Any] = {
        "benchmark": "workload_speed",
        "what": "kvvmm replay of the trace: every strategy on the sim (llama-3.1-70b TP8, "
                "h200), then the p10/p90 bands",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count()},
        "versions": {"kvvmm": getattr(kvvmm, "__version__", "?"),
                     "python": platform.python_version(), "platform": platform.platform()},
        "trace": Path(path).name, "seconds": args.seconds, "repeat": args.repeat,
        **({"before": before, "after": after} if before is not None else after),
        "note": "least of `repeat` runs of each figure; cpu_s is this process's, bands_cpu_s "
                "adds the band run's second process; wall time on a shared machine moves "
                "with its load (load_before/after)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

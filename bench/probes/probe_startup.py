"""Where a workload strategy's startup driver time goes, call by call, on a GPU beside the sim.

The range replay (bench/bench_workload_gpu.py) reports one startup figure per strategy: the
driver time of the owner's constructor (slot 0) and the strategy's prepare/start. On the H200
the sim predicted 0.27-0.39 of it for the range strategies and 1.5x of it for prefix growth,
and the figure alone does not say which call the model misses. This probe runs each strategy's
startup only (two seconds of traffic), several rounds and in two orders (a strategy run first
in a process may pay a cold cost later ones do not), and writes each startup call's op, size
and time on CUDA and in the sim.

    python3 bench/probes/probe_startup.py --trace .data/AzureLLMInferenceTrace_conv.csv \
        --rounds 5 --out h200-startup.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvvmm.workload import load_azure_csv, run_workload

STRATEGIES = ("prefix", "xl-page-elastic", "request-ranges", "request-ranges+deferred")


def startup_calls(kind: str, wl: Any, name: str, *, model: str, tp: int) -> dict[str, Any]:
    """One run of ``name`` on ``kind``; the calls whose times sum to its startup figure."""
    r = run_workload(wl, [name], model=model, gpu="h200", tp=tp, driver=kind,
                     touch=kind != "sim", record=True).results[0]
    assert r.trace is not None
    target = r.startup_driver_s * 1e6
    calls, total = [], 0.0
    for e in r.trace.events:
        if total >= target - 1e-6:
            break
        us = e.sim_us if kind == "sim" else e.wall_us
        total += us
        calls.append({"op": e.op, "size": e.args.get("size"), "us": round(us, 3)})
    by_op: dict[str, list[float]] = {}
    for c in calls:
        by_op.setdefault(c["op"], []).append(c["us"])
    return {"startup_us": round(target, 3), "calls": len(calls),
            "by_op": {op: {"n": len(v), "sum_us": round(sum(v), 3),
                           "median_us": round(statistics.median(v), 3),
                           "first_us": v[0], "max_us": max(v)} for op, v in by_op.items()},
            "first_calls": calls[:8]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--driver", default="cuda", help="the measured driver (host: a dry run)")
    ap.add_argument("--out", default="h200-startup.json")
    args = ap.parse_args(argv)
    wl = load_azure_csv(args.trace).first(2.0)
    card = args.driver
    versions: dict[str, str] = {"python": platform.python_version()}
    try:
        import torch

        versions |= {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
        if args.driver == "cuda":
            card = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    out: dict[str, Any] = {
        "benchmark": "startup-calls", "card": card, "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": args.model, "tp": args.tp, "trace_seconds": 2.0, "rounds": args.rounds,
        "orders": {}}
    for order_name, order in (("forward", STRATEGIES), ("reverse", STRATEGIES[::-1])):
        rows: dict[str, Any] = {}
        for rnd in range(args.rounds):
            for name in order:
                row = rows.setdefault(name, {"measured": [], "predicted": None})
                row["measured"].append(startup_calls(args.driver, wl, name, model=args.model,
                                                     tp=args.tp))
                if row["predicted"] is None:
                    row["predicted"] = startup_calls("sim", wl, name, model=args.model,
                                                     tp=args.tp)
            print(order_name, rnd, {n: rows[n]["measured"][-1]["startup_us"] for n in order},
                  flush=True)
        for row in rows.values():
            row["measured_median_us"] = statistics.median(m["startup_us"] for m in row["measured"])
            row["ratio_sim_over_measured"] = round(
                row["predicted"]["startup_us"] / row["measured_median_us"], 3)
        out["orders"][order_name] = rows
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

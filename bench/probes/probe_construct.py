"""Where an owner's construction goes on a GPU, call by call, and what comes before it decides.

The fidelity benchmark times ``kvvmm bench``'s owner construction (64 buffers, slot 0 backed)
at 7.5-37 ms on the H200 in one session where the sim says 6.7-8.4 ms; calibrate's own rounds
saw 7-56 ms. This probe constructs the same owner, each call timed by a tracing wrapper, after
four things: nothing (another construction just closed), a settle sleep alone, the close of
an owner grown to 500k tokens (GBs released) then the sleep, and that close without the sleep.
Per case and round: the wall time, the calls' sum by op, and the rest (kvvmm's work, torch's
tensors).

    python3 bench/probes/probe_construct.py --rounds 4 --out h200-construct.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvvmm.driver import open_driver
from kvvmm.measure.workload import BENCH_WORKLOAD
from kvvmm.policy import parse_policy
from kvvmm.record import Trace, TracingDriver

CASES = ("after_construct", "after_sleep", "after_grown_close_and_sleep", "after_grown_close")


def construct(drv: Any, sync: Any) -> dict[str, Any]:
    tracer = TracingDriver(drv, Trace())
    sync()
    t0 = time.perf_counter()
    owner = BENCH_WORKLOAD.owner(tracer, parse_policy("default"))
    sync()
    wall = (time.perf_counter() - t0) * 1e6
    by: dict[str, list[float]] = {}
    for e in tracer.trace.events:
        by.setdefault(e.op, []).append(e.wall_us)
    owner.close()
    calls = sum(sum(v) for v in by.values())
    return {"wall_us": round(wall, 1), "calls_us": round(calls, 1),
            "rest_us": round(wall - calls, 1),
            "by_op": {op: {"n": len(v), "sum_us": round(sum(v), 1),
                           "median_us": round(statistics.median(v), 2),
                           "max_us": round(max(v), 1)} for op, v in by.items()}}


def grown_close(drv: Any) -> float:
    owner = BENCH_WORKLOAD.owner(drv, parse_policy("default"))
    for n in BENCH_WORKLOAD.decode_steps():
        owner.ensure_prefix(n)
    t0 = time.perf_counter()
    owner.close()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--driver", default="cuda", help="sim: a dry run without a GPU")
    ap.add_argument("--out", default="h200-construct.json")
    args = ap.parse_args(argv)
    sync: Any = lambda: None  # noqa: E731
    card, versions = args.driver, {"python": platform.python_version()}
    if args.driver == "cuda":
        import torch

        torch.zeros(1, device="cuda")
        sync = torch.cuda.synchronize
        card = torch.cuda.get_device_name(0)
        versions |= {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    drv = open_driver(args.driver)
    out: dict[str, Any] = {
        "benchmark": "construct-calls", "card": card, "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "buffers": len(BENCH_WORKLOAD.descs()), "settle_s": args.settle_s,
        "rounds": args.rounds, "cases": {c: [] for c in CASES}}
    construct(drv, sync)  # warm-up: the first construction of a process
    for r in range(args.rounds):
        for case in CASES:
            before: dict[str, Any] = {}
            if case == "after_construct":
                construct(drv, sync)
            if "grown" in case:
                before["grown_close_ms"] = round(grown_close(drv), 1)
            if "sleep" in case:
                time.sleep(args.settle_s)
            row = construct(drv, sync) | before
            out["cases"][case].append(row)
            print(r, case, row["wall_us"], row["calls_us"],
                  {op: v["sum_us"] for op, v in row["by_op"].items()}, flush=True)
    out["summary"] = {c: {k: statistics.median(row[k] for row in rows)
                          for k in ("wall_us", "calls_us", "rest_us")}
                      for c, rows in out["cases"].items()}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(out["summary"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (not a test): one hour of Azure's conversation trace replayed on the sim driver.

    python bench/workload/bench_workload.py [--trace PATH] [--out bench/results]

Goal: the whole trace (19,366 requests, one hour) replays for llama-3.1-70b at TP=8 on the
H200 profile on the sim driver in <= 10 s on one core, for each memory strategy (issue 13).
The process is pinned to one CPU; each strategy runs alone (its own owner, driver and
serving loop), timed from building the owner to the summary. Writes
``sim-workload-bench.json`` (card none: the sim) with the summaries and the wall times.

The trace is Azure's public LLM inference trace (CC-BY 4.0; Patel et al., "Splitwise",
ISCA 2024), read from ``../shared/data/azure-llm-inference-2023/`` or ``--trace``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvvmm.workload import STRATEGIES, ServingConfig, load_azure_csv, run_workload  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "data" / "azure-llm-inference-2023" / \
    "AzureLLMInferenceTrace_conv.csv"
TARGET_S = 10.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--tp", type=int, default=8)
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    t0 = time.perf_counter()
    wl = load_azure_csv(args.trace)
    load_s = time.perf_counter() - t0
    runs = []
    for order in ("lowest", "lifo"):
        for name in STRATEGIES:
            t0 = time.perf_counter()
            cmp = run_workload(wl, [name], model=args.model, gpu=args.gpu, tp=args.tp,
                               config=ServingConfig(slot_order=order))
            wall = time.perf_counter() - t0
            row = {"strategy": name, "slot_order": order, "wall_s": round(wall, 3),
                   "meets_target": wall <= TARGET_S, **cmp.results[0].summary()}
            runs.append(row)
            print(f"{order:6s} {name:14s} {wall:6.2f} s  peak backed "
                  f"{row['peak_backed_bytes'] / 2**30:7.2f} GiB  decode driver "
                  f"{row['decode_driver_ms']:8.3f} ms", flush=True)
    import kvvmm

    out = {
        "benchmark": "sim-workload", "card": "none (sim driver, h200 profile)",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {"kvvmm": getattr(kvvmm, "__version__", "?"),
                     "python": platform.python_version(), "platform": platform.platform()},
        "cpu": platform.processor() or platform.machine(), "cores_used": 1,
        "trace": {"file": Path(args.trace).name, "requests": len(wl),
                  "duration_s": round(wl.duration_s, 3), "load_s": round(load_s, 3),
                  "source": "Azure Public Dataset, AzureLLMInferenceTrace_conv.csv (CC-BY 4.0; "
                            "Patel et al., Splitwise, ISCA 2024)"},
        "model": args.model, "gpu": args.gpu, "tp": args.tp, "target_s": TARGET_S,
        "runs": runs,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sim-workload-bench.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
    return 0 if all(r["meets_target"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

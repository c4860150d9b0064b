"""kvvmm's CudaDriver per call, two trees side by side on one card (not a test).

    python3 bench/device/percall_beforeafter.py --before DIR --out FILE
    bash bench/device/card_check.sh beforeafter     # DIR = .gpu/before, on the device

Runs this tree and the tree at ``--before`` (each with its C fast path built) in alternating
child processes, ``--rounds`` times: each child times create / map / set_access / unmap /
release of 2 MiB and 32 MiB handles (``--reps`` cycles after a warm-up) through the driver
protocol only, which both trees share. Writes the medians per tree and call, and after /
before, to ``--out``: does a change to the driver's hot path make a call slower?
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
from kvvmm.driver.cuda import CudaDriver
reps = int(sys.argv[1])
d = CudaDriver()
out = {}
for mib in (2, 32):
    size = mib << 20
    va = d.reserve(size)
    t = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}
    for i in range(reps + 20):
        a = time.perf_counter_ns(); h = d.create(size)
        b = time.perf_counter_ns(); d.map(va, size, h)
        c = time.perf_counter_ns(); d.set_access(va, size)
        e = time.perf_counter_ns(); d.unmap(va, size)
        f = time.perf_counter_ns(); d.release(h)
        g = time.perf_counter_ns()
        if i >= 20:
            for k, x, y in (("create", a, b), ("map", b, c), ("set_access", c, e),
                            ("unmap", e, f), ("release", f, g)):
                t[k].append((y - x) / 1e3)
    d.free(va, size)
    out[f"{mib}MiB"] = t
print(json.dumps({"fast": type(d).__name__, "calls": out,
                  "c_path": bool(getattr(d, "_fast", None) or getattr(d, "fast_path", None))}))
"""


def _child(tree: Path, reps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    got = subprocess.run([sys.executable, "-c", CHILD, str(reps)], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(got.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    trees = {"before": Path(a.before).resolve(), "after": Path.cwd()}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {t: {} for t in trees}
    for r in range(a.rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            got = _child(trees[name], a.reps)
            for size, calls in got["calls"].items():
                for call, xs in calls.items():
                    samples[name].setdefault(size, {}).setdefault(call, []).extend(xs)
    med = {t: {s: {c: round(statistics.median(xs), 3) for c, xs in cs.items()}
               for s, cs in v.items()} for t, v in samples.items()}
    ratio = {s: {c: round(med["after"][s][c] / med["before"][s][c], 3) for c in cs}
             for s, cs in med["before"].items()}
    import torch
    res = {"benchmark": "percall_beforeafter", "date": time.strftime("%Y-%m-%d"),
           "card": torch.cuda.get_device_name(0), "versions": {"torch": torch.__version__},
           "rounds": a.rounds, "reps": a.reps, "median_us": med, "after_over_before": ratio}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(ratio, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

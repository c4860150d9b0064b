"""The first create after a pause that follows a release: how long a pause, how many GiB.

The profile's ``idle_release`` (docs/FIDELITY.md, "Idle creates") charges the first create after
a pause of at least ``pause_s`` a premium per GiB released before it, at least
``min_released_gib``; both thresholds were assumed (1 s, 10 GiB) from runs that only had 1.5-2 s
pauses and 0.1, 1.6, 61 and 110 GiB. This probe releases ``G`` GiB (handles of 2 GiB, created
and released through the driver, nothing else between), sleeps ``P`` seconds, then times one
2 MiB create and the one after it, for every pair of ``--gib`` and ``--pause`` values, in
rotated order, ``--rounds`` times. Per pair: the first create's µs (median, min, max) and the
second's median (the warm cost), and the premium per GiB.

    python3 bench/probes/probe_idle_release.py --out h200-idle-release.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvvmm.driver import open_driver
from kvvmm.units import GiB, MiB


def one(drv: Any, gib: int, pause_s: float) -> tuple[float, float]:
    """Release ``gib`` GiB, sleep, then the first and second 2 MiB create's µs."""
    hs = [drv.create(2 * GiB) for _ in range(gib // 2)]
    for h in hs:
        drv.release(h)
    time.sleep(pause_s)
    out = []
    for _ in range(2):
        t0 = time.perf_counter()
        h = drv.create(2 * MiB)
        out.append((time.perf_counter() - t0) * 1e6)
        drv.release(h)
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--gib", type=int, nargs="+", default=[0, 4, 16, 64])
    ap.add_argument("--pause", type=float, nargs="+", default=[0.05, 0.25, 0.5, 1.0, 2.0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--driver", default="cuda", help="sim: a dry run without a GPU")
    ap.add_argument("--out", default="h200-idle-release.json")
    args = ap.parse_args(argv)
    card, versions = args.driver, {"python": platform.python_version()}
    if args.driver == "cuda":
        import torch

        torch.zeros(1, device="cuda")
        card = torch.cuda.get_device_name(0)
        versions |= {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    drv = open_driver(args.driver)
    pairs = list(itertools.product(args.gib, args.pause))
    got: dict[str, list[tuple[float, float]]] = {}
    try:
        for r in range(args.rounds):
            order = pairs[r % len(pairs):] + pairs[:r % len(pairs)]
            for gib, pause in order:
                got.setdefault(f"{gib}GiB/{pause}s", []).append(one(drv, gib, pause))
    finally:
        drv.close()
    cases = {}
    for (gib, pause) in pairs:
        rows = got[f"{gib}GiB/{pause}s"]
        first = [a for a, _ in rows]
        warm = statistics.median(b for _, b in rows)
        prem = statistics.median(first) - warm
        cases[f"{gib}GiB/{pause}s"] = {
            "gib": gib, "pause_s": pause, "first_us": [round(x, 1) for x in first],
            "first_median_us": round(statistics.median(first), 1),
            "second_median_us": round(warm, 1), "premium_us": round(prem, 1),
            "premium_per_gib_us": round(prem / gib, 1) if gib else None}
    res = {"benchmark": "idle-release", "card": card, "versions": versions,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "rounds": args.rounds, "cases": cases}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    for k, v in cases.items():
        print(f"{k:>12}: first {v['first_median_us']:>9.1f} us (second "
              f"{v['second_median_us']:.1f}), premium {v['premium_us']:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

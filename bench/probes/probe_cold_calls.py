"""Is a driver call slow because it is the first of its kind: on a fresh driver, after a pause,
or after other work? The startup probe (probe_startup.py) saw each fresh owner's first create,
map and set_access cost 2-5x the calls after them on the H200 (first create 67-113 us, then
22 us), and its reserve 43-55 us where calibrate's reserve loop says 8 us.

Each scenario runs ``--rounds`` rounds of: reserve 110 GiB, ``--calls`` x (create 2 MiB, map it
1 GiB apart, set_access), then unmap, release and free; it records the first call of each op
and the median of the later ones. The scenarios differ only in what comes between rounds:

- ``fresh_back_to_back``: a new driver each round, nothing between;
- ``fresh_after_sleep``: a new driver each round, a 50 ms sleep first;
- ``fresh_after_work``: a new driver each round, ~30 ms of Python work on 64 MiB first;
- ``same_after_sleep``: one driver for every round, a 50 ms sleep first;
- ``same_after_work``: one driver for every round, the Python work first;
- ``same_after_sleep_<N>ms`` (``--gaps``): one driver, an N ms sleep first: how short a pause
  makes calls cold (the sim's ``cold_calls.gap_ms``).

    python3 bench/probes/probe_cold_calls.py --out h200-cold-calls.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvvmm.driver import Driver, open_driver

GiB, MiB = 1 << 30, 1 << 20
OPS = ("reserve", "create", "map", "set_access", "unmap", "release", "free")


def python_work() -> None:
    """About 30 ms of dict and list work over 64 MiB: the caches hold none of the driver."""
    big = bytearray(64 * MiB)
    d: dict[int, int] = {}
    for i in range(0, len(big), 4096):
        big[i] = i & 255
        d[i] = i
    sum(d.values())


def one_round(drv: Driver, calls: int) -> dict[str, list[float]]:
    pc = time.perf_counter
    t: dict[str, list[float]] = {op: [] for op in OPS}

    def timed(op: str, fn: Callable[[], Any]) -> Any:
        t0 = pc()
        r = fn()
        t[op].append((pc() - t0) * 1e6)
        return r

    va = timed("reserve", lambda: drv.reserve(110 * GiB))
    hs = []
    for i in range(calls):
        h = timed("create", lambda: drv.create(2 * MiB))
        timed("map", lambda i=i, h=h: drv.map(va + i * GiB, 2 * MiB, h))
        timed("set_access", lambda i=i: drv.set_access(va + i * GiB, 2 * MiB))
        hs.append(h)
    for i, h in enumerate(hs):
        timed("unmap", lambda i=i: drv.unmap(va + i * GiB, 2 * MiB))
        timed("release", lambda h=h: drv.release(h))
    timed("free", lambda: drv.free(va, 110 * GiB))
    return t


def scenario(name: str, rounds: int, calls: int, kind: str) -> dict[str, Any]:
    fresh = name.startswith("fresh")
    gap_s = float(name.rsplit("_", 1)[1][:-2]) / 1e3 if name.endswith("ms") else 0.05
    between = (lambda: time.sleep(gap_s)) if "sleep" in name else \
        python_work if name.endswith("work") else (lambda: None)
    shared = None if fresh else open_driver(kind)
    firsts: dict[str, list[float]] = {op: [] for op in OPS}
    laters: dict[str, list[float]] = {op: [] for op in OPS}
    for _ in range(rounds):
        between()
        drv = open_driver(kind) if fresh else shared
        assert drv is not None
        t = one_round(drv, calls)
        for op, xs in t.items():
            firsts[op].append(xs[0])
            laters[op].extend(xs[1:])
        if fresh:
            drv.close()
    if shared is not None:
        shared.close()
    out = {}
    for op in OPS:
        f = statistics.median(firsts[op])
        later = statistics.median(laters[op]) if laters[op] else None
        out[op] = {"first_median_us": round(f, 3),
                   "first_all_us": [round(x, 2) for x in firsts[op]],
                   "later_median_us": None if later is None else round(later, 3),
                   "premium_us": None if later is None else round(f - later, 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--driver", default="cuda", help="host: a dry run without a GPU")
    ap.add_argument("--gaps", default="", help="comma-separated ms: same_after_sleep_<N>ms")
    ap.add_argument("--out", default="h200-cold-calls.json")
    args = ap.parse_args(argv)
    card, versions = args.driver, {"python": platform.python_version()}
    if args.driver == "cuda":
        import torch

        torch.zeros(1, device="cuda")  # the context exists before any round
        card = torch.cuda.get_device_name(0)
        versions |= {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    res: dict[str, Any] = {
        "benchmark": "cold-calls", "card": card, "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "rounds": args.rounds, "calls": args.calls, "scenarios": {}}
    gaps = [f"same_after_sleep_{g.strip()}ms" for g in args.gaps.split(",") if g.strip()]
    for name in ("fresh_back_to_back", "fresh_after_sleep", "fresh_after_work",
                 "same_after_sleep", "same_after_work", *gaps):
        res["scenarios"][name] = s = scenario(name, args.rounds, args.calls, args.driver)
        print(name, {op: (v["first_median_us"], v["later_median_us"]) for op, v in s.items()},
              flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

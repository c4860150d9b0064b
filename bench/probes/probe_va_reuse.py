"""Does first touch survive a free? The question the fidelity runs leave open (issue 27).

The sim charges a map and a set_access more when they enter a region of VA nothing was mapped
into before (``first_touch``, per mapping). The fidelity runs' 2 MiB slot-0 startups read
0.76-0.86 of the sim, and their 160 create / map / set_access cost about 60 us a triple, where
``probe_startup.py`` paid 58-63 us for the set_access alone (docs/FIDELITY.md, "The call after
a cold one"). One mechanism fits: each strategy's owner reserves the same VA its predecessor
freed, the driver hands the same addresses back, and what it set up for a region outlives the
free. This times it, on one driver, per round:

- ``fresh``: reserve ``2 x regions x region`` bytes; into each region, one granule at its
  start (map and set_access timed), then one beside it (the touched case);
- ``remapped``: everything unmapped and released, the same VA still reserved: the same maps
  again (does an unmap forget the region?);
- ``reused``: the reservation freed, the same size reserved again (``same_va`` says whether the
  driver gave the same base back): the same maps;
- ``new_va``: with that reservation still held, a second one of the same size (new VA): the
  same maps.

Per phase: median map and set_access of the region's first granule and of the one beside it,
and the extra (first - beside): first touch where the region is new, about 0 where the card
remembers it.

    PYTHONPATH=$PWD python3 bench/probes/probe_va_reuse.py --out $OUT/h200-va-reuse.json
    python3 bench/probes/probe_va_reuse.py --driver host --rounds 1   # the control flow, no GPU
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
PHASES = ("fresh", "remapped", "reused", "new_va")


def _touch(d: Any, base: int, regions: int, region: int, out: dict[str, list[float]],
           made: list[tuple[int, int]]) -> None:
    """A granule at each region's start, then one beside it, timed; each mapping joins
    ``made`` as it is made (a failure part way leaves them there to undo)."""
    g = d.granularity()
    for i in range(regions):
        start = base + 2 * i * region
        for va, where in ((start, "first"), (start + g, "beside")):
            h = d.create(g)
            t0 = time.perf_counter_ns()
            try:
                d.map(va, g, h)
            except BaseException:
                d.release(h)  # mapped nowhere: the handle alone to give back
                raise
            t1 = time.perf_counter_ns()
            made.append((va, h))
            d.set_access(va, g)
            t2 = time.perf_counter_ns()
            out[f"{where}_map"].append((t1 - t0) / 1e3)
            out[f"{where}_set_access"].append((t2 - t1) / 1e3)


def _undo(d: Any, made: list[tuple[int, int]]) -> None:
    g = d.granularity()
    for va, h in reversed(made):
        try:
            d.unmap(va, g)
        finally:
            d.release(h)
    made.clear()


def run_round(d: Any, regions: int, region: int) -> dict[str, Any]:
    total = 2 * regions * region
    t: dict[str, dict[str, list[float]]] = {
        p: {f"{w}_{op}": [] for w in ("first", "beside") for op in ("map", "set_access")}
        for p in PHASES}
    held: list[int] = []
    made: list[tuple[int, int]] = []
    try:
        a = d.reserve(total)
        held.append(a)
        for phase in ("fresh", "remapped"):
            _touch(d, a, regions, region, t[phase], made)
            _undo(d, made)
        d.free(a, total)
        held.remove(a)
        b = d.reserve(total)
        held.append(b)
        _touch(d, b, regions, region, t["reused"], made)
        _undo(d, made)
        c = d.reserve(total)
        held.append(c)
        _touch(d, c, regions, region, t["new_va"], made)
        _undo(d, made)
        return {"same_va": b == a, "new_va_differs": c not in (a, b), "times": t}
    finally:
        _undo(d, made)
        for va in held:
            d.free(va, total)


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in PHASES:
        per: dict[str, float] = {}
        for key in rounds[0]["times"][p]:
            xs = [x for r in rounds for x in r["times"][p][key]]
            per[key] = round(statistics.median(xs), 2)
        for op in ("map", "set_access"):
            per[f"extra_{op}"] = round(per[f"first_{op}"] - per[f"beside_{op}"], 2)
            per[f"extra_{op}_by_round"] = [
                round(statistics.median(r["times"][p][f"first_{op}"])
                      - statistics.median(r["times"][p][f"beside_{op}"]), 2) for r in rounds]
        out[p] = per
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--driver", default="cuda", choices=("cuda", "host", "sim"))
    ap.add_argument("--regions", type=int, default=32)
    ap.add_argument("--region-mib", type=int, default=512,
                    help="the profile's first-touch region (h200: 512 MiB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="h200-va-reuse.json")
    args = ap.parse_args(argv)

    from kvvmm import __version__, open_driver

    d = open_driver(args.driver)
    rounds = [run_round(d, args.regions, args.region_mib * MiB) for _ in range(args.rounds)]
    card = None
    if args.driver == "cuda":
        import torch

        card = torch.cuda.get_device_name()
    doc = {
        "benchmark": "probe_va_reuse",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "card": card, "driver": args.driver, "host": platform.node(),
        "versions": {"kvvmm": __version__, "python": platform.python_version()},
        "regions": args.regions, "region_mib": args.region_mib, "rounds": args.rounds,
        "same_va_every_round": [r["same_va"] for r in rounds],
        "new_va_differs_every_round": [r["new_va_differs"] for r in rounds],
        "phases_us": summarize(rounds),
        "unit": "us per call on the calling thread (perf_counter_ns), medians over rounds x "
                "regions; extra = first granule of a region - the one beside it",
    }
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for p, v in doc["phases_us"].items():
        print(f"{p:9s} set_access first {v['first_set_access']:7.1f} beside "
              f"{v['beside_set_access']:7.1f} extra {v['extra_set_access']:6.1f} | map extra "
              f"{v['extra_map']:6.1f}")
    print("same VA after free:", doc["same_va_every_round"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

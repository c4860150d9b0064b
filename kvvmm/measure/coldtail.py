"""The cold call's tail (issue 27): how much of a cold call's premium the next call of its kind
still pays, from the committed H200 startup probes; ``--write`` puts it in the shipped h200
profile (``cold_calls.second``), ``--check`` says whether that drifted.

The sim charged a pause's cold premium to the first call of each kind only (docs/FIDELITY.md,
"Cold calls"), and request-ranges+deferred's startup, the one startup that makes a second
create, map and set_access after the first (the reserve's refill, a 50 MiB handle), read
1.33x the sim's point over the committed fidelity runs. ``bench/probes/probe_startup.py``
timed every call of that startup on the H200, 12 rounds in two files
(``bench/results/h200-startup.json``, ``h200-startup-cold.json``, 2026-12-03): in every round
the second create cost 45-55 µs, the second set_access 69-104, the second map 7-36, against
17, 47 and 3 µs that the profile charges the same calls warm. Per round, the second call's
excess over the profile's warm cost of it, over the profile's premium for its kind; per
kind, the median over the rounds (``second``). The maps of ``h200-startup.json`` ran on a
host whose warm maps cost 10 µs, not the profile's 2-3 (its prefix startup's median map: 10.4
to 10.9 µs), so their excess is taken over that run's own warm map (the median map of the
prefix startups in the same file) instead.

    python bench/cold_second.py            # print the shares and the rounds
    python bench/cold_second.py --check    # exit 1 if the shipped profile's differ
    python bench/cold_second.py --write    # write them into kvvmm/hardware/data/h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from kvvmm.hardware import get_profile, profile_data, sim_costs

ROOT = Path(__file__).resolve().parents[2]  # the checkout: its bench/results

RUNS = ("bench/results/h200-startup.json", "bench/results/h200-startup-cold.json")
STARTUP = "request-ranges+deferred"
OPS = ("create", "map", "set_access")
PROFILE = ROOT / "kvvmm" / "hardware" / "data" / "h200.json"


def _warm_map_us(run: dict[str, Any]) -> float:
    """The run's own warm map: the median map of its prefix startups (160 maps each)."""
    meds = [m["by_op"]["map"]["median_us"] for order in run["orders"].values()
            for m in order["prefix"]["measured"]]
    return float(statistics.median(meds))


def second_shares(profile: Any = "h200", runs: tuple[str, ...] = RUNS) -> dict[str, Any]:
    """Per kind, the median over the rounds of (second call - its warm cost) / premium."""
    prof = get_profile(profile)
    costs = sim_costs(prof)
    cold = costs.cold
    assert cold is not None, "the profile models no cold calls"
    rows: dict[str, list[float]] = {op: [] for op in OPS}
    for path in runs:
        run = json.loads((ROOT / path).read_text(encoding="utf-8"))
        map_warm = _warm_map_us(run)
        for order in run["orders"].values():
            for m in order[STARTUP]["measured"]:
                seen: dict[str, int] = {}
                for c in m["first_calls"]:
                    op = c["op"]
                    seen[op] = seen.get(op, 0) + 1
                    if op not in rows or seen[op] != 2:
                        continue
                    warm = costs.calls(op, int(c["size"]))
                    if op == "map":
                        warm = max(warm, map_warm)
                    rows[op].append(round((float(c["us"]) - warm) / cold.premium_us[op], 4))
    return {"second": {op: round(max(0.0, min(1.0, statistics.median(v))), 3)
                       for op, v in rows.items() if v},
            "rounds": {op: v for op, v in rows.items()}}


SOURCE = ("bench/cold_second.py on bench/results/h200-startup.json and h200-startup-cold.json "
          "(bench/probes/probe_startup.py on an H200, 2026-12-03, 12 rounds): "
          "request-ranges+deferred's startup makes a cold create, map and set_access, then a "
          "second of each at once (a 50 MiB handle); per kind, the median over the rounds of the "
          "second call's excess over this profile's warm cost of it (the map: over the run's "
          "own warm map) over this profile's premium; the other kinds were not measured "
          "(nothing)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true")
    g.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    got = second_shares()
    print(json.dumps(got, indent=1))
    data = json.loads(PROFILE.read_text(encoding="utf-8"))
    have = (data.get("cold_calls") or {}).get("second")
    if args.check:
        same = have == got["second"]
        print("shipped profile:", "up to date" if same else f"differs ({have})")
        return 0 if same else 1
    if args.write:
        sec = data["cold_calls"]
        new: dict[str, Any] = {}
        for k, v in sec.items():  # after partial_source, keeping the section's order
            if k in ("second", "second_source"):
                continue  # the old figures: the new ones go in below
            new[k] = v
            if k == "partial_source":
                new["second"], new["second_source"] = got["second"], SOURCE
        if "second" not in new:
            new["second"], new["second_source"] = got["second"], SOURCE
        data["cold_calls"] = new
        PROFILE.write_text(json.dumps(data, indent=1, ensure_ascii=True) + "\n",
                           encoding="utf-8")
        print("wrote", PROFILE)
    profile_data(get_profile("h200"))  # still loads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

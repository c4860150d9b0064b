"""Probe (sim, CPU): request-ranges+deferred's reserve against held memory and decode stalls,
as warm as back to back and in real time.

    python bench/probes/probe_reserve_sweep.py [--trace CSV] [--seconds 600]
        [--reserve-mib 32,48,64,96] [--extra-mib 0,16,32] [--out sim-reserve-sweep.json]

The strategy's defaults (48 MiB mapped ahead, cached blocks given back above 80 MiB) came from
a sweep with no pauses between calls. In real time an engine's calls come hundreds of
milliseconds apart and each pays the cold premium (``run_workload(pause_scale=1.0)``), so an
admission that outruns the reserve waits longer for its commit. This runs the same sweep in
both modes (llama-3.1-70b TP8 rank 0, the H200 profile, Azure's conversation trace) beside
prefix growth in each, and writes per point: mean held over mean used, decode-path driver
time and its ratio to prefix growth's, the stalled steps, and which call stalled (an
admission or a lease's growth). One JSON, the date and versions in it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvvmm.units import MiB  # noqa: E402
from kvvmm.workload import find_trace, run_workload  # noqa: E402
from kvvmm.workload.requests import load_workload  # noqa: E402
from kvvmm.workload.strategies import RequestRanges  # noqa: E402

MODES = {"no_pauses": None, "real_time": 1.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--trace", default=None, help="Azure conversation CSV (default: found)")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--reserve-mib", default="32,48,64,96")
    ap.add_argument("--extra-mib", default="0,16,32",
                    help="high_bytes over reserve_bytes, MiB")
    ap.add_argument("--out", default="sim-reserve-sweep.json")
    args = ap.parse_args(argv)
    path = find_trace(args.trace, start=ROOT)
    if path is None:
        print("probe_reserve_sweep: no trace (pass --trace)", file=sys.stderr)
        return 2
    reqs = load_workload(path).first(args.seconds)
    common: dict[str, Any] = {"model": "llama-3.1-70b", "tp": 8, "gpu": "h200"}
    prefix = {mode: run_workload(reqs, ["prefix"], pause_scale=scale, **common).results[0]
              for mode, scale in MODES.items()}
    rows = []
    for reserve in (int(x) for x in args.reserve_mib.split(",")):
        for extra in (int(x) for x in args.extra_mib.split(",")):
            row: dict[str, Any] = {"reserve_mib": reserve, "high_mib": reserve + extra}
            for mode, scale in MODES.items():
                r = run_workload(reqs, [lambda r=reserve, e=extra: RequestRanges(
                    deferred=True, reserve_bytes=r * MiB, high_bytes=(r + e) * MiB)],
                    pause_scale=scale, **common).results[0]
                pre = prefix[mode].decode_driver_s
                row[mode] = {
                    "held_over_used": round(r.mean_backed_bytes / r.mean_used_bytes, 4),
                    "decode_driver_ms": round(r.decode_driver_s * 1e3, 2),
                    "over_prefix": round(r.decode_driver_s / pre, 3) if pre else None,
                    "stalled_steps": r.stalled_steps, "max_stall_us": round(r.max_stall_s * 1e6),
                    "stalls_by_call": {"admit": r.ranges["stalled_admits"],
                                       "grow": r.ranges["stalled_grows"]},
                    "deferred_admits": r.ranges["deferred_admits"],
                    "deferred_ms": r.ranges["deferred_ms"],
                    "deferred_max_ms": r.ranges["deferred_max_ms"]}
            rows.append(row)
            rt, warm = row["real_time"], row["no_pauses"]
            print(f"reserve {reserve:4d} MiB, high {reserve + extra:4d}: held/used "
                  f"{rt['held_over_used']:.3f}; decode {warm['decode_driver_ms']:.1f} ms "
                  f"({warm['over_prefix']:.2f}x prefix) warm, {rt['decode_driver_ms']:.1f} ms "
                  f"({rt['over_prefix']:.2f}x) in real time, {rt['stalls_by_call']}; "
                  f"{rt['deferred_admits']} admissions a step later (max "
                  f"{rt['deferred_max_ms']:.1f} ms)",
                  flush=True)
    out = {"probe": "reserve-sweep", "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "trace": Path(path).name, "seconds": args.seconds, "requests": len(reqs.requests),
           **common, "strategy": "request-ranges+deferred",
           "prefix_decode_driver_ms": {m: round(p.decode_driver_s * 1e3, 2)
                                       for m, p in prefix.items()},
           "targets": {"held_over_used": 1.25, "over_prefix": 2.0}, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

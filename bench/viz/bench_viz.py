"""Benchmark (not a test): how long ``kvvmm.viz.va_map`` takes on large arenas.

    python bench/viz/bench_viz.py [--out bench/results] [--repeat 7]   # writes viz-bench.json

The targets: a 10k-mapping figure built
in <= 0.2 s in Python; every view (bars, grouped heatmap, drill-down, the 160-buffer
llama-3.1-70b TP8 map, 1,000 buffers, 100k mappings) in <= 0.5 s. The snapshot is
what decode growth under ``Exact()`` leaves: 40 buffers of 1 GiB in one arena on the sim
driver (H200 profile), each extended by one 2 MiB handle per step for 250 steps, the
handles of different buffers created in turn. Also timed: the heatmap past the threshold
(20k mappings), the figure's JSON (what a notebook or ``kvvmm map`` sends on), and
``describe``. Times are the median of ``--repeat`` runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


from kvvmm import Arena, ArenaSnapshot, KvBufferOwner, OwnerSnapshot, SimDriver
from kvvmm.layout import load_model, model_descs
from kvvmm.measure.machine import cpu_model, load_average, versions
from kvvmm.snapshot import AllocationInfo, MappingInfo
from kvvmm.units import GiB, MiB
from kvvmm.viz import HEATMAP_THRESHOLD, describe, va_map

ROOT = Path(__file__).resolve().parents[2]

TARGET_S = 0.2
VIEW_TARGET_S = 0.5


def grown_snapshot(buffers: int, steps: int) -> ArenaSnapshot:
    """``buffers`` 1 GiB allocations, each grown by a 2 MiB handle per step (Exact growth)."""
    drv = SimDriver("h200", capacity_bytes=1 << 50)
    arena = Arena(drv, reserve_bytes=buffers * GiB, name=f"{buffers}x{steps} exact growth")
    offsets = [arena.allocate(GiB, f"kv{i}") for i in range(buffers)]
    for step in range(1, steps + 1):
        arena.commit_many([(o, step * 2 * MiB) for o in offsets])
    return arena.snapshot()


def llama70b_tp8() -> OwnerSnapshot:
    """One TP8 rank of llama-3.1-70b: 160 buffers, 300k tokens of prefix backed."""
    descs = model_descs(load_model("llama-3.1-70b"), tp=8, reserved_tokens=1 << 20,
                        page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=SimDriver("h200"), dtype="bfloat16", page_size=16,
                          reserved_tokens=1 << 20, descs=descs)
    owner.ensure_prefix(300_000)
    return owner.snapshot()


def synthetic(buffers: int, handles_each: int) -> ArenaSnapshot:
    """Straight from the dataclasses (no driver): ``buffers`` k/v allocations, half backed."""
    gran, allocs, maps, off, hid = 2 * MiB, [], [], 0, 1
    size = 2 * handles_each * gran
    for i in range(buffers):
        n = f"{'kv'[i % 2]}{i // 2}"
        maps += [MappingInfo(off + h * gran, gran, hid + h, n) for h in range(handles_each)]
        hid += handles_each
        allocs.append(AllocationInfo(n, off, size, size, handles_each * gran))
        off += size
    return ArenaSnapshot(name="synthetic", driver="sim", device_name="none", granularity=gran,
                         base=0x7F0000000000, reserved_bytes=off, cursor_bytes=off,
                         allocations=tuple(allocs), mappings=tuple(maps),
                         backed_bytes=len(maps) * gran, closed=False)


def timed(fn: Callable[[], object], repeat: int) -> dict[str, float]:
    fn()  # warm-up: imports, plotly's validators
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(runs), 4), "min_s": round(min(runs), 4),
            "max_s": round(max(runs), 4), "runs": repeat}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    snap10k = grown_snapshot(40, 250)
    snap20k = grown_snapshot(80, 250)
    assert len(snap10k.mappings) == 10_000 and len(snap20k.mappings) > HEATMAP_THRESHOLD
    fig10k = va_map(snap10k)
    results = {
        "va_map_10k_bars": {"mappings": len(snap10k.mappings), "mode": fig10k.layout.meta["mode"],
                            **timed(lambda: va_map(snap10k), args.repeat)},
        "va_map_10k_forced_heatmap": {
            "mappings": len(snap10k.mappings),
            **timed(lambda: va_map(snap10k, heatmap=True), args.repeat)},
        "va_map_20k_heatmap": {"mappings": len(snap20k.mappings),
                               "mode": va_map(snap20k).layout.meta["mode"],
                               **timed(lambda: va_map(snap20k), args.repeat)},
        "to_json_10k": {"bytes": len(fig10k.to_json()),
                        **timed(fig10k.to_json, args.repeat)},
        "describe_10k": timed(lambda: describe(snap10k), args.repeat),
    }
    llama = llama70b_tp8()
    s1000, s100k = synthetic(1000, 10), synthetic(1000, 100)
    views = {
        "va_map_llama70b_tp8_160_buffers": (llama, {}),
        "va_map_llama70b_tp8_by_layer": (llama, {"group_by": "layer"}),
        "va_map_llama70b_tp8_drill_down_k3": (llama, {"buffer": "k3"}),
        "va_map_10k_drill_down_kv0": (snap10k, {"buffer": "kv0"}),
        "va_map_1000_buffers_10k_mappings": (s1000, {}),
        "va_map_1000_buffers_100k_mappings": (s100k, {}),
    }
    for key, (snap, kw) in views.items():
        arena = snap.arena if isinstance(snap, OwnerSnapshot) else snap
        results[key] = {"mappings": len(arena.mappings), "kwargs": kw,
                        "mode": va_map(snap, **kw).layout.meta["mode"],  # type: ignore[arg-type]
                        **timed(lambda s=snap, k=kw: va_map(s, **k), args.repeat)}  # type: ignore[misc]
    ok = results["va_map_10k_bars"]["median_s"] <= TARGET_S  # type: ignore[operator]
    ok = ok and all(r["median_s"] <= VIEW_TARGET_S for k, r in results.items()  # type: ignore[index,operator]
                    if k.startswith("va_map"))
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    res = {
        "benchmark": "viz",
        "date": date,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average": load_average(),
                    "python": platform.python_version(),
                    "system": platform.platform(), "card": "none (SimDriver, H200 profile)"},
        "versions": versions(ROOT, "plotly", "numpy"),
        "target": {"va_map_10k_s": TARGET_S, "every_view_s": VIEW_TARGET_S, "met": ok},
        "results": results,
    }
    print(json.dumps(res, indent=1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "viz-bench.json")  # the date is inside
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print("wrote", path)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

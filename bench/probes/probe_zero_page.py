"""What does ``CudaDriver(zero_page=...)`` cost on this GPU?

Runs on a GPU (the device machine), in under two minutes on an H200, and writes one JSON
(card, versions, date, and every figure below) to ``--out``:

A. Construction (the zero handles, made and zeroed) and reserve+cover / free for 4, 64 and
   246 GiB reservations, with blocks of 2 MiB (granule pieces only), 32, 64 (the default)
   and 128 MiB; zero_page off alongside.
B. The commit and decommit overhead per 2 MiB handle (map + set_access; unmap), zero_page
   off and on (64 MiB blocks) interleaved rep by rep in a shuffled order: a handle at the
   start of an untouched block, in the middle of one, and a decode-growth-like sequence
   (8 buffers grown 2 MiB a step for 64 steps, round-robin, then each decommitted whole).
   Handles are created before the timing: only the calls zero_page changes are timed.
C. A llama-3.1-70b owner (80 layers x K and V, 800k reserved tokens: ~244 GiB of VA)
   constructed and closed, zero_page off and on, interleaved.

    PYTHONPATH=$PWD python3 bench/probes/probe_zero_page.py --out "$OUT/h200-zero-page.json"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

MiB, GiB = 1 << 20, 1 << 30
pc = time.perf_counter


def _versions() -> dict[str, Any]:
    import importlib.metadata as md

    import torch
    from cuda.bindings import driver as drv

    out: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda_driver": drv.cuDriverGetVersion()[1]}
    for pkg in ("cuda-bindings", "cuda-python", "kvvmm"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def _ms(xs: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(xs) * 1e3, 4),
            "min_ms": round(min(xs) * 1e3, 4), "max_ms": round(max(xs) * 1e3, 4), "n": len(xs)}


def part_a(res: dict[str, Any]) -> None:
    from kvvmm.driver.cuda import CudaDriver

    rows = []
    for block in (0, 2 * MiB, 32 * MiB, 64 * MiB, 128 * MiB):
        t0 = pc()
        d = CudaDriver(zero_page=block or False)
        made = pc() - t0
        row: dict[str, Any] = {"block_mib": block // MiB, "construct_ms": round(made * 1e3, 3)}
        zs = d.zero_stats()
        row["zero_mib"] = zs.zero_bytes / MiB if zs else 0
        for size_gib in (4, 64, 246):
            size = size_gib * GiB
            t0 = pc()
            va = d.reserve(size)
            t1 = pc()
            n = d.zero_stats().mappings if zs else 0
            d.free(va, size)
            t2 = pc()
            row[f"{size_gib}GiB"] = {"reserve_ms": round((t1 - t0) * 1e3, 3),
                                     "free_ms": round((t2 - t1) * 1e3, 3), "mappings": n}
            print(block // MiB, size_gib, row[f"{size_gib}GiB"], flush=True)
        t0 = pc()
        d.close()
        row["close_ms"] = round((pc() - t0) * 1e3, 3)
        rows.append(row)
    res["A_reserve_cover_free"] = rows


def part_b(res: dict[str, Any], reps: int = 40) -> None:
    from kvvmm.driver.cuda import CudaDriver

    drivers = {"off": CudaDriver(), "on": CudaDriver(zero_page=64 * MiB)}
    g = drivers["off"].granularity()
    z = 64 * MiB
    rng = random.Random(0)
    out: dict[str, Any] = {"block_mib": 64, "reps": reps,
                           "fast_path": {k: d.fast_path for k, d in drivers.items()}}
    for where, off in (("block_start", 0), ("block_middle", z // 2)):
        t_map: dict[str, list[float]] = {"off": [], "on": []}
        t_unmap: dict[str, list[float]] = {"off": [], "on": []}
        vas = {k: d.reserve(reps * z) for k, d in drivers.items()}
        hs = {k: [d.create(g) for _ in range(reps)] for k, d in drivers.items()}
        for r in range(reps):
            order = ["off", "on"]
            rng.shuffle(order)
            for k in order:
                d, va = drivers[k], vas[k] + r * z + off  # an untouched block each rep
                t0 = pc()
                d.map(va, g, hs[k][r])
                d.set_access(va, g)
                t1 = pc()
                d.unmap(va, g)
                t2 = pc()
                t_map[k].append(t1 - t0)
                t_unmap[k].append(t2 - t1)
        for k, d in drivers.items():
            for h in hs[k]:
                d.release(h)
            d.free(vas[k], reps * z)
        out[where] = {k: {"commit": _ms(t_map[k]), "decommit": _ms(t_unmap[k])}
                      for k in drivers}
        print(where, json.dumps(out[where]), flush=True)

    # Decode-growth-like: 8 buffers of 128 MiB, 2 MiB a step, round-robin; then each one
    # decommitted whole (one unmap of its 64 mappings).
    buffers, steps = 8, 64
    grow: dict[str, list[float]] = {"off": [], "on": []}
    shrink: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(3):
        order = ["off", "on"]
        rng.shuffle(order)
        for k in order:
            d = drivers[k]
            span = steps * g
            total = buffers * (span + g) + g
            va = d.reserve(total)
            # One granule apart, so no buffer starts at a block's start.
            base = [va + g + b * (span + g) for b in range(buffers)]
            hs2 = [[d.create(g) for _ in range(steps)] for _ in range(buffers)]
            t0 = pc()
            for s in range(steps):
                for b in range(buffers):
                    d.map(base[b] + s * g, g, hs2[b][s])
                    d.set_access(base[b] + s * g, g)
            t1 = pc()
            for b in range(buffers):
                d.unmap(base[b], span)
            t2 = pc()
            grow[k].append((t1 - t0) / (buffers * steps))
            shrink[k].append((t2 - t1) / buffers)
            for row in hs2:
                for h in row:
                    d.release(h)
            d.free(va, total)
    out["decode_growth"] = {
        "buffers": buffers, "steps": steps,
        **{k: {"commit_per_handle": _ms(grow[k]), "decommit_per_buffer": _ms(shrink[k])}
           for k in drivers},
    }
    print("decode_growth", json.dumps(out["decode_growth"]), flush=True)
    for d in drivers.values():
        d.close()
    res["B_commit_decommit"] = out


def part_c(res: dict[str, Any], reps: int = 3) -> None:
    from kvvmm.driver.cuda import CudaDriver
    from kvvmm.layout import model_descs
    from kvvmm.owner import KvBufferOwner

    tokens = 800_000
    descs = model_descs("llama-3.1-70b", reserved_tokens=tokens, page_size=64,
                        dtype="bfloat16")
    drivers = {"off": CudaDriver(), "on": CudaDriver(zero_page=True)}
    times: dict[str, dict[str, list[float]]] = {k: {"construct": [], "close": []}
                                                for k in drivers}
    rng = random.Random(1)
    va_bytes = 0
    for _ in range(reps):
        order = ["off", "on"]
        rng.shuffle(order)
        for k in order:
            t0 = pc()
            owner = KvBufferOwner(driver=drivers[k], dtype="bfloat16", page_size=64,
                                  reserved_tokens=tokens, descs=descs)
            t1 = pc()
            va_bytes = owner.arena.reserved_bytes
            owner.close()
            t2 = pc()
            times[k]["construct"].append(t1 - t0)
            times[k]["close"].append(t2 - t1)
    res["C_owner"] = {"model": "llama-3.1-70b", "buffers": len(descs),
                      "reserved_tokens": tokens, "va_gib": round(va_bytes / GiB, 2),
                      **{k: {n: _ms(v) for n, v in t.items()} for k, t in times.items()}}
    print("owner", json.dumps(res["C_owner"]), flush=True)
    for d in drivers.values():
        d.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = os.path.join(os.environ.get("OUT", "."), "zero-page.json")
    ap.add_argument("--out", default=default, help="the JSON file to write")
    ap.add_argument("--parts", default="ABC", help="which parts to run (default ABC)")
    args = ap.parse_args()

    import torch

    torch.empty(1, device="cuda")
    res: dict[str, Any] = {"probe": "probe_zero_page", "card": torch.cuda.get_device_name(0),
                           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "versions": _versions()}
    t0 = pc()
    for part, fn in (("A", part_a), ("B", part_b), ("C", part_c)):
        if part in args.parts:
            t = pc()
            fn(res)
            res[f"{part}_s"] = round(pc() - t, 2)
            # Written after each part: a later part that fails must not lose the earlier.
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    res["total_s"] = round(pc() - t0, 2)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k.endswith("_s")}))


if __name__ == "__main__":
    main()

"""Benchmark (not a test): SimDriver operations per second, and a simulated decode growth.

    python bench/sim/bench_sim.py [--out bench/results]   # writes sim-bench.json there

1. Raw SimDriver throughput: create+map+set_access then unmap+release of 2 MiB handles, in
   a 1 TiB reservation (target: >= 200k driver operations per second).
2. Decode growth of 160 buffers (Llama-3.1-70B at TP=8: 80 layers x K and V, one KV head
   of 128 dims per rank, bf16) to 1M tokens in 4096-token steps, then finalize, then close,
   per growth policy: wall time, driver calls, handles, simulated driver time (the H200
   cost model) and its band (``grow_sim_driver_ms_band``: [low, mid, high], the growth at
   the profile's p10 and p90 costs, kvvmm.workload.bands).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from kvvmm import Chunked, Exact, Geometric, KvBufferOwner, SimDriver, mha_token_major
from kvvmm.driver.faults import FaultyDriver
from kvvmm.measure.elastic import GAP_S, LOOKAHEAD_BYTES, LOOKAHEAD_SWEEP
from kvvmm.measure.machine import cpu_model, load_average, versions
from kvvmm.measure.workload import BENCH_WORKLOAD
from kvvmm.policy import default_policy
from kvvmm.units import MiB
from kvvmm.workload.bands import band_profiles

ROOT = Path(__file__).resolve().parents[2]


def raw_ops(n: int = 100_000) -> dict[str, float]:
    d = SimDriver("h200", capacity_bytes=1 << 50)  # room for 100k handles
    g = d.granularity()
    va = d.reserve(1 << 40)
    t0 = time.perf_counter()
    handles = []
    for i in range(n):
        h = d.create(g)
        d.map(va + i * g, g, h)
        d.set_access(va + i * g, g)
        handles.append(h)
    t1 = time.perf_counter()
    for i, h in enumerate(handles):
        d.unmap(va + i * g, g)
        d.release(h)
    t2 = time.perf_counter()
    d.free(va, 1 << 40)
    ops = 5 * n
    return {"operations": ops, "seconds": round(t2 - t0, 4),
            "ops_per_s": round(ops / (t2 - t0)), "commit_ops_per_s": round(3 * n / (t1 - t0)),
            "teardown_ops_per_s": round(2 * n / (t2 - t1))}


def growth(policy: object, steps_to: int = 1_000_000, step: int = 4096,
           profile: object = "h200") -> dict[str, object]:
    drv = FaultyDriver(SimDriver(profile))  # type: ignore[arg-type]  # no faults: counts calls
    descs = mha_token_major(layers=80, kv_heads=8, head_dim=128, reserved_tokens=steps_to,
                            page_size=16, dtype="bfloat16", tp=8)
    t0 = time.perf_counter()
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=steps_to,
                          descs=descs, policy=policy)  # type: ignore[arg-type]
    t1 = time.perf_counter()
    c0, clock0 = len(drv.calls), drv.clock_us
    for n in range(step, steps_to + 1, step):
        owner.ensure_prefix(n)
    t2 = time.perf_counter()
    grow_calls, grow_sim = len(drv.calls) - c0, drv.clock_us - clock0
    snap = owner.snapshot()
    need = sum(d.prefix_span_bytes(steps_to - steps_to % step, 16) for d in descs)
    owner.finalize(steps_to)
    t3 = time.perf_counter()
    handles_final = owner.snapshot().handles
    owner.close()
    t4 = time.perf_counter()
    assert drv.stats().clean
    return {
        "policy": str(policy), "buffers": len(descs), "steps": steps_to // step,
        "construct_ms": round((t1 - t0) * 1e3, 2), "grow_ms": round((t2 - t1) * 1e3, 2),
        "grow_driver_calls": grow_calls, "grow_sim_driver_ms": round(grow_sim / 1e3, 2),
        "handles_after_growth": snap.handles, "overcommit_bytes": snap.backed_bytes - need,
        "finalize_ms": round((t3 - t2) * 1e3, 2), "handles_after_finalize": handles_final,
        "close_ms": round((t4 - t3) * 1e3, 2), "backed_bytes": snap.backed_bytes,
    }


def elastic_growth(*, pool: bool, lookahead_bytes: int = LOOKAHEAD_BYTES,
                   gap_s: float = GAP_S) -> dict[str, object]:
    """Issue 19: ``kvvmm bench``'s elastic growth (kvvmm.measure.bench.elastic_growth: 64 buffers x
    122 steps, Llama-3-8B-like, 2M reserved tokens, 4096-token steps to 500k, the default
    policy), on the sim's clock. The same gap and look-ahead as the H200 run: the bench sleeps
    ``gap_s`` between steps while the pool's thread works; here the pool is stepped
    (``run_once``) in each gap, which models a thread that finishes its work within the gap,
    so the result says how much of each gap that work took (``max_background_per_gap_ms``
    <= ``gap_ms`` is the model's condition). The owner is primed (``ensure_prefix(0)`` and a
    gap) before the first step, as in the bench. What each ``ensure_prefix`` costs in sim
    driver time is what a decode step would wait for."""
    from kvvmm.arena.pool import HandlePool

    w = BENCH_WORKLOAD
    drv = SimDriver("h200")
    descs = w.descs()
    hp = HandlePool(drv, threaded=False) if pool else None
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=w.page_size,
                          reserved_tokens=w.reserved_tokens, descs=descs, pool=hp,
                          lookahead_bytes=lookahead_bytes if pool else 0)
    owner.ensure_prefix(0)
    if hp is not None:
        hp.run_once()
    per_step: list[float] = []
    gaps: list[float] = []
    over_steps: list[int] = []
    for n in range(w.step_tokens, w.grow_to_tokens + 1, w.step_tokens):
        c = drv.clock_us
        owner.ensure_prefix(n)
        per_step.append(drv.clock_us - c)
        if hp is not None:
            c = drv.clock_us
            hp.run_once()
            gaps.append(drv.clock_us - c)
        # at every step, after the gap's work: the worst the look-ahead holds ahead
        over_steps.append(owner.backed_bytes - sum(d.prefix_span_bytes(n, w.page_size)
                                                   for d in descs))
    snap = owner.snapshot()
    need = sum(d.prefix_span_bytes(w.steps * w.step_tokens, w.page_size) for d in descs)
    # page-granular: single pages in the middle of a buffer, commit then decommit, twice
    # (the second commit takes the pool's retained handles: map + access only)
    mid = owner.pages // 2
    pages = list(range(mid, mid + 16 * 16, 16))  # one page per granule: one handle each
    cyc: dict[str, float] = {}
    for cycle in (1, 2):
        for op, fn in (("commit", owner.commit_pages), ("decommit", owner.decommit_pages)):
            c = drv.clock_us
            for p in pages:
                fn([p])
            cyc[f"page_{op}_us_cycle{cycle}"] = round((drv.clock_us - c) / len(pages), 1)
    owner.close()
    if hp is not None:
        hp.close()
    srt = sorted(per_step)
    bg = sum(gaps)
    return {
        "pool": pool, "lookahead_bytes": lookahead_bytes if pool else 0,
        "gap_ms": gap_s * 1e3, "buffers": len(descs), "steps": len(per_step),
        "ensure_prefix_blocked_ms": round(sum(per_step) / 1e3, 3),
        "step_p50_us": round(srt[len(srt) // 2], 1),
        "step_p99_us": round(srt[min(len(srt) - 1, math.ceil(len(srt) * 0.99) - 1)], 1),
        "background_driver_ms": round(bg / 1e3, 3),
        "max_background_per_gap_ms": round(max(gaps, default=0.0) / 1e3, 3),
        "total_driver_ms": round((sum(per_step) + bg) / 1e3, 3),
        "overcommit_bytes": snap.backed_bytes - need,
        "overcommit_peak_bytes": max(over_steps),
        "max_overcommit_per_buffer": max(b.backed_bytes - b.prefix_bytes for b in snap.buffers),
        # the first cycle's names as before, for comparison with older results
        "page_commit_us": cyc["page_commit_us_cycle1"],
        "page_decommit_us": cyc["page_decommit_us_cycle1"], **cyc,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    args = ap.parse_args()

    res: dict[str, object] = {
        "benchmark": "sim", "date": datetime.datetime.now(datetime.UTC).isoformat(
            timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_average": load_average(),
                    "python": platform.python_version(), "card": "none (SimDriver, H200 profile)"},
        "versions": versions(ROOT, "torch"),
        "target": {"ops_per_s": 200_000},
    }
    res["raw"] = raw_ops()
    policies = (default_policy(), Exact(), Chunked(64 * MiB), Geometric(2.0, 256 * MiB))
    res["decode_growth"] = [growth(p) for p in policies]
    # The simulated growth time's band: the same growth at the profile's p10 and p90 costs
    # (kvvmm.workload.bands), [low, mid, high] ms.
    lo_p, _, hi_p = band_profiles("h200")
    for row, p in zip(res["decode_growth"], policies, strict=True):  # type: ignore[call-overload]
        ends = [growth(p, profile=q)["grow_sim_driver_ms"] for q in (lo_p, hi_p)]
        row["grow_sim_driver_ms_band"] = [ends[0], row["grow_sim_driver_ms"], ends[1]]
    res["elastic_growth"] = [elastic_growth(pool=False), elastic_growth(pool=True)]
    res["elastic_lookahead_sweep"] = [elastic_growth(pool=True, lookahead_bytes=la)
                                      for la in (*LOOKAHEAD_SWEEP, 256 * MiB)
                                      if la != LOOKAHEAD_BYTES]
    print(json.dumps(res, indent=1))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sim-bench.json")  # the date is inside
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()

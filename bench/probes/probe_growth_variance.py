"""Why does the same decode growth take 30 ms in one round and 100 ms in the next?

Runs on a GPU (the device machine): the benchmark's decode growth (64 buffers x 122 steps of
4096 tokens, ``Chunked(128 MiB)``) many times in one process, with chosen pauses before some
rounds and an ``Exact()`` growth (7808 small handles) in between, and times every driver call
of each round by kind. Writes ``growth-variance.json`` under ``$OUT`` (or the folder given).

    PYTHONPATH=$PWD python3 bench/probes/probe_growth_variance.py "$OUT"
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from kvvmm.driver.cuda import CudaDriver
from kvvmm.measure import BENCH_WORKLOAD
from kvvmm.policy import Chunked, Exact
from kvvmm.units import MiB


class Timed:
    """The driver, with the time of each create/map/set_access/unmap/release summed."""

    def __init__(self, inner: CudaDriver) -> None:
        self._inner = inner
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.slowest: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def reset(self) -> None:
        self.t, self.n, self.slowest = {}, {}, {}

    def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self._inner, name)
        t0 = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t0
        self.t[name] = self.t.get(name, 0.0) + dt
        self.n[name] = self.n.get(name, 0) + 1
        self.slowest[name] = max(self.slowest.get(name, 0.0), dt)
        return out

    def create(self, size: int) -> int:
        return int(self._call("create", size))

    def map(self, va: int, size: int, handle: int) -> None:
        self._call("map", va, size, handle)

    def set_access(self, va: int, size: int, devices: Any = None) -> None:
        if devices is None:
            self._call("set_access", va, size)
        else:
            self._call("set_access", va, size, devices)

    def unmap(self, va: int, size: int) -> None:
        self._call("unmap", va, size)

    def release(self, handle: int) -> None:
        self._call("release", handle)


def grow(td: Timed, policy: Any) -> dict[str, Any]:
    owner = BENCH_WORKLOAD.owner(td, policy)
    free0, _ = td.mem_info()
    td.reset()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step_ms = []
    for n in BENCH_WORKLOAD.decode_steps():
        s0 = time.perf_counter()
        owner.ensure_prefix(n)
        step_ms.append((time.perf_counter() - s0) * 1e3)
    torch.cuda.synchronize()
    grow_ms = (time.perf_counter() - t0) * 1e3
    calls = {k: {"n": td.n[k], "total_ms": round(td.t[k] * 1e3, 2),
                 "mean_us": round(td.t[k] / td.n[k] * 1e6, 2),
                 "max_us": round(td.slowest[k] * 1e6, 1)} for k in td.t}
    t0 = time.perf_counter()
    owner.close()
    close_ms = (time.perf_counter() - t0) * 1e3
    close_calls = {k: round(td.t[k] * 1e3, 2) for k in td.t}
    free1, _ = td.mem_info()
    slow_steps = sorted(range(len(step_ms)), key=lambda i: -step_ms[i])[:5]
    return {"policy": str(policy), "grow_ms": round(grow_ms, 2), "calls": calls,
            "close_ms": round(close_ms, 2), "close_calls_cumulative_ms": close_calls,
            "free_before_gib": round(free0 / 2**30, 2),
            "free_after_close_gib": round(free1 / 2**30, 2),
            "step_ms_median": round(statistics.median(step_ms), 3),
            "slowest_steps": [(i, round(step_ms[i], 2)) for i in slow_steps]}


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.empty(1, device="cuda:0")
    td = Timed(CudaDriver(device=0))
    c128 = Chunked(128 * MiB)
    # (label, policy, pause before it in seconds)
    plan: list[tuple[str, Any, float]] = [
        ("fresh-1", c128, 0), ("b2b-2", c128, 0), ("b2b-3", c128, 0), ("b2b-4", c128, 0),
        ("b2b-5", c128, 0), ("pause3s", c128, 3), ("b2b-after-pause", c128, 0),
        ("exact", Exact(), 0), ("after-exact", c128, 0), ("after-exact-2", c128, 0),
        ("pause10s", c128, 10), ("b2b-after-10s", c128, 0),
        ("pause1s", c128, 1), ("pause1s-b", c128, 1), ("pause0.3s", c128, 0.3),
        ("pause0.3s-b", c128, 0.3),
    ]
    rows = []
    for label, pol, pause in plan:
        if pause:
            time.sleep(pause)
        r = grow(td, pol)
        r["label"], r["pause_s"] = label, pause
        rows.append(r)
        print(json.dumps({k: r[k] for k in ("label", "grow_ms", "close_ms")}
                         | {k: v["total_ms"] for k, v in r["calls"].items()}), flush=True)
    res = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": rows}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "growth-variance.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

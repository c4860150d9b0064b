"""What each piece of CudaDriver's map and unmap costs on the GPU host, in microseconds.

Times, one by one (median of many), the pieces an unmap is made of (the synchronize in its two
forms, the capture checks, the current-context query) and a map with the bookkeeping it
carries, beside the raw cuda-python calls, plus a pure-Python loop to compare this CPU with
another. Writes ``hot-path-parts.json`` under the folder given (``$OUT`` on the device).

    PYTHONPATH=$PWD python3 bench/probes/probe_hot_path.py "$OUT"
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from typing import Any


def med_us(fn: Callable[[], Any], n: int = 20000) -> float:
    pc = time.perf_counter
    xs = []
    for _ in range(n):
        t0 = pc()
        fn()
        xs.append(pc() - t0)
    return round(statistics.median(xs) * 1e6, 4)


def python_loop_us() -> float:
    """A fixed pure-Python workload (dict set, attribute add, compare), per iteration."""

    class H:
        __slots__ = ("maps", "size")

        def __init__(self) -> None:
            self.maps, self.size = 0, 2

    h, d = H(), {}
    t0 = time.perf_counter()
    for i in range(1_000_000):
        if h.size != 2 or i < 0:
            break
        d[i & 1023] = h
        h.maps += 1
    return round((time.perf_counter() - t0), 4)


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    res: dict[str, Any] = {
        "python": platform.python_version(),
        "python_loop_1M_s": python_loop_us(),
        "gcc": shutil.which("gcc") or shutil.which("cc") or "",
        "python_h": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
    }
    try:
        import torch
        from cuda.bindings import driver as d
    except ImportError as e:
        res["error"] = str(e)
    else:
        torch.cuda.init()  # type: ignore[no-untyped-call]
        torch.empty(1, device="cuda:0")
        _err, ctx = d.cuCtxGetCurrent()
        legacy = d.CUstream(d.CU_STREAM_LEGACY)
        res["cuCtxGetCurrent"] = med_us(d.cuCtxGetCurrent)
        res["cuCtxSynchronize"] = med_us(d.cuCtxSynchronize)
        res["cuCtxSynchronize_v2"] = med_us(lambda: d.cuCtxSynchronize_v2(ctx))
        res["cuCtxSynchronize_v2_result"] = str(d.cuCtxSynchronize_v2(ctx)[0])
        res["cuStreamIsCapturing_legacy"] = med_us(lambda: d.cuStreamIsCapturing(legacy))
        res["torch_is_current_stream_capturing"] = med_us(torch.cuda.is_current_stream_capturing)
        res["torch_C_isCurrentStreamCapturing"] = med_us(
            torch._C._cuda_isCurrentStreamCapturing)
        res["torch_C_getCurrentRawStream"] = med_us(lambda: torch._C._cuda_getCurrentRawStream(0))
        res["empty_lambda"] = med_us(lambda: None)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "hot-path-parts.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Does the VA alignment of a mapping change what CUDA calls cost or how fast tensors copy?

Two questions from ``kvvmm bench`` on the H200, answered on a GPU (the device machine):

A. kvvmm's 32 MiB creates took 1.56-1.75x the raw ones in three runs, 2 MiB and 512 MiB
   ones did not. The raw loop reserves with alignment 0, CudaDriver with the granularity.
   Each variant below runs create/map/access/sync/unmap/release, their order turned each
   rep; the create and release medians and the reservation addresses are reported.
B. Copy bandwidth of a 1 GiB bf16 tensor over eight 128 MiB handles whose VA starts 2 MiB
   past, or exactly at, a 128 MiB or 1 GiB boundary, against cudaMalloc tensors.

    PYTHONPATH=$PWD python3 bench/probes/probe_alignment.py "$OUT"
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from cuda.bindings import driver as d

from kvvmm.arena import device_tensor
from kvvmm.driver.cuda import CudaDriver
from kvvmm.measure import copy_tb_s

MiB, GiB = 1 << 20, 1 << 30


def ck(res: Any) -> Any:
    err = res[0] if isinstance(res, tuple) else res
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA call failed: {err}")
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    torch.empty(1, device="cuda:0")
    cd = CudaDriver()
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    acc = d.CUmemAccessDesc()
    acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = 0
    acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    res: dict[str, Any] = {"card": torch.cuda.get_device_name(0), "fast_path": cd.fast_path}

    # ---- A: create/release cost by reservation alignment
    size = 32 * MiB
    times: dict[str, dict[str, list[float]]] = {}
    pc = time.perf_counter

    def raw_cycle(name: str, va: int) -> Callable[[], None]:
        t = times.setdefault(name, {"create": [], "release": []})

        def run() -> None:
            t0 = pc()
            h = ck(d.cuMemCreate(size, prop, 0))
            t1 = pc()
            ck(d.cuMemMap(va, size, 0, h, 0))
            ck(d.cuMemSetAccess(va, size, [acc], 1))
            ck(d.cuCtxSynchronize())
            ck(d.cuMemUnmap(va, size))
            t2 = pc()
            ck(d.cuMemRelease(h))
            t3 = pc()
            t["create"].append(t1 - t0)
            t["release"].append(t3 - t2)
        return run

    def raw_create_only(name: str) -> Callable[[], None]:
        t = times.setdefault(name, {"create": [], "release": []})

        def run() -> None:
            t0 = pc()
            h = ck(d.cuMemCreate(size, prop, 0))
            t1 = pc()
            ck(d.cuMemRelease(h))
            t2 = pc()
            t["create"].append(t1 - t0)
            t["release"].append(t2 - t1)
        return run

    def kv_cycle(name: str, va: int) -> Callable[[], None]:
        t = times.setdefault(name, {"create": [], "release": []})

        def run() -> None:
            t0 = pc()
            h = cd.create(size)
            t1 = pc()
            cd.map(va, size, h)
            cd.set_access(va, size)
            cd.unmap(va, size)
            t2 = pc()
            cd.release(h)
            t3 = pc()
            t["create"].append(t1 - t0)
            t["release"].append(t3 - t2)
        return run

    vas = {
        "raw_align0": int(ck(d.cuMemAddressReserve(size, 0, 0, 0))),
        "raw_align2M": int(ck(d.cuMemAddressReserve(size, 2 * MiB, 0, 0))),
        "raw_align32M": int(ck(d.cuMemAddressReserve(size, size, 0, 0))),
        "kvvmm_default": cd.reserve(size),
        "kvvmm_align32M": cd.reserve(size, size),
    }
    res["A_reservations"] = {k: hex(v) for k, v in vas.items()}
    res["A_reservations_mod_32M"] = {k: (v % size) // MiB for k, v in vas.items()}
    runners = [raw_cycle(k, v) for k, v in vas.items() if k.startswith("raw")]
    runners += [kv_cycle(k, v) for k, v in vas.items() if k.startswith("kvvmm")]
    runners.append(raw_create_only("raw_create_release_only"))
    for rep in range(300):
        k = rep % len(runners)
        for run in runners[k:] + runners[:k]:
            run()
    res["A_us"] = {name: {op: round(statistics.median(v) * 1e6, 3) for op, v in t.items()}
                   for name, t in times.items()}
    for k, v in vas.items():
        if k.startswith("raw"):
            ck(d.cuMemAddressFree(v, size))
        else:
            cd.free(v, size)

    # ---- B: bandwidth by mapping alignment
    span = 8 * GiB
    base = int(ck(d.cuMemAddressReserve(span, GiB, 0, 0)))
    nbytes = GiB
    chunk = 128 * MiB
    handles: list[Any] = []

    def mapped_tensor(va: int) -> torch.Tensor:
        for i in range(nbytes // chunk):
            h = ck(d.cuMemCreate(chunk, prop, 0))
            ck(d.cuMemMap(va + i * chunk, chunk, 0, h, 0))
            ck(d.cuMemSetAccess(va + i * chunk, chunk, [acc], 1))
            handles.append((va + i * chunk, h))
        return device_tensor(va, nbytes, (nbytes // 2,), torch.bfloat16, 0, handles)

    bw: dict[str, Any] = {}
    plain_a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda:0").normal_()
    plain_b = torch.empty_like(plain_a).normal_()
    for label, pad in (("at_1GiB", 0), ("plus_2MiB", 2 * MiB), ("at_128MiB", 128 * MiB)):
        src = mapped_tensor(base + pad)
        dst = mapped_tensor(base + 4 * GiB + pad)
        src.normal_()
        runs_v, runs_p = [], []
        for _ in range(7):
            runs_v.append(copy_tb_s(dst, src))
            runs_p.append(copy_tb_s(plain_b, plain_a))
        v, p = statistics.median(runs_v), statistics.median(runs_p)
        bw[label] = {"vmm_TBps": v, "plain_TBps": p, "ratio": round(v / p, 4),
                     "runs_vmm": runs_v, "runs_plain": runs_p}
        del src, dst
        torch.cuda.synchronize()
        for va, h in handles:
            ck(d.cuMemUnmap(va, chunk))
            ck(d.cuMemRelease(h))
        handles.clear()
    ck(d.cuMemAddressFree(base, span))
    res["B_bandwidth_1GiB_over_128MiB_handles"] = bw
    cd.close()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "alignment.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

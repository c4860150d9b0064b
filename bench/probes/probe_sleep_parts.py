"""Probe (not a test): where a sleep's and a wake's time goes on a GPU, and what pinned host
memory costs the device.

tests/gpu/test_gpu_sleep.py measured an 8 GiB wake with contents at 8.9x a plain
host-to-device copy of the same bytes, and a host-backed sleep giving the device back 4 MiB
less than the owner's 2.4 GB. This times each step of the backup (open: pinning; save; flush;
load; drop: unpinning) inside a real owner's sleep and wake, the device memory pinned host
memory takes (page tables for its 4 KiB pages are device memory), and whether unpinning on a
second thread slows copies on the first.

    PYTHONPATH=$PWD python3 bench/probes/probe_sleep_parts.py --gib 8 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import platform
import threading
import time
from datetime import UTC, datetime
from typing import Any

import torch

from kvvmm import KvBufferOwner, mha_token_major
from kvvmm.arena import backup as backup_mod
from kvvmm.driver.cuda import CudaDriver
from kvvmm.policy import Exact
from kvvmm.units import GiB

ROW = 8 * 128 * 2


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def pinned_cost(gib: float) -> dict[str, Any]:
    n = int(gib * GiB)
    f0 = free_bytes()
    t0 = time.perf_counter()
    pieces = [torch.empty(s, dtype=torch.uint8, pin_memory=True)
              for s in backup_mod.pow2_pieces(n)]
    pin_s = time.perf_counter() - t0
    f1 = free_bytes()
    t0 = time.perf_counter()
    del pieces
    torch._C._host_emptyCache()
    unpin_s = time.perf_counter() - t0
    f2 = free_bytes()
    return {"gib": gib, "pin_s": pin_s, "unpin_s": unpin_s, "device_bytes_taken": f0 - f1,
            "device_bytes_back_after_unpin": f2 - f1,
            "device_bytes_per_host_gib": (f0 - f1) / gib}


def registered_cost(gib: float, huge: bool) -> dict[str, Any]:
    """Host memory from mmap (transparent huge pages asked for or not), pinned with
    cudaHostRegister: does the device's cost per host byte depend on the host page size?"""
    n = int(gib * GiB)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(m, dtype=torch.uint8)
    buf.fill_(1)  # fault the pages in (huge ones where the kernel gave them)
    f0 = free_bytes()
    rt = torch.cuda.cudart()
    t0 = time.perf_counter()
    err = rt.cudaHostRegister(buf.data_ptr(), n, 0)
    reg_s = time.perf_counter() - t0
    f1 = free_bytes()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dev.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    h2d_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rt.cudaHostUnregister(buf.data_ptr())
    unreg_s = time.perf_counter() - t0
    del dev, buf
    m.close()
    return {"gib": gib, "huge": huge, "register_rc": int(err), "register_s": reg_s,
            "unregister_s": unreg_s, "device_bytes_taken": f0 - f1,
            "h2d_GBps": n / h2d_s / 1e9}


def h2d_GBps(n: int) -> float:
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    del host, dev
    torch._C._host_emptyCache()
    return n / s / 1e9


def owner_parts(gib: int) -> dict[str, Any]:
    """A real owner's host-backed sleep and wake with every backup step timed."""
    times: dict[str, float] = {}
    orig = {k: getattr(backup_mod.HostBackup, k) for k in ("open", "save", "load", "drop")}
    orig_flush = backup_mod.Backup.flush

    def timed(name: str, fn: Any) -> Any:
        def inner(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                times[name] = times.get(name, 0.0) + time.perf_counter() - t0
        return inner

    for k, fn in orig.items():
        setattr(backup_mod.HostBackup, k, timed(k, fn))
    backup_mod.Backup.flush = timed("flush", orig_flush)  # type: ignore[method-assign]
    d = CudaDriver()
    try:
        tokens = gib * GiB // (2 * ROW) - 16
        descs = mha_token_major(layers=1, kv_heads=8, head_dim=128, reserved_tokens=tokens,
                                page_size=16, dtype="bfloat16")
        owner = KvBufferOwner(driver=d, dtype="bfloat16", page_size=16,
                              reserved_tokens=tokens, descs=descs, policy=Exact())
        owner.finalize(tokens)
        for t in owner.tensors:
            t.view(torch.int16).random_()
        del t  # a tensor left in this frame keeps the arena open after close (a deferred close)
        torch.cuda.synchronize()
        out: dict[str, Any] = {"gib": gib, "backed_bytes": owner.backed_bytes}
        for rnd, memory in enumerate(["torch", "mmap", "torch", "mmap"]):
            key = f"{memory}_{rnd}"
            backup_mod.wait_unpinned()
            times.clear()
            f0 = free_bytes()
            t0 = time.perf_counter()
            owner.sleep(backup_mod.HostBackup(memory))
            out[f"sleep_s_{key}"] = time.perf_counter() - t0
            out[f"sleep_parts_{key}"] = dict(times)
            out[f"device_freed_{key}"] = free_bytes() - f0
            times.clear()
            t0 = time.perf_counter()
            owner.wake()
            torch.cuda.synchronize()
            out[f"wake_s_{key}"] = time.perf_counter() - t0
            out[f"wake_parts_{key}"] = dict(times)
            t0 = time.perf_counter()
            backup_mod.wait_unpinned()
            out[f"unpin_after_wake_s_{key}"] = time.perf_counter() - t0
        owner.close()
    finally:
        for k, fn in orig.items():
            setattr(backup_mod.HostBackup, k, fn)
        backup_mod.Backup.flush = orig_flush  # type: ignore[method-assign]
        d.close()
    return out


def unpin_beside_copies(gib: int) -> dict[str, Any]:
    """Unpin ``gib`` GiB on a second thread while this one copies 1 GiB host-to-device
    again and again: does the unpin hold the driver's lock?"""
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    big = [torch.empty(s, dtype=torch.uint8, pin_memory=True)
           for s in backup_mod.pow2_pieces(gib * GiB)]
    done = threading.Event()
    t_unpin: list[float] = []

    def unpin() -> None:
        t0 = time.perf_counter()
        big.clear()
        torch._C._host_emptyCache()
        t_unpin.append(time.perf_counter() - t0)
        done.set()

    copies = []
    th = threading.Thread(target=unpin)
    th.start()
    while not done.is_set():
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - t0)
    th.join()
    del host, dev
    return {"gib": gib, "unpin_s": t_unpin[0], "copies": len(copies),
            "worst_copy_s": max(copies), "best_copy_s": min(copies),
            "copy_GBps_during": n * len(copies) / sum(copies) / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=8)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.empty(1, device="cuda")
    res: dict[str, Any] = {
        "card": torch.cuda.get_device_name(), "torch": torch.__version__,
        "python": platform.python_version(), "date": datetime.now(UTC).isoformat(),
        "h2d_GBps_1GiB": h2d_GBps(1 << 30)}
    steps = {"pinned": lambda: [pinned_cost(g) for g in (0.5, 2.3, float(a.gib))],
             "registered": lambda: [registered_cost(2.0, huge) for huge in (False, True)],
             "owner": lambda: owner_parts(a.gib),
             "unpin_beside_copies": lambda: unpin_beside_copies(a.gib)}
    rc = 0
    for name, step in steps.items():  # each step on its own: one failing keeps the others
        try:
            res[name] = step()
        except Exception as e:  # a probe reports and goes on
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            rc = 1
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())

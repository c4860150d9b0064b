"""Collective KV resizes on CUDA under NCCL: a world of one rank on one GPU.

The rank runs in a process of its own (``kvvmm.owner.distributed.spawn``, backend NCCL, 127.0.0.1),
so a crash cannot take the test session with it. It builds a CudaDriver owner, wraps it in a
DistributedOwner (the agreement tensors live on the GPU, as NCCL needs), finalizes
collectively, writes and reads the KV tensors, checks that an injected map failure rolls the
rank back, gathers the snapshot and shrinks. The two-GPU run is its own issue. Timings of
collective against plain finalize go to ``$OUT/gpu_distributed.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvvmm.owner.distributed import spawn  # noqa: E402

pytestmark = pytest.mark.usefixtures("needs_torch_cuda")

PS = 16


def _one_rank(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from kvvmm.driver import FaultyDriver
    from kvvmm.driver.cuda import CudaDriver
    from kvvmm.errors import CollectiveError
    from kvvmm.owner import KvBufferOwner
    from kvvmm.owner.distributed import DistributedOwner
    from kvvmm.owner.tp import tp_descs

    torch.cuda.set_device(rank)
    out: dict[str, Any] = {"backend": str(dist.get_backend())}
    drv = FaultyDriver(CudaDriver(device=rank))
    descs = tp_descs("llama-3.1-8b", tp=world, reserved_tokens=131072, page_size=PS,
                     dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PS, reserved_tokens=131072,
                          descs=descs)
    try:
        coll = DistributedOwner(owner, model="llama-3.1-8b", timeout_s=60)
        before = owner.snapshot()
        drv.arm({"map": 5})
        try:
            coll.finalize(65536)
        except CollectiveError as e:
            out["fault"] = {"phase": e.phase, "failed": list(e.failed_ranks),
                            "rolled_back": e.rolled_back}
        out["fault_unchanged"] = owner.snapshot() == before
        out["added"] = coll.finalize(65536)
        out["final_tokens"] = owner.final_tokens
        k = owner.tensors[0]
        k[:65536].fill_(3.0)
        torch.cuda.synchronize()
        out["sum_ok"] = bool(float(k[:65536].float().sum()) == 3.0 * k[:65536].numel())
        snap = coll.gather_snapshot()
        out["gathered_tp"] = None if snap is None else snap.tp
        out["shrunk"] = coll.shrink(PS)
        plain, collective = [], []
        for i in range(11):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            owner.finalize(65536)
            torch.cuda.synchronize()
            p = time.perf_counter() - t0
            owner.shrink(PS)
            t0 = time.perf_counter()
            coll.finalize(65536)
            torch.cuda.synchronize()
            c = time.perf_counter() - t0
            owner.shrink(PS)
            if i:
                plain.append(p * 1e3)
                collective.append(c * 1e3)
        out["plain_finalize_ms"] = statistics.median(plain)
        out["collective_finalize_ms"] = statistics.median(collective)
        out["device_name"] = drv.name
    finally:
        owner.close()
    return out


def test_a_collective_finalize_on_one_nccl_rank_backs_rolls_back_and_gathers() -> None:
    (got,) = spawn(_one_rank, 1, backend="nccl", timeout_s=300, group_timeout_s=120)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_distributed.json"), "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
    assert got["backend"] == "nccl"
    assert got["fault"] == {"phase": "map", "failed": [0], "rolled_back": True}
    assert got["fault_unchanged"]
    assert got["added"] > 0 and got["final_tokens"] == 65536 and got["sum_ok"]
    assert got["gathered_tp"] == 1 and got["shrunk"] > 0

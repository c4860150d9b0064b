"""Peer access and tensor-parallel ranks on real GPUs.

Most of this needs two GPUs (one arena's memory read and written by the other GPU; one
spawned process per GPU): those tests skip on a one-GPU machine, saying so. On one GPU the
rules for device lists still run (the own device named explicitly; a device that does not
exist refused with raw CUDA's own answer, CUDA_ERROR_INVALID_VALUE, which is recorded in
``$OUT/peer_answers.json``), and a one-rank tensor-parallel run goes through the
spawned-process path on CUDA.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvvmm.arena import Arena  # noqa: E402
from kvvmm.driver.base import CUDA_ERROR_INVALID_VALUE  # noqa: E402
from kvvmm.driver.cuda import CudaDriver  # noqa: E402
from kvvmm.errors import DriverError  # noqa: E402
from kvvmm.owner.tp import spawn_tp_snapshots  # noqa: E402

pytestmark = pytest.mark.usefixtures("needs_torch_cuda")

MiB = 1 << 20
ANSWERS: dict[str, Any] = {}


def _record(name: str, value: Any) -> None:
    ANSWERS[name] = value
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "peer_answers.json"), "w") as f:
            json.dump(ANSWERS, f, indent=1, sort_keys=True)


def _gpus() -> int:
    return int(torch.cuda.device_count())


@pytest.fixture
def two_gpus() -> tuple[CudaDriver, CudaDriver]:
    n = _gpus()
    if n < 2:
        pytest.skip(f"peer access needs 2 GPUs; this machine has {n} "
                    "(run tests/gpu/test_gpu_peer.py on a two-GPU machine, e.g. nvidia-h200-x2)")
    torch.empty(1, device="cuda:0")
    torch.empty(1, device="cuda:1")
    d0, d1 = CudaDriver(device=0), CudaDriver(device=1)
    if not d0.can_access_peer(1):
        d0.close()
        d1.close()
        pytest.skip("GPU 1 cannot access GPU 0's memory (cuDeviceCanAccessPeer is 0)")
    return d0, d1


@pytest.fixture
def pair(two_gpus: tuple[CudaDriver, CudaDriver]) -> Iterator[tuple[CudaDriver, CudaDriver]]:
    yield two_gpus
    for d in two_gpus:
        d.close()


# -- one GPU ------------------------------------------------------------------------------


def test_naming_the_own_device_is_the_default_access(cuda: Any) -> None:
    g = cuda.granularity()
    va = cuda.reserve(4 * g)
    h = cuda.create(g)
    cuda.map(va, g, h)
    cuda.set_access(va, g, devices=(0,))
    from kvvmm.arena._dlpack import device_tensor

    t = device_tensor(va, g, (g // 4,), torch.float32, 0, object())
    t.fill_(2.0)
    torch.cuda.synchronize()
    assert float(t.sum()) == 2.0 * (g // 4)
    del t
    gc.collect()
    cuda.unmap(va, g)
    cuda.release(h)
    cuda.free(va, 4 * g)
    assert not cuda.can_access_peer(0), "CUDA answers 0 for a device and itself"


def test_a_device_the_process_does_not_see_is_refused_as_raw_cuda_refuses_it(cuda: Any) -> None:
    n = _gpus()
    g = cuda.granularity()
    va = cuda.reserve(4 * g)
    h = cuda.create(g)
    cuda.map(va, g, h)
    with pytest.raises(DriverError) as info:
        cuda.set_access(va, g, devices=(0, n))
    # Raw CUDA's answer on a one-GPU H200 (2026-11-29, recorded below): INVALID_VALUE.
    assert info.value.cuda_error == CUDA_ERROR_INVALID_VALUE
    assert "not a device this process sees" in str(info.value)
    # What raw CUDA answers for the same call (kvvmm refused it before CUDA saw it).
    from cuda.bindings import driver as drv

    acc = drv.CUmemAccessDesc()
    acc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = n
    acc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    (err,) = drv.cuMemSetAccess(va, g, [acc], 1)
    _, name = drv.cuGetErrorName(err)
    raw = name.decode() if isinstance(name, bytes) else str(name)
    _record(f"raw cuMemSetAccess for device {n} (of {n} visible)", raw)
    cuda.set_access(va, g)  # the mapping is still fine
    cuda.unmap(va, g)
    cuda.release(h)
    cuda.free(va, 4 * g)
    assert raw == info.value.cuda_error, f"raw CUDA answered {raw}; kvvmm must answer the same"


def test_one_tp_rank_in_a_spawned_process_builds_its_owner_on_the_gpu() -> None:
    snap = spawn_tp_snapshots("cuda", model="llama-3.1-8b", tp=1, reserved_tokens=100_000,
                              finalize_tokens=10_000, timeout_s=180)
    (o,) = snap.owners
    assert snap.devices == (0,) and o.arena.driver == "cuda"
    assert o.final_tokens == 10_000 and o.backed_bytes >= 10_000 * 131072
    _record("spawned tp=1 owner: backed bytes", o.backed_bytes)


# -- two GPUs -----------------------------------------------------------------------------


def test_a_peer_reads_and_writes_memory_given_to_it(pair: tuple[CudaDriver, CudaDriver]
                                                    ) -> None:
    d0, _ = pair
    g = d0.granularity()
    va = d0.reserve(8 * g)
    h = d0.create(2 * g)
    d0.map(va, 2 * g, h)
    d0.set_access(va, 2 * g, devices=(0, 1))
    from kvvmm.arena._dlpack import device_tensor

    on0 = device_tensor(va, 2 * g, (2 * g // 4,), torch.float32, 0, object())
    on1 = device_tensor(va, 2 * g, (2 * g // 4,), torch.float32, 1, object())
    on0.fill_(3.0)
    torch.cuda.synchronize(0)
    assert float(on1.sum()) == 3.0 * (2 * g // 4), "GPU 1 did not read GPU 0's bytes"
    on1[:16] = 5.0
    torch.cuda.synchronize(1)
    assert on0[:16].tolist() == [5.0] * 16, "GPU 0 does not see GPU 1's write"
    del on0, on1
    gc.collect()
    d0.unmap(va, 2 * g)
    d0.release(h)
    d0.free(va, 8 * g)


def test_an_arena_grant_covers_what_is_backed_and_every_later_commit(
    pair: tuple[CudaDriver, CudaDriver],
) -> None:
    d0, _ = pair
    arena = Arena(d0, reserve_bytes=1024 * MiB)
    off = arena.allocate(256 * MiB, "kv")
    arena.commit(off, 64 * MiB)
    arena.grant_access([1])
    arena.commit(off, 192 * MiB)  # a later mapping, made with the peer in its access list
    local = arena.tensor(off, (96 * MiB,), "bfloat16")
    peer = arena.tensor(off, (96 * MiB,), "bfloat16", device=1)
    assert peer.device == torch.device("cuda", 1)
    local.fill_(1.0)
    torch.cuda.synchronize(0)
    assert float(peer.float().sum()) == 96 * MiB
    assert arena.snapshot().peer_devices == (1,)
    del local, peer
    gc.collect()
    arena.close()


def test_two_tp_ranks_run_in_two_spawned_processes_one_per_gpu() -> None:
    n = _gpus()
    if n < 2:
        pytest.skip(f"two tensor-parallel ranks need 2 GPUs; this machine has {n}")
    snap = spawn_tp_snapshots("cuda", model="llama-3.1-70b", tp=2, reserved_tokens=200_000,
                              finalize_tokens=50_000, timeout_s=300)
    assert snap.devices == (0, 1)
    assert [o.arena.driver for o in snap.owners] == ["cuda", "cuda"]
    assert snap.owners[0].backed_bytes == snap.owners[1].backed_bytes > 0
    _record("spawned tp=2 owners: backed bytes per rank", snap.owners[0].backed_bytes)

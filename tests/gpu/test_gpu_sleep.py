"""Sleep and wake on a GPU: contents through pinned host memory and a file, the
device's memory given back, a CUDA graph captured before the sleep replayed after the wake bit
for bit, the refusal during capture, zeros read while asleep with ``zero_page``, a failed wake
retried, and the wake's time against a plain host-to-device copy of the same bytes.

Sizes: ``KVVMM_SLEEP_GIB`` (default 8) GiB backed for the timing test; the issue's target is a
60 GiB pool (``KVVMM_SLEEP_GIB=60`` on an H200: 60 GiB of pinned host memory is needed). The
times go to ``$OUT/gpu_sleep_wake.json`` when ``OUT`` is set; they are measurements, asserted
only loosely.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvvmm import (
    DriverError,
    Fault,
    FaultyDriver,
    KvBufferOwner,
    SleepRefusedError,
    mha_token_major,
)
from kvvmm.arena.backup import HostBackup, wait_unpinned
from kvvmm.driver.base import CUDA_ERROR_OUT_OF_MEMORY
from kvvmm.driver.cuda import CudaDriver
from kvvmm.policy import Exact
from kvvmm.units import GiB, MiB

ROW_BYTES = 8 * 128 * 2  # kv_heads * head_dim * bfloat16


@pytest.fixture
def cd() -> Iterator[CudaDriver]:
    torch.empty(1, device="cuda")
    d = CudaDriver()
    yield d
    gc.collect()
    assert d.stats().clean, d.stats()
    d.close()


def _record(key: str, value: float) -> None:
    """One figure into ``$OUT/gpu_sleep_figures.json`` (kept across tests)."""
    if not os.environ.get("OUT"):
        return
    path = os.path.join(os.environ["OUT"], "gpu_sleep_figures.json")
    got = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    got[key] = value
    with open(path, "w") as f:
        json.dump(got, f, indent=1)


def make_owner(driver: Any, reserved: int = 1_000_000, layers: int = 2,
               **kw: Any) -> KvBufferOwner:
    descs = mha_token_major(layers=layers, kv_heads=8, head_dim=128, reserved_tokens=reserved,
                            page_size=16, dtype="bfloat16")
    return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16,
                         reserved_tokens=reserved, descs=descs, **kw)


def fill_random(owner: KvBufferOwner, n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    want = []
    for t in owner.tensors:
        x = torch.randint(-(1 << 15), 1 << 15, (n, 8, 128), dtype=torch.int16, device="cuda",
                          generator=gen)
        t[:n].view(torch.int16).copy_(x)
        want.append(x)
    torch.cuda.synchronize()
    return want


def same(owner: KvBufferOwner, want: list[torch.Tensor]) -> bool:
    n = want[0].shape[0]
    return all(torch.equal(t[:n].view(torch.int16), x)
               for t, x in zip(owner.tensors, want, strict=True))


@pytest.mark.parametrize("backup", ["host", "host-torch", "host-mmap", "disk"])
def test_sleep_gives_the_device_its_memory_back_and_wake_brings_every_byte_back(
        cd: CudaDriver, backup: str, tmp_path: Path) -> None:
    owner = make_owner(cd)
    owner.finalize(300_000)
    owner.commit_pages([50_000, 55_000])  # holes are remembered too
    want = fill_random(owner, 300_016)
    snap, backed = owner.snapshot(), owner.backed_bytes
    ptrs = [t.data_ptr() for t in owner.tensors]
    wait_unpinned()
    free0 = cd.mem_info()[0]
    how: Any = HostBackup(backup[5:]) if backup.startswith("host-") else backup
    res = owner.sleep(how, path=tmp_path / "kv.bin" if backup == "disk" else None)
    assert res.given_bytes == backed and cd.stats().physical_bytes == 0
    # target: >= 99.9% of the owner's physical bytes back to the device. A pinned host
    # backup costs the device memory while it exists (the driver's mapping of pinned host
    # memory: 0.17-0.25% of its size measured on an H200, torch_memory_saver's the same), so
    # there the device gets back less than the sleep released; a file backup costs nothing.
    back = cd.mem_info()[0] - free0
    _record(f"device_back_fraction_{backup}", back / backed)
    owner.wake()
    ok = (owner.snapshot() == snap, [t.data_ptr() for t in owner.tensors] == ptrs,
          same(owner, want))
    del want
    owner.close()  # before any assert: a failure must not leave the driver busy
    assert ok == (True, True, True), ok
    assert back >= (0.997 if backup.startswith("host") else 0.999) * backed, (back, backed)


def test_a_graph_captured_before_sleep_replays_after_wake_bit_for_bit(cd: CudaDriver) -> None:
    owner = make_owner(cd, layers=1)
    owner.finalize(200_000)
    want = fill_random(owner, 200_016, seed=1)
    k, v = owner.tensors
    idx = torch.arange(0, 200_000, 97, device="cuda")
    loc = torch.tensor([123_456], device="cuda")
    out = torch.empty(idx.numel(), 8, 128, dtype=torch.float32, device="cuda")

    def step() -> None:
        out.copy_(k.index_select(0, idx).float() * 0.5 + v.index_select(0, idx).float())
        k.index_copy_(0, loc, v.index_select(0, loc))  # a KV write, as decode makes

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up, outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    before_out = out.clone()
    before_kv = [t[:200_016].clone() for t in owner.tensors]
    owner.sleep("host")
    assert cd.stats().physical_bytes == 0
    owner.wake()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    # bits, not values: random KV bits hold NaNs, which compare unequal to themselves
    assert torch.equal(out.view(torch.int32), before_out.view(torch.int32))
    for t, b in zip(owner.tensors, before_kv, strict=True):
        assert torch.equal(t[:200_016].view(torch.int16), b.view(torch.int16))
    del graph, want, before_kv
    owner.close()


def test_sleep_during_a_cuda_graph_capture_is_refused_and_the_capture_survives(
        cd: CudaDriver) -> None:
    owner = make_owner(cd, layers=1)
    x = torch.zeros(16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    snap = owner.snapshot()
    graph = torch.cuda.CUDAGraph()
    refused: list[BaseException] = []
    with torch.cuda.graph(graph):  # raises at its end if the capture was invalidated
        x.add_(1)
        try:
            owner.sleep("host")
        except SleepRefusedError as e:
            refused.append(e)
    assert refused and "capture" in str(refused[0])
    assert owner.snapshot() == snap and not owner.asleep
    graph.replay()
    torch.cuda.synchronize()
    assert x[0].item() == 2.0
    owner.sleep()  # after the capture: works
    owner.wake()
    del graph
    owner.close()


def test_reads_while_asleep_are_zeros_with_zero_page() -> None:
    torch.empty(1, device="cuda")
    d = CudaDriver(zero_page=True)
    owner = make_owner(d, layers=1)
    owner.finalize(100_000)
    fill_random(owner, 100_016, seed=2)
    owner.sleep("host")
    assert all(float(t[:100_016].float().abs().sum()) == 0.0 for t in owner.tensors)
    owner.wake()
    assert any(bool(t[:100_016].any()) for t in owner.tensors)
    owner.close()
    gc.collect()
    d.close()


def test_a_wake_whose_map_fails_stays_asleep_and_a_retry_restores_every_byte() -> None:
    torch.empty(1, device="cuda")
    inner = CudaDriver()
    drv = FaultyDriver(inner)
    # On CUDA a create that runs out of memory empties torch's cache and is tried once more
    # (the default): opted out here, so the injected out-of-memory is the wake's failure.
    owner = make_owner(drv, layers=1, retry_on_oom=False)
    owner.finalize(100_000)
    owner.commit_pages([20_000])
    want = fill_random(owner, 100_016, seed=3)
    owner.sleep("host")
    held = inner.stats()
    for fault in (Fault("map", nth=2), Fault("create", nth=3, error=CUDA_ERROR_OUT_OF_MEMORY),
                  Fault("set_access", nth=1)):
        drv.arm(fault)
        with pytest.raises(DriverError):
            owner.wake()
        drv.disarm()
        assert owner.asleep and inner.stats() == held
    owner.wake()
    assert same(owner, want)
    del want
    owner.close()
    gc.collect()
    assert inner.stats().clean
    inner.close()


def _h2d_seconds(nbytes: int) -> float:
    """A plain pinned-host-to-device copy of ``nbytes``: the wake-with-contents yardstick."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del src, dst
    torch.cuda.empty_cache()
    empty_host = getattr(torch._C, "_host_emptyCache", None)  # the pinned block goes too
    if empty_host is not None:
        empty_host()
    return dt


def test_wake_time_with_and_without_contents_against_a_plain_host_to_device_copy(
        cd: CudaDriver) -> None:
    gib = int(os.environ.get("KVVMM_SLEEP_GIB", "8"))
    per_token = 2 * ROW_BYTES  # one layer: K and V
    tokens = gib * GiB // per_token - 16
    owner = make_owner(cd, reserved=tokens, layers=1, policy=Exact())
    owner.finalize(tokens)
    for t in owner.tensors:
        t.view(torch.int16).random_()
    torch.cuda.synchronize()
    backed = owner.backed_bytes
    h2d = _h2d_seconds(backed)
    out: dict[str, Any] = {"gib": gib, "backed_bytes": backed, "h2d_s": h2d,
                           "h2d_GBps": backed / h2d / 1e9,
                           "mappings": len(owner.snapshot().arena.mappings)}
    for name in ("torch", "mmap", None):
        wait_unpinned()
        t0 = time.perf_counter()
        res = owner.sleep(None if name is None else HostBackup(name))
        out[f"sleep_{name}_s"] = time.perf_counter() - t0
        out[f"sleep_{name}_given_fraction"] = res.given_bytes / backed
        t0 = time.perf_counter()
        owner.wake()
        torch.cuda.synchronize()
        out[f"wake_{name}_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        wait_unpinned()  # the backup's host memory, unpinned on a thread after the wake
        out[f"unpin_after_wake_{name}_s"] = time.perf_counter() - t0
    for name in ("torch", "mmap"):
        out[f"wake_{name}_over_h2d"] = out[f"wake_{name}_s"] / h2d
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_sleep_wake.json"), "w") as f:
            json.dump(out, f, indent=1)
    owner.close()
    # Loose bounds only (the targets, 1.2x and 50 ms at 60 GiB, are read from the
    # JSON): a wake must not be an order of magnitude off a plain copy.
    assert out["sleep_torch_given_fraction"] >= 0.999
    assert min(out["wake_torch_over_h2d"], out["wake_mmap_over_h2d"]) < 3.0, out
    assert out["wake_None_s"] < 1.0 + gib * 0.05, out
    assert backed >= (gib * GiB) - 64 * MiB

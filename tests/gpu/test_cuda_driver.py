"""What only a real GPU can show about CudaDriver: its device, context, close and capture.

The driver rules themselves (what every driver refuses, with which CUDA error name, and the
accounting that goes with them) are one table in ``tests/driver/test_driver_contract.py``, run on
this driver too, with its hot calls in C and in Python. What stays here needs a GPU and is no
row of it: the device and granularities CudaDriver reports, calls from a thread with no
current context, ``close()`` giving the device's memory back, an unmap refused during a CUDA
graph capture (recorded by the ``observe`` fixture, ``conftest.py``), and the C fast path
being on wherever it is built.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvvmm.driver.base import MemoryKind
from kvvmm.errors import ArgumentError

MiB = 1 << 20


def test_the_driver_names_its_device_and_kind(cuda: Any):
    assert cuda.kind == "cuda" and cuda.memory is MemoryKind.DEVICE and cuda.device == 0
    assert isinstance(cuda.name, str) and cuda.name and "\0" not in cuda.name
    free_bytes, total_bytes = cuda.mem_info()
    assert 0 < free_bytes <= total_bytes


def test_both_granularities_are_queried_and_one_is_chosen(cuda: Any):
    from kvvmm.driver.cuda import CudaDriver

    gmin, grec = cuda.granularity_min, cuda.granularity_recommended
    assert gmin > 0 and grec % gmin == 0
    assert cuda.granularity() == gmin
    rec = CudaDriver(granularity="recommended")
    big = CudaDriver(granularity=4 * gmin)
    try:
        assert rec.granularity() == grec
        assert big.granularity() == 4 * gmin
    finally:
        rec.close()
        big.close()
    with pytest.raises(ArgumentError, match="granularity"):
        CudaDriver(granularity="huge")
    with pytest.raises(ArgumentError, match="granularity"):
        CudaDriver(granularity=gmin + 4096)


def test_calls_work_from_a_thread_with_no_current_context(cuda: Any):
    g = cuda.granularity()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            va = cuda.reserve(4 * g)
            h = cuda.create(g)
            cuda.map(va, g, h)
            cuda.set_access(va, g)
            cuda.mem_info()
            cuda.unmap(va, g)
            cuda.release(h)
            cuda.free(va, 4 * g)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    assert cuda.stats().clean


def test_close_gives_back_everything_and_is_idempotent():
    from kvvmm.driver.cuda import CudaDriver

    d = CudaDriver()
    g = d.granularity()
    free0, _ = d.mem_info()
    va = d.reserve(8 * g)
    h = d.create(4 * g)
    d.map(va, 4 * g, h)
    d.set_access(va, 4 * g)
    d.create(2 * g)
    d.close()
    assert d.stats().clean
    d.close()
    probe = CudaDriver()
    try:
        free1, _ = probe.mem_info()
    finally:
        probe.close()
    assert abs(free1 - free0) < 64 * MiB


def test_unmap_during_cuda_graph_capture_is_refused_and_the_capture_survives(
    cuda: Any, observe: Any, needs_torch_cuda: None
):
    import torch

    g = cuda.granularity()
    va = cuda.reserve(4 * g)
    h = cuda.create(g)
    x = torch.zeros(16, device="cuda")
    # One unmap before the capture: it finds torch's capture check, and from then on the C
    # fast path (when on) makes the check itself; the refusal below is then its doing.
    cuda.map(va, g, h)
    cuda.unmap(va, g)
    assert cuda._b.capture_check is not None
    cuda.map(va, g, h)
    cuda.set_access(va, g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    err: Any = None
    with torch.cuda.graph(graph):  # raises at its end if the capture was invalidated
        x.add_(1)
        err = observe("unmap: during CUDA graph capture", cuda.unmap, va, g)
    assert err is not None, "unmap during capture must be refused"
    assert err.cuda_error == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", err
    assert cuda.stats().mappings == 1, "nothing was unmapped"
    graph.replay()
    torch.cuda.synchronize()
    assert x[0].item() == 2.0  # the warm-up and the replay; a capture runs nothing
    cuda.unmap(va, g)
    cuda.release(h)
    cuda.free(va, 4 * g)


def test_the_c_fast_path_is_on_wherever_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvvmm.driver import cuda as cuda_mod

    monkeypatch.delenv("KVVMM_CUDA_FASTPATH", raising=False)
    d = cuda_mod.CudaDriver()
    try:
        assert d.fast_path == (cuda_mod._cudafast is not None)
        if d.fast_path:  # the hot calls are C methods, no Python frame
            assert type(d.map).__name__ == "builtin_function_or_method"
    finally:
        d.close()

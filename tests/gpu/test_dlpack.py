"""Torch tensors over CudaDriver VA through ``kvvmm.arena._dlpack.device_tensor``, on a real GPU."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvvmm.arena import _dlpack  # noqa: E402

pytestmark = pytest.mark.usefixtures("needs_torch_cuda")


class Owner:
    """Stands in for the arena's keeper."""


def test_a_tensor_over_unmapped_va_is_accepted_and_writes_land_once_mapped(cuda: Any):
    g = cuda.granularity()
    va = cuda.reserve(4 * g)
    t = _dlpack.device_tensor(va, 4 * g, (4 * g // 4,), torch.float32, 0, Owner())
    assert t.device == torch.device("cuda", 0) and t.data_ptr() == va
    h = cuda.create(g)
    cuda.map(va, g, h)
    cuda.set_access(va, g)
    head = t[: g // 4]
    head.fill_(3.5)
    torch.cuda.synchronize()
    assert bool((head == 3.5).all())
    assert float(head.sum()) == 3.5 * (g // 4)
    del t, head
    gc.collect()
    cuda.unmap(va, g)
    cuda.release(h)
    cuda.free(va, 4 * g)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16"])
def test_bf16_and_fp8_tensors_read_and_write_device_memory(cuda: Any, name: str):
    dtype = getattr(torch, name)
    g = cuda.granularity()
    va = cuda.reserve(g)
    h = cuda.create(g)
    cuda.map(va, g, h)
    cuda.set_access(va, g)
    rows = g // (128 * dtype.itemsize)
    t = _dlpack.device_tensor(va, g, (rows, 128), dtype, 0, Owner())
    assert t.dtype == dtype and t.shape == (rows, 128) and t.data_ptr() == va
    src = torch.full((rows, 128), 1.5, dtype=torch.float32, device="cuda").to(dtype)
    t.copy_(src)
    raw = _dlpack.device_tensor(va, g, (g,), torch.uint8, 0, Owner())
    assert torch.equal(raw.view(rows, 128 * dtype.itemsize), src.view(torch.uint8))
    del t, raw
    gc.collect()
    cuda.unmap(va, g)
    cuda.release(h)
    cuda.free(va, g)


def test_the_owner_lives_while_a_device_tensor_or_view_lives(cuda: Any):
    g = cuda.granularity()
    va = cuda.reserve(g)
    owner = Owner()
    gone = weakref.ref(owner)
    before = _dlpack.live_capsules()
    t = _dlpack.device_tensor(va, g, (g // 2,), torch.bfloat16, 0, owner)
    del owner
    view = t[16:32]
    del t
    gc.collect()
    assert gone() is not None
    del view
    gc.collect()
    assert gone() is None and _dlpack.live_capsules() == before
    cuda.free(va, g)


def test_a_graph_captured_before_a_range_is_mapped_writes_there_after(cuda: Any):
    # The reason for reserving at the upper bound: capture first, back later.
    g = cuda.granularity()
    rows = 2 * g // 256  # rows of 128 bf16
    va = cuda.reserve(2 * g)
    h0 = cuda.create(g)
    cuda.map(va, g, h0)
    cuda.set_access(va, g)
    k = _dlpack.device_tensor(va, 2 * g, (rows, 128), torch.bfloat16, 0, Owner())
    loc = torch.zeros(1, dtype=torch.long, device="cuda")
    val = torch.full((1, 128), 3.0, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k.index_copy_(0, loc, val)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k.index_copy_(0, loc, val)
    h1 = cuda.create(g)
    cuda.map(va + g, g, h1)
    cuda.set_access(va + g, g)
    loc.fill_(rows - 1)  # a row in the granule mapped after the capture
    graph.replay()
    torch.cuda.synchronize()
    assert bool((k[rows - 1].float() == 3.0).all())
    del k, graph
    gc.collect()
    cuda.unmap(va, 2 * g)
    cuda.release(h0)
    cuda.release(h1)
    cuda.free(va, 2 * g)


_UNMAP_UNDER_A_KERNEL = textwrap.dedent(
    """
    import time, torch
    from kvvmm.arena._dlpack import device_tensor
    from kvvmm.driver.cuda import CudaDriver
    torch.cuda.init()
    torch.empty(1, device="cuda")
    d = CudaDriver()
    print("driver open", flush=True)
    n = 64 << 20
    va = d.reserve(n)
    h = d.create(n)
    d.map(va, n, h)
    d.set_access(va, n)
    x = device_tensor(va, n, (n // 4,), torch.float32, 0, None)
    x.fill_(0.0)
    torch.cuda.synchronize()
    print("mapped and written", flush=True)
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time, then a write to the range
    x.fill_(1.0)
    t = time.perf_counter()
    d.unmap(va, n)  # must wait for the fill, or the fill hits unmapped VA
    waited = time.perf_counter() - t
    del x
    d.release(h)
    d.free(va, n)
    torch.cuda.synchronize()
    print(f"OK waited {waited * 1e3:.1f} ms")
    """
)


def test_unmap_waits_for_a_kernel_still_writing_the_range():
    # In a child process: without the wait the context dies with an illegal address.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _UNMAP_UNDER_A_KERNEL], capture_output=True,
                       text=True, timeout=180, env=env)
    shown = f"rc={p.returncode}\nstdout:\n{p.stdout[-2000:]}\nstderr:\n{p.stderr[-3000:]}"
    assert p.returncode == 0 and "OK" in p.stdout, shown
    waited_ms = float(p.stdout.split("waited")[1].split()[0])
    assert waited_ms > 20, f"unmap returned after {waited_ms} ms: it did not wait\n{shown}"

"""Handles between processes on a real GPU: POSIX file descriptors.

A parent makes exportable handles (``CudaDriver(handle_type="posix_fd")``), writes through a torch
tensor over its arena, exports the handles and sends the descriptors to a *spawned* child
(SCM_RIGHTS over a pipe). The child imports them, backs an allocation of its own arena with
them (``adopt``), reads the parent's bytes through its own tensor and writes some back, which
the parent then sees. One GPU is enough.

What CUDA answered where kvvmm lets it answer, and what exportable handles cost, are written
to ``$OUT/export_answers.json`` and ``$OUT/export_cost.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvvmm.arena import Arena  # noqa: E402
from kvvmm.driver.base import CUDA_ERROR_INVALID_VALUE  # noqa: E402
from kvvmm.driver.cuda import CudaDriver  # noqa: E402
from kvvmm.errors import DriverError  # noqa: E402

pytestmark = pytest.mark.usefixtures("needs_torch_cuda")

MiB = 1 << 20
ANSWERS: dict[str, Any] = {}


def _record(name: str, value: Any, file: str = "export_answers.json") -> None:
    ANSWERS[name] = value
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, file), "w") as f:
            json.dump(ANSWERS if file == "export_answers.json" else value, f, indent=1,
                      sort_keys=True)


@pytest.fixture
def xdrv() -> Iterator[CudaDriver]:
    torch.empty(1, device="cuda")
    d = CudaDriver(handle_type="posix_fd")
    yield d
    d.close()


# -- the child (module level: the spawned process imports it by name) ---------------------


def _child_adopts(conn: Any, sizes: list[int]) -> None:
    try:
        import torch as t

        t.empty(1, device="cuda")
        drv = CudaDriver()  # importing needs no exportable handles of its own
        arena = Arena(drv, reserve_bytes=256 * MiB, name="child")
        off = arena.allocate(sum(sizes), "kv")
        for size in sizes:
            arena.adopt(off, drv.import_handle(recv_handle(conn), size), size)
        x = arena.tensor(off, (sum(sizes) // 2,), "bfloat16")
        total = float(x.float().sum())
        x[-8:] = 7.0
        t.cuda.synchronize()
        maps = [m.size_bytes for m in arena.snapshot().mappings]
        base = arena.base
        del x
        gc.collect()
        arena.close()
        clean = drv.stats().clean
        drv.close()
        conn.send(("ok", total, maps, clean, base))
    except BaseException as e:
        import traceback

        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", [], False, 0))
    finally:
        conn.close()


def _spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child, *args), daemon=True)
    p.start()
    child.close()
    return p, parent


# -- tests ----------------------------------------------------------------------------------


def test_a_spawned_child_maps_the_parents_handles_and_both_see_each_others_bytes(
    xdrv: CudaDriver,
) -> None:
    arena = Arena(xdrv, reserve_bytes=256 * MiB, name="parent")
    off = arena.allocate(16 * MiB, "kv")
    arena.commit(off, 4 * MiB)
    arena.commit(off, 10 * MiB)  # two handles: 4 MiB and 6 MiB
    x = arena.tensor(off, (5 * MiB,), "bfloat16")
    x.fill_(1.0)
    torch.cuda.synchronize()
    fds = arena.export_handles(off)
    assert [s for _, s in fds] == [4 * MiB, 6 * MiB]
    p, conn = _spawn(_child_adopts, [s for _, s in fds])
    for fd, _ in fds:
        send_handle(conn, fd, p.pid)
        os.close(fd)
    assert conn.poll(180), "the child sent nothing in 180 s"
    status, total, maps, child_clean, child_base = conn.recv()
    p.join(60)
    assert status == "ok", total
    _record("child process: base of its own reservation differs from the parent's",
            child_base != arena.base)
    assert total == 5 * MiB, "the child did not read the parent's bytes"
    assert maps == [4 * MiB, 6 * MiB] and child_clean
    assert x[-8:].float().tolist() == [7.0] * 8, "the parent does not see the child's write"
    assert float(x[:-8].float().sum()) == 5 * MiB - 8
    assert p.exitcode == 0
    del x
    gc.collect()
    arena.close()
    assert xdrv.stats().clean


def test_an_import_in_the_same_process_aliases_the_same_memory(xdrv: CudaDriver) -> None:
    g = xdrv.granularity()
    va = xdrv.reserve(8 * g)
    h = xdrv.create(g)
    xdrv.map(va, g, h)
    xdrv.set_access(va, g)
    try:
        h2 = xdrv.import_handle(xdrv.export_handle(h), g)
    except DriverError as e:
        _record("import in the exporting process", e.cuda_error)
        raise
    _record("import in the exporting process", "CUDA_SUCCESS")
    xdrv.map(va + 4 * g, g, h2)
    xdrv.set_access(va + 4 * g, g)
    from kvvmm.arena._dlpack import device_tensor

    a = device_tensor(va, g, (g,), torch.uint8, 0, object())
    b = device_tensor(va + 4 * g, g, (g,), torch.uint8, 0, object())
    a[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    assert b[:4].tolist() == [1, 2, 3, 4]
    s = xdrv.stats()
    assert (s.handles, s.physical_bytes) == (2, g), "the import is not counted as memory"
    del a, b
    gc.collect()
    xdrv.unmap(va, g)
    xdrv.unmap(va + 4 * g, g)
    xdrv.release(h)
    xdrv.release(h2)
    xdrv.free(va, 8 * g)
    assert xdrv.stats().clean


def test_export_of_a_handle_not_made_exportable_is_refused(cuda: Any) -> None:
    h = cuda.create(cuda.granularity())
    with pytest.raises(DriverError) as info:
        cuda.export_handle(h)
    _record("export of a handle created without requestedHandleTypes", info.value.cuda_error)
    assert any("handle_type='posix_fd'" in n for n in info.value.__notes__)
    cuda.release(h)


def test_import_of_a_descriptor_that_is_no_cuda_handle_is_refused(cuda: Any) -> None:
    g = cuda.granularity()
    with pytest.raises(DriverError) as info:
        cuda.import_handle(-1, g)
    assert info.value.cuda_error == CUDA_ERROR_INVALID_VALUE
    r, w = os.pipe()
    try:
        with pytest.raises(DriverError) as info:
            cuda.import_handle(r, g)
        _record("import of a pipe's descriptor", info.value.cuda_error)
        os.fstat(r)  # refused: still the caller's, still open
    finally:
        os.close(r)
        os.close(w)
    assert cuda.stats().clean


def test_what_exportable_handles_and_the_access_paths_cost_is_recorded() -> None:
    torch.empty(1, device="cuda")

    def create_release_us(d: CudaDriver, size: int, n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            h = d.create(size)
            d.release(h)
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    cost: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0)}
    plain, shared = CudaDriver(), CudaDriver(handle_type="posix_fd")
    try:
        for size, n in ((2 * MiB, 200), (64 * MiB, 40), (1024 * MiB, 8)):
            for name, d in (("plain", plain), ("exportable", shared)):
                create_release_us(d, size, 3)  # warm
                cost[f"create+release {size // MiB} MiB, {name} (us, median of {n})"] = round(
                    create_release_us(d, size, n), 2)
        g = plain.granularity()
        va = plain.reserve(4 * g)
        h = plain.create(g)
        plain.map(va, g, h)
        from cuda.bindings import driver as drv

        raw: list[float] = []
        dflt: list[float] = []
        named: list[float] = []
        for _ in range(300):
            t0 = time.perf_counter()
            drv.cuMemSetAccess(va, g, plain._access, 1)
            t1 = time.perf_counter()
            plain.set_access(va, g)
            t2 = time.perf_counter()
            plain.set_access(va, g, (0,))
            t3 = time.perf_counter()
            raw.append((t1 - t0) * 1e6)
            dflt.append((t2 - t1) * 1e6)
            named.append((t3 - t2) * 1e6)
        cost["set_access 2 MiB, raw cuMemSetAccess (us, median of 300)"] = round(
            statistics.median(raw), 3)
        cost["set_access 2 MiB, CudaDriver default devices=None (us)"] = round(
            statistics.median(dflt), 3)
        cost["set_access 2 MiB, CudaDriver devices=(0,) (us)"] = round(
            statistics.median(named), 3)
        plain.unmap(va, g)
        plain.release(h)
        plain.free(va, 4 * g)
    finally:
        plain.close()
        shared.close()
    _record("cost", cost, file="export_cost.json")
    assert all(v > 0 for k, v in cost.items() if k != "gpu")

"""``CudaDriver(zero_page=...)`` on a GPU: unbacked VA reads as zeros, and stays so.

Reserved VA that is not mapped is mapped read-only to zeroed memory (``kvvmm/driver/
zerocover.py`` plans the cover; ``tests/driver/test_zerocover.py`` runs the same driver code over a
fake libcuda on a CPU). Here, on the real driver, both paths (C fast path and Python):
tensors over unbacked VA print and sum to zero; commit, write, read, decommit, zero again;
granule-only and block covers, reservations that are not a multiple of the block, maps at
block edges and in the middle of blocks; a failure injected at every k-th map, unmap and
access call of each operation leaves stats, the cover's book, a real mapping's bytes and the
zero reads as they were; free and close give the zero memory back; an owner's tensor prints
before anything is committed; with ``zero_page`` off nothing changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvvmm.errors import ArgumentError, DriverError

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def zp(open_cuda_on_path: Callable[..., Any], needs_torch_cuda: None) -> Iterator[Any]:
    """``zp(zero_page=..., **kw)``: a CudaDriver (C path, then Python path), closed after."""
    import torch

    torch.empty(1, device="cuda")  # torch's context first: the driver uses the same one
    made: list[Any] = []

    def make(zero_page: Any = True, **kw: Any) -> Any:
        d = open_cuda_on_path(zero_page=zero_page, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def _view(d: Any, va: int, nbytes: int) -> Any:
    """An int32 tensor over ``[va, va+nbytes)`` of ``d``'s VA, one row per granule."""
    import torch

    from kvvmm.arena._dlpack import device_tensor

    g = d.granularity()
    return device_tensor(va, nbytes, (nbytes // g, g // 4), torch.int32, d.device, d)


def _granule_sums(d: Any, va: int, nbytes: int) -> list[int]:
    import torch

    t = _view(d, va, nbytes)
    out = t.to(torch.int64).sum(dim=1).tolist()
    del t
    return [int(x) for x in out]


def _fill(d: Any, va: int, nbytes: int, value: int) -> None:
    import torch

    t = _view(d, va, nbytes)
    t.fill_(value)
    torch.cuda.synchronize()
    del t


def _expect(d: Any, va: int, nbytes: int, mapped: dict[int, tuple[int, int]]) -> list[int]:
    """Per-granule sums: 0 where unbacked, value * g/4 where ``mapped`` (granule -> (n,
    value)) filled it."""
    g = d.granularity()
    out = [0] * (nbytes // g)
    for first, (n, value) in mapped.items():
        for i in range(first, first + n):
            out[i] = value * (g // 4)
    return out


@pytest.mark.parametrize("block_granules", [1, 16, 64, None], ids=["granule", "32MiB",
                                                                    "128MiB", "default"])
def test_unbacked_arena_va_reads_zeros_through_commit_and_decommit(
    zp: Any, block_granules: int | None
) -> None:
    import torch

    from kvvmm import Arena

    probe = zp(zero_page=False)
    g = probe.granularity()
    d = zp(zero_page=True if block_granules is None else block_granules * g)
    assert d.zero_page == (64 * MiB if block_granules is None else block_granules * g)
    arena = Arena(d, reserve_bytes=512 * MiB + 3 * g)  # not a multiple of any block
    off = arena.allocate(300 * MiB, "kv")
    t = arena.tensor(off, (300 * MiB // 2,), "bfloat16")
    text = repr(t)  # reads rows of unbacked VA: a fault without the cover
    assert "0." in text
    assert torch.count_nonzero(t).item() == 0
    arena.commit(off, 40 * MiB)
    n = 40 * MiB // 2
    t[:n].fill_(1.5)
    torch.cuda.synchronize()
    assert bool((t[:n] == 1.5).all())
    assert torch.count_nonzero(t[n:]).item() == 0  # past the commit: still the cover
    arena.commit(off, 200 * MiB)
    assert bool((t[:n] == 1.5).all())  # the first commit's bytes stay
    arena.decommit(off, 0)
    assert torch.count_nonzero(t).item() == 0  # given back: zeros again
    assert d.stats().mappings == 0 and d.stats().physical_bytes == 0
    zs = d.zero_stats()
    assert zs.uncovered_bytes == 0 and zs.covered_bytes == arena.reserved_bytes
    del t
    arena.close()
    assert d.stats().clean
    assert len(d._zero) == 0


@pytest.mark.parametrize("block_granules", [1, 8])
def test_maps_at_block_edges_and_in_the_middle_of_blocks(zp: Any, block_granules: int) -> None:
    d0 = zp(zero_page=False)
    g = d0.granularity()
    d = zp(zero_page=block_granules * g)
    size = 45 * g  # not a multiple of the block
    va = d.reserve(size)
    assert va % (block_granules * g) == 0
    assert _granule_sums(d, va, size) == [0] * 45
    mapped: dict[int, tuple[int, int]] = {}
    handles: dict[int, int] = {}
    # At a block's start, across a block edge, in a block's middle, a whole block, the tail.
    for i, (first, n) in enumerate([(0, 1), (7, 2), (12, 1), (16, 8), (30, 3), (44, 1)]):
        h = d.create(n * g)
        d.map(va + first * g, n * g, h)
        d.set_access(va + first * g, n * g)
        _fill(d, va + first * g, n * g, i + 1)
        mapped[first] = (n, i + 1)
        handles[first] = h
        assert _granule_sums(d, va, size) == _expect(d, va, size, mapped)
    with pytest.raises(DriverError, match="already mapped"):
        d.map(va + 17 * g, g, d.create(g))
    zs = d.zero_stats()
    assert zs.covered_bytes + d.stats().mapped_bytes == size and zs.uncovered_bytes == 0
    for first in (16, 0, 44, 7, 30, 12):
        n, _ = mapped.pop(first)
        d.unmap(va + first * g, n * g)
        d.release(handles.pop(first))
        assert _granule_sums(d, va, size) == _expect(d, va, size, mapped)
    d.free(va, size)
    assert len(d._zero) == 0


FAULTY = ("cuMemMap", "cuMemUnmap", "cuMemSetAccess")
OPS = ["map_middle", "map_edge", "map_block_start", "unmap", "unmap_released", "free",
       "reserve"]


def _inject(d: Any, name: str, k: int) -> tuple[list[int], Callable[[], None]]:
    """Make the k-th call of the instance's bound ``d._<name>`` from now fail (without
    calling CUDA); return the call counter and the function that puts it back."""
    from kvvmm.driver import cuda as cuda_mod

    real = getattr(d, "_" + name)
    seen = [0]
    bad = cuda_mod._drv.CUresult.CUDA_ERROR_UNKNOWN

    def call(*args: Any) -> Any:
        seen[0] += 1
        if seen[0] == k:
            return (bad,)
        return real(*args)

    setattr(d, "_" + name, call)
    return seen, lambda: setattr(d, "_" + name, real)


def _run(d: Any, op: str, va: int, va2: int, h: int) -> None:
    g = d.granularity()
    if op == "map_middle":
        d.map(va + 3 * g, 2 * g, h)
    elif op == "map_edge":  # across the edge of two 8-granule blocks
        d.map(va + 7 * g, 2 * g, h)
    elif op == "map_block_start":
        d.map(va + 16 * g, 2 * g, h)
    elif op in ("unmap", "unmap_released"):
        d.unmap(va + 10 * g, 2 * g)
    elif op == "free":
        d.free(va2, 27 * g)
    else:
        d.reserve(27 * g)


@pytest.mark.parametrize("name", FAULTY)
@pytest.mark.parametrize("op", OPS)
def test_a_failure_at_every_call_of_an_operation_changes_nothing(
    zp: Any, op: str, name: str
) -> None:
    g = zp(zero_page=False).granularity()
    k = 1
    while True:
        d = zp(zero_page=8 * g)
        va = d.reserve(32 * g)
        keep = d.create(g)  # a real mapping whose bytes must survive
        d.map(va + 20 * g, g, keep)
        d.set_access(va + 20 * g, g)
        _fill(d, va + 20 * g, g, 7)
        h = d.create(2 * g)
        if op in ("unmap", "unmap_released"):
            d.map(va + 10 * g, 2 * g, h)
            d.set_access(va + 10 * g, 2 * g)
            _fill(d, va + 10 * g, 2 * g, 9)
            if op == "unmap_released":
                d.release(h)  # its memory lives only through the mapping now
        va2 = d.reserve(27 * g) if op == "free" else 0
        before = (d.stats(), list(d._zero), d.zero_stats())
        sums = _granule_sums(d, va, 32 * g)
        seen, restore = _inject(d, name, k)
        try:
            _run(d, op, va, va2, h)
        except DriverError as e:
            restore()
            assert e.cuda_error == "CUDA_ERROR_UNKNOWN", e
            assert not getattr(e, "__notes__", None), e.__notes__  # every undo step worked
            assert (d.stats(), list(d._zero), d.zero_stats()) == before, (op, name, k)
            assert _granule_sums(d, va, 32 * g) == sums  # zeros, and the bytes, unchanged
            if va2:
                assert _granule_sums(d, va2, 27 * g) == [0] * 27
            d.close()
            k += 1
            continue
        restore()
        assert seen[0] < k, "the k-th call was made and did not fail"
        d.close()
        break
    # Every operation makes calls of each kind, except these three.
    none = {("free", "cuMemMap"), ("free", "cuMemSetAccess"), ("reserve", "cuMemUnmap")}
    assert (k > 1) == ((op, name) not in none), (op, name, k)


def test_free_and_close_give_the_zero_memory_back(zp: Any) -> None:
    probe = zp(zero_page=False)
    free0, _ = probe.mem_info()
    d = zp(zero_page=128 * MiB)
    zs = d.zero_stats()
    assert zs.zero_bytes == 2 * 128 * MiB - probe.granularity()
    free1, _ = probe.mem_info()
    assert free0 - free1 >= zs.zero_bytes - 64 * MiB  # the zero handles hold memory
    va = d.reserve(64 * GiB)
    assert d.zero_stats().mappings == 64 * GiB // (128 * MiB)
    d.free(va, 64 * GiB)
    assert d.zero_stats().mappings == 0
    d.close()
    free2, _ = probe.mem_info()
    assert abs(free2 - free0) < 64 * MiB
    d.close()  # idempotent


def test_an_owners_tensor_prints_before_its_commit(zp: Any) -> None:
    import torch

    from kvvmm import KvBufferOwner, mha_token_major

    d = zp(zero_page=True)
    descs = mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=200_000,
                            page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=d, dtype="bfloat16", page_size=16, reserved_tokens=200_000,
                          descs=descs)
    t = owner.tensors[0]
    text = repr(t)  # reads rows far past what is backed
    assert "tensor(" in text
    assert torch.count_nonzero(t[-1000:]).item() == 0
    del t
    owner.close()
    assert d.stats().clean


def test_a_map_during_cuda_graph_capture_is_refused_and_the_capture_survives(
    zp: Any, observe: Any
) -> None:
    import torch

    d = zp(zero_page=True)
    g = d.granularity()
    va = d.reserve(4 * g)
    h = d.create(g)
    x = torch.zeros(16, device="cuda")
    d.map(va, g, h)  # finds torch's capture check
    d.unmap(va, g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    err: Any = None
    before = (d.stats(), list(d._zero))
    with torch.cuda.graph(graph):  # raises at its end if the capture was invalidated
        x.add_(1)
        err = observe("map (zero_page): during CUDA graph capture", d.map, va, g, h)
    assert err is not None and err.cuda_error == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", err
    assert (d.stats(), list(d._zero)) == before
    graph.replay()
    torch.cuda.synchronize()
    assert x[0].item() == 2.0
    d.map(va, g, h)  # after the capture: works
    d.unmap(va, g)
    d.release(h)
    d.free(va, 4 * g)


def test_zero_page_arguments_and_which_calls_run_in_c(zp: Any) -> None:
    from kvvmm.driver import open_driver

    off = zp(zero_page=False)
    g = off.granularity()
    assert off.zero_page == 0 and off.zero_stats() is None
    on = zp(zero_page=True)
    builtin = "builtin_function_or_method"
    if off.fast_path:  # off: nothing changed, every hot call in C
        assert type(off.map).__name__ == builtin and type(off.unmap).__name__ == builtin
        # on: map and unmap in Python (the C path knows nothing of the cover), the rest in C
        assert on.fast_path
        assert type(on.map).__name__ != builtin and type(on.unmap).__name__ != builtin
        assert type(on.create).__name__ == builtin and type(on.set_access).__name__ == builtin
    for bad in (3 * g, g + 4096, 0, -g, "64MiB", 1.5):
        with pytest.raises(ArgumentError, match="zero_page"):
            zp(zero_page=bad)
    d = open_driver("cuda", zero_page=16 * g)
    try:
        assert d.zero_page == 16 * g  # type: ignore[attr-defined]
    finally:
        d.close()  # type: ignore[attr-defined]

"""Arena and owner on the real driver: tensors in device memory, fault matrix, capture flow."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvvmm import (
    Arena,
    Chunked,
    DriverError,
    Exact,
    Fault,
    FaultyDriver,
    KvBufferOwner,
    mha_token_major,
)
from kvvmm.driver.base import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY
from kvvmm.driver.cuda import CudaDriver
from kvvmm.units import GiB, MiB


@pytest.fixture
def cd() -> Iterator[CudaDriver]:
    torch.empty(1, device="cuda")
    d = CudaDriver()
    yield d
    assert d.stats().clean, d.stats()


def descs(reserved: int = 200_000, layers: int = 2) -> list:  # type: ignore[type-arg]
    return mha_token_major(layers=layers, kv_heads=8, head_dim=128, reserved_tokens=reserved,
                           page_size=16, dtype="bfloat16")


def test_arena_tensors_alias_device_memory_and_keep_the_arena_alive(cd: CudaDriver) -> None:
    arena = Arena(cd, reserve_bytes=1 * GiB)
    off = arena.allocate(64 * MiB, "x")
    t = arena.tensor(off, (32 * MiB // 2,), "bfloat16")
    assert t.is_cuda and t.data_ptr() == arena.base + off
    arena.commit(off, 64 * MiB)
    t.fill_(3.0)
    torch.cuda.synchronize()
    assert bool((t == 3.0).all())
    u8 = arena.tensor(off, (16,), "uint8")
    assert u8.cpu().tolist()[:2] == [0x40, 0x40]  # bf16 3.0 = 0x4040
    fp8 = arena.tensor(off, (16,), "float8_e4m3fn")
    assert fp8.dtype == torch.float8_e4m3fn
    del u8, fp8
    arena.close()
    assert not arena.released  # t is alive
    t.add_(1)
    torch.cuda.synchronize()
    del t
    import gc

    gc.collect()
    assert arena.released


def test_owner_bytes_written_after_finalize_read_back_intact(cd: CudaDriver) -> None:
    owner = KvBufferOwner(driver=cd, dtype="bfloat16", page_size=16, reserved_tokens=200_000,
                          descs=descs())
    owner.finalize(150_000)
    gen = torch.Generator(device="cuda").manual_seed(0)
    data = [torch.randn(150_016, 8, 128, device="cuda", generator=gen).bfloat16()
            for _ in owner.tensors]
    for t, x in zip(owner.tensors, data, strict=True):
        t[:150_016].copy_(x)
    for t, x in zip(owner.tensors, data, strict=True):
        assert torch.equal(t[:150_016], x)
    del data
    assert cd.stats().physical_bytes == owner.backed_bytes
    owner.close()


@pytest.mark.parametrize("op", ["commit", "finalize", "shrink", "close"])
@pytest.mark.parametrize("policy", [Exact(), Chunked(8 * MiB)], ids=["exact", "chunked"])
def test_a_failure_at_any_call_leaves_nothing_leaked_on_the_real_driver(
    cd: CudaDriver, op: str, policy: object
) -> None:
    ops = {"commit": lambda o: o.ensure_prefix(45_000), "finalize": lambda o: o.finalize(55_000),
           "shrink": lambda o: o.shrink(2_000), "close": lambda o: o.close()}

    def make() -> tuple[KvBufferOwner, FaultyDriver]:
        drv = FaultyDriver(cd)
        o = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=60_000,
                          descs=mha_token_major(layers=2, kv_heads=4, head_dim=64,
                                                reserved_tokens=60_000, page_size=16,
                                                dtype="bfloat16"),
                          policy=policy)  # type: ignore[arg-type]
        for n in (3000, 9000, 17000):
            o.ensure_prefix(n)
        return o, drv

    o, drv = make()
    n0 = len(drv.calls)
    ops[op](o)
    calls = drv.calls[n0:]
    done_backed = o.backed_bytes
    o.close()
    free0 = cd.mem_info()[0]
    for pos, call in enumerate(calls, start=1):
        for error in (CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_VALUE):
            o, drv = make()
            snap, st = o.snapshot(), cd.stats()
            drv.arm(Fault("*", nth=pos, error=error))
            with pytest.raises(DriverError) as info:
                ops[op](o)
            assert info.value.call == call and info.value.cuda_error == error
            drv.disarm()
            if call == "release" and op in ("shrink", "close"):
                # Past the point of no return (issue 18 item 5): every unmap succeeded, so
                # the VA no longer reaches the handle; the operation stands and the arena
                # keeps the handle it could not release, for close() to retry.
                assert o.arena.released if op == "close" else (
                    o.backed_bytes == done_backed and o.arena.unreleased_bytes > 0)
            elif not (op == "close" and o.arena.released):
                assert o.snapshot() == snap
                now = cd.stats()
                assert (now.mappings, now.mapped_bytes, now.physical_bytes) == (
                    st.mappings, st.mapped_bytes, st.physical_bytes)
            o.close()
            assert cd.stats().clean
    # The device got its memory back (within one granule of noise from other allocations).
    assert abs(cd.mem_info()[0] - free0) <= 2 * MiB


def test_a_graph_captured_before_finalize_writes_a_late_slot_after_it(cd: CudaDriver) -> None:
    owner = KvBufferOwner(driver=cd, dtype="bfloat16", page_size=16, reserved_tokens=1_000_000,
                          descs=descs(1_000_000, layers=1))
    k0 = owner.tensors[0]
    loc = torch.zeros(1, dtype=torch.long, device="cuda")
    val = torch.full((1, 8, 128), 3.0, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k0.index_copy_(0, loc, val)  # warm-up writes slot 0, which is backed
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k0.index_copy_(0, loc, val)
    owner.finalize(1_000_000)
    loc.fill_(999_999)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((k0[999_999].float() == 3.0).all())
    assert bool((k0[999_998].float() != 3.0).any()) or True  # untouched neighbour may be anything
    del k0, graph
    owner.close()


def test_arena_pool_serves_plain_torch_empty_from_the_reservation(cd: CudaDriver) -> None:
    arena = Arena(cd, reserve_bytes=4 * GiB)
    other = Arena(cd, reserve_bytes=1 * GiB)
    assert arena.pool is not other.pool  # several pools per process
    with torch.cuda.use_mem_pool(other.pool):
        y = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.use_mem_pool(arena.pool):
        x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    assert arena.base <= x.data_ptr() < arena.base + arena.reserved_bytes
    assert other.base <= y.data_ptr() < other.base + other.reserved_bytes
    off = x.data_ptr() - arena.base
    seg = arena.snapshot().allocations[-1]  # torch's segment: at least the 8 MiB asked for
    assert seg.offset == off and seg.size_bytes >= 8 * MiB
    arena.commit(off, seg.size_bytes)
    x.fill_(7)
    torch.cuda.synchronize()
    assert int(x.sum().item()) == 7 * 8 * MiB
    del x, y
    arena.close()  # drops the pool; torch hands the segments back
    other.close()
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    assert arena.released and other.released

"""On the GPU: a CUDA graph captured over an owner's tensor refuses the shrink that would
unmap what it baked in, naming the graph; a commit that needs torch's cached blocks succeeds
after torch's cache is emptied, once; torch's allocator capped at what a KV budget leaves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvvmm import Arena, CaptureConflictError, DriverOutOfMemoryError, KvBufferOwner
from kvvmm import mha_token_major as mha
from kvvmm.arena.reclaim import TorchAllocatorCap, TorchCacheReleaser
from kvvmm.driver.cuda import CudaDriver
from kvvmm.units import GiB, MiB


@pytest.fixture
def cd() -> Iterator[CudaDriver]:
    torch.empty(1, device="cuda")
    d = CudaDriver()
    yield d
    assert d.stats().clean, d.stats()


def test_a_shrink_under_a_captured_graph_is_refused_naming_the_graph(cd: CudaDriver) -> None:
    descs = mha(layers=1, kv_heads=8, head_dim=128, reserved_tokens=200_000, page_size=16,
                dtype="bfloat16")
    owner = KvBufferOwner(driver=cd, dtype="bfloat16", page_size=16, reserved_tokens=200_000,
                          descs=descs)
    owner.ensure_prefix(100_000)
    k0 = owner.tensors[0]
    loc = torch.full((1,), 90_000, dtype=torch.long, device="cuda")
    val = torch.full((1, 8, 128), 3.0, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k0.index_copy_(0, loc, val)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    with owner.capturing("decode-bs8"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            k0.index_copy_(0, loc, val)
        before = owner.snapshot()
        with pytest.raises(CaptureConflictError, match="decode-bs8"):
            owner.shrink(1_000)
        assert owner.snapshot() == before
        k0[90_000].zero_()
        graph.replay()  # the memory it baked in is still there
        torch.cuda.synchronize()
        assert bool((k0[90_000].float() == 3.0).all())
    del graph
    owner.shrink(1_000)  # released with the block
    del k0
    owner.close()


def test_a_commit_that_needs_torch_s_cached_blocks_succeeds_after_one_empty_cache(
    cd: CudaDriver
) -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    want = 1 * GiB
    arena = Arena(cd, reserve_bytes=2 * want)  # the default releaser: torch's cache
    assert isinstance(arena._releaser, TorchCacheReleaser)
    off = arena.allocate(want)
    held = torch.empty(free - want // 2, dtype=torch.uint8, device="cuda")  # all but 512 MiB
    del held  # freed to torch's cache, which keeps the blocks: the card counts them used
    assert torch.cuda.memory_reserved() >= free - want // 2
    opted_out = Arena(cd, reserve_bytes=want, retry_on_oom=False)
    o2 = opted_out.allocate(want)
    with pytest.raises(DriverOutOfMemoryError):
        opted_out.commit(o2, want)  # no release: out of memory as before
    assert torch.cuda.memory_reserved() >= free - want // 2
    opted_out.close()
    assert arena.commit(off, want) == want
    st = arena.reclaim_stats
    assert st.releases == 1 and st.retries == 1 and st.retries_failed == 0
    assert st.released_bytes >= free - want
    assert arena.snapshot().oom_retries == 1
    arena.close()


def test_torch_s_allocator_capped_by_a_kv_budget_refuses_what_the_budget_holds(
    cd: CudaDriver
) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    cap = TorchAllocatorCap(0, headroom_bytes=0)
    try:
        cap.follow(total - 256 * MiB)  # torch may take 256 MiB of the device
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(1 * GiB, dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()

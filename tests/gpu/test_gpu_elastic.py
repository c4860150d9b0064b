"""Elastic backing on the CUDA driver (both fast paths, via the ``cuda`` fixture): the handle
pool and its look-ahead, with bytes checked through torch. Holes and page calls run on CUDA in
tests/owner/test_elastic.py (its ``driver`` fixture's ``cuda-c`` kind), beside the sim and host."""

from __future__ import annotations

from typing import Any

import pytest

from kvvmm import Arena, KvBufferOwner, mha_token_major
from kvvmm.arena.pool import HandlePool

pytestmark = pytest.mark.cuda

G = 2 << 20


def _owner(drv: Any, **kw: Any) -> KvBufferOwner:
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=36_000,
                            page_size=16, dtype="bfloat16")
    return KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=36_000,
                         descs=descs, **kw)


def test_a_decommit_commit_cycle_through_the_pool_only_maps(cuda: Any) -> None:
    pool = HandlePool(cuda, threaded=False)
    arena = Arena(cuda, reserve_bytes=16 * G, pool=pool)
    o = arena.allocate(8 * G, "x")
    arena.commit_range(o, 2 * G, 2 * G)
    arena.decommit_range(o, 2 * G, 2 * G)
    assert pool.held_bytes == 2 * G
    arena.commit_range(o, 2 * G, 2 * G)
    assert pool.stats().reused == 1
    arena.close()
    pool.close()


def test_a_threaded_look_ahead_grows_ahead_and_closes_cleanly(
    cuda: Any, needs_torch_cuda: None
) -> None:
    pool = HandlePool(cuda)
    owner = _owner(cuda, pool=pool, lookahead_bytes=4 * G)
    for n in range(16, 30_000, 1000):
        owner.ensure_prefix(n)
    assert pool.drain(timeout_s=30)
    owner.snapshot().arena.check()
    t = owner.tensors[0]
    t[:30_000 - 1000].fill_(1.0)
    del t
    owner.close()
    pool.close(timeout_s=30)


def test_kernel_gap_keeps_the_gpu_busy_for_the_gap_and_the_look_ahead_runs_beside_it(
    cuda: Any, needs_torch_cuda: None
) -> None:
    import time

    from kvvmm.measure.elastic import kernel_gap

    gap = kernel_gap()
    assert gap.cycles_per_s > 1e8  # type: ignore[attr-defined]  # a GPU clock, not a unit slip
    for want in (0.005, 0.02):
        t0 = time.perf_counter()
        gap(want)
        took = time.perf_counter() - t0
        assert 0.8 * want <= took <= 3 * want + 0.005, (want, took)
    # the look-ahead's driver calls run on the pool's thread while a kernel runs and the
    # decode thread waits in the synchronize (the GIL released): bytes land, nothing leaks
    pool = HandlePool(cuda)
    owner = _owner(cuda, pool=pool, lookahead_bytes=4 * G)
    for n in range(16, 30_000, 1000):
        owner.ensure_prefix(n)
        gap(0.002)
    assert pool.drain(timeout_s=30)
    assert pool.stats().jobs >= 1 and pool.stats().errors == 0
    owner.snapshot().arena.check()
    t = owner.tensors[0]
    t[:29_000].fill_(1.0)
    assert float(t[:29_000].float().sum()) == t[:29_000].numel()
    del t
    owner.close()
    pool.close(timeout_s=30)

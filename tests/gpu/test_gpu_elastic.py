"""Issue 19 on the CUDA driver (both fast paths, via the ``cuda`` fixture): holes, page calls,
the handle pool and its look-ahead, with bytes checked through torch."""

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


def test_a_hole_in_the_middle_is_backed_and_given_back_while_its_neighbours_keep_their_bytes(
    cuda: Any, needs_torch_cuda: None
) -> None:
    import torch

    arena = Arena(cuda, reserve_bytes=32 * G)
    o = arena.allocate(16 * G, "x")
    arena.commit(o, 2 * G)
    arena.commit_range(o, 4 * G, 2 * G)
    arena.commit_range(o, 8 * G, 2 * G)
    t = arena.tensor(o, (16 * G,), "uint8")
    t[:2 * G].fill_(1)
    t[4 * G:6 * G].fill_(2)
    t[8 * G:10 * G].fill_(3)
    torch.cuda.synchronize()
    assert arena.decommit_range(o, 4 * G, 2 * G) == 2 * G
    assert int(t[:2 * G].sum()) == 2 * G and int(t[8 * G:10 * G].sum()) == 3 * 2 * G
    arena.commit_range(o, 4 * G, 2 * G)
    t[4 * G:6 * G].fill_(5)
    assert int(t[4 * G:6 * G].sum()) == 5 * 2 * G
    arena.snapshot().check()
    del t
    arena.close()


def test_owner_page_calls_back_single_pages_in_the_middle_of_every_buffer(
    cuda: Any, needs_torch_cuda: None
) -> None:
    owner = _owner(cuda)
    assert owner.commit_pages([1000, 2000]) == 4 * G
    page = owner.tensors[0][1000 * 16:1001 * 16]
    page.fill_(2.0)
    assert float(page.float().sum()) == 2.0 * page.numel()
    del page
    assert owner.decommit_pages([1000, 2000]) == 4 * G
    assert owner.release_beyond(16) == 0
    owner.close()


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

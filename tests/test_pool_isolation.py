"""A HandlePool shared by several owners hands no owner another owner's bytes (hardening
round 2, class 13): on the host driver's real memory, an owner writes its KV, gives the pages
back to the pool, and a second owner's commit of the same size reads nothing of it; the first
owner still reuses its own handles; ``share_across_owners=True`` is the explicit opt-in."""

from __future__ import annotations

import pytest

from kvvmm import KvBufferOwner, mha_token_major
from kvvmm.arena.pool import HandlePool
from kvvmm.driver.host import HostDriver
from kvvmm.errors import ArgumentError
from kvvmm.units import GiB

TOKENS = 200_000
PAGE = 16


def _owner(drv: HostDriver, pool: HandlePool, name: str) -> KvBufferOwner:
    descs = mha_token_major(layers=1, kv_heads=1, head_dim=64, reserved_tokens=TOKENS,
                            page_size=PAGE, dtype="bfloat16")
    return KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PAGE, reserved_tokens=TOKENS,
                         descs=descs, pool=pool, name=name)


def _secret_then_give_back(a: KvBufferOwner, pages: list[int]) -> None:
    a.commit_pages(pages)
    for t in a.tensors:
        for p in pages:
            t[p * PAGE:(p + 1) * PAGE].fill_(7.0)  # A's KV
    a.decommit_pages(pages)  # its handles go to the pool


@pytest.mark.parametrize("share", [False, True])
def test_another_owner_never_reads_what_an_owner_gave_back_unless_sharing_is_asked(
        share: bool) -> None:
    drv = HostDriver(capacity_bytes=2 * GiB)
    pool = HandlePool(drv, threaded=False, share_across_owners=share)
    a, b = _owner(drv, pool, "a"), _owner(drv, pool, "b")
    pages = [2048, 4096, 6144]  # one granule each, far from slot 0
    _secret_then_give_back(a, pages)
    assert pool.held_bytes > 0
    b.commit_pages(pages)
    seen = max(float(t[p * PAGE:(p + 1) * PAGE].abs().max()) for t in b.tensors for p in pages)
    stats = pool.stats()
    if share:
        assert stats.reused > 0 and seen == 7.0  # the opt-in: reuse, old bytes and all
    else:
        assert seen == 0.0 and stats.withheld > 0  # fresh handles for b
        a.commit_pages(pages)  # a takes its own back: the pool still saves its creates
        assert pool.stats().reused > stats.reused
    for o in (a, b):
        o.close()
    pool.close()
    assert drv.stats().clean


def test_share_across_owners_is_a_bool() -> None:
    with pytest.raises(ArgumentError, match="share_across_owners"):
        HandlePool(HostDriver(capacity_bytes=GiB), share_across_owners="yes")  # type: ignore[arg-type]

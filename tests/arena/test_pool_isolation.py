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


def test_an_imported_handle_is_never_pooled_so_shared_memory_never_comes_back_as_private(
        ) -> None:
    """An arena that adopts memory another process exported (here: this process's own
    export, imported again) releases it when it gives it back: pooled, the next commit would
    map memory the exporter still reads and writes."""
    import ctypes

    import torch

    from kvvmm import Arena

    drv = HostDriver(capacity_bytes=GiB)
    g = drv.granularity()
    exporter = Arena(drv, reserve_bytes=4 * g, name="exporter")
    src = exporter.allocate(g, "kv")
    exporter.commit(src, g)
    ((fd, size),) = exporter.export_handles(src)
    pool = HandlePool(drv, threaded=False)
    importer = Arena(drv, reserve_bytes=4 * g, name="importer", pool=pool)
    dst = importer.allocate(g, "kv")
    importer.adopt(dst, drv.import_handle(fd, size), size)

    def view(arena: Arena) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_uint8 * g).from_address(arena.base), dtype=torch.uint8)

    view(exporter).fill_(3)
    assert int(view(importer)[0]) == 3  # one memory, two mappings
    retained = pool.stats().retained
    importer.decommit(dst, 0)  # gives the adopted handle back: released, not pooled
    assert pool.stats().retained == retained and pool.held_bytes == 0
    importer.commit(dst, g)  # a fresh handle: the exporter's bytes are not in it
    view(importer).fill_(9)
    assert int(view(exporter)[0]) == 3 and int(view(importer)[0]) == 9
    for a in (importer, exporter):
        a.close()
    pool.close()
    assert drv.stats().clean

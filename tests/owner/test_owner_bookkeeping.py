"""The owner's bookkeeping never lies after a failure (hardening round 2, class 1): whatever
fails, at whatever step, ``committed_pages`` lists only pages whose granules are mapped in
every buffer and the backed mirror matches the arena. A property test over random page, slot
and prefix operations with injected driver failures (a failed release after the unmaps leaves
the decommit standing and the handle kept for close: the case that used to leave pages listed
whose memory was gone)."""

from __future__ import annotations

import random

import pytest

from kvvmm import KvBufferOwner, SimDriver, mha_token_major
from kvvmm.driver import Fault, FaultyDriver
from kvvmm.errors import ArgumentError, DriverError

G = 2 * 1024 * 1024
TOKENS = 36_000


def _mapped_pages(owner: KvBufferOwner) -> set[int]:
    """Pages whose granules are mapped in every buffer, read from the arena."""
    runs = []
    for off in owner._offsets:
        maps = owner.arena.mappings_of(off)
        runs.append(maps)
    out = set()
    for p in range(owner.pages):
        ok = True
        for i, maps in enumerate(runs):
            lo, hi = owner._page_granules(i, p)
            covered = lo
            for a, b in maps:
                if a <= covered < b:
                    covered = b
            if covered < hi:
                ok = False
                break
        if ok:
            out.add(p)
    return out


def _check(owner: KvBufferOwner) -> None:
    listed = set(owner.committed_pages)
    mapped = _mapped_pages(owner)
    assert listed <= mapped, f"listed but not mapped: {sorted(listed - mapped)[:10]}"
    assert owner._backed == [owner.arena.prefix_of(o) for o in owner._offsets]
    owner.arena.snapshot().check()


@pytest.mark.parametrize("seed", range(10))
def test_committed_pages_never_list_memory_that_is_gone(seed: int) -> None:
    rng = random.Random(seed)
    drv = FaultyDriver(SimDriver("h200"))
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=TOKENS,
                            page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=TOKENS,
                          descs=descs)
    block = owner.slot_block_tokens()
    failures = 0
    for _ in range(150):
        if rng.random() < 0.3:
            drv.arm(Fault(rng.choice(["create", "map", "set_access", "unmap", "release"]),
                          nth=rng.randint(1, 3)))
        op = rng.randrange(7)
        try:
            if op == 0:
                owner.commit_pages(rng.sample(range(1, owner.pages), rng.randint(1, 6)))
            elif op == 1:
                listed = sorted(owner.committed_pages - {0})
                if listed:
                    owner.decommit_pages(rng.sample(listed, rng.randint(1, len(listed))))
            elif op == 2:
                a = rng.randrange(1, TOKENS // block - 1) * block
                owner.commit_slots([(a, a + block * rng.randint(1, 3))])
            elif op == 3:
                a = rng.randrange(1, TOKENS // block - 1) * block
                owner.decommit_slots([(a, min(a + block * rng.randint(1, 3), TOKENS))])
            elif op == 4:
                owner.release_beyond(rng.randrange(16, TOKENS + 1))
            elif op == 5:
                owner.shrink(rng.randrange(0, TOKENS + 1))
            else:
                owner.ensure_prefix(rng.randrange(0, TOKENS // 4))
        except DriverError:
            failures += 1
        except ArgumentError:
            pass  # e.g. decommit_pages of a page inside the prefix
        drv.disarm()
        _check(owner)
    assert failures > 0  # the faults reached the owner
    owner.close()


def _orphans(owner: KvBufferOwner) -> list[tuple[int, int, int]]:
    """Mappings that no page still wants touches: not slot 0's page, not a committed page,
    not a page of the ensured prefix or finalized span, and past the buffer's backed prefix
    (growth over-commits beyond the tokens asked: that backing is the policy's, and stays)
    (``(buffer, start, end)``)."""
    ps = owner.page_size
    ensured = max(owner.prefix_tokens, owner.final_tokens or 0)
    kept = owner.committed_pages
    out = []
    for i, off in enumerate(owner._offsets):
        pb = owner._page_bytes[i]
        grown = owner.arena.prefix_of(off)
        for s, e in owner.arena.mappings_of(off):
            if s >= grown and not any(q == 0 or q in kept or q * ps < ensured
                       for q in range(s // pb, (e - 1) // pb + 1)):
                out.append((i, s, e))
    return out


@pytest.mark.parametrize("layout", ["token_major", "interleaved"])
@pytest.mark.parametrize("seed", range(6))
def test_no_mapping_outlives_every_page_it_backs(layout: str, seed: int) -> None:
    """Whatever mix of page, slot and prefix calls: once no committed page, no prefix and
    not slot 0 uses a mapping, it is gone (a commit_slots handle given back page by page
    used to stay mapped, unused, until close)."""
    from kvvmm.layout import layer_interleaved

    rng = random.Random(seed)
    drv = SimDriver("h200")
    if layout == "interleaved":
        descs = layer_interleaved(layers=2, kv_heads=4, head_dim=64, reserved_tokens=TOKENS,
                                  page_size=16, dtype="bfloat16")
    else:
        descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=TOKENS,
                                page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=TOKENS,
                          descs=descs)
    block = owner.slot_block_tokens()
    ps = owner.page_size
    for _ in range(120):
        op = rng.randrange(5)  # not release_beyond: a mapping it cuts stays by contract
        try:
            if op == 0:  # a request's range, several blocks: one handle per buffer
                a = rng.randrange(1, TOKENS // block - 4) * block
                owner.commit_slots([(a, a + block * rng.randint(1, 4))])
            elif op == 1:  # pages go one call at a time, in any order
                listed = sorted(owner.committed_pages - {0})
                for p in rng.sample(listed, min(len(listed), rng.randint(1, 8))):
                    owner.decommit_pages([p])
            elif op == 2:
                a = rng.randrange(1, TOKENS // ps - 8) * ps
                owner.decommit_slots([(a, a + ps * rng.randint(1, 8))])
            elif op == 3:
                owner.commit_pages(rng.sample(range(1, owner.pages), rng.randint(1, 4)))
            else:
                owner.ensure_prefix(rng.randrange(0, TOKENS // 8))
        except ArgumentError:
            pass  # e.g. a range reaching page 0
        assert not _orphans(owner), _orphans(owner)[:5]
        _check(owner)
    owner.close()


@pytest.mark.parametrize("layout", ["token_major", "interleaved"])
@pytest.mark.parametrize("seed", range(8))
def test_a_slot_range_given_back_page_by_page_gives_its_handles_back(layout: str,
                                                                       seed: int) -> None:
    """commit_slots backs a range with one handle per buffer; giving its pages back one call
    at a time, in any order, gives every byte back by the last page (it stayed mapped until
    close), and not a byte before a page of it is left."""
    from kvvmm.layout import layer_interleaved

    rng = random.Random(seed)
    kw = dict(kv_heads=4, head_dim=64, reserved_tokens=TOKENS, page_size=16,
              dtype="bfloat16")
    descs = (layer_interleaved(layers=2, **kw) if layout == "interleaved"  # type: ignore[arg-type]
             else mha_token_major(layers=1, **kw))  # type: ignore[arg-type]
    owner = KvBufferOwner(driver=SimDriver("h200"), dtype="bfloat16", page_size=16,
                          reserved_tokens=TOKENS, descs=descs)
    block, ps = owner.slot_block_tokens(), owner.page_size
    base = owner.backed_bytes
    a = rng.randrange(1, TOKENS // block - 6) * block
    b = a + block * rng.randint(1, 5)
    owner.commit_slots([(a, b)])
    handles = len(owner.arena.snapshot().mappings)
    assert handles == 2 * len(owner._offsets)  # slot 0's granule and the range, per buffer
    pages = list(range(a // ps, b // ps))
    rng.shuffle(pages)
    for k, p in enumerate(pages):
        owner.decommit_pages([p])
        left = k < len(pages) - 1
        assert (owner.backed_bytes > base) == left, (k, owner.backed_bytes, base)
    assert owner.backed_bytes == base and not _orphans(owner)
    _check(owner)
    owner.close()

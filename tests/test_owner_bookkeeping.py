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

"""The owner's page bookkeeping under several caller threads on disjoint pages (hardening
round 2, class 12): no page is lost or invented, the arena agrees, nothing leaks. The
contract is in KvBufferOwner's docstring."""

from __future__ import annotations

import random
import sys
import threading

import pytest

from kvvmm import KvBufferOwner, SimDriver, mha_token_major
from kvvmm.driver.host import HostDriver
from kvvmm.units import GiB

TOKENS = 200_000


@pytest.fixture(autouse=True)
def _switch_often() -> object:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as finely as CPython allows
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("kind", ["sim", "host"])
def test_threads_on_disjoint_pages_lose_none_of_them(kind: str) -> None:
    drv = SimDriver("h200") if kind == "sim" else HostDriver(capacity_bytes=2 * GiB)
    descs = mha_token_major(layers=1, kv_heads=1, head_dim=64, reserved_tokens=TOKENS,
                            page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=TOKENS,
                          descs=descs)
    # pages whose granules no other thread's pages share: one granule is 1,024 pages here
    per_granule = 2 * 1024 * 1024 // (16 * 64 * 2)
    threads, mine = 6, {}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        rng = random.Random(t)
        pool = [g * per_granule + 5 for g in range(1 + t, owner.pages // per_granule, threads)]
        held: set[int] = set()
        try:
            for _ in range(150):
                p = rng.choice(pool)
                if p in held:
                    owner.decommit_pages([p])
                    held.discard(p)
                else:
                    owner.commit_pages([p])
                    held.add(p)
        except BaseException as e:
            errors.append(e)
        mine[t] = held

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not errors, errors
    expected = set().union(*mine.values())
    assert set(owner.committed_pages) == expected
    owner.arena.snapshot().check()
    mapped = {m.offset // (2 * 1024 * 1024) for m in owner.arena.snapshot().mappings}
    assert mapped >= {p // per_granule for p in expected}
    owner.close()
    assert drv.stats().clean

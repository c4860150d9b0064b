"""Fault matrix: every driver call of commit, finalize, shrink and close, failing.

For each operation we first count the driver calls it makes, then run it again once per
call position and error kind with that call failing. Each time: the error names the call,
the owner's snapshot is as it was, the driver holds exactly what it held (by its own
accounting), and after the fault is gone a close leaves the driver clean.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvvmm import (
    Chunked,
    DriverError,
    DriverOutOfMemoryError,
    Exact,
    Fault,
    FaultyDriver,
    KvBufferOwner,
    SimDriver,
    mha_token_major,
)
from kvvmm.driver.base import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, Driver
from kvvmm.driver.host import HostDriver
from kvvmm.units import GiB

ERRORS = [CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_VALUE]
PAGE = 16
RESERVED = 60_000


def inner_driver(kind: str) -> Driver:
    if kind == "sim":
        return SimDriver("h200")
    return HostDriver(capacity_bytes=2 * GiB)


def make_owner(kind: str, policy: object) -> tuple[KvBufferOwner, FaultyDriver]:
    drv = FaultyDriver(inner_driver(kind))
    descs = mha_token_major(layers=2, kv_heads=4, head_dim=64, reserved_tokens=RESERVED,
                            page_size=PAGE, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PAGE,
                          reserved_tokens=RESERVED, descs=descs, policy=policy)  # type: ignore[arg-type]
    # Several mappings per buffer, so shrink and close have several calls to fail.
    for n in (3000, 9000, 17000):
        owner.ensure_prefix(n)
    return owner, drv


def physical_state(drv: FaultyDriver) -> tuple[int, int, int, int]:
    s = drv.stats()
    # Handle *count* may drop in a failed shrink (handles released while still mapped are
    # legal and keep their memory); what must not change is what is held.
    return s.reservations, s.mappings, s.mapped_bytes, s.physical_bytes


OPS: dict[str, Callable[[KvBufferOwner], object]] = {
    "commit": lambda o: o.ensure_prefix(45_000),
    "finalize": lambda o: o.finalize(55_000),
    "shrink": lambda o: o.shrink(2_000),
    "close": lambda o: o.close(),
}


def count_calls(kind: str, op: str, policy: object) -> list[str]:
    owner, drv = make_owner(kind, policy)
    before = len(drv.calls)
    OPS[op](owner)
    calls = drv.calls[before:]
    owner.close()
    assert drv.stats().clean
    return calls


@pytest.mark.parametrize("kind", ["sim", "host"])
@pytest.mark.parametrize("policy", [Exact(), Chunked(8 << 20)], ids=["exact", "chunked"])
@pytest.mark.parametrize("op", list(OPS))
def test_a_failure_at_any_call_leaves_nothing_leaked_and_the_snapshot_as_it_was(
    kind: str, op: str, policy: object
) -> None:
    calls = count_calls(kind, op, policy)
    assert len(calls) >= 2, f"{op} made too few calls to test: {calls}"
    for pos, call in enumerate(calls, start=1):
        for error in ERRORS:
            owner, drv = make_owner(kind, policy)
            snap, held = owner.snapshot(), physical_state(drv)
            drv.arm(Fault("*", nth=pos, error=error))
            with pytest.raises(DriverError) as info:
                OPS[op](owner)
            err = info.value
            where = f"{op}: call {pos}/{len(calls)} ({call}) failing with {error}"
            assert err.call == call, where
            assert err.cuda_error == error, where
            assert str(err).startswith(f"{call}("), where
            assert isinstance(err, DriverOutOfMemoryError) == (error == CUDA_ERROR_OUT_OF_MEMORY)
            drv.disarm()
            if op == "close" and owner.arena.released:
                # Past the point of no return (the VA is freed): the arena keeps the handles
                # it could not release, and a second close() releases them.
                assert call == "release", where
                assert drv.stats().handles > 0, where
            else:
                assert owner.snapshot() == snap, where
                assert physical_state(drv) == held, where
                assert not owner.closed, where
                OPS[op](owner)  # the same operation now succeeds
            owner.close()
            assert drv.stats().clean, where
            if kind == "host":
                drv.inner.close()  # type: ignore[attr-defined]


def test_a_failed_finalize_keeps_the_bytes_already_written_on_the_host_driver() -> None:
    owner, drv = make_owner("host", Exact())
    for i, t in enumerate(owner.tensors):
        t[:17000].fill_(i + 1)
    drv.arm(Fault("set_access", nth=3))
    with pytest.raises(DriverError, match="set_access"):
        owner.finalize(55_000)
    for i, t in enumerate(owner.tensors):
        assert bool((t[:17000] == i + 1).all())
    owner.close()


def test_a_failed_shrink_keeps_the_bytes_below_the_kept_span_on_the_host_driver() -> None:
    owner, drv = make_owner("host", Exact())
    for i, t in enumerate(owner.tensors):
        t[:17000].fill_(i + 1)
    drv.arm(Fault("unmap", nth=2))
    with pytest.raises(DriverError, match="unmap"):
        owner.shrink(2_000)
    # Buffer 0 was unmapped before the failure: its range beyond the kept span is backed
    # again with fresh memory (those bytes were being given up). The others never moved.
    for i, t in enumerate(owner.tensors):
        assert bool((t[:2000] == i + 1).all())
        if i >= 1:
            assert bool((t[:17000] == i + 1).all())
    owner.shrink(2_000)
    for i, t in enumerate(owner.tensors):
        assert bool((t[:2000] == i + 1).all())
    owner.close()

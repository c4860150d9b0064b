"""A change of the owner's backing in steps (``prepare_*``, ``map``, ``confirm`` or ``undo``:
what the collective owner runs on every rank) is the one-go call's change when confirmed, and
nothing at all when undone or when any driver call fails at any step: the owner's record and
the driver's books as before, nothing leaked."""

from __future__ import annotations

from typing import Any

import pytest

from kvvmm import KvBufferOwner, SimDriver, mha_token_major
from kvvmm.driver import Fault, FaultyDriver
from kvvmm.errors import ArgumentError, AsleepError, ClosedError, DriverError, OutOfRangeError
from kvvmm.owner.prepared import PreparedBacking

TOKENS = 36_000
PAGES = [700, 701, 1500, 2200]


def _owner(drv: Any) -> KvBufferOwner:
    descs = mha_token_major(layers=2, kv_heads=4, head_dim=64, reserved_tokens=TOKENS,
                            page_size=16, dtype="bfloat16")
    return KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=TOKENS,
                         descs=descs)


def _state(drv: Any, owner: KvBufferOwner) -> tuple[Any, ...]:
    st = drv.stats()
    return (st.handles, st.mappings, st.mapped_bytes,
            [owner.mapped(i) for i in range(len(owner.descs))], owner.committed_pages,
            owner.prefix_tokens, owner.final_tokens, owner.backed_tokens, owner.backed_bytes)


STEPS = {
    "finalize": (lambda o: o.prepare_finalize(9000), lambda o: o.finalize(9000)),
    "ensure_prefix": (lambda o: o.prepare_ensure_prefix(5000), lambda o: o.ensure_prefix(5000)),
    "pages": (lambda o: o.prepare_pages(PAGES), lambda o: o.commit_pages(PAGES)),
}


@pytest.mark.parametrize("op", STEPS)
def test_confirmed_steps_are_the_one_go_call(op: str) -> None:
    prepare, one_go = STEPS[op]
    drv_a, drv_b = SimDriver("h200"), SimDriver("h200")
    with _owner(drv_a) as a, _owner(drv_b) as b:
        a.ensure_prefix(100)
        b.ensure_prefix(100)
        p = prepare(a)
        assert p.state == "prepared" and p.handles
        assert a.backed_bytes == b.backed_bytes  # made, nothing mapped yet
        p.map()
        p.confirm()
        added = one_go(b)
        assert p.state == "confirmed" and p.size_bytes == added
        assert _state(drv_a, a) == _state(drv_b, b)
        assert p.undo() is True and _state(drv_a, a) == _state(drv_b, b)  # the owner's now
    assert drv_a.stats().clean and drv_b.stats().clean


@pytest.mark.parametrize("op", STEPS)
@pytest.mark.parametrize("undo_after", ["prepare", "map"])
def test_an_undo_leaves_the_owner_and_the_driver_as_they_were(op: str, undo_after: str) -> None:
    drv = SimDriver("h200")
    with _owner(drv) as owner:
        owner.ensure_prefix(100)
        before = _state(drv, owner)
        p = STEPS[op][0](owner)
        if undo_after == "map":
            p.map()
        assert p.undo() is True and p.state == "undone"
        assert _state(drv, owner) == before
        owner.arena.snapshot().check()
        with pytest.raises(ArgumentError, match="after undone"):
            p.map()
        with pytest.raises(ArgumentError, match="after undone"):
            p.confirm()
    assert drv.stats().clean


@pytest.mark.parametrize("op", STEPS)
@pytest.mark.parametrize("call", ["create", "map", "set_access"])
@pytest.mark.parametrize("nth", [1, 2, 5])
def test_a_failure_at_any_step_changes_nothing(op: str, call: str, nth: int) -> None:
    drv = FaultyDriver(SimDriver("h200"))
    with _owner(drv) as owner:
        owner.ensure_prefix(100)
        before = _state(drv, owner)
        drv.arm(Fault(call, nth=nth))
        p: PreparedBacking | None = None
        try:
            p = STEPS[op][0](owner)
            p.map()
        except DriverError:
            assert p is None or (p.state == "undone" and p.rolled_back)
            drv.disarm()
            assert _state(drv, owner) == before
            owner.arena.snapshot().check()
        else:  # fewer calls than nth: it went through; then undone, it is gone again
            drv.disarm()
            assert p.undo() is True and _state(drv, owner) == before
        STEPS[op][1](owner)  # and the owner works on
    assert drv.stats().clean


def test_prepare_checks_as_the_one_go_call_and_refuses_a_closed_or_asleep_owner() -> None:
    drv = SimDriver("h200")
    owner = _owner(drv)
    with pytest.raises(OutOfRangeError):
        owner.prepare_finalize(TOKENS + 1)
    with pytest.raises(ArgumentError):
        owner.prepare_ensure_prefix(-1)
    with pytest.raises(OutOfRangeError):
        owner.prepare_pages([owner.pages])
    p = owner.prepare_pages([5])
    with pytest.raises(ArgumentError, match="a mapped backing"):
        p.confirm()  # not mapped yet
    p.undo()
    owner.sleep()
    with pytest.raises(AsleepError):
        owner.prepare_finalize(9000)
    owner.wake()
    owner.close()
    with pytest.raises(ClosedError):
        owner.prepare_ensure_prefix(100)
    assert drv.stats().clean

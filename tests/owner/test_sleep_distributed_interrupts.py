"""A collective sleep or wake interrupted (Ctrl-C, SystemExit: not an Exception) at its
agreement or its confirmation leaves the rank as the call found it: awake with
its mappings after an interrupted sleep, asleep after an interrupted wake. One gloo rank in
this process, on the simulator (as tests/owner/test_distributed_interrupts.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvvmm import KvBufferOwner, SimDriver, mha_token_major

TOKENS = 36_000


def _setup() -> tuple[SimDriver, KvBufferOwner, Any]:
    from kvvmm.owner.distributed import DistributedOwner

    drv = SimDriver("h200")
    descs = mha_token_major(layers=2, kv_heads=4, head_dim=64, reserved_tokens=TOKENS,
                            page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=TOKENS,
                          descs=descs)
    dist_owner = DistributedOwner(owner, timeout_s=30)
    dist_owner.finalize(TOKENS // 2)
    return drv, owner, dist_owner


def _interrupt_at(monkeypatch: pytest.MonkeyPatch, dist_owner: Any, nth: int,
                  exc: type[BaseException]) -> None:
    real = dist_owner._agree
    calls = {"n": 0}

    def agree(*a: Any, **k: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == nth:
            raise exc()
        return real(*a, **k)

    monkeypatch.setattr(dist_owner, "_agree", agree)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize(("op", "nth"), [("sleep", 1), ("sleep", 2), ("wake", 1), ("wake", 2)])
def test_an_interrupted_collective_sleep_or_wake_leaves_the_rank_as_it_was(
        gloo_world_of_one: None, monkeypatch: pytest.MonkeyPatch, op: str, nth: int,
        exc: type[BaseException]) -> None:
    drv, owner, dist_owner = _setup()
    if op == "wake":
        dist_owner.sleep("host")
    before = (owner.snapshot(), owner.asleep, drv.stats().physical_bytes)
    _interrupt_at(monkeypatch, dist_owner, nth, exc)
    with pytest.raises(exc):
        getattr(dist_owner, op)("host") if op == "sleep" else dist_owner.wake()
    monkeypatch.undo()
    assert (owner.snapshot(), owner.asleep, drv.stats().physical_bytes) == before, (op, nth)
    # and the rank goes on: the other call of the pair works
    if owner.asleep:
        dist_owner.wake()
    else:
        dist_owner.sleep()
        dist_owner.wake()
    owner.close()
    assert drv.stats().clean

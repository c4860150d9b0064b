"""Every timeout is a finite number of seconds (or None where None means "no limit"): NaN
never compares, so a wait on it never ends, and infinity given to a collective reports the
group broken. Each is refused typed, naming the argument, with nothing changed (hardening
round 2, class 9)."""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvvmm import KvBufferOwner, SimDriver, mha_token_major
from kvvmm.arena.pool import HandlePool
from kvvmm.checks import seconds_arg
from kvvmm.errors import ArgumentError
from kvvmm.owner import RangeBacking

BAD = [math.nan, math.inf, -math.inf, -1, -0.5, True, "5", None, 10**400, [1]]


def _owner(drv: SimDriver) -> KvBufferOwner:
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=36_000,
                            page_size=16, dtype="bfloat16")
    return KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=36_000,
                         descs=descs)


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_seconds_arg_refuses_what_is_not_a_finite_number_of_seconds(bad: object) -> None:
    with pytest.raises(ArgumentError, match="timeout"):
        seconds_arg("timeout", bad)


def test_seconds_arg_takes_finite_seconds_and_none_where_it_means_no_limit() -> None:
    assert seconds_arg("t", 0) == 0.0 and seconds_arg("t", 2.5) == 2.5
    assert seconds_arg("t", None, none=True) == math.inf
    with pytest.raises(ArgumentError, match="> 0"):
        seconds_arg("t", 0, zero=False)


@pytest.fixture
def parts() -> Iterator[dict[str, Any]]:
    drv = SimDriver("h200")
    pool = HandlePool(drv)
    owner = _owner(drv)
    backing = RangeBacking(owner)
    lease = backing.admit(100)
    yield {"pool": pool, "backing": backing, "lease": lease}
    backing.close()
    owner.close()
    pool.close()


WAITS: dict[str, Callable[[dict[str, Any], object], object]] = {
    "HandlePool.drain": lambda p, t: p["pool"].drain(timeout_s=t),
    "HandlePool.close": lambda p, t: p["pool"].close(timeout_s=t),
    "RangeBacking.drain": lambda p, t: p["backing"].drain(timeout_s=t),
    "RangeBacking.wait": lambda p, t: p["backing"].wait(p["lease"], timeout_s=t),
    "RangeBacking.close": lambda p, t: p["backing"].close(timeout_s=t),
}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, True, "5", None], ids=repr)
@pytest.mark.parametrize("call", list(WAITS))
def test_a_wait_refuses_a_timeout_that_is_not_finite_and_changes_nothing(
        parts: dict[str, Any], call: str, bad: object) -> None:
    with pytest.raises(ArgumentError, match="timeout_s"):
        WAITS[call](parts, bad)
    assert not parts["pool"].closed and not parts["backing"].closed  # a refused close stands


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0, -3, True], ids=repr)
def test_spawn_and_the_tp_helpers_refuse_non_finite_limits_before_starting_anything(
        bad: object) -> None:
    from kvvmm.owner.distributed import spawn
    from kvvmm.owner.tp import run_per_device, spawn_tp_snapshots

    with pytest.raises(ArgumentError, match="timeout_s"):
        spawn(print, 1, timeout_s=bad)
    with pytest.raises(ArgumentError, match="group_timeout_s"):
        spawn(print, 1, group_timeout_s=bad)
    with pytest.raises(ArgumentError, match="timeout_s"):
        run_per_device(print, [0], timeout_s=bad)
    with pytest.raises(ArgumentError, match="timeout_s"):
        spawn_tp_snapshots("sim", model="llama-3.1-8b", tp=1, reserved_tokens=4096,
                           timeout_s=bad)


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0, -1.0, True, "10"], ids=repr)
def test_a_distributed_owner_refuses_a_non_finite_collective_timeout(bad: object) -> None:
    import torch.distributed as dist

    from kvvmm.owner.distributed import DistributedOwner

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    owner = _owner(SimDriver("h200"))
    try:
        with pytest.raises(ArgumentError, match="timeout_s"):
            DistributedOwner(owner, timeout_s=bad)
        assert DistributedOwner(owner, timeout_s=None).timeout_s is None
    finally:
        owner.close()
        dist.destroy_process_group()

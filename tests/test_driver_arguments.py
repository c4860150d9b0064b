"""Everything that takes a driver (or an owner) refuses what is not one with a typed error
naming the argument, before it is first used: no AttributeError from deep inside
(hardening round 2, class 11)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvvmm import Arena, KvBufferOwner, mha_token_major
from kvvmm.arena.pool import HandlePool
from kvvmm.driver import FaultyDriver
from kvvmm.errors import ArgumentError
from kvvmm.measure.bench import TimedDriver
from kvvmm.owner import RangeBacking
from kvvmm.record.tracing import TracingDriver

_DESCS = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=4096, page_size=16,
                         dtype="bfloat16")


def _calibration_driver(x: Any) -> Any:
    from kvvmm.measure.calibrate import TimedDriver as CalibrationTimedDriver

    return CalibrationTimedDriver(x)


TAKES_A_DRIVER: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "HandlePool": ("driver", lambda x: HandlePool(x)),
    "Arena": ("driver", lambda x: Arena(x, reserve_bytes=1 << 30)),
    "KvBufferOwner": ("driver", lambda x: KvBufferOwner(driver=x, dtype="bfloat16",
                                                        page_size=16, reserved_tokens=4096,
                                                        descs=_DESCS)),
    "FaultyDriver": ("inner", lambda x: FaultyDriver(x)),
    "TracingDriver": ("inner", lambda x: TracingDriver(x)),
    "TimedDriver": ("inner", lambda x: TimedDriver(x)),
    "calibrate's timing driver": ("inner", _calibration_driver),
}
NOT_DRIVERS = ["sim", "cuda", None, 3, 2.5, object(), b"host"]


def _bad_id(bad: object) -> str:
    """The case's name: its repr, but a bare object's without its address, so every
    process names the same tests (pytest-xdist's workers must collect the same ids)."""
    return "object()" if type(bad) is object else repr(bad)


@pytest.mark.parametrize("bad", NOT_DRIVERS, ids=_bad_id)
@pytest.mark.parametrize("what", list(TAKES_A_DRIVER))
def test_what_takes_a_driver_refuses_what_is_not_one(what: str, bad: object) -> None:
    name, make = TAKES_A_DRIVER[what]
    with pytest.raises(ArgumentError, match=name) as e:
        make(bad)
    if bad in ("sim", "cuda"):
        assert "open_driver" in str(e.value)  # a kind's name gets the way to open it


@pytest.mark.parametrize("bad", NOT_DRIVERS, ids=_bad_id)
def test_range_backing_refuses_what_is_not_an_owner(bad: object) -> None:
    with pytest.raises(ArgumentError, match="owner"):
        RangeBacking(bad)  # type: ignore[arg-type]

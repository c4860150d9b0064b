"""FaultyDriver: wrap any driver and make chosen calls fail with chosen CUDA errors.

Tests and notebooks use it to prove that every multi-step change undoes itself: fail the
3rd ``create``, every ``map`` of 64 MiB or more, or simply the Nth call of any kind. A failed
call is *not* passed to the inner driver, exactly like a CUDA call that returned an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvvmm.checks import int_arg
from kvvmm.driver.base import (
    CALLS,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    Driver,
    driver_error,
)
from kvvmm.driver.wrapper import NAMED, DriverWrapper
from kvvmm.errors import ArgumentError

__all__ = ["Fault", "FaultyDriver"]

_ERRORS = (CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_UNKNOWN",
           "CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_ILLEGAL_ADDRESS")


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected failure.

    Attributes:
        call: a protocol call (``"create"``, ``"map"``, ...) or ``"*"`` for any call.
        nth: fail the nth matching call (1-based, counted from when the fault is armed);
            ``None`` fails every matching call.
        min_size: only calls whose ``size`` argument is at least this many bytes match.
        error: the CUDA error name to raise.
    """

    call: str = "*"
    nth: int | None = 1
    min_size: int = 0
    error: str = CUDA_ERROR_OUT_OF_MEMORY

    def __post_init__(self) -> None:
        if self.call != "*" and self.call not in CALLS:
            raise ArgumentError("call", self.call, f"'*' or one of {list(CALLS)}")
        if self.nth is not None:  # True is an int >= 1 to isinstance, not to int_arg
            int_arg("nth", self.nth, lo=1, limit="an int >= 1 or None")
        if self.error not in _ERRORS:
            raise ArgumentError("error", self.error, f"one of {list(_ERRORS)}")


class FaultyDriver(DriverWrapper):
    """A driver that fails the calls its :class:`Fault` list picks, and counts every call.

    Args:
        inner: the driver to wrap.
        fail: faults to arm now: a :class:`Fault`, several, or ``{"create": 3}`` (fail the
            3rd create with out-of-memory).
    """

    def __init__(
        self, inner: Driver, fail: Fault | Iterable[Fault] | Mapping[str, int] = ()
    ) -> None:
        super().__init__(inner)
        self.calls: list[str] = []  #: every call made through this wrapper, in order
        self.injected: list[str] = []  #: calls that were made to fail
        self._faults: list[Fault] = []
        self._seen: list[int] = []
        self.arm(fail)

    def __repr__(self) -> str:
        return f"FaultyDriver({self.inner!r}, fail={self._faults!r})"

    def arm(self, fail: Fault | Iterable[Fault] | Mapping[str, int]) -> None:
        """Add faults; their ``nth`` counts from now."""
        if isinstance(fail, Fault):
            faults = [fail]
        elif isinstance(fail, Mapping):
            faults = [Fault(call=c, nth=n) for c, n in fail.items()]
        else:
            faults = list(fail)
        self._faults.extend(faults)
        self._seen.extend(0 for _ in faults)

    def disarm(self) -> None:
        """Remove every fault; later calls all pass through."""
        self._faults.clear()
        self._seen.clear()

    def _call(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        if call == "pin" or call == "unpin":  # not protocol calls: never counted or failed
            return fn(*args)
        self.calls.append(call)
        if self._faults:
            named = NAMED[call](*args)
            named.pop("devices", None)  # a DriverError carries the ints only
            size = named.get("size", 0)
            for i, f in enumerate(self._faults):
                if (f.call == "*" or f.call == call) and size >= f.min_size:
                    self._seen[i] += 1
                    if f.nth is None or self._seen[i] == f.nth:
                        self.injected.append(call)
                        raise driver_error(call, named, f.error, "injected by FaultyDriver")
        return fn(*args)

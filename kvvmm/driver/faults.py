"""FaultyDriver: wrap any driver and make chosen calls fail with chosen CUDA errors.

Tests and notebooks use it to prove that every multi-step change undoes itself: fail the
3rd ``create``, every ``map`` of 64 MiB or more, or simply the Nth call of any kind. A failed
call is *not* passed to the inner driver, exactly like a CUDA call that returned an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvvmm.driver.base import (
    CALLS,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    Driver,
    DriverStats,
    MemoryKind,
    check_driver,
    driver_error,
)
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
        if self.nth is not None and (not isinstance(self.nth, int) or self.nth < 1):
            raise ArgumentError("nth", self.nth, "an int >= 1 or None")
        if self.error not in _ERRORS:
            raise ArgumentError("error", self.error, f"one of {list(_ERRORS)}")


class FaultyDriver(Driver):
    """A driver that fails the calls its :class:`Fault` list picks, and counts every call.

    Args:
        inner: the driver to wrap.
        fail: faults to arm now: a :class:`Fault`, several, or ``{"create": 3}`` (fail the
            3rd create with out-of-memory).
    """

    def __init__(
        self, inner: Driver, fail: Fault | Iterable[Fault] | Mapping[str, int] = ()
    ) -> None:
        check_driver(inner, "inner")  # typed, not an AttributeError on .kind
        self.inner = inner
        self.kind: str = inner.kind
        self.device: int = inner.device
        self.name: str = inner.name
        self.memory: MemoryKind = inner.memory
        self.calls: list[str] = []  #: every call made through this wrapper, in order
        self.injected: list[str] = []  #: calls that were made to fail
        self._faults: list[Fault] = []
        self._seen: list[int] = []
        self.arm(fail)

    def __repr__(self) -> str:
        return f"FaultyDriver({self.inner!r}, fail={self._faults!r})"

    @property
    def clock_us(self) -> float:
        return self.inner.clock_us

    def library_work(self, op: str, units: int = 1) -> None:
        """Pass the library's work per operation on to a simulator (a no-op elsewhere)."""
        self.inner.library_work(op, units)

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

    def _gate(self, call: str, args: dict[str, int]) -> None:
        self.calls.append(call)
        size = args.get("size", 0)
        for i, f in enumerate(self._faults):
            if (f.call == "*" or f.call == call) and size >= f.min_size:
                self._seen[i] += 1
                if f.nth is None or self._seen[i] == f.nth:
                    self.injected.append(call)
                    raise driver_error(call, args, f.error, "injected by FaultyDriver")

    def granularity(self) -> int:
        return self.inner.granularity()

    def reserve(self, size: int, align: int = 0) -> int:
        self._gate("reserve", {"size": size, "align": align})
        return self.inner.reserve(size, align)

    def free(self, va: int, size: int) -> None:
        self._gate("free", {"va": va, "size": size})
        self.inner.free(va, size)

    def create(self, size: int) -> int:
        self._gate("create", {"size": size})
        return self.inner.create(size)

    def release(self, handle: int) -> None:
        self._gate("release", {"handle": handle})
        self.inner.release(handle)

    def map(self, va: int, size: int, handle: int) -> None:
        self._gate("map", {"va": va, "size": size, "handle": handle})
        self.inner.map(va, size, handle)

    def unmap(self, va: int, size: int) -> None:
        self._gate("unmap", {"va": va, "size": size})
        self.inner.unmap(va, size)

    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        self._gate("set_access", {"va": va, "size": size})
        if devices is None:
            self.inner.set_access(va, size)
        else:
            self.inner.set_access(va, size, devices)

    def mem_info(self) -> tuple[int, int]:
        self._gate("mem_info", {})
        return self.inner.mem_info()

    def stats(self) -> DriverStats:
        return self.inner.stats()

    def export_handle(self, handle: int) -> int:
        self._gate("export_handle", {"handle": handle})
        return self.inner.export_handle(handle)

    def import_handle(self, fd: int, size: int) -> int:
        self._gate("import_handle", {"fd": fd, "size": size})  # a refused fd stays the caller's
        return self.inner.import_handle(fd, size)

    def pin(self, va: int) -> None:
        """Pass a view's pin on to the wrapped driver (drivers without pins ignore it)."""
        self.inner.pin(va)

    def unpin(self, va: int) -> None:
        """Drop a pin on the wrapped driver (see :meth:`pin`)."""
        self.inner.unpin(va)

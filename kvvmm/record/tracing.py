"""TracingDriver: a driver wrapper that records every call into a :class:`Trace`.

Wrap the driver, work as usual, save the trace. Arenas record their own operations only when
they are handed the trace (``Arena(driver, ..., trace=drv.trace)``): nothing here is found by
walking wrappers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvvmm.driver.base import Driver, DriverStats, MemoryKind, check_driver
from kvvmm.errors import DriverError
from kvvmm.record.trace import Trace

__all__ = ["TracingDriver"]


class TracingDriver(Driver):
    """Wraps a driver and records every call into :attr:`trace`.

    Recording costs about a microsecond per call; leave it off on hot paths you time.
    """

    def __init__(self, inner: Driver, trace: Trace | None = None) -> None:
        check_driver(inner, "inner")  # typed, not an AttributeError on .kind
        self.inner = inner
        self.kind: str = inner.kind
        self.device: int = inner.device
        self.name: str = inner.name
        self.memory: MemoryKind = inner.memory
        self.trace = trace if trace is not None else Trace()
        self.trace.meta.setdefault("driver", inner.kind)
        self.trace.meta.setdefault("device_name", inner.name)
        self.trace.meta.setdefault("device", inner.device)
        self.trace.meta.setdefault("granularity", inner.granularity())
        profile = getattr(inner, "profile", None)
        if profile is not None:
            self.trace.meta.setdefault("profile", getattr(profile, "key", str(profile)))
        self.trace.meta.setdefault("recorded", time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    @property
    def clock_us(self) -> float:
        return self.inner.clock_us

    def library_work(self, op: str, units: int = 1) -> None:
        """Pass the library's work per operation on to a simulator (a no-op elsewhere)."""
        self.inner.library_work(op, units)

    def _call(self, op: str, args: dict[str, Any], fn: Any, *a: Any) -> Any:
        clock0 = self.clock_us
        t0 = time.perf_counter()
        try:
            result = fn(*a)
        except Exception as e:  # a DriverError by its CUDA name, anything else by its type
            name = e.cuda_error if isinstance(e, DriverError) else type(e).__name__
            self.trace.add(op, args, None, name, (time.perf_counter() - t0) * 1e6,
                           self.clock_us - clock0)
            raise
        self.trace.add(op, args, result if isinstance(result, int) else None, None,
                       (time.perf_counter() - t0) * 1e6, self.clock_us - clock0)
        return result

    def granularity(self) -> int:
        return self.inner.granularity()

    def reserve(self, size: int, align: int = 0) -> int:
        return int(self._call("reserve", {"size": size, "align": align}, self.inner.reserve,
                              size, align))

    def free(self, va: int, size: int) -> None:
        self._call("free", {"va": va, "size": size}, self.inner.free, va, size)

    def create(self, size: int) -> int:
        return int(self._call("create", {"size": size}, self.inner.create, size))

    def release(self, handle: int) -> None:
        self._call("release", {"handle": handle}, self.inner.release, handle)

    def map(self, va: int, size: int, handle: int) -> None:
        self._call("map", {"va": va, "size": size, "handle": handle}, self.inner.map,
                   va, size, handle)

    def unmap(self, va: int, size: int) -> None:
        self._call("unmap", {"va": va, "size": size}, self.inner.unmap, va, size)

    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        if devices is None:
            self._call("set_access", {"va": va, "size": size}, self.inner.set_access, va, size)
        else:  # peers: the device list is recorded (as a JSON list) and replayed
            self._call("set_access", {"va": va, "size": size, "devices": list(devices)},
                       self.inner.set_access, va, size, devices)

    def mem_info(self) -> tuple[int, int]:
        free, total = self._call("mem_info", {}, self.inner.mem_info)
        return int(free), int(total)

    def stats(self) -> DriverStats:
        return self.inner.stats()

    def export_handle(self, handle: int) -> int:
        return int(self._call("export_handle", {"handle": handle}, self.inner.export_handle,
                              handle))

    def import_handle(self, fd: int, size: int) -> int:
        return int(self._call("import_handle", {"fd": fd, "size": size},
                              self.inner.import_handle, fd, size))

    def pin(self, va: int) -> None:
        """Pass a view's pin on to the wrapped driver (drivers without pins ignore it)."""
        self.inner.pin(va)

    def unpin(self, va: int) -> None:
        """Drop a pin on the wrapped driver (see :meth:`pin`)."""
        self.inner.unpin(va)



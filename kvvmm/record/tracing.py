"""TracingDriver: a driver wrapper that records every call into a :class:`Trace`.

Arenas record their own operations only when handed the trace
(``Arena(driver, ..., trace=drv.trace)``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvvmm.driver.base import Driver
from kvvmm.driver.wrapper import NAMED, DriverWrapper
from kvvmm.errors import DriverError
from kvvmm.record.trace import Trace

__all__ = ["TracingDriver"]


class TracingDriver(DriverWrapper):
    """Wraps a driver and records every call into :attr:`trace`.

    Recording costs about a microsecond per call; leave it off on hot paths you time.
    """

    def __init__(self, inner: Driver, trace: Trace | None = None) -> None:
        super().__init__(inner)
        self.trace = trace if trace is not None else Trace()
        self.trace.meta.setdefault("driver", inner.kind)
        self.trace.meta.setdefault("device_name", inner.name)
        self.trace.meta.setdefault("device", inner.device)
        self.trace.meta.setdefault("granularity", inner.granularity())
        profile = getattr(inner, "profile", None)  # the simulator's (not a protocol call)
        if profile is not None:
            self.trace.meta.setdefault("profile", getattr(profile, "key", str(profile)))
        self.trace.meta.setdefault("recorded", time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def _call(self, call: str, fn: Callable[..., Any], *a: Any) -> Any:
        if call == "pin" or call == "unpin":  # not protocol calls: not in a trace
            return fn(*a)
        args = NAMED[call](*a)  # peers' devices as a JSON list, replayed
        inner = self.inner
        clock0 = inner.clock_us
        t0 = time.perf_counter()
        try:
            result = fn(*a)
        except Exception as e:  # a DriverError by its CUDA name, anything else by its type
            name = e.cuda_error if isinstance(e, DriverError) else type(e).__name__
            self.trace.add(call, args, None, name, (time.perf_counter() - t0) * 1e6,
                           inner.clock_us - clock0)
            raise
        self.trace.add(call, args, result if isinstance(result, int) else None, None,
                       (time.perf_counter() - t0) * 1e6, inner.clock_us - clock0)
        return result

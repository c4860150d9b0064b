"""DriverWrapper: a driver that forwards every call to the driver it wraps, through one method.

``FaultyDriver`` (fails chosen calls), ``TracingDriver`` (records them) and ``TimedDriver``
(times them) are wrappers: each overrides :meth:`DriverWrapper._call`, the one place every
protocol call (and ``pin``/``unpin``) passes, instead of forwarding each call by hand.

A wrapper costs a Python frame or two per call, so none of these sits between the arena or
owner and a driver in normal use: they are for tests, notebooks, recording and measuring. A
wrapper that must sit there (``BudgetedDriver``, which charges creates to a GPU's budget)
overrides the calls it changes and declares the others as fields (``__slots__``) holding the
inner driver's own bound methods, set in its constructor: those calls then cost what they
cost on the driver itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvvmm.driver.base import Driver, DriverStats, MemoryKind, check_driver

__all__ = ["NAMED", "DriverWrapper"]

#: Each call that passes :meth:`DriverWrapper._call`, and its arguments by name as a trace
#: and a DriverError name them (``set_access``'s ``devices``, when a caller passes it, as a
#: list: a trace saves it as JSON). A dict literal per call: ``dict(zip(names, args))``
#: costs three times as much, on every traced call.
NAMED: dict[str, Callable[..., dict[str, Any]]] = {
    "reserve": lambda size, align: {"size": size, "align": align},
    "free": lambda va, size: {"va": va, "size": size},
    "create": lambda size: {"size": size},
    "release": lambda handle: {"handle": handle},
    "map": lambda va, size, handle: {"va": va, "size": size, "handle": handle},
    "unmap": lambda va, size: {"va": va, "size": size},
    "set_access": lambda va, size, devices=None: (
        {"va": va, "size": size} if devices is None
        else {"va": va, "size": size, "devices": list(devices)}),
    "mem_info": lambda: {},
    "export_handle": lambda handle: {"handle": handle},
    "import_handle": lambda fd, size: {"fd": fd, "size": size},
    "pin": lambda va: {"va": va},
    "unpin": lambda va: {"va": va},
}


class DriverWrapper(Driver):
    """Wraps ``inner``: every call goes to it through :meth:`_call`, unchanged by default.

    ``granularity``, ``stats``, ``clock_us``, ``handle_type``, ``granularity_min``,
    ``fast_path`` and ``library_work`` are the inner driver's own (never gated, recorded or
    timed); ``close`` is the protocol's no-op: the wrapped driver is its opener's to close.

    Args:
        inner: the driver to wrap.
    Raises:
        ArgumentError: ``inner`` is not a driver.
    """

    def __init__(self, inner: Driver) -> None:
        check_driver(inner, "inner")  # typed, not an AttributeError on .kind
        self.inner = inner
        self.kind: str = inner.kind
        self.device: int = inner.device
        self.name: str = inner.name
        self.memory: MemoryKind = inner.memory

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def _call(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Make ``call`` (a key of :data:`NAMED`): ``fn`` is the inner driver's method,
        ``args`` its positional arguments (``NAMED[call](*args)`` names them). Override to
        gate, record or time every call in one place."""
        return fn(*args)

    # -- the inner driver's own, passed through untouched --------------------------------

    def granularity(self) -> int:
        return self.inner.granularity()

    def stats(self) -> DriverStats:
        return self.inner.stats()

    @property
    def clock_us(self) -> float:
        return self.inner.clock_us

    @property
    def handle_type(self) -> str:
        """The wrapped driver's: what its handles can be shared as."""
        return self.inner.handle_type

    @property
    def granularity_min(self) -> int:
        """The wrapped driver's minimum granularity."""
        return self.inner.granularity_min

    @property
    def fast_path(self) -> bool | None:
        """The wrapped driver's: whether its hot calls run in C."""
        return self.inner.fast_path

    @property  # the inner driver's bound method itself: no frame here, and work_hook sees
    def library_work(self) -> Callable[[str, int], None]:  # type: ignore[override]
        """The inner driver's ``library_work`` (a no-op except on the simulator)."""
        return self.inner.library_work

    # -- every other call, through _call -------------------------------------------------

    def reserve(self, size: int, align: int = 0) -> int:
        return int(self._call("reserve", self.inner.reserve, size, align))

    def free(self, va: int, size: int) -> None:
        self._call("free", self.inner.free, va, size)

    def create(self, size: int) -> int:
        return int(self._call("create", self.inner.create, size))

    def release(self, handle: int) -> None:
        self._call("release", self.inner.release, handle)

    def map(self, va: int, size: int, handle: int) -> None:
        self._call("map", self.inner.map, va, size, handle)

    def unmap(self, va: int, size: int) -> None:
        self._call("unmap", self.inner.unmap, va, size)

    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        # Two arguments when the caller passed two: CudaDriver's C fast path takes only
        # (va, size) and hands a third, even None, to the slower Python path.
        if devices is None:
            self._call("set_access", self.inner.set_access, va, size)
        else:
            self._call("set_access", self.inner.set_access, va, size, devices)

    def mem_info(self) -> tuple[int, int]:
        free, total = self._call("mem_info", self.inner.mem_info)
        return int(free), int(total)

    def export_handle(self, handle: int) -> int:
        return int(self._call("export_handle", self.inner.export_handle, handle))

    def import_handle(self, fd: int, size: int) -> int:
        return int(self._call("import_handle", self.inner.import_handle, fd, size))

    def pin(self, va: int) -> None:
        """Pass a view's pin on to the wrapped driver (drivers without pins ignore it)."""
        self._call("pin", self.inner.pin, va)

    def unpin(self, va: int) -> None:
        """Drop a pin on the wrapped driver (see :meth:`pin`)."""
        self._call("unpin", self.inner.unpin, va)

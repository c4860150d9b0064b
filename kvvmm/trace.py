"""Traces: every driver call as an event; versioned JSON; replay onto a SimDriver.

Record on a GPU, look at it on a laptop: wrap a driver in :class:`TracingDriver`, work as
usual, ``trace.save("run.json")``; later ``Trace.load`` and replay it, or draw it with
``kvvmm map run.json``. Arenas that find a trace on their driver also note their own
operations in it (``arena.open``, ``arena.allocate``, ...), so a replay rebuilds the same
arena snapshot (``kvvmm.arena.replay_arenas``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvvmm.driver.base import CALLS, Driver, DriverStats, MemoryKind
from kvvmm.errors import DriverError, TraceFormatError

__all__ = ["FORMAT", "VERSION", "Trace", "TraceEvent", "TracingDriver", "find_trace", "replay"]

FORMAT = "kvvmm-trace"
VERSION = 1
# The int arguments each driver call must carry to be replayed.
_ARGS: dict[str, tuple[str, ...]] = {
    "reserve": ("size", "align"), "free": ("va", "size"), "create": ("size",),
    "release": ("handle",), "map": ("va", "size", "handle"), "unmap": ("va", "size"),
    "set_access": ("va", "size"), "mem_info": (), "export_handle": ("handle",),
    "import_handle": ("fd", "size"),
}


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One driver call (or one arena operation, ``op`` starting with ``"arena."``).

    Attributes:
        seq: position in the trace, from 0.
        op: the call (``"create"``) or arena operation (``"arena.commit"``).
        args: its arguments (ints for driver calls; names and ints for arena operations).
        result: the return value (a VA or handle), or None.
        error: the CUDA error name if the call failed, else None.
        wall_us: wall time the call took, in microseconds.
        sim_us: simulated cost (SimDriver's cost model), 0.0 for real drivers.
    """

    seq: int
    op: str
    args: dict[str, Any]
    result: int | None = None
    error: str | None = None
    wall_us: float = 0.0
    sim_us: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "args": self.args, "result": self.result,
                "error": self.error, "wall_us": round(self.wall_us, 3),
                "sim_us": round(self.sim_us, 3)}


@dataclass(slots=True)
class Trace:
    """An ordered list of events plus what the recording driver was."""

    meta: dict[str, Any] = field(default_factory=dict)
    events: list[TraceEvent] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def add(self, op: str, args: dict[str, Any], result: int | None = None,
            error: str | None = None, wall_us: float = 0.0, sim_us: float = 0.0) -> TraceEvent:
        ev = TraceEvent(len(self.events), op, args, result, error, wall_us, sim_us)
        self.events.append(ev)
        return ev

    def driver_calls(self) -> list[TraceEvent]:
        """Only the driver calls (no arena notes)."""
        return [e for e in self.events if not e.op.startswith("arena.")]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "meta": self.meta,
                "events": [e.to_json() for e in self.events]}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as JSON (format ``kvvmm-trace``, version 1)."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def from_json(cls, data: object) -> Trace:
        """Rebuild a trace from :meth:`to_json` output; raise TraceFormatError if malformed."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TraceFormatError(f"not a kvvmm trace: format must be {FORMAT!r}")
        version = data.get("version")
        if type(version) is not int or version != VERSION:
            raise TraceFormatError(
                f"trace version {data.get('version')!r} is not supported: must be {VERSION}"
            )
        meta, raw = data.get("meta", {}), data.get("events")
        if not isinstance(meta, dict) or not isinstance(raw, list):
            raise TraceFormatError("a trace needs a 'meta' object and an 'events' list")
        trace = cls(meta=meta)
        for i, e in enumerate(raw):
            try:
                op, args = e["op"], e["args"]
                if not isinstance(op, str) or not isinstance(args, dict):
                    raise TypeError("op must be a string and args an object")
                if not op.startswith("arena.") and op not in CALLS:
                    raise ValueError(f"unknown op {op!r}")
                for key in _ARGS.get(op, ()):
                    v = args.get(key)
                    if type(v) is not int:
                        raise TypeError(f"{op} needs an int argument {key!r}, got {v!r}")
                devices = args.get("devices")
                if devices is not None and (not isinstance(devices, list) or not all(
                        type(d) is int for d in devices)):
                    raise TypeError(f"{op}'s devices must be a list of ints, got {devices!r}")
                trace.add(op, args, e.get("result"), e.get("error"),
                          float(e.get("wall_us", 0.0)), float(e.get("sim_us", 0.0)))
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"event {i} is malformed: {exc}") from None
        return trace

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace written by :meth:`save`."""
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{os.fspath(path)} is not JSON: {e}") from None
        return cls.from_json(data)


class TracingDriver:
    """Wraps a driver and records every call into :attr:`trace`.

    Recording costs about a microsecond per call; leave it off on hot paths you time.
    """

    def __init__(self, inner: Driver, trace: Trace | None = None) -> None:
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
        return float(getattr(self.inner, "clock_us", 0.0))

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


def find_trace(driver: object) -> Trace | None:
    """The trace recording ``driver``'s calls, looking through wrappers; None if none."""
    seen = 0
    while driver is not None and seen < 16:
        t = getattr(driver, "trace", None)
        if isinstance(t, Trace):
            return t
        driver = getattr(driver, "inner", None)
        seen += 1
    return None


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A replayed call whose outcome differs from the recording."""

    seq: int
    op: str
    recorded: str  #: "ok" or the recorded CUDA error name
    replayed: str  #: "ok" or the replayed CUDA error name


def replay(trace: Trace, driver: Driver) -> list[Mismatch]:
    """Replay every driver call of ``trace`` on ``driver``; return the outcomes that differ.

    Addresses and handles are translated: a recorded reservation maps to the one the replay
    driver handed out, offsets within it kept; recorded handles map to replayed handles.
    Calls that failed in the recording are replayed too: the driver must refuse them again.
    Wrap a :class:`FaultyDriver` *around* the tracing driver, so injected faults (which no
    replay driver can reproduce) never reach the trace.

    Handle sharing: an export is replayed (its descriptor kept for a later import of the
    recorded one); an import of a descriptor that came from elsewhere (another process) is
    replayed as a create of the same size, which maps the same; descriptors left unimported
    are closed at the end.
    """
    va_map: dict[int, tuple[int, int]] = {}  # recorded reservation start -> (replay, size)
    h_map: dict[int, int] = {}
    fd_map: dict[int, int] = {}  # recorded exported fd -> replayed one
    out: list[Mismatch] = []

    def tva(va: int) -> int:
        for start, (new, size) in va_map.items():
            if start <= va < start + size:
                return new + (va - start)
        return va

    for ev in trace.driver_calls():
        a = ev.args
        try:
            if ev.op == "reserve":
                if ev.error is not None:
                    driver.reserve(a["size"], a["align"])
                else:
                    assert ev.result is not None
                    va_map[ev.result] = (driver.reserve(a["size"], a["align"]), a["size"])
            elif ev.op == "free":
                driver.free(tva(a["va"]), a["size"])
                if ev.error is None:
                    va_map.pop(a["va"], None)  # its VA may be handed out again
            elif ev.op == "create":
                h = driver.create(a["size"])
                if ev.result is not None:
                    h_map[ev.result] = h
            elif ev.op == "release":
                driver.release(h_map.get(a["handle"], -1))
            elif ev.op == "map":
                driver.map(tva(a["va"]), a["size"], h_map.get(a["handle"], -1))
            elif ev.op == "unmap":
                driver.unmap(tva(a["va"]), a["size"])
            elif ev.op == "set_access":
                devices = a.get("devices")
                if devices is None:
                    driver.set_access(tva(a["va"]), a["size"])
                else:
                    driver.set_access(tva(a["va"]), a["size"], tuple(devices))
            elif ev.op == "mem_info":
                driver.mem_info()
            elif ev.op == "export_handle":
                fd = driver.export_handle(h_map.get(a["handle"], -1))
                if ev.result is not None:
                    old = fd_map.pop(ev.result, None)
                    if old is not None:
                        os.close(old)
                    fd_map[ev.result] = fd
                else:
                    os.close(fd)
            elif ev.op == "import_handle":
                if ev.error is not None:
                    h = driver.import_handle(-1, a["size"])  # must be refused again
                elif a["fd"] in fd_map:
                    h = driver.import_handle(fd_map[a["fd"]], a["size"])
                    del fd_map[a["fd"]]  # the driver owns it now
                else:  # exported by another process: same-sized memory of our own
                    h = driver.create(a["size"])
                if ev.result is not None:
                    h_map[ev.result] = h
            got = "ok"
        except DriverError as e:
            got = e.cuda_error
        want = ev.error or "ok"
        if got != want:
            out.append(Mismatch(ev.seq, ev.op, want, got))
    for fd in fd_map.values():
        os.close(fd)
    return out

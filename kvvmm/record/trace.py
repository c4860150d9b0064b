"""Traces: driver calls and arena operations, each in its own typed list, saved as JSON.

Record on a GPU, look at it on a laptop. A :class:`Trace` holds two lists that share one
sequence counter, so their order is known:

- ``events``: every driver call (:class:`TraceEvent`), written by a
  :class:`~kvvmm.record.tracing.TracingDriver` wrapped around the driver;
- ``ops``: every arena operation (:class:`ArenaOp`: open, allocate, commit, ...), written by an
  :class:`~kvvmm.arena.Arena` that was given the trace (``Arena(..., trace=t)``).

Recording is explicit: an arena records only into a trace it was handed. ``Trace.save`` writes
format ``kvvmm-trace`` version 2; ``Trace.load`` also reads version 1, whose arena operations
sat among the driver calls as ``"arena.*"`` events. :mod:`kvvmm.replay` replays both lists.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvvmm.driver.base import CALLS
from kvvmm.errors import TraceFormatError

__all__ = ["ARENA_OPS", "FORMAT", "VERSION", "ArenaOp", "Trace", "TraceEvent"]

FORMAT = "kvvmm-trace"
VERSION = 2
#: What an arena records, in the order they can happen.
ARENA_OPS = ("open", "allocate", "commit", "decommit", "grant_access", "adopt", "close")
# The int arguments each driver call must carry to be replayed.
_ARGS: dict[str, tuple[str, ...]] = {
    "reserve": ("size", "align"), "free": ("va", "size"), "create": ("size",),
    "release": ("handle",), "map": ("va", "size", "handle"), "unmap": ("va", "size"),
    "set_access": ("va", "size"), "mem_info": (), "export_handle": ("handle",),
    "import_handle": ("fd", "size"),
}


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One driver call.

    Attributes:
        seq: position in the trace (shared with :class:`ArenaOp`), from 0.
        op: the call (``"create"``), one of ``kvvmm.driver.base.CALLS``.
        args: its int arguments (``size``, ``va``, ``handle``; ``devices`` for peers).
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


@dataclass(frozen=True, slots=True)
class ArenaOp:
    """One arena operation that succeeded.

    Attributes:
        seq: position in the trace (shared with :class:`TraceEvent`).
        arena: the arena's number in this trace (0, 1, ... in order of opening).
        op: one of :data:`ARENA_OPS`.
        args: its arguments (``name``, ``nbytes``, ``offset``, ``keep_bytes``, ``devices``).
    """

    seq: int
    arena: int
    op: str
    args: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "arena": self.arena, "op": self.op, "args": self.args}


@dataclass(slots=True)
class Trace:
    """Driver calls and arena operations in order, plus what the recording driver was."""

    meta: dict[str, Any] = field(default_factory=dict)
    events: list[TraceEvent] = field(default_factory=list)  #: driver calls
    ops: list[ArenaOp] = field(default_factory=list)  #: arena operations
    arenas: int = 0  #: arenas opened so far (the next one's number)

    def __len__(self) -> int:
        return len(self.events) + len(self.ops)

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def _seq(self) -> int:
        return len(self.events) + len(self.ops)

    def add(self, op: str, args: dict[str, Any], result: int | None = None,
            error: str | None = None, wall_us: float = 0.0, sim_us: float = 0.0) -> TraceEvent:
        """Append a driver call."""
        ev = TraceEvent(self._seq(), op, args, result, error, wall_us, sim_us)
        self.events.append(ev)
        return ev

    def open_arena(self) -> int:
        """Number a new arena (it then records ``open`` with :meth:`add_op`)."""
        self.arenas += 1
        return self.arenas - 1

    def add_op(self, arena: int, op: str, **args: Any) -> ArenaOp:
        """Append an arena operation."""
        rec = ArenaOp(self._seq(), arena, op, args)
        self.ops.append(rec)
        return rec

    def driver_calls(self) -> list[TraceEvent]:
        """The driver calls (the same list as :attr:`events`)."""
        return self.events

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "meta": self.meta,
                "events": [e.to_json() for e in self.events],
                "arena_ops": [o.to_json() for o in self.ops]}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as JSON (format ``kvvmm-trace``, version 2)."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def from_json(cls, data: object) -> Trace:
        """Rebuild a trace from :meth:`to_json` output; raise TraceFormatError if malformed."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TraceFormatError(f"not a kvvmm trace: format must be {FORMAT!r}")
        version = data.get("version")
        if type(version) is not int or version not in (1, VERSION):
            raise TraceFormatError(
                f"trace version {data.get('version')!r} is not supported: must be 1 or {VERSION}"
            )
        meta, raw = data.get("meta", {}), data.get("events")
        raw_ops = data.get("arena_ops", [])
        if not isinstance(meta, dict) or not isinstance(raw, list) or not isinstance(
                raw_ops, list):
            raise TraceFormatError("a trace needs a 'meta' object and an 'events' list")
        trace = cls(meta=meta)
        if version == 1:  # arena operations were "arena.<op>" events among the calls
            calls = [e for e in raw if not _is_v1_op(e)]
            raw_ops = [_v1_op(e) for e in raw if _is_v1_op(e)]
        else:
            calls = raw
        for i, e in enumerate(calls):
            try:
                trace._load_call(e)
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"event {i} is malformed: {exc}") from None
        for i, o in enumerate(raw_ops):
            try:
                trace._load_op(o)
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceFormatError(f"arena op {i} is malformed: {exc}") from None
        # Keep the recorded order: both lists sorted by their recorded seq, renumbered.
        trace._renumber()
        return trace

    def _load_call(self, e: Any) -> None:
        op, args = e["op"], e["args"]
        if not isinstance(op, str) or not isinstance(args, dict):
            raise TypeError("op must be a string and args an object")
        if op not in CALLS:
            raise ValueError(f"unknown op {op!r}")
        for key in _ARGS.get(op, ()):
            v = args.get(key)
            if type(v) is not int:
                raise TypeError(f"{op} needs an int argument {key!r}, got {v!r}")
        devices = args.get("devices")
        if devices is not None and (not isinstance(devices, list) or not all(
                type(d) is int for d in devices)):
            raise TypeError(f"{op}'s devices must be a list of ints, got {devices!r}")
        seq = e.get("seq", len(self.events))
        self.events.append(TraceEvent(seq if type(seq) is int else len(self.events), op, args,
                                      e.get("result"), e.get("error"),
                                      float(e.get("wall_us", 0.0)), float(e.get("sim_us", 0.0))))

    def _load_op(self, o: Any) -> None:
        op, args, arena = o["op"], o["args"], o["arena"]
        if not isinstance(op, str) or not isinstance(args, dict):
            raise TypeError("op must be a string and args an object")
        if op not in ARENA_OPS:
            raise ValueError(f"unknown arena op {op!r}")
        if type(arena) is not int:
            raise TypeError(f"arena must be an int, got {arena!r}")
        seq = o.get("seq", len(self.ops))
        self.ops.append(ArenaOp(seq if type(seq) is int else len(self.ops), arena, op, args))
        self.arenas = max(self.arenas, arena + 1)

    def _renumber(self) -> None:
        merged: list[tuple[int, int, int]] = [(e.seq, 0, i) for i, e in enumerate(self.events)]
        merged += [(o.seq, 1, i) for i, o in enumerate(self.ops)]
        merged.sort()
        events, ops = list(self.events), list(self.ops)
        self.events, self.ops = [], []
        for seq, kind, i in merged:
            del seq
            if kind == 0:
                e = events[i]
                self.events.append(TraceEvent(self._seq(), e.op, e.args, e.result, e.error,
                                              e.wall_us, e.sim_us))
            else:
                o = ops[i]
                self.ops.append(ArenaOp(self._seq(), o.arena, o.op, o.args))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace written by :meth:`save` (version 1 or 2)."""
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{os.fspath(path)} is not JSON: {e}") from None
        return cls.from_json(data)


def _is_v1_op(e: object) -> bool:
    return isinstance(e, dict) and isinstance(e.get("op"), str) and e["op"].startswith("arena.")


def _v1_op(e: dict[str, Any]) -> dict[str, Any]:
    args = dict(e.get("args") or {}) if isinstance(e.get("args"), dict) else e.get("args")
    arena = args.pop("arena", None) if isinstance(args, dict) else None
    return {"seq": e.get("seq"), "arena": arena, "op": e["op"].removeprefix("arena."),
            "args": args}

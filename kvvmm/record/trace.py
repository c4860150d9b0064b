"""Traces: driver calls and arena operations, each in its own typed list, saved as JSON.

A :class:`Trace` holds two lists that share one sequence counter: ``events``, the driver
calls a :class:`~kvvmm.record.tracing.TracingDriver` records, and ``ops``, the operations of
an :class:`~kvvmm.arena.Arena` handed the trace (``Arena(..., trace=t)``). ``Trace.save``
writes format ``kvvmm-trace`` version 2; ``Trace.load`` also reads version 1, whose arena
operations sat among the driver calls as ``"arena.*"`` events.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvvmm.checks import is_int
from kvvmm.errors import TraceFormatError
from kvvmm.record.validate import (
    ARENA_OPS,
    check_call,
    check_meta,
    check_op,
    check_order,
    label,
    show,
)

__all__ = ["ARENA_OPS", "FORMAT", "VERSION", "ArenaOp", "Trace", "TraceEvent"]

FORMAT = "kvvmm-trace"
VERSION = 2


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One driver call."""

    seq: int  #: position in the trace (shared with :class:`ArenaOp`), from 0
    op: str  #: the call (``"create"``), one of ``kvvmm.driver.base.CALLS``
    args: dict[str, Any]  #: its int arguments (``size``, ``va``, ``handle``; ``devices``)
    result: int | None = None  #: the return value (a VA or handle), or None
    error: str | None = None  #: the CUDA error name if the call failed, else None
    wall_us: float = 0.0  #: wall time the call took, in microseconds
    sim_us: float = 0.0  #: simulated cost (SimDriver's cost model), 0.0 for real drivers

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "args": self.args, "result": self.result,
                "error": self.error, "wall_us": round(self.wall_us, 3),
                "sim_us": round(self.sim_us, 3)}


@dataclass(frozen=True, slots=True)
class ArenaOp:
    """One arena operation that succeeded."""

    seq: int  #: position in the trace (shared with :class:`TraceEvent`)
    arena: int  #: the arena's number in this trace (0, 1, ... in order of opening)
    op: str  #: one of :data:`ARENA_OPS`
    args: dict[str, Any]  #: its arguments (``name``, ``nbytes``, ``offset``, ...)

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

    def validate(self) -> None:
        """Raise TraceFormatError unless every record is one a replay can run (the checks
        :meth:`from_json` makes, for a trace built in memory).

        Raises:
            TraceFormatError: naming the first bad record (``event 3 (seq 5, map)``) and field.
        """
        check_meta(self.meta)
        for i, e in enumerate(self.events):
            check_call(f"event {i}", e.seq, e.op, e.args, e.result, e.error, e.wall_us,
                       e.sim_us)
        for i, o in enumerate(self.ops):
            check_op(f"arena op {i}", o.seq, o.arena, o.op, o.args)
        check_order([(label(f"event {i}", e.seq, e.op), e.seq)
                     for i, e in enumerate(self.events)],
                    [(label(f"arena op {i}", o.seq, o.op), o.seq, o.arena, o.op)
                     for i, o in enumerate(self.ops)])

    @classmethod
    def from_json(cls, data: object) -> Trace:
        """Rebuild a trace from :meth:`to_json` output (version 1 or 2), checking every field.

        Raises:
            TraceFormatError: not a trace, an unsupported version, or a record that breaks the
                format: the message names it (``event 3 (seq 5, map)``) and the field.
        """
        if not isinstance(data, dict):
            raise TraceFormatError(f"not a kvvmm trace: format must be {FORMAT!r} "
                                   f"(a JSON object), got {show(data)}")
        if data.get("format") != FORMAT:
            raise TraceFormatError(f"not a kvvmm trace: format must be {FORMAT!r}, got "
                                   f"{show(data.get('format'))}")
        version = data.get("version")
        if not is_int(version) or version not in (1, VERSION):
            raise TraceFormatError(
                f"trace version {show(version)} is not supported: must be 1 or {VERSION}")
        known = ("format", "version", "meta", "events") + (("arena_ops",) if version == 2
                                                            else ())
        for k in data:
            if k not in known:
                raise TraceFormatError(f"a version {version} trace has no field {show(k)} "
                                       f"(it has {', '.join(known)})")
        meta = data.get("meta", {})
        check_meta(meta)
        raw, raw_ops = data.get("events"), data.get("arena_ops", [])
        if not isinstance(raw, list):
            raise TraceFormatError(f"a trace needs an 'events' list, got {show(raw)}")
        if not isinstance(raw_ops, list):
            raise TraceFormatError(f"a trace's 'arena_ops' must be a list, got {show(raw_ops)}")
        trace = cls(meta=meta)
        calls: list[tuple[str, Any]] = []
        ops: list[tuple[str, Any]] = []
        if version == 1:  # arena operations were "arena.<op>" events among the calls
            for i, e in enumerate(raw):
                (ops if _is_v1_op(e) else calls).append(
                    (f"event {i}", _v1_op(e) if _is_v1_op(e) else e))
        else:
            calls = [(f"event {i}", e) for i, e in enumerate(raw)]
            ops = [(f"arena op {i}", o) for i, o in enumerate(raw_ops)]
        where_calls = [trace._load_call(where, e) for where, e in calls]
        where_ops = [trace._load_op(where, o) for where, o in ops]
        check_order([(w, e.seq) for w, e in zip(where_calls, trace.events, strict=True)],
                    [(w, o.seq, o.arena, o.op)
                     for w, o in zip(where_ops, trace.ops, strict=True)])
        # Keep the recorded order: both lists sorted by their recorded seq, renumbered.
        trace._renumber()
        return trace

    def _load_call(self, where: str, e: object) -> str:
        d = _record(where, e, _CALL_FIELDS, ("seq", "op", "args"))
        seq, op, args = d["seq"], d["op"], d["args"]
        result, error = d.get("result"), d.get("error")
        wall_us, sim_us = d.get("wall_us", 0.0), d.get("sim_us", 0.0)
        check_call(where, seq, op, args, result, error, wall_us, sim_us)
        self.events.append(TraceEvent(seq, op, args, result, error, float(wall_us),
                                      float(sim_us)))
        return label(where, seq, op)

    def _load_op(self, where: str, o: object) -> str:
        d = _record(where, o, _OP_FIELDS, _OP_FIELDS)
        seq, arena, op, args = d["seq"], d["arena"], d["op"], d["args"]
        check_op(where, seq, arena, op, args)
        self.ops.append(ArenaOp(seq, arena, op, args))
        self.arenas = max(self.arenas, arena + 1)
        return label(where, seq, op)

    def _renumber(self) -> None:
        merged: list[tuple[int, int, int]] = [(e.seq, 0, i) for i, e in enumerate(self.events)]
        merged += [(o.seq, 1, i) for i, o in enumerate(self.ops)]
        events, ops = list(self.events), list(self.ops)
        self.events, self.ops = [], []
        for _seq, kind, i in sorted(merged):
            if kind == 0:
                e = events[i]
                self.events.append(TraceEvent(self._seq(), e.op, e.args, e.result, e.error,
                                              e.wall_us, e.sim_us))
            else:
                o = ops[i]
                self.ops.append(ArenaOp(self._seq(), o.arena, o.op, o.args))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace written by :meth:`save` (version 1 or 2), checking every field.

        Raises:
            TraceFormatError: the file cannot be read, is not UTF-8 JSON, or is not a valid
                trace (see :meth:`from_json`); the message starts with the path.
        """
        where = os.fspath(path)
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError as e:  # a missing file is as unreadable as a broken one, to a caller
            raise TraceFormatError(f"{where}: cannot read it: {e.strerror or e}") from None
        try:
            return cls.loads(text)
        except TraceFormatError as e:
            raise TraceFormatError(f"{where}: {e}") from None

    @classmethod
    def loads(cls, text: str | bytes) -> Trace:
        """Parse a trace from JSON text (what :meth:`save` writes), checking every field.

        Raises:
            TraceFormatError: not UTF-8, not JSON, nested too deeply to parse, a key repeated in
                one object, or not a valid trace (see :meth:`from_json`).
        """
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceFormatError(f"not UTF-8 text: byte {e.start} is "
                                       f"{text[e.start:e.start + 1]!r}") from None
        try:
            data = json.loads(text, object_pairs_hook=_no_repeats)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"not JSON: {e}") from None
        except RecursionError:  # json.loads recurses once per nested list or object
            raise TraceFormatError("not a kvvmm trace: JSON nested too deeply to parse") \
                from None
        except ValueError as e:  # e.g. an int literal of more than 4300 digits
            raise TraceFormatError(f"not JSON a trace can hold: {e}") from None
        return cls.from_json(data)


# The fields of each record as saved, and the ones a record may leave out.
_CALL_FIELDS = ("seq", "op", "args", "result", "error", "wall_us", "sim_us")
_OP_FIELDS = ("seq", "arena", "op", "args")


def _record(where: str, e: object, fields: tuple[str, ...],
            required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(e, dict):
        raise TraceFormatError(f"{where}: a record must be an object, got {show(e)}")
    for k in e:
        if k not in fields:
            raise TraceFormatError(f"{label(where, e.get('seq'))}: unknown field {show(k)} "
                                   f"(a record has {', '.join(fields)})")
    for k in required:
        if k not in e:
            raise TraceFormatError(f"{label(where, e.get('seq'), e.get('op'))}: field {k!r} "
                                   "is missing")
    return e


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys silently; a trace that says two things
    # about one field is not one we can trust.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise TraceFormatError(f"field {show(k)} appears twice in one object")
        out[k] = v
    return out


def _is_v1_op(e: object) -> bool:
    return isinstance(e, dict) and isinstance(e.get("op"), str) and e["op"].startswith("arena.")


def _v1_op(e: Any) -> dict[str, Any]:
    # Version 1 kept the arena's number among the arguments; the call fields (result, error,
    # times) of such an event meant nothing and are dropped.
    out = {k: e[k] for k in ("seq", "args") if k in e}
    out["op"] = e["op"].removeprefix("arena.")
    if isinstance(out.get("args"), dict):
        out["args"] = dict(out["args"])
        if "arena" in out["args"]:
            out["arena"] = out["args"].pop("arena")
    return out

"""The trace format, checked field by field: what a loaded or hand-built trace must hold.

A trace is input from elsewhere, so everything a replay reads is checked before it runs.
Every failure is a :class:`~kvvmm.errors.TraceFormatError` whose one-line message names the
record (``event 3 (seq 5, map)``) and the field (``args.size``). The functions take plain
fields, so raw JSON and an in-memory trace are checked the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from kvvmm.checks import is_int
from kvvmm.driver.base import CALLS
from kvvmm.errors import TraceFormatError

__all__ = ["ARENA_OPS", "CALL_ARGS", "MAX_DEVICES", "OP_ARGS", "check_call", "check_meta",
           "check_op", "check_order", "label", "show"]

#: What an arena records, in the order they can happen.
ARENA_OPS = ("open", "allocate", "commit", "decommit", "commit_range", "decommit_range",
             "grant_access", "adopt", "sleep", "wake", "close")
#: The int arguments each driver call must carry to be replayed.
CALL_ARGS: dict[str, tuple[str, ...]] = {
    "reserve": ("size", "align"), "free": ("va", "size"), "create": ("size",),
    "release": ("handle",), "map": ("va", "size", "handle"), "unmap": ("va", "size"),
    "set_access": ("va", "size"), "mem_info": (), "export_handle": ("handle",),
    "import_handle": ("fd", "size"),
}
# Calls whose success returns the int a later call refers to (a VA, a handle, a descriptor):
# the replay maps the recorded one to its own, so a successful one must carry it.
_RETURNS = frozenset({"reserve", "create", "export_handle", "import_handle"})
#: Each arena operation's arguments: "int" (bytes or an offset), "str" or "devices".
OP_ARGS: dict[str, dict[str, str]] = {
    "open": {"name": "str", "reserve_bytes": "int", "base": "int"},
    "allocate": {"name": "str", "nbytes": "int", "offset": "int"},
    "commit": {"offset": "int", "nbytes": "int"},
    "decommit": {"offset": "int", "keep_bytes": "int"},
    "grant_access": {"devices": "devices"},
    "adopt": {"offset": "int", "nbytes": "int"},
    "close": {},
    # a granule-aligned range [start, start + nbytes) of the allocation
    "commit_range": {"offset": "int", "start": "int", "nbytes": "int"},
    "decommit_range": {"offset": "int", "start": "int", "nbytes": "int"},
    # backup: "none", "host", "disk" (or a Backup's kind); nbytes: given back / backed again
    "sleep": {"backup": "str", "nbytes": "int"},
    "wake": {"nbytes": "int"},
}
#: Device ordinals a trace may name: a replay builds a SimNode of that many devices.
MAX_DEVICES = 1024
_U64 = 1 << 64  # addresses, sizes and handles are unsigned 64-bit on every driver
_SEQ_END = 1 << 63
_ARENA_END = 1 << 32
_TEXT_MAX = 4096  # names and error names: longer is not a recording
_META_DEPTH = 32  # meta is free-form, but a replay must be able to walk and save it


def show(v: object) -> str:
    """``v`` for a one-line message: short, and safe for any value (huge ints, deep lists)."""
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, int):
        # repr() of an int past 4300 digits raises; past 2**64 it is noise anyway.
        return repr(v) if -_U64 < v < _U64 else f"an int of {v.bit_length()} bits"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        text = repr(v[:40])
        return text + f" (+{len(v) - 40} chars)" if len(v) > 40 else text
    if isinstance(v, (list, tuple)):
        return f"a list of {len(v)} items"
    if isinstance(v, dict):
        return f"an object of {len(v)} fields"
    return f"a {type(v).__name__}"


def label(where: str, seq: object = None, op: object = None) -> str:
    """``"event 3 (seq 5, map)"``: where a record sits (``"event 3"``), with what is known."""
    parts = []
    if is_int(seq):
        parts.append(f"seq {show(seq)}")
    if isinstance(op, str) and (op in CALLS or op in ARENA_OPS):
        parts.append(op)
    return where + (f" ({', '.join(parts)})" if parts else "")


def _fail(where: str, what: str) -> TraceFormatError:
    return TraceFormatError(f"{where}: {what}")


def _int(where: str, name: str, v: object, lo: int = 0, hi: int = _U64) -> int:
    if not is_int(v) or not lo <= v < hi:
        raise _fail(where, f"{name} must be an int in [{_bound(lo)}, {_bound(hi)}), "
                           f"got {show(v)}")
    return v


def _bound(n: int) -> str:
    for e in (63, 64):
        if abs(n) == 1 << e:
            return ("-" if n < 0 else "") + f"2**{e}"
    return str(n)


def _text(where: str, name: str, v: object) -> str:
    if not isinstance(v, str) or not v or len(v) > _TEXT_MAX:
        raise _fail(where, f"{name} must be a non-empty string of at most {_TEXT_MAX} chars, "
                           f"got {show(v)}")
    _unicode(where, name, v)
    return v


def _unicode(where: str, name: str, v: str) -> None:
    try:  # a JSON "\ud800" escape loads as a lone surrogate, which nothing can print or save
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(where, f"{name} is not valid Unicode (a lone surrogate)") from None


def _duration(where: str, name: str, v: object) -> None:
    ok = (is_int(v) and 0 <= v < _U64) or (
        isinstance(v, float) and math.isfinite(v) and v >= 0)
    if not ok:
        raise _fail(where, f"{name} must be a finite number of microseconds >= 0, "
                           f"got {show(v)}")


def _devices(where: str, name: str, v: object) -> None:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_DEVICES:
        raise _fail(where, f"{name} must be a list of at most {MAX_DEVICES} device ordinals, "
                           f"got {show(v)}")
    for j, d in enumerate(v):
        _int(where, f"{name}[{j}]", d, 0, MAX_DEVICES)


def _args(where: str, v: object) -> Mapping[Any, Any]:
    if not isinstance(v, dict):
        raise _fail(where, f"args must be an object, got {show(v)}")
    return v


def _fields(where: str, args: Mapping[Any, Any], allowed: Iterable[str], op: str) -> None:
    allowed = tuple(allowed)
    for k in args:
        if k not in allowed:
            takes = ", ".join(allowed) or "no arguments"
            raise _fail(where, f"args has an unknown field {show(k)} ({op} takes {takes})")


def check_call(where: str, seq: object, op: object, args: object, result: object,
               error: object, wall_us: object, sim_us: object) -> None:
    """Raise TraceFormatError unless these fields make a driver call a replay can run.

    Args:
        where: the record's place, for the message (``"event 3"``); the seq and op are
            added to it once they are known good.
    """
    _int(where, "seq", seq, 0, _SEQ_END)
    if not isinstance(op, str) or op not in CALLS:
        raise _fail(label(where, seq),
                    f"op must be a driver call ({', '.join(CALLS)}), got {show(op)}")
    where = label(where, seq, op)
    if error is not None:
        _text(where, "error", error)
    a = _args(where, args)
    extra = ("devices",) if op == "set_access" else ()
    _fields(where, a, CALL_ARGS[op] + extra, op)
    # A refused call records what its caller passed, which may be a negative size; a call
    # that succeeded had sane arguments.
    lo = -_SEQ_END if error is not None else 0
    for key in CALL_ARGS[op]:
        if key not in a:
            raise _fail(where, f"args.{key} is missing ({op} needs "
                               f"{', '.join(CALL_ARGS[op])})")
        _int(where, f"args.{key}", a[key], lo)
    if "devices" in a:
        _devices(where, "args.devices", a["devices"])
    if result is not None:
        if error is not None:
            raise _fail(where, f"a refused call has no result, got result={show(result)}")
        _int(where, "result", result)
    elif error is None and op in _RETURNS:
        raise _fail(where, f"result is missing: a {op} that succeeded returned an int")
    _duration(where, "wall_us", wall_us)
    _duration(where, "sim_us", sim_us)


def check_op(where: str, seq: object, arena: object, op: object, args: object) -> None:
    """Raise TraceFormatError unless these fields make an arena operation a replay can run."""
    _int(where, "seq", seq, 0, _SEQ_END)
    if not isinstance(op, str) or op not in ARENA_OPS:
        raise _fail(label(where, seq), f"op must be an arena operation "
                                       f"({', '.join(ARENA_OPS)}), got {show(op)}")
    where = label(where, seq, op)
    _int(where, "arena", arena, 0, _ARENA_END)
    a = _args(where, args)
    kinds = OP_ARGS[op]
    _fields(where, a, kinds, op)
    for key, kind in kinds.items():
        if key not in a:
            raise _fail(where, f"args.{key} is missing ({op} needs {', '.join(kinds)})")
        if kind == "int":
            _int(where, f"args.{key}", a[key])
        elif kind == "str":
            _text(where, f"args.{key}", a[key])
        else:
            _devices(where, f"args.{key}", a[key])


def check_meta(meta: object) -> None:
    """Raise TraceFormatError unless ``meta`` is a JSON object a replay can read and save."""
    if not isinstance(meta, dict):
        raise TraceFormatError(f"a trace needs a 'meta' object, got {show(meta)}")
    # Walk with a stack, not recursion: an in-memory meta may nest deeply or hold itself.
    stack: list[tuple[str, object, int]] = [("meta", meta, 0)]
    while stack:
        path, v, depth = stack.pop()
        if depth > _META_DEPTH:
            raise TraceFormatError(f"{path} nests deeper than {_META_DEPTH} levels")
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise TraceFormatError(f"{path} has a key that is not a string: {show(k)}")
                _unicode("meta", f"{path} key {show(k)}", k)
                # A key is the user's text: name it as a quoted index unless it is a plain
                # word, so a newline in a key cannot break the one-line message.
                seg = f".{k}" if k.isidentifier() else f"[{show(k)}]"
                stack.append((f"{path}{seg}", x, depth + 1))
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{path}[{j}]", x, depth + 1) for j, x in enumerate(v))
        elif isinstance(v, str):
            _unicode("meta", path, v)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise TraceFormatError(f"{path} must be a finite number, got {v!r}")
        elif is_int(v):
            _int("meta", path, v, -_SEQ_END)
        elif not (v is None or isinstance(v, bool)):
            raise TraceFormatError(f"{path} must be a JSON value, got {show(v)}")
    # What a replay reads from meta.
    gran = meta.get("granularity", 1)
    if not is_int(gran) or not 1 <= gran <= 1 << 40 or gran & (gran - 1):
        raise TraceFormatError(
            f"meta.granularity must be a power of two in [1, 2**40] (bytes), got {show(gran)}")
    if "device" in meta:
        _int("meta", "meta.device", meta["device"], 0, MAX_DEVICES)
    for key in ("driver", "device_name", "profile", "recorded"):
        if key in meta and not isinstance(meta[key], str):
            raise TraceFormatError(f"meta.{key} must be a string, got {show(meta[key])}")


def check_order(calls: Iterable[tuple[str, int]],
                ops: Iterable[tuple[str, int, int, str]]) -> None:
    """Raise TraceFormatError unless the records are in recorded order and arenas are open.

    Args:
        calls: ``(where, seq)`` of each driver call, in list order (fields already checked).
        ops: ``(where, seq, arena, op)`` of each arena operation, in list order.
    """
    owner: dict[int, str] = {}
    for kind in (calls, ops):
        last: tuple[str, int] | None = None
        for rec in kind:
            where, seq = rec[0], rec[1]
            if seq in owner:
                raise _fail(where, f"seq {seq} repeats {owner[seq]}'s")
            if last is not None and seq < last[1]:
                raise _fail(where, f"seq {seq} comes after seq {last[1]} ({last[0]}): records "
                                   "must be in recorded order")
            owner[seq] = where
            last = (where, seq)
    state: dict[int, str] = {}  # arena -> where it was opened, then where it was closed
    closed: set[int] = set()
    for where, _seq, arena, op in ops:
        if op == "open":
            if arena in state:
                raise _fail(where, f"arena {arena} is opened again (first by {state[arena]})")
            state[arena] = where
        elif arena not in state:
            raise _fail(where, f"arena {arena} was never opened")
        elif arena in closed:
            raise _fail(where, f"arena {arena} is used after its close ({state[arena]})")
        elif op == "close":
            closed.add(arena)
            state[arena] = where

"""kvvmm's errors: each class says who should react to it, and how.

Every error kvvmm raises on purpose is a :class:`KvvmmError`. Input errors also derive from
``ValueError`` (or ``TypeError``) so callers that already catch those keep working. Messages
name the offending value and the limit it broke, with sizes in bytes and ranges half-open
``[start, end)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "AlignmentError",
    "ArgumentError",
    "AsleepError",
    "BackupError",
    "BusyError",
    "CaptureConflictError",
    "ClosedError",
    "CollectiveError",
    "DriverArgumentError",
    "DriverError",
    "DriverOutOfMemoryError",
    "DriverUnavailableError",
    "KvvmmError",
    "OutOfRangeError",
    "ProfileError",
    "ReservationExhaustedError",
    "SleepRefusedError",
    "StateError",
    "TraceFormatError",
    "UnknownDtypeError",
    "WorkloadFormatError",
    "WrongTypeError",
]


class KvvmmError(Exception):
    """Base of every error kvvmm raises on purpose; catch this to catch them all."""


class ArgumentError(KvvmmError, ValueError):
    """A caller passed a value kvvmm cannot use (negative, zero, of the wrong kind, ...).

    The caller should fix the value: nothing was changed. ``name`` is the argument,
    ``value`` what was passed, ``limit`` the bound it broke (a human-readable string).
    """

    def __init__(self, name: str, value: object, limit: str, detail: str = "") -> None:
        self.name = name
        self.value = value
        self.limit = limit
        self.detail = detail
        msg = f"{name}={_show_value(value)} is invalid: must be {limit}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild from the fields (not the message) and keep notes: errors cross processes.
        return (type(self), (self.name, self.value, self.limit, self.detail), self.__dict__)


class AlignmentError(ArgumentError):
    """A size or offset is not a multiple of the granularity the driver works in.

    Round the value with ``kvvmm.units.align_up`` or pass an aligned one.
    """


class OutOfRangeError(ArgumentError):
    """A value or span lies outside what was reserved (tokens, bytes, a buffer's span).

    kvvmm never clamps: a span beyond its reservation is a layout bug the caller must see.
    """


class UnknownDtypeError(ArgumentError, TypeError):
    """A dtype name or object kvvmm does not know; pass a torch dtype or its name."""


class ReservationExhaustedError(KvvmmError):
    """The arena's reserved VA has no room for another allocation.

    Reserve more VA when constructing the arena (VA is free until backed), or allocate less.
    """


class ClosedError(KvvmmError):
    """An arena or owner was used after ``close()``. Create a new one."""


class CollectiveError(KvvmmError):
    """A collective KV change (every rank of a process group, all or nothing) did not happen.

    Raised on every rank: a rank failed (``failed_ranks``), the ranks asked for different
    token counts, or a collective broke (a rank died or ran past the timeout). Each rank has
    already rolled itself back (``rolled_back``; if not, the notes say which undo failed), so
    the caller should fix the cause named in ``__cause__`` or the message, and retry; after a
    broken collective, rebuild the process group first.
    """

    def __init__(self, op: str, phase: str, reason: str, *,
                 failed_ranks: tuple[int, ...] = (), rolled_back: bool = True) -> None:
        self.op = op  #: the change, e.g. ``"finalize(4096)"``
        self.phase = phase  #: ``"prepare"``, ``"agree"``, ``"map"`` or ``"confirm"``
        self.reason = reason
        self.failed_ranks = tuple(failed_ranks)  #: ranks that failed; () when unknown
        self.rolled_back = rolled_back  #: this rank is as it was before the call
        state = "rolled back" if rolled_back else "NOT fully rolled back (see notes)"
        super().__init__(f"{op} aborted on every rank in {phase}: {reason}; this rank {state}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_collective, (self.op, self.phase, self.reason, self.failed_ranks,
                                      self.rolled_back), self.__dict__)


def _rebuild_collective(op: str, phase: str, reason: str, failed_ranks: tuple[int, ...],
                        rolled_back: bool) -> CollectiveError:
    return CollectiveError(op, phase, reason, failed_ranks=failed_ranks,
                           rolled_back=rolled_back)


class AsleepError(KvvmmError):
    """An arena or owner was asked to back or give back memory while asleep (``sleep()``).

    Nothing changed: its memory (and backup, if any) waits for ``wake()``. Call ``wake()``
    first, then retry; ``close()`` works asleep too (it drops the backup).
    """


class SleepRefusedError(KvvmmError):
    """``sleep()`` or ``wake()`` cannot run now; nothing changed.

    A CUDA graph capture is underway (sleep after it ends), the arena is already asleep (or
    awake, for ``wake()``), or it holds adopted handles (memory another process shares: give
    them back first). The message names which.
    """


class CaptureConflictError(KvvmmError):
    """An operation would unmap, move or grow memory a live capture baked in; nothing changed.

    A CUDA graph, an NCCL or RDMA registration or a kernel's bounds recorded the range (or
    the capacity) with :meth:`~kvvmm.arena.Arena.record_capture`. Release the capture (or
    recapture after the change) first. ``capture`` is its name, ``op`` the refused operation,
    ``start`` and ``end`` the VA ``[start, end)`` it would have touched.
    """

    def __init__(self, capture: str, op: str, start: int, end: int, detail: str) -> None:
        self.capture = capture
        self.op = op
        self.start = start
        self.end = end
        self.detail = detail
        super().__init__(f"{op} refused: it would touch [{start:#x}, {end:#x}), which the live "
                         f"capture {capture!r} baked in ({detail}); release that capture "
                         f"first, or recapture after the {op}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.capture, self.op, self.start, self.end, self.detail),
                self.__dict__)


class BackupError(KvvmmError):
    """A sleep's backup could not be made or read back (out of host memory, a full disk).

    The arena is as it was before the call: awake with its contents when ``sleep()`` failed,
    asleep with its backup intact when ``wake()`` failed. ``__cause__`` is the underlying
    error; free host memory or disk (or pick the other ``backup``) and retry.
    """


class StateError(KvvmmError, RuntimeError):
    """An action was asked of an object in a state that cannot take it; nothing changed.

    A lab panel's button before the step it needs (no arena open: Reserve first) or while
    another reservation is open (Close first). The message names the missing step: do it,
    then retry. A ``RuntimeError`` too, so code that caught those keeps working.
    """


class BusyError(KvvmmError):
    """A driver (or other owner of memory) was asked to close while what it gave out is in use.

    Nothing was given back. Drop the tensors over its memory and close their arenas first,
    then close again.
    """


class DriverUnavailableError(KvvmmError):
    """The requested driver cannot run here (no GPU, no CUDA driver library, not Linux).

    Pick another driver (``open_driver("sim")`` works everywhere) or run on a machine that
    has what the message names.
    """


class DriverError(KvvmmError):
    """A driver call failed; carries the call, its arguments and the CUDA error name.

    ``call`` is the protocol method (``"map"``), ``call_args`` its arguments (ints),
    ``cuda_error`` the name CUDA uses for the failure (``"CUDA_ERROR_INVALID_VALUE"``). The
    kvvmm operation that made the call has already undone its earlier steps when this
    reaches the caller; failures of that undo are attached as notes.
    """

    def __init__(
        self, call: str, args: Mapping[str, int], cuda_error: str, reason: str = ""
    ) -> None:
        self.call = call
        self.call_args = dict(args)
        self.cuda_error = cuda_error
        self.reason = reason
        shown = ", ".join(f"{k}={_show_int(k, v)}" for k, v in self.call_args.items())
        msg = f"{call}({shown}) failed: {cuda_error}"
        if reason:
            msg += f": {reason}"
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.call_args, self.cuda_error, self.reason),
                self.__dict__)


class DriverOutOfMemoryError(DriverError):
    """The device has no physical memory left for a create (CUDA_ERROR_OUT_OF_MEMORY).

    Back fewer bytes, shrink other owners, or free memory held elsewhere in the process.
    """


class DriverArgumentError(ArgumentError, DriverError):
    """A driver call got an argument that is not an int (a bool, float, str, None, ...).

    Both an :class:`ArgumentError` (it names the value and what it must be) and a
    :class:`DriverError` with ``CUDA_ERROR_INVALID_VALUE`` (code that catches driver failures
    keeps catching it). Nothing was called: pass an int.
    """

    def __init__(self, call: str, name: str, value: object, limit: str,
                 detail: str = "") -> None:
        self.call = call
        self.call_args: dict[str, int] = {}  # the arguments were not all ints
        self.cuda_error = "CUDA_ERROR_INVALID_VALUE"
        self.reason = detail
        self.name = name
        self.value = value
        self.limit = limit
        self.detail = f"{call}() refused it: {detail or 'CUDA_ERROR_INVALID_VALUE'}"
        # Not super().__init__: ArgumentError's would hand the message to DriverError's.
        Exception.__init__(
            self, f"{name}={_show_value(value)} is invalid: must be {limit} ({self.detail})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.name, self.value, self.limit, self.reason),
                self.__dict__)


class _Missing:
    """The value of a field a profile lacks (not null: null is a value a file can hold)."""

    def __repr__(self) -> str:
        return "<missing>"

    def __reduce__(self) -> str:
        return "_MISSING"  # one object, across pickling too


_MISSING = _Missing()


class ProfileError(ArgumentError):
    """A GPU profile (a ``kvvmm-hardware-profile`` JSON file, or its data) cannot be used.

    Not a regular file, too large, not UTF-8 JSON, or a field of the wrong type or out of its
    bounds. Fix the field the message names in that file, or pass a shipped key (``"h200"``);
    nothing was loaded. ``where`` is the file, ``field`` the field's path in it (``""`` for the
    file as a whole), ``value`` what it holds and ``limit`` what it must be. An
    :class:`ArgumentError` (and a ``ValueError``), so code that caught those keeps working.
    A field the file lacks has ``value`` :attr:`MISSING`.
    """

    MISSING: object = _MISSING  #: the ``value`` of a required field that is absent

    def __init__(self, where: str, field: str, value: object, limit: str,
                 detail: str = "") -> None:
        self.where = where
        self.field = field
        self.name = field or "profile"
        self.value = value
        self.limit = limit
        self.detail = detail
        # Every part is bounded (a path, a key or a value may be megabytes of a hostile file).
        shown = f"profile {_show_path(where)}"
        if field and value is _MISSING:
            msg = f"{shown}: {_clip(field)} is missing: it must be {_clip(limit, 300)}"
        else:
            if field:
                shown += f": {_clip(field)}={_show_json(value)}"
            msg = f"{shown} is invalid: must be {_clip(limit, 300)}"
        if detail:
            msg += f" ({_clip(detail, 300)})"
        Exception.__init__(self, msg)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.where, self.field, self.value, self.limit, self.detail),
                self.__dict__)


class TraceFormatError(KvvmmError, ValueError):
    """A saved trace cannot be read: wrong format, unknown version or a malformed event."""


class WorkloadFormatError(KvvmmError, ValueError):
    """A request trace (Azure CSV, JSONL) has a bad row; the message names its row and field.

    Fix or drop that row of the file; nothing was loaded.
    """


def _show_value(value: object) -> str:
    """``repr(value)`` for a message, safe and short for any value (a huge int, a hostile
    ``__repr__``)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ is the caller's; the refusal still says what it was
        return f"<a {type(value).__name__}>"
    return text if len(text) <= 200 else text[:197] + "..."


def _show_json(value: object) -> str:
    """A value as JSON spells it where Python's repr differs (null, true, false)."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return _show_value(value)


def _show_path(path: str) -> str:
    """A file's path for a message: its end (the file's name) kept when it is long."""
    return _show_value(path) if len(path) <= 200 else repr("..." + path[-197:])


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _show_int(key: str, value: int) -> str:
    # Addresses read best in hex, sizes in decimal bytes.
    if key in ("va", "address", "base"):
        return hex(value)
    return str(value)


class WrongTypeError(ArgumentError, TypeError):
    """An argument of the wrong type (a str where an object kvvmm made is expected, ...);
    nothing was changed: pass the right object."""

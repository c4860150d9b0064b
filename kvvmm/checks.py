"""The one argument checker: every public entry point checks its ints, numbers and flags here.

No kvvmm size, offset, count, fraction or duration is ever a bool, so the int and number
checkers refuse one; a flag (``bool_arg``) takes ``True`` or ``False`` only. Messages come
from :class:`~kvvmm.errors.ArgumentError`, naming the argument, the value and the limit.
"""

from __future__ import annotations

import math
from typing import TypeGuard

from kvvmm.errors import ArgumentError, OutOfRangeError

__all__ = ["bool_arg", "int_arg", "is_int", "is_number", "number_arg", "seconds_arg"]


def is_int(value: object) -> TypeGuard[int]:
    """True for a plain int (``bool`` is not one here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object, *, finite: bool = True) -> bool:
    """True for an int or a float that is not a bool, NaN, or (with ``finite``) infinite.

    An int past float's range counts as infinite; NaN is never a number here (it compares
    false with every bound).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        if finite:
            try:
                float(value)
            except OverflowError:
                return False
        return True
    return not math.isnan(value) and (not finite or not math.isinf(value))


def bool_arg(name: str, value: object, *, limit: str = "True or False") -> bool:
    """Return ``value`` if it is ``True`` or ``False``; raise naming the value otherwise.

    Raises:
        ArgumentError: anything but ``True`` or ``False`` (``0``, ``1``, ``None``, ...).
    """
    if not isinstance(value, bool):
        raise ArgumentError(name, value, limit)
    return value


def int_arg(name: str, value: object, *, lo: int | None = None, hi: int | None = None,
            limit: str = "", unit: str = "") -> int:
    """Return ``value`` if it is an int in ``[lo, hi]``; raise naming the limit otherwise.

    Args:
        name: the argument's name as the caller wrote it (``"nbytes"``, ``"shape[1]"``).
        lo, hi: the bounds, inclusive (None: no bound).
        limit: the limit as the message should state it; default from ``lo``/``hi``/``unit``.
        unit: shown after the default limit (``"bytes"``, ``"tokens"``).
    Raises:
        ArgumentError: not an int (or a bool), or below ``lo``.
        OutOfRangeError: above ``hi``.
    """
    if not is_int(value):
        raise ArgumentError(name, value, limit or _default(lo, hi, unit))
    if lo is not None and value < lo:
        raise ArgumentError(name, value, limit or _default(lo, hi, unit))
    if hi is not None and value > hi:
        raise OutOfRangeError(name, value, limit or _default(lo, hi, unit))
    return value


def _default(lo: int | None, hi: int | None, unit: str) -> str:
    if lo is None and hi is None:
        text = "an int"
    elif hi is None:
        text = "an int > 0" if lo == 1 else f"an int >= {lo}"
    elif lo is None:
        text = f"an int <= {hi}"
    else:
        text = f"an int in [{lo}, {hi}]"
    return f"{text} ({unit})" if unit else text


def number_arg(name: str, value: object, *, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False, hi_open: bool = False, finite: bool = True,
               limit: str = "", unit: str = "") -> float:
    """Return ``value`` as a float if it is a number in the bounds; raise naming the limit.

    Args:
        lo, hi: the bounds (None: no bound), excluded themselves with ``lo_open``/``hi_open``.
        finite: refuse +-inf (and ints past float's range).
        limit, unit: as :func:`int_arg`'s.
    Raises:
        ArgumentError: a bool, not a number, NaN, infinite (with ``finite``) or outside the
            bounds. Always this class (not :class:`~kvvmm.errors.OutOfRangeError` above
            ``hi``): a number's bounds are a setting's range, not a reservation's.
    """
    if not is_number(value, finite=finite):
        raise ArgumentError(name, value, limit or _default_number(lo, hi, lo_open, hi_open,
                                                                  finite, unit))
    assert isinstance(value, (int, float))
    below = lo is not None and (value <= lo if lo_open else value < lo)
    above = hi is not None and (value >= hi if hi_open else value > hi)
    if below or above:
        raise ArgumentError(name, value, limit or _default_number(lo, hi, lo_open, hi_open,
                                                                  finite, unit))
    try:
        return float(value)
    except OverflowError:  # only with finite=False: an int past float's range is infinite
        return math.inf if value > 0 else -math.inf


def _default_number(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool,
                    finite: bool, unit: str) -> str:
    kind = "a finite number" if finite else "a number"
    if lo is None and hi is None:
        text = kind
    elif hi is None:
        text = f"{kind} {'>' if lo_open else '>='} {lo}"
    elif lo is None:
        text = f"{kind} {'<' if hi_open else '<='} {hi}"
    else:
        text = f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    return f"{text} ({unit})" if unit else text


def seconds_arg(name: str, value: object, *, none: bool = False, zero: bool = True) -> float:
    """Return ``value`` as float seconds if it is a finite number >= 0 (> 0 with
    ``zero=False``); ``None`` passes through as ``inf`` when ``none`` (no limit).

    Raises:
        ArgumentError: a bool, not a number, NaN, infinite, or below the bound.
    """
    if value is None and none:
        return math.inf
    want = (f"a finite number of seconds {'>=' if zero else '>'} 0"
            + (", or None (no limit)" if none else ""))
    return number_arg(name, value, lo=0, lo_open=not zero, limit=want)

"""The one argument checker: every public entry point checks its ints, numbers and flags here.

A Python ``bool`` is an ``int``; no kvvmm size, offset, count, id, fraction or duration is
ever a bool, so every int and number checker here refuses it. A flag is the other way round:
``bool_arg`` takes ``True`` or ``False`` only, never ``0``, ``1`` or another truthy object.
Messages come from :class:`~kvvmm.errors.ArgumentError`: they name the argument, the value
and the limit it broke. The predicates (``is_int``, ``is_number``) serve the sites that raise
another kvvmm error (a driver's, a trace file's) and only need the test.
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

    An int past float's range counts as infinite: kvvmm computes with these numbers as floats.
    NaN is never a number here: it compares false with every bound, so a check written as
    ``x < lo`` lets it through and whatever uses it next misbehaves.
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

    A flag takes a bool only: ``0``, ``1``, ``None`` or a string would be read by its
    truthiness, which is never what a caller who passed one meant.

    Args:
        name: the argument's name as the caller wrote it (``"keep_pool"``).
        value: what was passed.
        limit: the limit as the message should state it (what the flag means, if useful).
    Returns:
        ``value``, typed as a bool.
    Raises:
        ArgumentError: anything but ``True`` or ``False``.
    """
    if not isinstance(value, bool):
        raise ArgumentError(name, value, limit)
    return value


def int_arg(name: str, value: object, *, lo: int | None = None, hi: int | None = None,
            limit: str = "", unit: str = "") -> int:
    """Return ``value`` if it is an int in ``[lo, hi]``; raise naming the limit otherwise.

    Args:
        name: the argument's name as the caller wrote it (``"nbytes"``, ``"shape[1]"``).
        value: what was passed.
        lo: smallest allowed value (None: no lower bound).
        hi: largest allowed value (None: no upper bound).
        limit: the limit as the message should state it; default from ``lo``/``hi``/``unit``.
        unit: shown after the default limit (``"bytes"``, ``"tokens"``).
    Returns:
        ``value``, typed as an int.
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
        name: the argument's name as the caller wrote it (``"factor"``, ``"q"``).
        value: what was passed; an int or a float, never a bool or NaN.
        lo: smallest allowed value (None: no lower bound); excluded itself with ``lo_open``.
        hi: largest allowed value (None: no upper bound); excluded itself with ``hi_open``.
        finite: refuse +-inf (and ints past float's range); with False, infinity passes
            whatever bound it does not break.
        limit: the limit as the message should state it; default from the bounds and ``unit``.
        unit: shown after the default limit (``"seconds"``).
    Returns:
        ``value`` as a float.
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

    NaN never compares, so a wait on it never ends; infinity is what ``None`` says, and a
    collective given it reports the group broken: both are refused as numbers.

    Raises:
        ArgumentError: a bool, not a number, NaN, infinite, or below the bound.
    """
    if value is None and none:
        return math.inf
    want = (f"a finite number of seconds {'>=' if zero else '>'} 0"
            + (", or None (no limit)" if none else ""))
    return number_arg(name, value, lo=0, lo_open=not zero, limit=want)

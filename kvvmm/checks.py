"""The one argument checker: every public entry point checks its ints through here.

A Python ``bool`` is an ``int``; no kvvmm size, offset, count or id is ever a bool, so both
functions refuse it. Messages come from :class:`~kvvmm.errors.ArgumentError`: they name the
argument, the value and the limit it broke.
"""

from __future__ import annotations

import math

from kvvmm.errors import ArgumentError, OutOfRangeError

__all__ = ["int_arg", "is_int", "seconds_arg"]


def is_int(value: object) -> bool:
    """True for a plain int (``bool`` is not one here)."""
    return isinstance(value, int) and not isinstance(value, bool)


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
    assert isinstance(value, int)
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
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(name, value, want)
    try:
        v = float(value)
    except OverflowError:  # an int past float's range: not a finite number of seconds
        raise ArgumentError(name, value, want) from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise ArgumentError(name, value, want)
    return v

"""Byte units, alignment, the only parsing of sizes written as text, and the only formatting
of sizes and ranges in the library."""

from __future__ import annotations

import re

from kvvmm.errors import ArgumentError, OutOfRangeError

__all__ = ["MAX_BYTES", "GiB", "KiB", "MiB", "PiB", "TiB", "align_down", "align_up",
           "fmt_bytes", "fmt_range", "parse_size"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
PiB = 1 << 50

#: The largest size a text size may name (64 PiB): far above any card or host, far below
#: where a byte count stops fitting the 64-bit fields that drivers and the ledger keep.
MAX_BYTES = 1 << 56

_SIZE_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB, "pib": PiB,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
#: Digits, an optional fraction, an optional unit; ASCII digits only (``int`` would take
#: other scripts' digits, which no one writes a size in).
_SIZE_RE = re.compile(r"\s*([0-9]+)(?:\.([0-9]+))?\s*([a-zA-Z]*)\s*", re.ASCII)
#: Longer text is refused before it is read as a number: bounded work for any input.
_SIZE_MAX_CHARS = 64
_SIZE_FORMS = "a whole number of bytes (85899345920) or a number with a unit (80GiB, 1.5GiB, " \
              "512MiB, 2GB)"


def parse_size(text: str, *, name: str = "size", lo: int = 0, hi: int = MAX_BYTES) -> int:
    """Read a size written as text: ``"80GiB"`` -> 85899345920, ``"4096"`` -> 4096.

    Plain digits are bytes; a unit may follow, binary (KiB, MiB, GiB, TiB, PiB) or decimal
    (KB, MB, GB, TB, PB), any case, spaces allowed around it. A fraction is read exactly (no
    float in between): ``"1.5GiB"`` is 1610612736 bytes, and ``"1.5B"`` is refused, since
    it is not a whole number of bytes. Signs, exponents, NaN and infinity are refused.

    Args:
        text: what was written (at most 64 characters).
        name: the argument's name, for the message (``"--budget-bytes"``).
        lo: the smallest size allowed, bytes.
        hi: the largest size allowed, bytes (at most :data:`MAX_BYTES`).
    Returns:
        The size in bytes.
    Raises:
        ArgumentError: not a string, too long, not a size in this form, not a whole number
            of bytes, or below ``lo``.
        OutOfRangeError: above ``hi`` (or :data:`MAX_BYTES`); the message names both.
    """
    hi = min(hi, MAX_BYTES)
    if not isinstance(text, str):
        raise ArgumentError(name, text, f"a size as text: {_SIZE_FORMS}")
    if len(text) > _SIZE_MAX_CHARS:
        raise ArgumentError(name, text, f"a size of at most {_SIZE_MAX_CHARS} characters: "
                            f"{_SIZE_FORMS}", f"it has {len(text)}")
    m = _SIZE_RE.fullmatch(text)
    if m is None or m.group(3).lower() not in _SIZE_UNITS:
        raise ArgumentError(name, text, _SIZE_FORMS, _why_not_a_size(text))
    whole, frac, unit = m.group(1), m.group(2) or "", m.group(3).lower()
    scaled = int(whole + frac) * _SIZE_UNITS[unit]  # the digits as an integer, times the unit
    den: int = 10 ** len(frac)
    nbytes, rest = divmod(scaled, den)
    if rest:
        raise ArgumentError(name, text, "a whole number of bytes",
                            f"it is {nbytes} and {rest}/{den} bytes")
    limit = f"a size in [{lo}, {hi}] bytes ({fmt_bytes(lo)} to {fmt_bytes(hi)})"
    if nbytes < lo:
        raise ArgumentError(name, text, limit, f"it is {nbytes} bytes")
    if nbytes > hi:
        raise OutOfRangeError(name, text, limit, f"it is {nbytes} bytes")
    return nbytes


def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment`` (bytes; value >= 0, alignment > 0).

    Raises:
        ArgumentError: if ``alignment`` <= 0 or ``value`` < 0 (a ``ValueError``).
    """
    _check_alignment(value, alignment)
    return -(-value // alignment) * alignment


def align_down(value: int, alignment: int) -> int:
    """Round ``value`` down to a multiple of ``alignment`` (bytes; value >= 0, alignment > 0).

    Raises:
        ArgumentError: as :func:`align_up` does.
    """
    _check_alignment(value, alignment)
    return value // alignment * alignment


def _check_alignment(value: int, alignment: int) -> None:
    if alignment <= 0:
        raise ArgumentError("alignment", alignment, "> 0")
    if value < 0:
        raise ArgumentError("value", value, ">= 0")


def _why_not_a_size(text: str) -> str:
    """What is wrong with a text that is not a size, where a reader might wonder."""
    t = text.strip().lower()
    if t.startswith("-"):
        return "a size is never negative"
    if t.lstrip("+") in ("nan", "inf", "infinity"):
        return "a size is a finite number"
    if re.fullmatch(r"\+?[0-9.]+e[+-]?[0-9]+[a-z]*", t, re.ASCII):
        return "write the digits out: no exponents"
    return ""


_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def fmt_bytes(nbytes: int) -> str:
    """Format a byte count for people: ``2097152 -> "2.0 MiB"``, ``512 -> "512 B"``."""
    sign = "-" if nbytes < 0 else ""
    n = abs(nbytes)
    for i, (name, size) in enumerate(_UNITS):
        if n >= size:
            if i and round(n / size, 1) >= 1024:  # 1048575 B is "1.0 MiB", not "1024.0 KiB"
                name, size = _UNITS[i - 1]
            return f"{sign}{n / size:.1f} {name}"
    return f"{sign}{n} B"


def fmt_range(start: int, end: int) -> str:
    """Format a half-open address range: ``"[0x7f0000200000, 0x7f0000400000)"``."""
    return f"[{start:#x}, {end:#x})"

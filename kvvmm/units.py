"""Byte units, alignment and the only formatting of sizes and ranges in the library."""

from __future__ import annotations

from kvvmm.errors import ArgumentError

__all__ = ["GiB", "KiB", "MiB", "TiB", "align_down", "align_up", "fmt_bytes", "fmt_range"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment``.

    Args:
        value: bytes, >= 0.
        alignment: bytes, > 0.
    Returns:
        The smallest multiple of ``alignment`` that is >= ``value``.
    Raises:
        ArgumentError: if ``alignment`` <= 0 or ``value`` < 0 (a ``ValueError``).
    """
    if alignment <= 0:
        raise ArgumentError("alignment", alignment, "> 0")
    if value < 0:
        raise ArgumentError("value", value, ">= 0")
    return -(-value // alignment) * alignment


def align_down(value: int, alignment: int) -> int:
    """Round ``value`` down to a multiple of ``alignment`` (bytes; value >= 0, alignment > 0).

    Raises:
        ArgumentError: as :func:`align_up` does.
    """
    if alignment <= 0:
        raise ArgumentError("alignment", alignment, "> 0")
    if value < 0:
        raise ArgumentError("value", value, ">= 0")
    return value // alignment * alignment


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

"""Growth policies: how big a handle to create when a buffer's backed prefix must grow.

Small handles cost copy bandwidth on a GPU (docs/MEASUREMENTS.md); a policy trades
over-commit (bytes backed before they are needed) for fewer, larger handles. Policies are
pure: they map (backed, needed, limit) to a new backed size. The owner applies them; the
planner and the lab simulate them without a driver.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvvmm.checks import int_arg, is_int, number_arg
from kvvmm.errors import ArgumentError
from kvvmm.units import MiB, align_up, fmt_bytes

__all__ = ["Chunked", "Exact", "Geometric", "GrowthPolicy", "default_policy", "parse_policy",
           "simulate_growth"]


@runtime_checkable
class GrowthPolicy(Protocol):
    """Decides the backed size of a buffer that must reach ``need_bytes``."""

    def target_bytes(self, backed_bytes: int, need_bytes: int, limit_bytes: int, gran: int) -> int:
        """New backed size: >= need, <= limit, a multiple of ``gran`` (or == limit).

        Args:
            backed_bytes: bytes backed now (a multiple of ``gran``).
            need_bytes: bytes that must be backed; > ``backed_bytes``.
            limit_bytes: the buffer's granularity-aligned reserved size.
            gran: the driver's granularity in bytes.
        """
        ...


def _check_positive_int(name: str, value: object) -> int:
    return int_arg(name, value, lo=1, unit="bytes")


@dataclass(frozen=True, slots=True)
class Exact:
    """One handle per extension, exactly as large as needed."""

    def target_bytes(self, backed_bytes: int, need_bytes: int, limit_bytes: int, gran: int) -> int:
        return min(align_up(need_bytes, gran), limit_bytes)

    def __str__(self) -> str:
        return "Exact()"


@dataclass(frozen=True, slots=True)
class Chunked:
    """Every extension is at least ``min_bytes``: over-commit stays under one chunk."""

    min_bytes: int = 64 * MiB

    def __post_init__(self) -> None:
        _check_positive_int("min_bytes", self.min_bytes)

    def target_bytes(self, backed_bytes: int, need_bytes: int, limit_bytes: int, gran: int) -> int:
        ext = max(need_bytes - backed_bytes, self.min_bytes)
        return min(align_up(backed_bytes + ext, gran), limit_bytes)

    def __str__(self) -> str:
        return f"Chunked({fmt_bytes(self.min_bytes)})"


@dataclass(frozen=True, slots=True)
class Geometric:
    """Each extension is ``factor - 1`` times what is backed, in ``[min_bytes, max_bytes]``.

    Over-commit is bounded relative to what is backed: after any extension at most
    ``factor - 1`` times the bytes backed before it (or ``min_bytes``, or one request's own
    need) lie beyond the need. Handles double (factor 2) up to ``max_bytes``, so a large
    buffer is mostly large handles, and a small prefix stays small. An extension larger than
    ``max_bytes`` happens only when a single request needs more than that.

    Args:
        factor: growth factor, in ``(1, 1e6]``.
        max_bytes: the largest extension a policy step makes on its own, > 0.
        min_bytes: the smallest extension, >= 0 (0: just what is needed).
    """

    factor: float = 2.0
    max_bytes: int = 256 * MiB
    min_bytes: int = 0

    def __post_init__(self) -> None:
        f = self.factor
        number_arg("factor", f, lo=1.0, hi=1e6, lo_open=True, limit="a number in (1, 1e6]")
        _check_positive_int("max_bytes", self.max_bytes)
        m = self.min_bytes
        if not is_int(m) or not 0 <= m <= self.max_bytes:
            raise ArgumentError("min_bytes", m, f"an int in [0, max_bytes={self.max_bytes}] "
                                                f"(bytes)")

    def target_bytes(self, backed_bytes: int, need_bytes: int, limit_bytes: int, gran: int) -> int:
        grow = min(max(int(backed_bytes * (self.factor - 1.0)), self.min_bytes), self.max_bytes)
        ext = max(need_bytes - backed_bytes, grow)
        return min(align_up(backed_bytes + ext, gran), limit_bytes)

    def __str__(self) -> str:
        low = f", min {fmt_bytes(self.min_bytes)}" if self.min_bytes else ""
        return f"Geometric({self.factor:g}, {fmt_bytes(self.max_bytes)}{low})"


def default_policy() -> GrowthPolicy:
    """The owner's default: ``Geometric(2, 256 MiB, min 8 MiB)``.

    Over-commit bounded relative to what is backed (at most what was backed before the last
    extension, never more than 256 MiB per buffer), handles that double from 8 MiB, so a
    large buffer is mostly large handles and a small prefix stays small (docs/MEASUREMENTS.md
    compares the policies).
    """
    return Geometric(2.0, 256 * MiB, 8 * MiB)


def parse_policy(spec: str) -> GrowthPolicy:
    """A policy from its short spelling, as ``kvvmm calibrate``'s plans and the benchmarks name
    them: ``"default"``, ``"exact"``, ``"chunked:MiB"``, ``"geometric:factor:max MiB"``.

    Raises:
        ArgumentError: not one of those spellings, a number that does not parse, or a policy
            argument out of its bounds (a ``ValueError``).
    """
    if not isinstance(spec, str):
        raise ArgumentError("spec", spec, f"a policy spec string: {_SPELLINGS}")
    parts = spec.split(":")
    try:
        if parts[0] == "default":
            return default_policy()
        if parts[0] == "exact":
            return Exact()
        if parts[0] == "chunked" and len(parts) == 2:
            return Chunked(int(parts[1]) * MiB)
        if parts[0] == "geometric" and len(parts) == 3:
            return Geometric(float(parts[1]), int(parts[2]) * MiB)
    except ArgumentError as e:  # Chunked's / Geometric's own bound: say which spec gave it
        e.add_note(f"from the policy spec {spec!r}")
        raise
    except ValueError:  # int() or float() of a part that is not a number
        raise ArgumentError("spec", spec, _SPELLINGS, "a number does not parse") from None
    raise ArgumentError("spec", spec, _SPELLINGS)


_SPELLINGS = "'default', 'exact', 'chunked:MiB' or 'geometric:factor:max MiB'"


def simulate_growth(
    policy: GrowthPolicy, needs: Iterable[int], limit_bytes: int, gran: int, backed_bytes: int = 0
) -> list[int]:
    """Sizes of the handles a buffer gets when it must reach each of ``needs`` in turn.

    Args:
        policy: the growth policy.
        needs: byte counts the buffer must have backed, in order (need not be monotonic).
        limit_bytes: the buffer's aligned reserved size.
        gran: granularity in bytes.
        backed_bytes: bytes backed before the first need.
    Returns:
        One entry per handle created, in bytes.
    """
    out: list[int] = []
    backed = backed_bytes
    for need in needs:
        if need > backed:
            new = policy.target_bytes(backed, need, limit_bytes, gran)
            out.append(new - backed)
            backed = new
    return out

"""The arena's records: the frozen reports of a decommit (:class:`DecommitResult`,
:class:`RangeResult`), its live mappings and allocations (``_Map``, ``_Alloc``), and small
pure helpers over them."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvvmm.driver.base import check_driver
from kvvmm.units import fmt_bytes, fmt_range

if TYPE_CHECKING:
    from kvvmm.arena.backup import Backup

__all__ = ["DecommitResult", "RangeResult", "check_driver"]


# -- live state --------------------------------------------------------------------------


@dataclass(slots=True)
class _Map:
    offset: int
    size: int
    handle: int  # the driver's handle
    hid: int  # the arena's id for it


@dataclass(slots=True)
class _Alloc:
    name: str
    offset: int
    size: int
    requested: int
    backed: int = 0  # bytes backed in the allocation (holes not counted)
    maps: list[_Map] = field(default_factory=list)


@dataclass(slots=True)
class _Sleep:
    """What a sleeping arena remembers: each allocation's mappings as ``(offset, size,
    hid)`` (arena offsets, the arena's ids), the backup (None: bytes dropped) and the bytes."""

    maps: list[tuple[_Alloc, list[tuple[int, int, int]]]]
    backup: Backup | None
    nbytes: int


@dataclass(frozen=True, slots=True)
class DecommitResult:
    """What one decommit did to one allocation; ``kept_mapping`` is the mapping that
    straddles ``keep_bytes`` and so stayed (maps are whole handles)."""

    name: str  #: the allocation's name
    offset: int  #: the allocation's offset from the arena base
    keep_bytes: int  #: bytes asked to stay backed from the allocation's start
    given_bytes: int  #: bytes given back (unmapped and released)
    backed_bytes: int  #: bytes backed from the allocation's start afterwards
    #: ``[start, end)`` from the arena base of the straddling mapping; None if there is none
    kept_mapping: tuple[int, int] | None

    @property
    def held_bytes(self) -> int:
        """Bytes that stayed backed beyond ``keep_bytes`` because a mapping straddles it."""
        return max(self.backed_bytes - self.keep_bytes, 0)

    def __str__(self) -> str:
        text = f"{self.name}: gave back {fmt_bytes(self.given_bytes)}"
        if self.kept_mapping is not None:
            start, end = self.kept_mapping
            text += (f"; the mapping {fmt_range(start, end)} straddles keep "
                     f"{fmt_bytes(self.keep_bytes)}, so {fmt_bytes(self.held_bytes)} beyond it "
                     f"stays backed (maps are whole handles)")
        return text


@dataclass(frozen=True, slots=True)
class RangeResult:
    """What one range decommit did to one allocation; ``kept_mappings`` are those the range
    cuts, which stayed (``[start, end)`` from the arena base)."""

    name: str  #: the allocation's name
    offset: int  #: the allocation's offset from the arena base
    start: int  #: the range's start, from the allocation's start
    nbytes: int  #: the range's length
    given_bytes: int  #: bytes given back (unmapped and released)
    backed_bytes: int  #: bytes backed in the allocation afterwards (holes not counted)
    kept_mappings: tuple[tuple[int, int], ...]  #: mappings the range cuts, which stayed

    @property
    def held_bytes(self) -> int:
        """Bytes of the range that stayed backed because a mapping it cuts stays."""
        lo, hi = self.offset + self.start, self.offset + self.start + self.nbytes
        return sum(min(e, hi) - max(s, lo) for s, e in self.kept_mappings)

    def __str__(self) -> str:
        text = (f"{self.name}: gave back {fmt_bytes(self.given_bytes)} of "
                f"{fmt_range(self.offset + self.start, self.offset + self.start + self.nbytes)}")
        if self.kept_mappings:
            s, e = self.kept_mappings[0]
            text += (f"; {len(self.kept_mappings)} mapping(s) the range cuts stay (first "
                     f"{fmt_range(s, e)}), {fmt_bytes(self.held_bytes)} of the range with them "
                     f"(maps are whole handles)")
        return text


def _map_offset(m: _Map) -> int:
    return m.offset


def _insert(a: _Alloc, m: _Map) -> None:
    """Put ``m`` among ``a``'s mappings, kept sorted by offset (a bisect: no list built)."""
    i = bisect.bisect_left(a.maps, m.offset, key=_map_offset)
    a.maps.insert(i, m)
    a.backed += m.size


def _touching(maps: Sequence[_Map], lo: int, hi: int) -> Sequence[_Map]:
    """The mappings of sorted, disjoint ``maps`` that overlap ``[lo, hi)`` (a bisect)."""
    i = bisect.bisect_right(maps, lo, key=_map_offset)
    if i and maps[i - 1].offset + maps[i - 1].size > lo:
        i -= 1
    j = bisect.bisect_left(maps, hi, lo=i, key=_map_offset)
    return maps[i:j]


def _discard(a: _Alloc, ms: Iterable[_Map]) -> None:
    """Take ``ms`` (each one of ``a``'s mappings) out of ``a.maps`` by bisect."""
    maps = a.maps
    for m in ms:
        i = bisect.bisect_left(maps, m.offset, key=_map_offset)
        if i < len(maps) and maps[i] is m:
            del maps[i]
        else:  # not where the order says (cannot happen): find it by identity
            maps[:] = [x for x in maps if x is not m]


def _overlaps(ranges: Iterable[tuple[int, int]], lo: int, hi: int) -> bool:
    return any(s < hi and lo < e for s, e in ranges)


def _runs(ms: Sequence[_Map]) -> list[list[_Map]]:
    """``ms`` (sorted) split into runs of adjacent mappings."""
    out: list[list[_Map]] = []
    for m in ms:
        if out and out[-1][-1].offset + out[-1][-1].size == m.offset:
            out[-1].append(m)
        else:
            out.append([m])
    return out


def _prefix(a: _Alloc) -> int:
    """Bytes backed contiguously from ``a``'s start (O(1) when there is no hole)."""
    maps = a.maps
    if not maps:
        return 0
    last = maps[-1]
    if last.offset + last.size - a.offset == a.backed and maps[0].offset == a.offset:
        return a.backed
    end = a.offset
    for m in a.maps:
        if m.offset != end:
            break
        end += m.size
    return end - a.offset

"""The frozen records every layer above the arena reads: snapshots of arenas, owners, TP ranks.

Plain ints (bytes, offsets from the arena base), names and tuples, nothing live.
Conservation holds in every arena snapshot (:meth:`ArenaSnapshot.check`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvvmm.errors import ArgumentError

__all__ = [
    "AllocationInfo",
    "ArenaSnapshot",
    "BufferInfo",
    "MappingInfo",
    "OwnerSnapshot",
    "TpSnapshot",
]


@dataclass(frozen=True, slots=True)
class MappingInfo:
    """One mapping: a whole handle attached to VA."""

    offset: int  #: start, from the arena base
    size_bytes: int  #: the handle's size
    handle_id: int  #: the arena's own id for the handle (1, 2, ...), the same on any driver
    allocation: str  #: name of the allocation it backs

    @property
    def end(self) -> int:
        return self.offset + self.size_bytes


@dataclass(frozen=True, slots=True)
class AllocationInfo:
    """One allocation: a granularity-aligned piece of the reservation, backed anywhere.

    Backing may have holes (``Arena.commit_range``/``decommit_range``): ``backed_bytes``
    counts every backed byte, ``prefix_bytes`` those backed contiguously from the start (what
    ``commit``/``ensure_prefix`` grow). Without holes the two are equal.
    """

    name: str
    offset: int  #: start, from the arena base (a multiple of the granularity)
    size_bytes: int  #: its span, rounded up to the granularity
    requested_bytes: int  #: what ``allocate`` was asked for
    backed_bytes: int  #: bytes backed in the allocation (holes not counted)
    #: bytes backed contiguously from ``offset``; -1 (a record built without it): taken as
    #: ``backed_bytes``, that is no holes
    prefix_bytes: int = -1

    def __post_init__(self) -> None:
        if self.prefix_bytes < 0:
            object.__setattr__(self, "prefix_bytes", self.backed_bytes)

    @property
    def hole_bytes(self) -> int:
        """Backed bytes beyond the prefix, past at least one hole."""
        return self.backed_bytes - self.prefix_bytes

    @property
    def end(self) -> int:
        return self.offset + self.size_bytes


@dataclass(frozen=True, slots=True)
class ArenaSnapshot:
    """Everything viz needs about an arena at one moment; nothing live."""

    name: str
    driver: str  #: driver kind, one of ``kvvmm.driver.DRIVER_KINDS``: "sim", "host", "cuda"
    device_name: str
    granularity: int
    base: int  #: address of the reservation
    reserved_bytes: int
    cursor_bytes: int  #: bump cursor: allocations lie in [0, cursor)
    allocations: tuple[AllocationInfo, ...]
    mappings: tuple[MappingInfo, ...]  #: sorted by offset
    backed_bytes: int
    closed: bool
    #: other devices given read/write access to everything backed (``grant_access``)
    peer_devices: tuple[int, ...] = ()
    #: memory held by the arena's handle pool: created, not mapped anywhere (not in
    #: ``backed_bytes``; the pool is shared by the arenas of its driver)
    pool_bytes: int = 0
    #: asleep (``Arena.sleep``): the bytes a wake backs again at the same VA (not in
    #: ``backed_bytes``: that memory was given back); 0 while awake
    asleep_bytes: int = 0
    #: asleep: the mappings a wake makes again (same offsets, sizes and ids), sorted by
    #: offset, for a lab to draw where the memory comes back; () while awake
    asleep_mappings: tuple[MappingInfo, ...] = ()
    #: the live captures' names (graphs, registrations: ``Arena.record_capture``), oldest
    #: first; a decommit, sleep or close under one of them is refused
    captures: tuple[str, ...] = ()
    #: creates tried once more after the cache releaser (torch's cache) handed memory back
    #: (``Arena.reclaim_stats`` has the rest)
    oom_retries: int = 0

    @property
    def unbacked_bytes(self) -> int:
        """Reserved VA with no memory behind it (inside allocations or beyond the cursor)."""
        return self.reserved_bytes - self.backed_bytes

    @property
    def slack_bytes(self) -> int:
        """Reserved VA no allocation has claimed yet."""
        return self.reserved_bytes - self.cursor_bytes

    def allocation(self, name: str) -> AllocationInfo:
        """The allocation called ``name``."""
        for a in self.allocations:
            if a.name == name:
                return a
        raise ArgumentError("name", name, f"one of {[a.name for a in self.allocations]}")

    def check(self) -> None:
        """Assert the conservation laws; raises AssertionError naming the broken one."""
        mapped = sum(m.size_bytes for m in self.mappings)
        per_alloc = sum(a.backed_bytes for a in self.allocations)
        assert mapped == per_alloc == self.backed_bytes, (mapped, per_alloc, self.backed_bytes)
        assert self.backed_bytes + self.unbacked_bytes == self.reserved_bytes
        assert 0 <= self.cursor_bytes <= self.reserved_bytes
        assert self.pool_bytes >= 0, self.pool_bytes
        pos = 0
        for a in self.allocations:
            assert a.offset >= pos and a.end <= self.cursor_bytes, a
            assert 0 <= a.prefix_bytes <= a.backed_bytes <= a.size_bytes, a
            pos = a.end
        by_alloc: dict[str, int] = {}
        prefix: dict[str, int] = {}
        end = -1
        for m in self.mappings:  # sorted, non-overlapping, each inside its allocation
            a = self.allocation(m.allocation)
            assert m.offset >= end, f"mapping {m} overlaps or is out of order (last end {end})"
            assert m.size_bytes > 0 and a.offset <= m.offset and m.end <= a.end, (
                f"mapping {m} is not inside {a.name} [{a.offset}, {a.end})")
            end = m.end
            by_alloc[a.name] = by_alloc.get(a.name, 0) + m.size_bytes
            if m.offset == a.offset + prefix.get(a.name, 0):
                prefix[a.name] = prefix.get(a.name, 0) + m.size_bytes
        for a in self.allocations:
            assert by_alloc.get(a.name, 0) == a.backed_bytes, (a, by_alloc.get(a.name, 0))
            assert prefix.get(a.name, 0) == a.prefix_bytes, (a, prefix.get(a.name, 0))


@dataclass(frozen=True, slots=True)
class BufferInfo:
    """One KV buffer's place and state in the owner's arena."""

    name: str
    offset: int  #: from the arena base
    shape: tuple[int, ...]
    reserved_span_bytes: int  #: the whole upper-bound tensor
    aligned_bytes: int  #: reserved span rounded up to the granularity (its allocation)
    backed_bytes: int
    page0_bytes: int  #: the slot-0 page's span (backed since construction)
    prefix_bytes: int  #: span of the ensured prefix
    final_bytes: int | None  #: final span after ``finalize``, else None


@dataclass(frozen=True, slots=True)
class OwnerSnapshot:
    """An owner at one moment: its arena's snapshot plus the token-level marks."""

    arena: ArenaSnapshot
    dtype: str
    page_size: int
    reserved_tokens: int
    prefix_tokens: int  #: largest n given to ensure_prefix (or the page at construction)
    final_tokens: int | None  #: serving capacity set by finalize (or lowered by shrink)
    policy: str
    buffers: tuple[BufferInfo, ...]

    @property
    def backed_bytes(self) -> int:
        return self.arena.backed_bytes

    @property
    def handles(self) -> int:
        return len(self.arena.mappings)


@dataclass(frozen=True, slots=True)
class TpSnapshot:
    """All ranks of a tensor-parallel KV cache at one moment: one owner snapshot per rank."""

    model: str
    tp: int
    devices: tuple[int, ...]  #: device of each rank, in rank order
    owners: tuple[OwnerSnapshot, ...]  #: in rank order

    @property
    def backed_bytes(self) -> int:
        """Bytes backed on all devices together."""
        return sum(o.backed_bytes for o in self.owners)

    @property
    def reserved_bytes(self) -> int:
        """VA reserved on all devices together."""
        return sum(o.arena.reserved_bytes for o in self.owners)

"""A change of an owner's backing taken in steps: prepare (create), map, then confirm or undo.

A caller that must decide between creating and mapping (the collective owner) asks the owner
for the change by parts: :meth:`~kvvmm.owner.KvBufferOwner.prepare_finalize`,
:meth:`~kvvmm.owner.KvBufferOwner.prepare_ensure_prefix` or
:meth:`~kvvmm.owner.KvBufferOwner.prepare_pages` check the arguments as the one-go call does
and create the handles (or take them from the pool), mapping nothing. Then
:meth:`PreparedBacking.map` maps them, and :meth:`PreparedBacking.confirm` makes the change
the owner's, or :meth:`PreparedBacking.undo` gives back exactly what it made. The owner
re-reads its backed prefixes after each step, under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvvmm.errors import ArgumentError

if TYPE_CHECKING:
    from kvvmm.owner.buffers import KvBufferOwner

__all__ = ["PreparedBacking", "PreparedHandle"]


@dataclass(frozen=True, slots=True)
class PreparedHandle:
    """One handle created for ``[start, start + size_bytes)`` of the buffer at ``offset``."""

    offset: int  #: the buffer's allocation offset in the arena
    start: int  #: from the allocation's start
    handle: int
    size_bytes: int


class PreparedBacking:
    """Handles made for one change of an owner's backing; ``state`` says how far it went:
    ``"prepared"`` (made, not mapped), ``"mapped"``, ``"confirmed"`` (the owner's) or
    ``"undone"``. Made by the owner's ``prepare_*`` calls, never directly."""

    __slots__ = ("_at_prefix", "_mapped", "_owner", "_record", "_unmapped", "handles",
                 "rolled_back", "state", "what")

    def __init__(self, owner: KvBufferOwner, what: str, handles: Sequence[PreparedHandle], *,
                 at_prefix: bool, record: Callable[[], None]) -> None:
        self._owner = owner
        self.what = what  #: the change, as the owner's call would be written
        self.handles: tuple[PreparedHandle, ...] = tuple(handles)
        self._unmapped = list(self.handles)  # made and not mapped: released by an undo
        self._mapped: list[PreparedHandle] = []  # mapped by map(), not yet the owner's
        self._at_prefix = at_prefix  # each maps right after its buffer's backed prefix
        self._record = record  # the owner's bookkeeping of the change, run by confirm()
        self.state = "prepared"
        #: False when a failed :meth:`map`'s own undo could not give everything back.
        self.rolled_back = True

    def __repr__(self) -> str:
        return (f"PreparedBacking({self.what}: {len(self.handles)} handles, "
                f"{self.size_bytes} bytes, {self.state})")

    @property
    def size_bytes(self) -> int:
        """Bytes of every handle made."""
        return sum(p.size_bytes for p in self.handles)

    def _check_state(self, want: str, call: str) -> None:
        if self.state != want:
            raise ArgumentError("prepared", self, f"a {want} backing ({call}() after "
                                                  f"{self.state})")

    def map(self) -> None:
        """Map every handle at its range, under the owner's lock.

        Raises:
            ArgumentError: not ``"prepared"``.
            Exception: a map failed: this change is undone (every handle it mapped unmapped,
                the others released; :attr:`rolled_back` says whether all of that went),
                the state ``"undone"``; the undo's own failures are notes on the error.
        """
        self._check_state("prepared", "map")
        owner = self._owner
        arena = owner.arena
        with owner._slots_lock:
            try:
                while self._unmapped:
                    p = self._unmapped[0]
                    if self._at_prefix:
                        arena.adopt(p.offset, p.handle, p.size_bytes, own=True)
                    else:
                        arena.adopt_range(p.offset, p.start, p.handle, p.size_bytes, own=True)
                    self._mapped.append(self._unmapped.pop(0))  # the arena's from now on
            except BaseException as e:  # a failed map leaves its handle ours: released
                self.rolled_back = self._undo_locked(e)
                raise
            finally:
                owner._resynced()
            self.state = "mapped"

    def confirm(self) -> None:
        """Make the mapped change the owner's: its token counts or committed pages.

        Raises:
            ArgumentError: not ``"mapped"``.
        """
        self._check_state("mapped", "confirm")
        owner = self._owner
        with owner._slots_lock:
            self._record()
            self._mapped.clear()
            self.state = "confirmed"
            owner._resynced()

    def undo(self, err: BaseException | None = None) -> bool:
        """Give back what this change made: release the handles not mapped, unmap (and
        release) those :meth:`map` mapped; the owner's other backing stays. A no-op once
        confirmed or undone (an unmap that failed before is tried again).

        Returns:
            True if everything went; False if a release or the unmap failed (a note on
            ``err`` says which; what the unmap kept stays mapped until close).
        """
        if self.state == "confirmed":
            return True
        owner = self._owner
        with owner._slots_lock:
            try:
                return self._undo_locked(err)
            finally:
                owner._resynced()

    def _undo_locked(self, err: BaseException | None) -> bool:
        owner = self._owner
        arena = owner.arena
        clean = True
        pool = arena.handle_pool
        for p in self._unmapped:
            try:
                if pool is None or not pool.give(p.handle, p.size_bytes, arena.pool_tag):
                    arena.driver.release(p.handle)
            except Exception as e:  # keep releasing the others; say which one stayed
                clean = False
                if err is not None:
                    err.add_note(f"release(handle={p.handle}) of a prepared handle also "
                                 f"failed: {e}")
        self._unmapped.clear()
        self.state = "undone"
        if not self._mapped:
            return clean
        try:
            arena.decommit_ranges([(p.offset, p.start, p.size_bytes) for p in self._mapped])
        except Exception as e:  # the arena attached its own undo notes to e
            if err is not None:
                err.add_note(f"rolling the maps back failed: {e}")
                for note in getattr(e, "__notes__", []):
                    err.add_note(note)
            return False
        self._mapped.clear()
        return clean


def prepare(owner: KvBufferOwner, what: str, plan: Sequence[tuple[int, int, int]], *,
            at_prefix: bool, record: Callable[[], None]) -> PreparedBacking:
    """Create a handle for each ``(offset, start, nbytes)`` of ``plan`` (the arena's pool
    first, then a create retried once after the pool or the cache releases memory); on a
    failure release those made and raise."""
    made: list[PreparedHandle] = []
    try:
        for off, start, size in plan:
            made.append(PreparedHandle(off, start, owner.arena.new_handle(size), size))
    except BaseException as e:
        PreparedBacking(owner, what, made, at_prefix=at_prefix, record=record).undo(e)
        raise
    return PreparedBacking(owner, what, made, at_prefix=at_prefix, record=record)

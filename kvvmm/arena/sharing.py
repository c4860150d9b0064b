"""Sharing: peers of the process (``grant_access``) and other processes (export, adopt).

A handle the caller hands to ``adopt`` must be nobody's yet: one an arena of the same
driver maps or is giving back, or a :class:`~kvvmm.arena.pool.HandlePool` holds idle, is
refused before anything changes, so no owner reaches memory another holds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from kvvmm.arena.pool import handle_holder
from kvvmm.arena.records import _Alloc, _insert, _Map, _prefix, _runs
from kvvmm.arena.state import _ArenaState, _locked
from kvvmm.arena.transaction import Transaction
from kvvmm.checks import bool_arg, int_arg, is_int
from kvvmm.errors import AlignmentError, ArgumentError, DriverError


class SharingMixin(_ArenaState):
    """Peer access and cross-process handles of an :class:`~kvvmm.arena.arena.Arena`."""

    @property
    def peer_devices(self) -> tuple[int, ...]:
        """Other devices given access by :meth:`grant_access` (empty: only the arena's)."""
        return () if self._access is None else self._access[1:]

    @_locked
    def grant_access(self, devices: Iterable[int]) -> None:
        """Let other devices (peers) read and write all the arena backs, now and later.

        Every backed range gets access for the arena's device and ``devices``, and every
        later commit maps with the same access. Access is only ever widened.

        Args:
            devices: device ordinals (the arena's own may be among them).
        Raises:
            ArgumentError: ``devices`` not ints.
            DriverError: the driver refused (not a device of the process, or no peer path).
                The arena's record is unchanged; ranges granted before the failing call stay
                accessible (access cannot be narrowed). With nothing backed yet, a bad
                device fails the next commit instead.
            ClosedError: after ``close()``.
        """
        self._check_open("grant_access")
        extra = list(devices)
        for i, dev in enumerate(extra):
            int_arg(f"devices[{i}]", dev, lo=0, limit="a device ordinal (an int >= 0)")
        new = tuple(dict.fromkeys((self.device, *self.peer_devices, *extra)))
        if len(new) == 1:
            return
        d = self.driver
        for a in self._allocs:  # one call per run of adjacent mappings (holes are not mapped)
            for run in _runs(a.maps):
                start, end = run[0].offset, run[-1].offset + run[-1].size
                d.set_access(self.base + start, end - start, new)
        self._access = new
        self._note("grant_access", devices=list(new))

    @_locked
    def export_handles(self, offset: int) -> list[tuple[int, int]]:
        """POSIX file descriptors for the handles backing the allocation at ``offset``.

        Another process backs an allocation of its own with them, in order:
        ``import_handle(fd, size)`` then :meth:`adopt` for each. The caller owns the
        descriptors. The driver's ``handle_type`` must be ``"posix_fd"``.

        Returns:
            ``[(fd, size_bytes), ...]`` in VA order, covering the backed prefix.
        Raises:
            DriverError: an export failed; descriptors already made are closed.
        """
        self._check_open("export_handles")
        a = self._alloc_at(offset)
        out: list[tuple[int, int]] = []
        try:
            for m in a.maps:
                out.append((self.driver.export_handle(m.handle), m.size))
        except DriverError:
            for fd, _ in out:
                os.close(fd)
            raise
        return out

    @_locked
    def adopt(self, offset: int, handle: int, nbytes: int, *, own: bool = False) -> int:
        """Back the next ``nbytes`` of the allocation at ``offset`` with ``handle``.

        Typically ``driver.import_handle(fd, size)`` of memory another process exported:
        mapped right after the backed prefix and made accessible; from then on the arena
        owns it and releases it on decommit or close.

        Args:
            offset: an allocation's offset.
            handle: a live handle of this arena's driver, of exactly ``nbytes``.
            nbytes: the handle's size, a multiple of the granularity that fits the
                allocation after its backed prefix.
            own: the handle is this process's own (made by this driver, not imported): the
                arena's like one it made. False (shared memory): released when given back,
                never pooled, and a sleep is refused while it is mapped.
        Returns:
            ``nbytes``.
        Raises:
            ArgumentError, OutOfRangeError, AlignmentError: bad arguments; nothing changed.
            DriverError: the map or the access failed; undone, and the handle is still the
                caller's.
        """
        self._check_open("adopt")
        a = self._alloc_at(offset)
        prefix = _prefix(a)
        nxt = [m.offset - a.offset for m in a.maps if m.offset - a.offset > prefix]
        room = (nxt[0] if nxt else a.size) - prefix
        int_arg("nbytes", nbytes, lo=1, hi=room,
             limit=f"in [1, {room}] (allocation {a.name!r} has {room} unbacked bytes after "
                   f"its {prefix}-byte backed prefix)")
        if nbytes % self.granularity:
            raise AlignmentError("nbytes", nbytes,
                                 f"a multiple of the granularity {self.granularity}")
        self._map_callers_handle(a, prefix, handle, nbytes, own)
        self._note("adopt", offset=a.offset, nbytes=nbytes)
        return nbytes

    def _map_callers_handle(self, a: _Alloc, start: int, handle: int, nbytes: int,
                            own: bool) -> None:
        """Map a caller-made ``handle`` at ``start`` of ``a`` and grant access; the handle
        stays the caller's until both succeeded."""
        bool_arg("own", own, limit="True or False (is the handle this process's own?)")
        if not is_int(handle):
            raise ArgumentError("handle", handle, "an int (a handle of this arena's driver)")
        who = handle_holder(self.driver, handle)
        if who is not None:
            raise ArgumentError("handle", handle, "a handle no arena or pool holds",
                                f"{who}: memory one owner holds is never mapped by another; "
                                f"nothing changed")
        d = self.driver
        va = self.base + a.offset + start
        d.map(va, nbytes, handle)
        try:
            self._set_access(va, nbytes)
        except BaseException as e:
            undo = Transaction()
            undo.push(f"unmap(va={va:#x}, size={nbytes})", lambda: d.unmap(va, nbytes))
            undo.unwind(e)
            raise
        _insert(a, _Map(a.offset + start, nbytes, handle, self._next_hid))
        self._next_hid += 1
        if not own:
            self._adopted.add(handle)  # released when given back, never pooled

    @_locked
    def adopt_range(self, offset: int, start: int, handle: int, nbytes: int, *,
                    own: bool = False) -> int:
        """Back ``[start, start + nbytes)`` of the allocation at ``offset`` with ``handle``.

        :meth:`adopt` at any granule-aligned range no mapping overlaps (a collective
        page commit's prepared handle). Recorded as a ``commit_range``.

        Args:
            offset: an allocation's offset.
            start: bytes from the allocation's start, a multiple of the granularity.
            handle: a live handle of this arena's driver, of exactly ``nbytes``.
            nbytes: the handle's size, > 0, a multiple of the granularity;
                ``start + nbytes <= size``.
            own: as for :meth:`adopt`.
        Returns:
            ``nbytes``.
        Raises:
            ArgumentError, OutOfRangeError, AlignmentError: bad arguments, or the range
                overlaps a mapping; nothing changed.
            DriverError: the map or the access failed; undone, and the handle is still the
                caller's.
        """
        self._check_open("adopt_range")
        a, lo, hi = self._check_range("adopt_range", offset, start, nbytes)
        if hi == lo:
            raise ArgumentError("nbytes", nbytes, "> 0 (the handle's size)")
        self._wait_inflight([(a, lo, hi)])  # the look-ahead may be mapping it right now
        self._check_open("adopt_range")
        hit = [(m.offset - a.offset, m.offset - a.offset + m.size) for m in a.maps
               if m.offset - a.offset < hi and lo < m.offset - a.offset + m.size]
        if hit:  # mapping over a mapping would fail in the driver, or worse, on the host
            raise ArgumentError("start", start,
                                f"a range that no mapping overlaps: [{lo}, {hi}) of allocation "
                                f"{a.name!r} overlaps its mapping(s) {hit[:4]}")
        self._map_callers_handle(a, lo, handle, nbytes, own)
        self._note("commit_range", offset=a.offset, start=lo, nbytes=nbytes)
        return nbytes

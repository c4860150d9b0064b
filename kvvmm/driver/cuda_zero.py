"""The zero cover's execution for :class:`~kvvmm.driver.cuda.CudaDriver` (``zero_page``).

:mod:`kvvmm.driver.zerocover` plans which VA is covered by which zero piece and keeps the
book; this module makes those plans into CUDA calls, each multi-step change undoing itself
when a call fails part way: the zero handles made and zeroed at construction, the cover of a
new reservation and its removal before a free, and ``map`` / ``unmap`` with the cover on
(the driver's hot calls when it is on, chosen at construction: a driver with ``zero_page``
off never passes here). The design is "Zero page" in docs/CUDA_DRIVER.md.

:class:`ZeroPageMixin` is one of ``CudaDriver``'s bases, not a driver of its own: it runs on
the driver's state (its book, its bound CUDA calls, its lock) and its checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvvmm.driver.base import check_call_ints, locked
from kvvmm.driver.cuda_capture import _cuda, _name
from kvvmm.driver.zerocover import Piece, ZeroCover, ZeroCoverStats, runs
from kvvmm.errors import ArgumentError, DriverError

__all__ = ["ZERO_PAGE_BLOCK", "ZeroPageMixin"]

#: ``zero_page=True``'s block: the largest granularity-times-a-power-of-two up to this. 64 MiB:
#: a 246 GiB reservation is ~3,936 zero mappings (~40 µs of cuMemSetAccess each, ~0.17 s),
#: for 2 x 64 MiB - 2 MiB = 126 MiB of zero memory (0.09% of an H200); 32 MiB would halve
#: the memory and double the cover's cost.
ZERO_PAGE_BLOCK = 64 << 20




class ZeroPageMixin:
    """``CudaDriver``'s calls with the zero cover on, and the cover's own steps.

    Attributes:
        zero_page: the block size in bytes, 0 when off.
    """

    # What this uses of CudaDriver (set by its constructor; declared for the type checker).
    zero_page: int
    device: int
    _zero: ZeroCover | None
    _zraw: dict[int, int]  # zero piece size -> its zero handle (raw)
    # mapping start -> the access list a set_access with devices= gave it (zero page on
    # only: an undo that maps a real handle back gives it the same access again)
    _peer_access: dict[int, list[Any]]
    _ro_access: list[Any]  # the zero cover's access: read-only, this device only
    _gran: int
    _ok: Any
    _ctx: Any
    _prop: Any
    _access: list[Any]
    _maps: dict[int, Any]
    _handles: dict[int, Any]
    _res: dict[int, int]
    _res_starts: list[int]
    _cuMemCreate: Any
    _cuMemMap: Any
    _cuMemUnmap: Any
    _cuMemRelease: Any
    _cuMemSetAccess: Any
    _cuMemRetainAllocationHandle: Any

    if TYPE_CHECKING:  # CudaDriver's own methods, which these steps call
        def close(self) -> None: ...
        def _cuda_error(self, call: str, args: dict[str, int], fn: str,
                        err: Any) -> DriverError: ...
        @staticmethod
        def _refuse(call: str, args: dict[str, int], reason: str) -> DriverError: ...
        def _map_slow(self, va: int, size: int, handle: int, h: Any) -> Any: ...
        def _tiling(self, call: str, va: int, size: int) -> list[int]: ...
        def _synchronize(self, call: str, va: int, size: int) -> None: ...
        def _unmapped(self, h: Any) -> None: ...

    def _start_zero_page(self, zero_page: bool | int) -> None:
        """Check the block size, create and zero the zero handles, route map/unmap here."""
        g = self._gran
        if zero_page is True:
            block = g
            while block * 2 <= ZERO_PAGE_BLOCK:
                block *= 2
        else:
            block = int(zero_page)
            ratio = block // g
            if block % g or ratio & (ratio - 1):
                self.close()
                raise ArgumentError(
                    "zero_page", zero_page,
                    f"True, False, or a block size in bytes: the granularity ({g}) times a "
                    "power of two",
                )
        drv = _cuda()._drv
        ro = drv.CUmemAccessDesc()
        ro.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        ro.location.id = self.device
        ro.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        self._ro_access = [ro]
        self._peer_access = {}
        cover = ZeroCover(g, block)
        raws: dict[int, int] = {}
        try:
            for n in cover.sizes:
                err, obj = self._cuMemCreate(n, self._prop, 0)
                if err != self._ok:
                    raise self._cuda_error("zero_page", {"size": n}, "cuMemCreate", err)
                raws[n] = int(obj)
            self._zero_fill(raws)
        except BaseException:
            for raw in raws.values():
                drv.cuMemRelease(raw)
            self.close()
            raise
        self._zero = cover
        self._zraw = raws
        self.zero_page = block  # CudaDriver._choose_hot_calls makes map and unmap ours

    def _zero_fill(self, raws: dict[int, int]) -> None:
        """Zero the zero handles once: cuMemCreate memory holds whatever it last held.

        Each is mapped read/write at a temporary reservation, one ``cuMemsetD8`` over all of
        them runs in this device's primary context, synchronized, then unmapped and freed.
        """
        drv = _cuda()._drv
        total = sum(raws)
        args = {"size": total}
        err, ptr = drv.cuMemAddressReserve(total, self._gran, 0, 0)
        if err != self._ok:
            raise self._cuda_error("zero_page", args, "cuMemAddressReserve", err)
        tmp = int(ptr)
        mapped: list[tuple[int, int]] = []
        try:
            pos = tmp
            for n, raw in raws.items():
                (err,) = self._cuMemMap(pos, n, 0, raw, 0)
                if err != self._ok:
                    raise self._cuda_error("zero_page", args, "cuMemMap", err)
                mapped.append((pos, n))
                pos += n
            (err,) = self._cuMemSetAccess(tmp, total, self._access, 1)
            if err != self._ok:
                raise self._cuda_error("zero_page", args, "cuMemSetAccess", err)
            drv.cuCtxPushCurrent(self._ctx)
            try:
                (err,) = drv.cuMemsetD8(tmp, 0, total)
                (err2,) = drv.cuCtxSynchronize()  # also after a failed memset: then unmap
            finally:
                drv.cuCtxPopCurrent()
            if err != self._ok or err2 != self._ok:
                bad = err if err != self._ok else err2
                fn = "cuMemsetD8" if err != self._ok else "cuCtxSynchronize"
                raise self._cuda_error("zero_page", args, fn, bad)
        finally:
            for pos, n in mapped:
                drv.cuMemUnmap(pos, n)
            drv.cuMemAddressFree(tmp, total)

    def _cover_reservation(self, va: int, size: int, args: dict[str, int]) -> None:
        """Cover a new reservation; undo it (free the VA) if the cover fails."""
        z = self._zero
        assert z is not None
        z.add_reservation(va, size)
        notes: list[str] = []
        fail = self._z_put(z.cover(va, va + size), notes)
        if fail is None:
            return
        e = self._z_error("reserve", args, fail, [])
        if z.overlapping(va, va + size):  # the undo left pieces: keep the VA in the book
            e.add_note(f"the reservation at {va:#x} ({size} bytes) stays in this driver's book "
                       "with what is still mapped in it: close() gives it back")
            self._note(e, notes, va, va + size)
            raise e
        z.drop_reservation(va)
        del self._res[va]
        self._res_starts.remove(va)
        (err,) = _cuda()._drv.cuMemAddressFree(va, size)
        if err != self._ok:
            e.add_note(f"undo: cuMemAddressFree({va:#x}) returned {_name(err)}: that VA leaks")
        raise e

    def _uncover_reservation(self, va: int, size: int, args: dict[str, int]) -> list[Piece]:
        """Before a free: unmap the cover of the reservation at ``va``; return its pieces
        (to put back if the free fails). If an unmap fails, what went is put back and the
        error raised."""
        z = self._zero
        assert z is not None
        end = va + size
        cover = z.overlapping(va, end)
        if cover:
            # A kernel may still read the cover (a tensor over it dropped before its kernel
            # ended): wait for the device first, as an unmap does.
            self._synchronize("free", va, size)
            notes: list[str] = []
            fail = self._z_take(cover)
            if fail is not None:
                self._z_reput([p for p in cover if p not in z], notes)
                e = self._z_error("free", args, fail, [])
                self._note(e, notes, va, end)
                raise e
        return cover

    def _recover_reservation(self, e: DriverError, cover: list[Piece], va: int,
                             end: int) -> None:
        """The free failed after its cover went: cover it again (what cannot be goes on
        ``e`` as notes)."""
        notes: list[str] = []
        self._z_reput(cover, notes)
        self._note(e, notes, va, end)

    def _release_zero_handles(self) -> None:
        """At close, after every free: release the zero handles (nothing maps them now)."""
        drv = _cuda()._drv
        for raw in self._zraw.values():
            drv.cuMemRelease(raw)
        self._zraw = {}

    def _z_put(self, pieces: list[Piece], notes: list[str]) -> tuple[str, Any] | None:
        """Map zero pieces, then read-only access per run; all or none. Returns the failed
        call (its name and CUDA's error) after undoing, or None. Records what is mapped."""
        if not pieces:
            return None
        z = self._zero
        assert z is not None
        raw = self._zraw
        done: list[Piece] = []
        fail: tuple[str, Any] | None = None
        for s, n in pieces:
            (err,) = self._cuMemMap(s, n, 0, raw[n], 0)
            if err:
                fail = ("cuMemMap", err)
                break
            done.append((s, n))
        z.add(done)
        if fail is None:
            for lo, hi in runs(done):
                (err,) = self._cuMemSetAccess(lo, hi - lo, self._ro_access, 1)
                if err:
                    fail = ("cuMemSetAccess", err)
                    break
        if fail is not None and done:
            undo = self._z_take(done)
            if undo is not None:
                left = [(s, s + n) for s, n in done if (s, n) in z]
                notes.append(
                    f"undo: {undo[0]} returned {_name(undo[1])}: {len(left)} zero mappings "
                    f"from {left[0][0]:#x} stay mapped, some perhaps without read access"
                )
        return fail

    def _z_reput(self, pieces: list[Piece], notes: list[str]) -> None:
        """``_z_put`` as an undo step: a failure becomes a note (the caller raises the
        original error)."""
        fail = self._z_put(pieces, notes)
        if fail is not None:
            notes.append(f"undo: {fail[0]} returned {_name(fail[1])} while covering "
                         f"{len(pieces)} zero pieces again")

    def _z_take(self, pieces: list[Piece]) -> tuple[str, Any] | None:
        """Unmap zero pieces, one call per run; stop at the first failure (returned, as
        ``_z_put``'s). Records each run that went."""
        z = self._zero
        assert z is not None
        for lo, hi in runs(pieces):
            (err,) = self._cuMemUnmap(lo, hi - lo)
            if err:
                return ("cuMemUnmap", err)
            z.remove([p for p in pieces if lo <= p[0] < hi])
        return None

    def _z_error(self, call: str, args: dict[str, int], fail: tuple[str, Any],
                 notes: list[str]) -> DriverError:
        e = self._cuda_error(call, args, fail[0], fail[1])
        for n in notes:
            e.add_note(n)
        return e

    def _note(self, e: DriverError, notes: list[str], lo: int, hi: int) -> None:
        """Add the undo's notes, and which VA of ``[lo, hi)`` is now left uncovered."""
        for n in notes:
            e.add_note(n)
        z = self._zero
        if z is None:
            return
        holes = [(a, b) for a, b in z.gaps(lo, hi)
                 if not any(s < b and a < s + m.size for s, m in self._maps.items())]
        if holes:
            e.add_note("left uncovered (reading it faults; a map over it works): "
                       + ", ".join(f"[{a:#x}, {b:#x})" for a, b in holes))

    @locked
    def _zp_map(self, va: int, size: int, handle: int) -> None:
        """map with the zero cover on: synchronize, unmap the zero pieces over
        ``[va, va+size)``, re-cover what they covered outside it, map the handle."""
        va, size, handle = check_call_ints("map", va=va, size=size, handle=handle).values()
        args = {"va": va, "size": size, "handle": handle}
        h = self._map_slow(va, size, handle, self._handles.get(handle))
        z = self._zero
        assert z is not None
        end = va + size
        for a, b in z.gaps(va, end):  # a real mapping there, or a hole an undo left
            for s, m in self._maps.items():
                if s < b and a < s + m.size:
                    raise self._refuse("map", args, f"{s:#x} is already mapped there")
        self._synchronize("map", va, size)
        if not h.live:  # released (on the C path, which takes no lock) while we waited
            raise self._refuse("map", args, f"handle {handle} is not live")
        old, new = z.uncover(va, end)
        notes: list[str] = []
        fail = self._z_take(old)
        if fail is None:
            fail = self._z_put(new, notes)
            if fail is None:
                self._maps[va] = h
                h.maps += 1
                (err,) = self._cuMemMap(va, size, 0, h.raw, 0)
                if not err:
                    return
                del self._maps[va]
                h.maps -= 1
                fail = ("cuMemMap", err)
        # Undo: the re-cover out, the old pieces back.
        e = self._z_error("map", args, fail, [])
        undo = self._z_take([p for p in new if p in z])
        if undo is not None:
            notes.append(f"undo: {undo[0]} returned {_name(undo[1])}")
            # The old pieces cannot all go back: cover what is not covered instead.
            lo = old[0][0] if old else va
            hi = old[-1][0] + old[-1][1] if old else end
            for a, b in z.gaps(lo, hi):
                self._z_reput(z.cover(a, b), notes)
        else:
            self._z_reput([p for p in old if p not in z], notes)
        if old:
            self._note(e, notes, old[0][0], old[-1][0] + old[-1][1])
        raise e

    @locked
    def _zp_unmap(self, va: int, size: int, recover: bool = True) -> None:
        """unmap with the zero cover on: unmap, then cover ``[va, va+size)`` read-only (if
        that fails, map the handles back with the access they had)."""
        va, size = check_call_ints("unmap", va=va, size=size).values()
        args = {"va": va, "size": size}
        maps = self._maps
        m = maps.get(va)
        starts = [va] if m is not None and m.size == size else self._tiling("unmap", va, size)
        self._synchronize("unmap", va, size)
        taken = [(s, maps.pop(s)) for s in starts]
        # A released handle's memory goes with its last mapping: hold a reference across
        # the unmap so that an undo can map it back.
        held: list[int] = []
        for s, h in taken:
            if not h.live:
                err, obj = self._cuMemRetainAllocationHandle(s)
                if err:
                    maps.update(taken)
                    self._drop_refs(held)
                    raise self._cuda_error("unmap", args, "cuMemRetainAllocationHandle", err)
                held.append(int(obj))
        (err,) = self._cuMemUnmap(va, size)
        if err:
            maps.update(taken)
            self._drop_refs(held)
            raise self._cuda_error("unmap", args, "cuMemUnmap", err)
        notes: list[str] = []
        z = self._zero
        assert z is not None
        fail = self._z_put(z.cover(va, va + size), notes) if recover else None
        if fail is not None:
            e = self._z_error("unmap", args, fail, [])
            for s, h in taken:  # map the real handles back, with their bytes and access
                (err,) = self._cuMemMap(s, h.size, 0, h.raw, 0)
                if err:
                    notes.append(f"undo: cuMemMap of the handle back at {s:#x} returned "
                                 f"{_name(err)}: that mapping is gone")
                    self._unmapped(h)
                    continue
                maps[s] = h
                (err,) = self._cuMemSetAccess(s, h.size, self._access, 1)
                peers = self._peer_access.get(s)
                if not err and peers is not None:
                    (err,) = self._cuMemSetAccess(s, h.size, peers, len(peers))
                if err:
                    notes.append(f"undo: cuMemSetAccess of the mapping back at {s:#x} "
                                 f"returned {_name(err)}: it is mapped but not accessible")
            self._drop_refs(held)
            self._note(e, notes, va, va + size)
            raise e
        self._drop_refs(held)
        for s, h in taken:
            self._peer_access.pop(s, None)
            self._unmapped(h)


    def _drop_refs(self, held: list[int]) -> None:
        """Release the references ``cuMemRetainAllocationHandle`` gave."""
        for raw in held:
            self._cuMemRelease(raw)


    @locked
    def zero_stats(self) -> ZeroCoverStats | None:
        """What the zero cover holds (None when ``zero_page`` is off): its mappings, the VA
        they cover, the device memory of the zero handles, and any reserved VA left neither
        mapped nor covered (0 unless an undo failed). :meth:`stats` leaves all of it out."""
        z = self._zero
        if z is None:
            return None
        real = sum(h.size for h in self._maps.values())
        return ZeroCoverStats(
            block=z.block, piece_sizes=z.sizes, zero_bytes=sum(z.sizes), mappings=len(z),
            covered_bytes=z.covered_bytes,
            uncovered_bytes=sum(self._res.values()) - z.covered_bytes - real,
        )


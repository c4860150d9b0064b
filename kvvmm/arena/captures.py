"""What baked an arena's addresses in: captures, and the operations they refuse.

A CUDA graph, an NCCL or RDMA registration, a kernel given its bounds by value keeps using
the VA it saw; unmapping under it makes its next replay read freed memory or fault. Each such
consumer records a :class:`Capture` (its name, its VA ranges, whether the capacity it saw
must stay); the arena checks the live captures before every unmap, before a close, and (for a
fixed capacity) before a commit past it, and refuses with
:class:`~kvvmm.errors.CaptureConflictError` before any driver call.

A consumer that can follow a change passes ``on_conflict``: called with the spans an
operation would touch, it re-registers and returns the ranges it keeps; the operation goes
ahead if they no longer meet it. Only the recorder releases a capture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvvmm.arena.state import _ArenaState, _locked
from kvvmm.checks import bool_arg, is_int
from kvvmm.errors import ArgumentError, CaptureConflictError

__all__ = ["Capture", "CaptureRegistry", "CapturesMixin", "ConflictHook"]

#: ``on_conflict(capture, op, spans)``: re-register and return the VA ranges kept, or
#: None to have the operation refused.
ConflictHook = Callable[["Capture", str, tuple[tuple[int, int], ...]],
                        Sequence[tuple[int, int]] | None]


@dataclass(frozen=True, eq=False, slots=True)
class Capture:
    """One consumer's record of the VA it baked in (compared by identity; only its arena's
    registry changes it: its ranges when the consumer re-registers, ``live`` at release).

    Attributes:
        name: shown in every refusal (``"decode-bs8"``, ``"nccl:tp-allreduce"``).
        ranges: absolute VA ``[start, end)`` it uses, sorted, none overlapping.
        fixed_capacity: the consumer baked in the capacity it saw: no commit may grow an
            allocation it covers past the end of its ranges there.
        survives_sleep: a sleep (same VA, memory given back until the wake) is allowed
            under it; the consumer must launch nothing while the arena sleeps.
        on_conflict: see :data:`ConflictHook`; None: refuse.
    """

    name: str
    ranges: tuple[tuple[int, int], ...]
    fixed_capacity: bool = False
    survives_sleep: bool = False
    on_conflict: ConflictHook | None = None
    _by: int = field(default=0, repr=False)
    live: bool = True  #: False once released


def _overlap(ranges: Iterable[tuple[int, int]], spans: Sequence[tuple[int, int]]
             ) -> tuple[int, int] | None:
    """The first span that meets any of ``ranges`` (both half-open), or None."""
    for lo, hi in ranges:
        for s, e in spans:
            if s < hi and lo < e:
                return max(s, lo), min(e, hi)
    return None


class CaptureRegistry:
    """The live captures of one arena; its methods run under the arena's lock.

    Args:
        owner_name: the arena's name, for messages.
        lo, hi: the arena's VA ``[lo, hi)``: every range a capture records lies inside.
    """

    __slots__ = ("_hi", "_live", "_lo", "_name", "fixed")

    def __init__(self, owner_name: str, lo: int, hi: int) -> None:
        self._name, self._lo, self._hi = owner_name, lo, hi
        self._live: list[Capture] = []
        self.fixed = 0  #: live captures with a fixed capacity (the commit path reads it)

    def __bool__(self) -> bool:
        return bool(self._live)

    @property
    def live(self) -> tuple[Capture, ...]:
        """The live captures, oldest first."""
        return tuple(self._live)

    def _checked_ranges(self, ranges: object) -> tuple[tuple[int, int], ...]:
        limit = (f"a non-empty sequence of (start, end) VA pairs with start < end inside "
                 f"the arena's [{self._lo:#x}, {self._hi:#x})")
        if isinstance(ranges, (str, bytes)) or not isinstance(ranges, Iterable):
            raise ArgumentError("ranges", ranges, limit)
        out = []
        for r in ranges:
            if (not isinstance(r, tuple) or len(r) != 2 or not all(is_int(x) for x in r)
                    or not self._lo <= r[0] < r[1] <= self._hi):
                raise ArgumentError("ranges", r, limit)
            out.append((int(r[0]), int(r[1])))
        if not out:
            raise ArgumentError("ranges", ranges, limit)
        out.sort()
        merged = [out[0]]
        for s, e in out[1:]:
            if s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        return tuple(merged)

    def record(self, name: str, ranges: object, by: object, *, fixed_capacity: bool = False,
               survives_sleep: bool = False, on_conflict: ConflictHook | None = None
               ) -> Capture:
        """Record a capture; see :meth:`Arena.record_capture
        <kvvmm.arena.Arena.record_capture>`."""
        if not isinstance(name, str) or not name:
            raise ArgumentError("name", name, "a non-empty str")
        if any(c.name == name for c in self._live):
            raise ArgumentError("name", name, f"unique among the live captures of arena "
                                              f"{self._name!r}")
        bool_arg("fixed_capacity", fixed_capacity, limit="a bool")
        bool_arg("survives_sleep", survives_sleep, limit="a bool")
        if on_conflict is not None and not callable(on_conflict):
            raise ArgumentError("on_conflict", on_conflict, "a callable or None")
        if by is None:
            raise ArgumentError("by", by, "the object that records the capture (it alone "
                                          "may release it)")
        cap = Capture(name, self._checked_ranges(ranges), fixed_capacity, survives_sleep,
                      on_conflict, id(by))
        self._live.append(cap)
        self.fixed += fixed_capacity
        return cap

    def release(self, cap: object, by: object) -> None:
        """Release ``cap``; only the object that recorded it may.

        Raises:
            ArgumentError: ``cap`` is not a live capture of this arena, or ``by`` is not
                the object that recorded it; nothing changed.
        """
        if not isinstance(cap, Capture) or not any(c is cap for c in self._live):
            raise ArgumentError("capture", cap, f"a live capture of arena {self._name!r}")
        if id(by) != cap._by:
            raise ArgumentError("by", by, f"the object that recorded capture {cap.name!r} "
                                          f"(another may not release it)")
        self._drop(cap)

    def _drop(self, cap: Capture) -> None:
        self._live.remove(cap)
        self.fixed -= cap.fixed_capacity
        object.__setattr__(cap, "live", False)

    def _refuse(self, cap: Capture, op: str, spans: tuple[tuple[int, int], ...],
                hit: tuple[int, int], why: str,
                again: Callable[[Capture], tuple[int, int] | None]) -> None:
        """Let the consumer re-register if it can; raise if it still stands in the way."""
        hook = cap.on_conflict
        if hook is not None:
            kept = hook(cap, op, spans)
            if not cap.live:  # it released itself
                return
            if kept is not None:
                new = self._checked_ranges(kept) if kept else ()
                if not new:  # it keeps nothing: its registration ends here
                    self._drop(cap)
                    return
                object.__setattr__(cap, "ranges", new)
                left = again(cap)
                if left is None:
                    return
                hit = left
        raise CaptureConflictError(cap.name, op, hit[0], hit[1],
                                   f"{why} in arena {self._name!r}")

    def check_unmap(self, op: str, spans: Sequence[tuple[int, int]]) -> None:
        """Refuse ``op`` if it unmaps VA a live capture uses (``spans``: absolute VA).

        A sleep passes captures that survive it. Called before any driver call.

        Raises:
            CaptureConflictError: names the first capture in the way.
        """
        if not self._live:
            return
        spans = tuple(spans)
        for cap in list(self._live):
            if op == "sleep" and cap.survives_sleep:
                continue
            hit = _overlap(cap.ranges, spans)
            if hit is not None:
                self._refuse(cap, op, spans, hit, f"its ranges {_show(cap.ranges)}",
                             lambda c: _overlap(c.ranges, spans))

    def check_close(self) -> None:
        """Refuse a close while any capture is live (the VA itself goes)."""
        for cap in list(self._live):
            self._refuse(cap, "close", ((self._lo, self._hi),), cap.ranges[0],
                         "a close frees the whole reservation", lambda c: c.ranges[0])

    def _grows_past(self, cap: Capture, spans: Sequence[tuple[int, int]],
                    allocs: Sequence[tuple[int, int]] = ()) -> tuple[int, int] | None:
        """A span of a covered allocation that ends past the capacity ``cap`` baked in."""
        for s, e in spans:
            a_lo, a_hi = next(((lo, hi) for lo, hi in allocs if lo <= s < hi), (self._lo,
                                                                                 self._hi))
            ends = [hi for lo, hi in cap.ranges if lo < a_hi and hi > a_lo]
            if ends and e > max(ends):
                return max(s, max(ends)), e
        return None

    def check_grow(self, spans: Sequence[tuple[int, int]],
                   allocs: Sequence[tuple[int, int]]) -> None:
        """Refuse a commit whose new mappings (``spans``) grow an allocation (``allocs``: the
        VA of each allocation the commit touches) past a fixed capacity a capture baked in.

        Raises:
            CaptureConflictError: names the capture.
        """
        spans = tuple(spans)
        for cap in list(self._live):
            if cap.fixed_capacity:
                hit = self._grows_past(cap, spans, allocs)
                if hit is not None:
                    self._refuse(cap, "commit", spans, hit,
                                 f"a fixed capacity, its ranges {_show(cap.ranges)}",
                                 lambda c: self._grows_past(c, spans, allocs))

    def blocks_growth(self, span: tuple[int, int], alloc: tuple[int, int]) -> bool:
        """Whether a fixed-capacity capture forbids backing ``span`` (no callback: for a
        look-ahead, which only skips what it may not back)."""
        return any(c.fixed_capacity and self._grows_past(c, (span,), (alloc,))
                   for c in self._live)


def _show(ranges: Sequence[tuple[int, int]]) -> str:
    shown = ", ".join(f"[{lo:#x}, {hi:#x})" for lo, hi in ranges[:3])
    return shown + (f" and {len(ranges) - 3} more" if len(ranges) > 3 else "")


class CapturesMixin(_ArenaState):
    """:class:`~kvvmm.arena.Arena`'s calls for captures (the checks live in the backing
    paths of :mod:`~kvvmm.arena.state`)."""

    @_locked
    def record_capture(self, name: str, ranges: Iterable[tuple[int, int]] | None = None, *,
                       by: object, fixed_capacity: bool = False, survives_sleep: bool = False,
                       on_conflict: ConflictHook | None = None) -> Capture:
        """Record that a consumer baked part of the arena's VA in (a graph, a registration).

        Until released, an unmap of its ranges (and with ``fixed_capacity`` a commit
        growing past them) is refused with :class:`~kvvmm.errors.CaptureConflictError`.

        Args:
            name: shown in refusals; unique among the arena's live captures.
            ranges: absolute VA ``[start, end)`` pairs inside the reservation (default:
                every mapping the arena holds now).
            by: the object recording it: only it may :meth:`release_capture` it.
            fixed_capacity: the consumer baked in the capacity it saw.
            survives_sleep: a sleep is allowed under it (launch nothing until the wake).
            on_conflict: ``(capture, op, spans) -> ranges kept or None``: called before a
                refused operation; returning ranges clear of ``spans`` lets it go ahead,
                ``()`` ends the capture, None refuses.
        Returns:
            The :class:`Capture`.
        Raises:
            ArgumentError: a bad argument, a name in use, or no mapping to default to;
                nothing recorded.
            ClosedError: after ``close()``.
        """
        self._check_open("record_capture")
        if ranges is None:
            base = self.base
            ranges = [(base + m.offset, base + m.offset + m.size)
                      for a in self._allocs for m in a.maps]
        return self._captures.record(name, ranges, by, fixed_capacity=fixed_capacity,
                                     survives_sleep=survives_sleep, on_conflict=on_conflict)

    @_locked
    def release_capture(self, capture: Capture, *, by: object) -> None:
        """Release a capture: what it covered may be unmapped again.

        Raises:
            ArgumentError: not a live capture of this arena, or ``by`` is not the object
                that recorded it; nothing changed.
        """
        self._captures.release(capture, by)

    @property
    def captures(self) -> tuple[Capture, ...]:
        """The live captures, oldest first."""
        return self._captures.live

    @_locked
    def check_close(self) -> None:
        """Raise :class:`~kvvmm.errors.CaptureConflictError` if a close would be refused
        because a capture is live (an owner asks before it changes anything of its own)."""
        if not self._released:
            self._captures.check_close()

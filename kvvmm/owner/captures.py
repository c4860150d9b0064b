"""An owner's captures: what a CUDA graph or a registration baked of its buffers in.

``owner.capturing("decode-bs8")`` wraps a graph capture: every mapping of the owner's
buffers at entry is recorded as a capture of its arena (:mod:`~kvvmm.arena.captures`) until
the block ends, so any unmap under it is refused with
:class:`~kvvmm.errors.CaptureConflictError` naming the graph. A graph replayed after the
block passes ``keep=True``; a registration (NCCL, RDMA) records with :func:`record`; both
are released with the owner's ``release_capture``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvvmm.arena.captures import Capture, ConflictHook
from kvvmm.checks import bool_arg

if TYPE_CHECKING:
    from kvvmm.owner.buffers import KvBufferOwner

__all__ = ["capturing", "owner_ranges", "record"]


def owner_ranges(owner: KvBufferOwner) -> list[tuple[int, int]]:
    """Every mapping of the owner's buffers now, as absolute VA ``[start, end)``."""
    snap = owner.arena.snapshot()
    return [(snap.base + m.offset, snap.base + m.offset + m.size_bytes) for m in snap.mappings]


def record(owner: KvBufferOwner, name: str, ranges: Iterable[tuple[int, int]] | None = None,
           *, fixed_capacity: bool = False, survives_sleep: bool = False,
           on_conflict: ConflictHook | None = None) -> Capture:
    """Record a capture of ``owner``'s buffers, owned by ``owner``.

    Args:
        owner: the owner whose arena the consumer baked in.
        name: the consumer, shown in refusals (unique among the live captures).
        ranges: absolute VA ``[start, end)`` pairs (default: :func:`owner_ranges`).
        fixed_capacity, survives_sleep, on_conflict: as for
            :meth:`Arena.record_capture <kvvmm.arena.Arena.record_capture>`.
    Returns:
        The :class:`~kvvmm.arena.captures.Capture`.
    Raises:
        ArgumentError: a bad argument or a name in use; ClosedError: after close.
    """
    owner._check_open("record_capture")
    return owner.arena.record_capture(
        name, owner_ranges(owner) if ranges is None else ranges, by=owner,
        fixed_capacity=fixed_capacity, survives_sleep=survives_sleep, on_conflict=on_conflict)


@contextmanager
def capturing(owner: KvBufferOwner, name: str, *, keep: bool = False,
              fixed_capacity: bool = False, survives_sleep: bool = False,
              on_conflict: ConflictHook | None = None) -> Iterator[Capture]:
    """Record a capture of every mapping of ``owner`` (at entry) around a ``with`` block.

    Args:
        keep: False: released on exit. True: stays live after the block (a graph captured
            in it and replayed later), until ``owner.release_capture``.
        Others: as :func:`record`.
    """
    bool_arg("keep", keep, limit="a bool")
    cap = record(owner, name, fixed_capacity=fixed_capacity, survives_sleep=survives_sleep,
                 on_conflict=on_conflict)
    try:
        yield cap
    except BaseException:
        if cap.live:  # the capture failed: nothing was baked in
            owner.arena.release_capture(cap, by=owner)
        raise
    if cap.live and not keep:
        owner.arena.release_capture(cap, by=owner)

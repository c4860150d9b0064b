"""KvBufferOwner: a model's KV buffers in one arena, backed as serving needs them.

The flow SGLang uses to size its KV pool after CUDA-graph capture:

1. construct: lay every buffer out in one arena at its upper-bound shape (``reserved_tokens``)
   so tensor pointers never move, and back one page of each (slot 0: capture routes every
   dummy KV write there);
2. capture CUDA graphs against those tensors;
3. ``finalize(n)``: back each buffer's final span now that the memory budget is known;
4. ``ensure_prefix(n)`` grows backing on demand, ``shrink(n)`` gives memory back.

``commit_pages`` / ``decommit_pages`` back and give back pages anywhere (page ``p`` = slots
``[p * page_size, (p + 1) * page_size)``), and ``release_beyond(n)`` everything past the first
``n`` slots. With a :class:`~kvvmm.arena.pool.HandlePool` and ``lookahead_bytes`` a background
thread backs each buffer that far beyond the prefix before ``ensure_prefix`` needs it.
Every span is checked before anything is committed; nothing is clamped.
"""

from __future__ import annotations

import itertools
import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvvmm.arena import Arena, DecommitResult
from kvvmm.arena.arena import MAX_RESERVE_BYTES, RangeResult, SleepResult, check_driver
from kvvmm.arena.backup import Backup
from kvvmm.arena.captures import Capture, ConflictHook
from kvvmm.checks import is_int
from kvvmm.driver.base import Driver, work_hook
from kvvmm.dtypes import dtype_itemsize, dtype_name
from kvvmm.errors import ArgumentError, AsleepError, ClosedError, DriverError, OutOfRangeError
from kvvmm.layout import KvBufferDesc
from kvvmm.layout.geometry import (
    agreed_page_size,
    agreed_reserved_tokens,
    check_itemsize,
    growth_targets,
)
from kvvmm.owner.options import OwnerOptions
from kvvmm.owner.prepared import PreparedBacking, prepare
from kvvmm.policy import Exact, GrowthPolicy
from kvvmm.snapshot import BufferInfo, OwnerSnapshot
from kvvmm.units import align_up, fmt_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["KvBufferOwner", "ShrinkResult"]

_EXACT = Exact()
#: What an asleep owner still answers: the pure questions (no memory is touched).
_ASLEEP_OK = frozenset({"slot_ranges", "page_ranges", "sleep", "wake"})


@dataclass(frozen=True, slots=True)
class ShrinkResult:
    """What one :meth:`KvBufferOwner.shrink` did: bytes given back, and what stopped it
    (a buffer whose last mapping straddles its kept span gives back less: ``held``)."""

    tokens: int  #: the token count shrunk to
    given_bytes: int  #: bytes given back across all buffers
    buffers: tuple[DecommitResult, ...]  #: one per buffer, in ``descs`` order

    @property
    def held(self) -> tuple[DecommitResult, ...]:
        """Buffers that kept more than their span because a mapping straddles it."""
        return tuple(b for b in self.buffers if b.kept_mapping is not None)

    @property
    def held_bytes(self) -> int:
        """Bytes that stayed backed beyond the kept spans (whole handles straddling them)."""
        return sum(b.held_bytes for b in self.buffers)

    def __str__(self) -> str:
        text = f"shrink({self.tokens}): gave back {fmt_bytes(self.given_bytes)}"
        held = self.held
        if held:
            text += (f"; {len(held)} of {len(self.buffers)} buffers keep "
                     f"{fmt_bytes(self.held_bytes)} beyond their spans in mappings that "
                     f"straddle them (first: {held[0]})")
        return text


class KvBufferOwner:
    """Owns one arena and the KV buffers laid out in it, in ``descs`` order.

    Threads: the page and slot calls (:meth:`commit_pages`, :meth:`decommit_pages`,
    :meth:`note_pages`, :meth:`commit_slots`, :meth:`decommit_slots`) may come from several
    threads at once (one lock). :meth:`ensure_prefix`, :meth:`finalize`, :meth:`shrink`,
    :meth:`release_beyond` and :meth:`close` are the engine's thread's: one at a time.

    Args:
        driver: any driver object (not a kind's name: ``kvvmm.open_driver("sim")`` first).
        device: device ordinal (default: the driver's).
        dtype: a torch dtype or its name (``"bfloat16"``); its itemsize must be the descs'.
        page_size: tokens per page, > 0 (default: the page-major descs' ``tokens_per_row``;
            required when every desc is token-major).
        reserved_tokens: upper bound on tokens the buffers can ever hold, in
            ``[page_size, what the descs hold]`` (default: what the descs hold).
        descs: the buffers (:class:`~kvvmm.layout.KvBufferDesc`), K buffers first by
            convention; names must be unique.
        options: how the owner backs (:class:`~kvvmm.owner.options.OwnerOptions`).
        **settings: the same fields as keywords (``policy=Chunked(...)``); not with ``options``.
    Raises:
        ArgumentError, OutOfRangeError, UnknownDtypeError: bad arguments or descs that
            disagree with each other or with ``dtype``/``page_size``/``reserved_tokens``,
            naming the one that is wrong; nothing reserved.
        DriverError: reserving or backing slot 0 failed; nothing is left behind.
    """

    def __init__(self, *, driver: Driver, dtype: Any, descs: Sequence[KvBufferDesc],
                 device: int | None = None, page_size: int | None = None,
                 reserved_tokens: int | None = None, options: OwnerOptions | None = None,
                 **settings: Any) -> None:
        check_driver(driver)
        #: How this owner backs (the record it was made with, or one made of the keywords).
        self.options = opts = OwnerOptions.of(options, settings)
        self._lay_out(driver, dtype, descs, page_size, reserved_tokens)
        self.policy: GrowthPolicy = opts.growth
        self._init_state(opts.lookahead_bytes)
        self._open(driver, device, opts)

    def _lay_out(self, driver: Driver, dtype: Any, descs: Sequence[KvBufferDesc],
                 page_size: int | None, reserved_tokens: int | None) -> None:
        """Check the layout against itself and work out each buffer's spans and limits."""
        self.dtype = dtype_name(dtype)
        self.itemsize = dtype_itemsize(self.dtype)
        if page_size is not None:
            _tokens("page_size", page_size, lo=1, hi=None)
        if reserved_tokens is not None:
            _tokens("reserved_tokens", reserved_tokens, lo=1, hi=None)
        _check_descs(descs)
        self.descs: tuple[KvBufferDesc, ...] = tuple(descs)
        check_itemsize(self.descs, dtype, self.itemsize)
        self.page_size = agreed_page_size(self.descs, page_size)
        self.reserved_tokens = agreed_reserved_tokens(self.descs, self.page_size,
                                                      reserved_tokens, self.itemsize)
        #: The most ``ensure_prefix`` backs: every slot the tensors index up to the final span
        #: of ``reserved_tokens``, the padded page included (SGLang hands out its top page).
        self.max_prefix_tokens = self.reserved_tokens + self.page_size
        gran = driver.granularity()
        self._spans = [d.reserved_span_bytes(self.itemsize) for d in self.descs]
        self._names = [d.name for d in self.descs]
        self._limits = [align_up(s, gran) for s in self._spans]
        total = sum(self._limits)
        if total > MAX_RESERVE_BYTES:  # refused here, naming what the caller can change
            arg = "descs" if reserved_tokens is None else "reserved_tokens"
            raise OutOfRangeError(
                arg, self.reserved_tokens if arg == "reserved_tokens" else len(self.descs),
                f"small enough that the buffers fit in {MAX_RESERVE_BYTES} bytes of VA "
                f"(256 TiB, the most an arena reserves)",
                f"the {len(self.descs)} buffers need {total} bytes",
            )
        self._rows = [(d.tokens_per_row, d.row_bytes) for d in self.descs]
        # tokens_per_row is 1 or the page size, so pages are equal runs of rows
        self._page_bytes = [self.page_size // tpr * rb if tpr > 1 else self.page_size * rb
                            for tpr, rb in self._rows]
        self.pages = min(s // pb for s, pb in zip(self._spans, self._page_bytes, strict=True))

    def _init_state(self, lookahead_bytes: int) -> None:
        """The owner's own state before anything is backed (docs/DESIGN.md, "Where a
        change to the owner's state goes")."""
        self.prefix_tokens = 0
        self.final_tokens: int | None = None
        self._closed = False
        # Derived by _sync_backed only: each buffer's backed prefix; the tokens it covers
        # (ensure_prefix has nothing to back up to it) and up to which the look-ahead
        # needs nothing.
        self._backed = [0] * len(self.descs)
        self._covered = 0
        self._ahead = -1
        # ensure_prefix's fast path: the most tokens with nothing to back or queue; -1
        # sends every call down the full path (closed, asleep, or the simulator's hook).
        self._quiet = -1
        # Pages committed and not given back; a granule stays backed while any page in it is.
        self._pages: set[int] = set()
        self._lookahead = lookahead_bytes
        self._ahead_queued = False
        self._ahead_n = 0  # the most tokens a look-ahead was asked for (its job reads it)
        # The page set and the backed prefixes change under this lock (RangeBacking's
        # thread calls the slot calls).
        self._slots_lock = threading.RLock()

    def _open(self, driver: Driver, device: int | None, opts: OwnerOptions) -> None:
        """Reserve the arena, lay the buffers out in it, make their tensors and back slot 0's
        page; on any failure the arena is closed again and nothing is left behind."""
        self.arena = Arena(driver, reserve_bytes=sum(self._limits), device=device,
                           name=opts.name, trace=opts.trace, pool=opts.pool,
                           cache_releaser=opts.cache_releaser, retry_on_oom=opts.retry_on_oom)
        self._pool = self.arena.handle_pool  # fixed for the arena's life
        # The simulator's charge for the library's own work (None on real drivers).
        self._work = work_hook(driver)
        self._charge("owner.open")
        try:
            self._offsets = [self.arena.allocate(s, d.name)
                             for d, s in zip(self.descs, self._spans, strict=True)]
            self.tensors: list[torch.Tensor] = [
                self.arena.tensor(o, d.shape, self.dtype)
                for o, d in zip(self._offsets, self.descs, strict=True)
            ]
            # Slot 0 before capture, exactly one page: the budget is unknown until after it.
            ps = self.page_size
            self._back([d.prefix_span_bytes(ps, ps) for d in self.descs], _EXACT)
            self.prefix_tokens = ps
        except BaseException:
            self.tensors = []
            self.arena.close()
            raise

    def __repr__(self) -> str:
        return (f"KvBufferOwner({len(self.descs)} buffers, {self.dtype}, page {self.page_size}, "
                f"reserved {self.reserved_tokens} tokens, final {self.final_tokens}, "
                f"policy {self.policy})")

    def __enter__(self) -> KvBufferOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- backing --------------------------------------------------------------------------

    def _charge(self, op: str) -> None:
        if self._work is not None:
            self._work(op, len(self.descs))

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"KvBufferOwner: {what} after close()")
        if self.arena.asleep and what not in _ASLEEP_OK:
            raise AsleepError(f"KvBufferOwner: {what} while asleep (sleep() gave its memory "
                              f"back); call wake() first")

    def _back(self, spans: Sequence[int], policy: GrowthPolicy) -> int:
        """Back each buffer to at least ``spans[i]``; check every span before any commit."""
        targets = growth_targets(policy, self._names, spans, self._spans, self._limits,
                                 self._backed, self.arena.granularity)
        requests = [(self._offsets[i], target) for i, _, target in targets]
        if not requests:
            return 0
        self._charge("owner.grow")
        try:
            return self.arena.commit_many(requests)
        finally:
            self._sync_backed()

    def _sync_backed(self) -> None:
        # Under the lock: the look-ahead's job syncs from the pool's thread too.
        with self._slots_lock:
            self._backed = backed = [self.arena.prefix_of(o) for o in self._offsets]
            # span(n) = ceil(n / tpr) * rb <= backed  <=>  n <= (backed // rb) * tpr
            covered = min(self.max_prefix_tokens,
                          *((b // rb) * tpr for (tpr, rb), b in zip(self._rows, backed,
                                                                    strict=True)))
            ahead = self.max_prefix_tokens
            la = self._lookahead
            if la:  # nothing to ask while span + la / 2 <= backed; its job tops up to span + la
                half = la // 2
                for (tpr, rb), b, limit in zip(self._rows, backed, self._limits, strict=True):
                    if b < limit:
                        ahead = min(ahead, (b - half) // rb * tpr if b >= half else -1)
            self._covered, self._ahead = covered, ahead
            self._quiet = (-1 if self._work is not None or self._closed or self.arena.asleep
                           else min(covered, ahead) if la else covered)

    def _resynced(self) -> None:
        """:meth:`_sync_backed` unless closed (a prepared change's steps end with it)."""
        if not self._closed and not self.arena.closed:
            self._sync_backed()

    # -- the owner's record, read (docs/DESIGN.md: what is mapped is the arena's) ----------

    def mapped(self, i: int, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
        """Buffer ``i``'s mappings that overlap ``[lo, hi)``, as sorted ``(start, end)``
        bytes from the buffer's start (``hi`` defaults to the buffer's end)."""
        off = self._offsets[i]
        return self.arena.mappings_over(off, lo, self._limits[i] if hi is None else hi)

    def unbacked(self, i: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """The pieces of ``[lo, hi)`` (bytes from buffer ``i``'s start) no mapping covers."""
        out, at = [], lo
        for s, e in self.arena.mappings_over(self._offsets[i], lo, hi):
            if s > at:
                out.append((at, s))
            at = max(at, e)
        if at < hi:
            out.append((at, hi))
        return out

    def slots_mapped(self, start: int, stop: int) -> str:
        """``"all"``, ``"none"`` or ``"some"``: how much of token slots ``[start, stop)``
        (page-aligned) is mapped, over every buffer, read under the owner's lock.

        Raises:
            ArgumentError, OutOfRangeError: a bad range (as :meth:`slot_ranges`).
        """
        covered = total = 0
        with self._slots_lock:  # no commit or decommit between the ranges and the reading
            for off, lo, nbytes in self.slot_ranges([(start, stop)]):
                total += nbytes
                for a, b in self.arena.mappings_over(off, lo, lo + nbytes):
                    covered += min(b, lo + nbytes) - max(a, lo)
        return "all" if covered == total else "none" if covered == 0 else "some"

    def finalize_bytes(self, n: int) -> int:
        """Bytes this owner holds after ``finalize(n)`` (pure: nothing changes).

        Raises:
            ArgumentError, OutOfRangeError: bad ``n`` (as :meth:`finalize`).
        """
        self._check_open("finalize_bytes")
        n = _tokens("n", n, lo=self.page_size, hi=self.reserved_tokens, what="page_size")
        gran, total = self.arena.granularity, 0
        for i, (d, off, limit) in enumerate(zip(self.descs, self._offsets, self._limits,
                                                strict=True)):
            need = min(align_up(d.final_span_bytes(n, self.page_size), gran), limit)
            total += self.arena.backed_of(off) + sum(e - s for s, e in self.unbacked(i, 0, need))
        return total

    # -- a change in steps (kvvmm.owner.prepared: prepare, map, confirm or undo) ------------

    def _grow_plan(self, spans: Sequence[int], policy: GrowthPolicy
                   ) -> list[tuple[int, int, int]]:
        """``(offset, start, nbytes)`` of each gap to back so that every buffer's prefix
        reaches ``spans[i]`` as the policy grows it, in VA order; every span checked first."""
        prefixes = [self.arena.prefix_of(off) for off in self._offsets]
        plan = []
        for i, prefix, target in growth_targets(policy, self._names, spans, self._spans,
                                                self._limits, prefixes,
                                                self.arena.granularity):
            off = self._offsets[i]
            plan += [(off, s, e - s) for s, e in self.unbacked(i, prefix, target)]
        return plan

    def prepare_finalize(self, n: int) -> PreparedBacking:
        """:meth:`finalize` by parts: check ``n`` and create the handles it would map (see
        :mod:`kvvmm.owner.prepared`); ``confirm()`` sets :attr:`final_tokens`.

        Raises:
            As :meth:`finalize` (nothing made); DriverError: a create failed (those made
            released).
        """
        self._check_open("finalize")
        n = _tokens("n", n, lo=self.page_size, hi=self.reserved_tokens, what="page_size")
        spans = [d.final_span_bytes(n, self.page_size) for d in self.descs]

        def record() -> None:
            self.final_tokens = n
        with self._slots_lock:  # the plan reads the mappings as one; the creates run after
            plan = self._grow_plan(spans, _EXACT)
        return prepare(self, f"finalize({n})", plan, at_prefix=True, record=record)

    def prepare_ensure_prefix(self, n: int) -> PreparedBacking:
        """:meth:`ensure_prefix` by parts, with the owner's growth policy (see
        :meth:`prepare_finalize`); ``confirm()`` raises :attr:`prefix_tokens` to ``n``."""
        self._check_open("ensure_prefix")
        n = _tokens("n", n, lo=0, hi=self.max_prefix_tokens, what="0", hi_name=PREFIX_BOUND)
        spans = [d.prefix_span_bytes(n, self.page_size) for d in self.descs]

        def record() -> None:
            self.prefix_tokens = max(self.prefix_tokens, n)
        with self._slots_lock:
            plan = self._grow_plan(spans, self.policy)
        return prepare(self, f"ensure_prefix({n})", plan, at_prefix=True, record=record)

    def prepare_pages(self, pages: Iterable[int]) -> PreparedBacking:
        """:meth:`commit_pages` by parts; ``confirm()`` commits the pages.

        Raises:
            As :meth:`commit_pages` (nothing made); DriverError: a create failed (those made
            released).
        """
        self._check_open("commit_pages")
        ids = self._check_pages(pages, "commit")

        def record() -> None:
            self._pages.update(ids)
        with self._slots_lock:
            plan = [(off, s, e - s) for i, off in enumerate(self._offsets)
                    for lo, hi in _merged(self._page_granules(i, p) for p in ids)
                    for s, e in self.unbacked(i, lo, hi)]
        return prepare(self, f"commit_pages({len(ids)} pages)", plan, at_prefix=False,
                       record=record)

    def ensure_prefix(self, n: int) -> int:
        """Back the first ``n`` token slots of every buffer (the growth policy sizes handles).

        Args:
            n: tokens, in ``[0, max_prefix_tokens]`` (``reserved_tokens`` plus the padded
                page).
        Returns:
            Bytes newly backed.
        Raises:
            ArgumentError, OutOfRangeError: bad ``n``; nothing committed.
            DriverError: a driver call failed; every buffer is as it was.
        """
        # The decode step's usual case, in as few steps as Python allows.
        if type(n) is int and n >= 0:
            quiet = self._quiet
            if n <= quiet:
                if n > self.prefix_tokens:
                    self.prefix_tokens = n
                return 0
            if quiet >= 0 and n <= self._covered:  # backed: only the look-ahead to queue
                if n > self.prefix_tokens:
                    self.prefix_tokens = n
                self._queue_lookahead(n)
                return 0
        # Else no call either while the mirror covers n, on an open owner of a real driver;
        # anything else is checked (and the sim charged) first.
        if not (type(n) is int and 0 <= n <= self._covered and not self._closed
                and self._work is None):
            self._check_open("ensure_prefix")
            if self._work is not None:  # _charge inlined: this runs every decode step
                self._work("owner.ensure_prefix", len(self.descs))
            n = _tokens("n", n, lo=0, hi=self.max_prefix_tokens, what="0",
                        hi_name=PREFIX_BOUND)
        if n <= self._covered:  # nothing to back: O(1), however many buffers
            if n > self.prefix_tokens:
                self.prefix_tokens = n
            if n > self._ahead and self._lookahead:
                self._queue_lookahead(n)
            return 0
        # prefix_span_bytes inlined; the pool's thread may have backed these spans since.
        spans = [-(-n // tpr) * rb for tpr, rb in self._rows]
        if self._lookahead:
            self._sync_backed()
            if all(s <= b for s, b in zip(spans, self._backed, strict=True)):
                self.prefix_tokens = max(self.prefix_tokens, n)
                self._queue_lookahead(n)
                return 0
        added = self._back(spans, self.policy)
        self.prefix_tokens = max(self.prefix_tokens, n)
        if self._lookahead:
            self._queue_lookahead(n)
        return added

    def _queue_lookahead(self, n: int) -> None:
        """Ask the pool's thread to back each buffer ``lookahead_bytes`` beyond ``n`` tokens
        (one job at a time: a queued job reads the largest ``n`` asked)."""
        if self._ahead_queued:  # a job not yet started reads the larger n
            if n > self._ahead_n:
                self._ahead_n = n
            return
        pool = self._pool
        if pool is None or pool.closed:
            return
        self._ahead_n = n
        self._ahead_queued = True
        try:
            pool.submit(self._lookahead_job)
        except BaseException:
            self._ahead_queued = False
            raise

    def _lookahead_job(self) -> None:
        """The look-ahead on the pool's thread (see :meth:`_queue_lookahead`)."""
        try:
            if self._closed or self.arena.closed or self.arena.asleep:
                return
            n = self._ahead_n
            self._sync_backed()
            gran, la = self.arena.granularity, self._lookahead
            reqs = []
            for off, (tpr, rb), limit, backed in zip(self._offsets, self._rows,
                                                     self._limits, self._backed, strict=True):
                want = min(-(-n // tpr) * rb + la, limit)
                if want > backed:
                    target = self.policy.target_bytes(backed, want, limit, gran)
                    target = min(align_up(max(target, want), gran), limit)
                    reqs.append((off, backed, target - backed))
            if reqs:
                self.arena.prepare_ranges(reqs)
                if not self._closed and not self.arena.closed:
                    self._sync_backed()  # the decode step then sees it with no pass
        finally:
            self._ahead_queued = False

    def finalize(self, n: int) -> int:
        """Back each buffer's final span for ``n`` tokens and make ``n`` the capacity.

        The final span includes one padded page beyond ``n``; backed exactly.

        Args:
            n: tokens, ``page_size <= n <= reserved_tokens``.
        Returns:
            Bytes newly backed.
        Raises:
            ArgumentError, OutOfRangeError: bad ``n``; nothing committed.
            DriverError: a driver call failed; every buffer is as it was.
        """
        self._check_open("finalize")
        self._charge("owner.resize")
        n = _tokens("n", n, lo=self.page_size, hi=self.reserved_tokens, what="page_size")
        added = self._back([d.final_span_bytes(n, self.page_size) for d in self.descs], _EXACT)
        self.final_tokens = n
        return added

    def shrink(self, n: int) -> int:
        """Give back whole mappings beyond each buffer's final span for ``n`` tokens.

        A handle straddling the span stays backed: :meth:`shrink_report` says which.

        Args:
            n: tokens to keep, ``page_size <= n <= reserved_tokens``.
        Returns:
            Bytes given back.
        Raises:
            ArgumentError, OutOfRangeError: bad ``n``; nothing changed.
            DriverError: a driver call failed; see :meth:`shrink_report`.
        """
        return self.shrink_report(n).given_bytes

    def shrink_report(self, n: int) -> ShrinkResult:
        """:meth:`shrink`, returning what it did to each buffer (see :class:`ShrinkResult`).

        Raises:
            ArgumentError, OutOfRangeError: bad ``n``; nothing changed.
            DriverError: an unmap failed: every buffer and byte is as it was. Or a release
                failed after every unmap: the shrink stands and the arena retries the
                release later (:meth:`Arena.decommit_many_report`).
        """
        self._check_open("shrink")
        self._charge("owner.resize")
        n = _tokens("n", n, lo=self.page_size, hi=self.reserved_tokens, what="page_size")
        keep = [d.final_span_bytes(n, self.page_size) for d in self.descs]
        return self._give_back_beyond(n, keep)

    # -- pages (holes) --------------------------------------------------------------------

    def _check_pages(self, pages: Iterable[int], what: str) -> list[int]:
        if isinstance(pages, (str, bytes)):
            raise ArgumentError("pages", pages, "an iterable of page ids (ints)")
        out = sorted({_tokens(f"pages[{i}]", p, lo=0, hi=None)
                      for i, p in enumerate(pages)})
        if out and out[-1] >= self.pages:
            raise OutOfRangeError("pages", out[-1],
                                  f"page ids in [0, {self.pages}) ({self.pages} pages of "
                                  f"{self.page_size} tokens fit every buffer)")
        if what == "decommit" and out and out[0] == 0:
            raise ArgumentError("pages", 0, "page ids >= 1: page 0 holds slot 0, which captured "
                                            "CUDA graphs write (it stays backed)")
        return out

    def _page_granules(self, i: int, p: int) -> tuple[int, int]:
        """Buffer ``i``'s bytes of page ``p``, rounded out to granules (buffer-relative)."""
        gran, pb = self.arena.granularity, self._page_bytes[i]
        lo = p * pb // gran * gran
        return lo, min(align_up((p + 1) * pb, gran), self._limits[i])

    def commit_pages(self, pages: Iterable[int]) -> int:
        """Back the pages ``pages`` of every buffer, in one transaction.

        Page ``p`` is the bytes of token slots ``[p * page_size, (p + 1) * page_size)``,
        rounded out to granules; pages whose granules overlap share one handle, others get
        one each. Pages already backed cost nothing.

        Args:
            pages: page ids in ``[0, pages)`` (:attr:`pages`).
        Returns:
            Bytes newly backed.
        Raises:
            ArgumentError, OutOfRangeError: a bad page id; nothing committed.
            DriverError: a driver call failed; every buffer is as it was.
        """
        self._check_open("commit_pages")
        self._charge("owner.pages")
        ids = self._check_pages(pages, "commit")
        reqs = self._ranges_of(ids)
        with self._slots_lock:  # the page set changes as one with the mappings
            try:
                added = self.arena.commit_ranges(reqs)
            finally:
                self._sync_backed()
            self._pages.update(ids)
        return added

    def _ranges_of(self, ids: Sequence[int]) -> list[tuple[int, int, int]]:
        reqs: list[tuple[int, int, int]] = []
        for i, off in enumerate(self._offsets):
            for lo, hi in _merged(self._page_granules(i, p) for p in ids):
                reqs.append((off, lo, hi - lo))
        return reqs

    def page_ranges(self, pages: Iterable[int]) -> list[tuple[int, int, int]]:
        """The granule-aligned ``(offset, start, nbytes)`` ranges :meth:`commit_pages`
        asks its arena to back (pure).

        Raises:
            ArgumentError, OutOfRangeError: a bad page id (as :meth:`commit_pages`).
        """
        self._check_open("page_ranges")
        return self._ranges_of(self._check_pages(pages, "commit"))

    def note_pages(self, pages: Iterable[int], *, committed: bool = True) -> None:
        """Record pages as committed (or not) without backing or giving back anything.

        ``committed=True``: every granule of the pages must be backed in every buffer
        already; they join :attr:`committed_pages`. ``committed=False``: the pages leave it
        whatever is backed (the next decommit of those pages frees their memory).

        Raises:
            ArgumentError, OutOfRangeError: a bad page id, or (``committed``) a page not
                wholly backed; nothing changed.
        """
        self._check_open("note_pages")
        ids = self._check_pages(pages, "commit")
        with self._slots_lock:
            self._note_pages(ids, committed)

    def _note_pages(self, ids: Sequence[int], committed: bool) -> None:
        if committed:
            for off, lo, n in self._ranges_of(ids):
                at = lo
                for s, e in self.arena.mappings_of(off):
                    if s <= at < e:
                        at = e
                if at < lo + n:  # marking an unbacked page committed would lie to decommits
                    raise ArgumentError("pages", ids, "pages whose granules are backed in "
                                        f"every buffer (buffer at {off}: byte {at} is not)")
            self._pages.update(ids)
        else:
            self._pages.difference_update(ids)
        self._sync_backed()

    def decommit_pages(self, pages: Iterable[int]) -> int:
        """Give back the pages ``pages`` of every buffer, in one transaction.

        A granule goes only when no committed page shares it; a mapping that also backs
        pages still wanted (committed, slot 0's, the ensured prefix's) stays whole
        (:meth:`decommit_pages_report` names it). Pages inside the ensured prefix may go
        (a hole; the next ``ensure_prefix`` fills it).

        Args:
            pages: page ids in ``[1, pages)``; page 0 (slot 0) always stays.
        Returns:
            Bytes given back.
        Raises:
            ArgumentError, OutOfRangeError: a bad page id; nothing changed.
            DriverError: as for :meth:`shrink_report`.
        """
        return sum(r.given_bytes for r in self.decommit_pages_report(pages))

    def decommit_pages_report(self, pages: Iterable[int]) -> tuple[RangeResult, ...]:
        """:meth:`decommit_pages`, returning one :class:`RangeResult` per range given back."""
        self._check_open("decommit_pages")
        self._charge("owner.pages")
        ids = self._check_pages(pages, "decommit")
        with self._slots_lock:  # which granules go depends on every page still committed
            return self._decommit_pages_locked(ids)

    def _decommit_pages_locked(self, ids: Sequence[int]) -> tuple[RangeResult, ...]:
        left = self._pages.difference(ids)
        # Slot 0's page always stays. Sorted: "does a kept page touch this granule" is one
        # bisection, not a scan of the granule's pages.
        keep = sorted(left | {0})
        gran = self.arena.granularity
        reqs: list[tuple[int, int, int]] = []
        # Buffers of one shape free the same ranges: work them out once per shape.
        by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
        wanted = self._wanted_test(left, ids)
        for i, off in enumerate(self._offsets):
            pb, limit = self._page_bytes[i], self._limits[i]
            ranges = by_shape.get((pb, limit))
            if ranges is None:
                free: set[int] = set()
                for p in ids:
                    lo, hi = self._page_granules(i, p)
                    for g in range(lo, hi, gran):  # a granule stays while a committed page uses it
                        first, last = g // pb, (min(g + gran, limit) - 1) // pb
                        j = bisect_left(keep, first)
                        if j == len(keep) or keep[j] > last:
                            free.add(g)
                ranges = _merged([(g, g + gran) for g in sorted(free)], touching=True)
                by_shape[(pb, limit)] = ranges
            for lo, hi in self._whole_mappings(i, off, ranges, wanted):
                reqs.append((off, lo, hi - lo))
        results = self._decommit_reqs(reqs)
        self._pages = left
        return results

    def _decommit_reqs(self, reqs: list[tuple[int, int, int]]) -> tuple[RangeResult, ...]:
        """Give back ``reqs`` (the lock held). After a failure, undone or past the unmaps,
        the committed pages list only those whose granules are still mapped."""
        try:
            results = self.arena.decommit_ranges_report(reqs) if reqs else ()
        except DriverError:
            self._sync_backed()
            self._reconcile_pages()
            raise
        self._sync_backed()
        return results

    def _reconcile_pages(self) -> None:
        """Drop from the committed pages every page a granule of which is unmapped in some
        buffer (after a failure: ``committed_pages`` never lists memory that is gone)."""
        self._pages = {p for p in self._pages
                       if not any(self.unbacked(i, *self._page_granules(i, p))
                                  for i in range(len(self._offsets)))}

    def release_beyond(self, n: int) -> int:
        """Give back everything past the first ``n`` token slots of every buffer.

        Unlike :meth:`shrink` no padded page is kept; a mapping straddling the end stays
        whole. Pages committed past ``n`` are forgotten; the token counts are capped at ``n``.

        Args:
            n: tokens, ``page_size <= n <= reserved_tokens`` (slot 0's page stays).
        Returns:
            Bytes given back.
        Raises:
            ArgumentError, OutOfRangeError: bad ``n``; nothing changed.
            DriverError: as for :meth:`shrink_report`.
        """
        self._check_open("release_beyond")
        n = _tokens("n", n, lo=self.page_size, hi=self.reserved_tokens, what="page_size")
        keep = [-(-n // tpr) * rb for tpr, rb in self._rows]
        return self._give_back_beyond(n, keep).given_bytes

    def _give_back_beyond(self, n: int, keep: Sequence[int]) -> ShrinkResult:
        before = self._backed
        first_gone = -(-n // self.page_size)
        try:
            results = self.arena.decommit_many_report(zip(self._offsets, keep, strict=True))
        except DriverError:
            self._sync_backed()
            if self._backed != before:  # past the unmaps: it stood
                self._cap_tokens(n)
            self._reconcile_pages()  # a hole's pages past n may be gone even if the prefix
            raise                    # stood: list only what is still mapped
        self._sync_backed()
        self._cap_tokens(n)
        self._pages = {p for p in self._pages if p < first_gone}
        return ShrinkResult(tokens=n, given_bytes=sum(r.given_bytes for r in results),
                            buffers=results)

    # -- slot ranges ----------------------------------------------------------------------

    def slot_block_tokens(self) -> int:
        """The fewest token slots, a whole number of pages, whose bytes are whole granules in
        every buffer: slot ranges aligned to it back and give back with no granule shared."""
        gran, ps = self.arena.granularity, self.page_size
        block = ps
        for tpr, rb in self._rows:
            per_token = rb // tpr if tpr > 1 else rb
            need = gran // math.gcd(gran, per_token)  # slots whose bytes are whole granules
            if tpr > 1:
                need = math.lcm(need, tpr)
            block = math.lcm(block, need)
        return block

    def _check_slots(self, ranges: Iterable[tuple[int, int]]) -> tuple[list[tuple[int, int]],
                                                                        list[range]]:
        """Merged ``[start, stop)`` slot ranges (page-aligned) and their page ids, as one
        ``range`` per slot range (a set takes a range in C: no per-page Python)."""
        if isinstance(ranges, (str, bytes)):
            raise ArgumentError("ranges", ranges, "an iterable of (start, stop) slot ranges")
        ps, top = self.page_size, self.pages * self.page_size
        out: list[tuple[int, int]] = []
        for i, r in enumerate(ranges):
            if type(r) is tuple and len(r) == 2:  # the usual case, checked without messages
                a, b = r
                if (type(a) is int and type(b) is int and 0 <= a < b <= top
                        and not a % ps and not b % ps):
                    out.append((a, b))
                    continue
            if not (isinstance(r, tuple) and len(r) == 2):
                raise ArgumentError(f"ranges[{i}]", r, "a (start, stop) tuple of token slots")
            a = _tokens(f"ranges[{i}][0]", r[0], lo=0, hi=None)
            b = _tokens(f"ranges[{i}][1]", r[1], lo=a + 1, hi=None, what="start + 1")
            if a % ps or b % ps:
                raise ArgumentError(f"ranges[{i}]", r, f"page-aligned slots (multiples of "
                                                       f"page_size={ps})")
            if b > top:
                raise OutOfRangeError(f"ranges[{i}][1]", b, f"<= {top} ({self.pages} pages "
                                                            f"of {ps} slots fit every buffer)")
            out.append((a, b))
        merged = _merged(out, touching=True)
        return merged, [range(a // ps, b // ps) for a, b in merged]

    def _slot_bytes(self, i: int, a: int, b: int) -> tuple[int, int]:
        """Buffer ``i``'s bytes of slots ``[a, b)``, rounded out to granules."""
        tpr, rb = self._rows[i]
        gran = self.arena.granularity
        lo = a // tpr * rb // gran * gran
        return lo, min(align_up(-(-b // tpr) * rb, gran), self._limits[i])

    def slot_ranges(self, ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """The ``(offset, start, nbytes)`` arena ranges :meth:`commit_slots` backs (pure)."""
        self._check_open("slot_ranges")
        return self._slot_reqs(self._check_slots(ranges)[0])

    def _slot_reqs(self, merged: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
        return [(off, lo, hi - lo) for i, off in enumerate(self._offsets)
                for lo, hi in _merged((self._slot_bytes(i, a, b) for a, b in merged),
                                      touching=True)]

    def commit_slots(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Back token-slot ranges ``[start, stop)`` of every buffer, in one transaction.

        Each contiguous range gets one handle per buffer for each unbacked gap in it (one
        in all with :func:`~kvvmm.layout.layer_interleaved`); its pages join
        :attr:`committed_pages`. Ranges aligned to :meth:`slot_block_tokens` share no granule.

        Args:
            ranges: ``(start, stop)`` token slots, multiples of ``page_size``,
                ``stop <= pages * page_size``.
        Returns:
            Bytes newly backed.
        Raises:
            ArgumentError, OutOfRangeError: a bad range; nothing committed.
            DriverError: a driver call failed; every buffer is as it was.
        """
        self._check_open("commit_slots")
        self._charge("owner.pages")
        merged, ids = self._check_slots(ranges)
        reqs = self._slot_reqs(merged)
        with self._slots_lock:
            try:
                added = self.arena.commit_ranges(reqs)
            finally:
                self._sync_backed()
            self._pages.update(*ids)
        return added

    def decommit_slots(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Give back token-slot ranges ``[start, stop)`` of every buffer, in one transaction.

        The inverse of :meth:`commit_slots`, with :meth:`decommit_pages`'s rules; costs what
        the ranges' ends touch, not what is committed elsewhere.

        Args:
            ranges: as :meth:`commit_slots`; a range must not include slot 0's page.
        Returns:
            Bytes given back.
        Raises:
            ArgumentError, OutOfRangeError: a bad range; nothing changed.
            DriverError: as for :meth:`decommit_pages`.
        """
        self._check_open("decommit_slots")
        self._charge("owner.pages")
        merged, ids = self._check_slots(ranges)
        if merged and merged[0][0] == 0:
            raise ArgumentError("ranges", merged[0], "ranges from page 1 on: page 0 holds "
                                                     "slot 0, which captured CUDA graphs write")
        gran, ps = self.arena.granularity, self.page_size
        with self._slots_lock:
            pages = self._pages
            reqs: list[tuple[int, int, int]] = []
            wanted = self._wanted_test(pages, itertools.chain.from_iterable(ids))
            for i, off in enumerate(self._offsets):
                pb = self._page_bytes[i]
                spans = []
                for a, b in merged:
                    lo, hi = self._slot_bytes(i, a, b)
                    p0, p1 = a // ps, b // ps
                    # the end granules may hold pages outside [p0, p1) still committed
                    if any(q == 0 or q in pages for q in range(lo // pb, p0)):
                        lo += gran
                    if any(q in pages for q in range(p1, -(-hi // pb))):
                        hi -= gran
                    if hi > lo:
                        spans.append((lo, hi))
                for lo, hi in self._whole_mappings(i, off, _merged(spans, touching=True),
                                                   wanted):
                    reqs.append((off, lo, hi - lo))
            results = self._decommit_reqs(reqs)
            pages.difference_update(*ids)
        return sum(r.given_bytes for r in results)

    def _wanted_test(self, kept: set[int] | frozenset[int],
                     going: Iterable[int]) -> Callable[[int], bool]:
        """Whether page ``q`` must stay backed after a decommit of the pages ``going``: slot
        0's page, or a page committed or ensured and not going."""
        gone = frozenset(going)
        ps = self.page_size
        ensured = max(self.prefix_tokens, self.final_tokens or 0)

        def wanted(q: int) -> bool:
            if q == 0:
                return True
            if q in gone:
                return False
            return q in kept or q * ps < ensured
        return wanted

    def _whole_mappings(self, i: int, off: int, ranges: list[tuple[int, int]],
                        wanted: Callable[[int], bool]) -> list[tuple[int, int]]:
        """``ranges`` (buffer ``i``'s granules to give back) widened to every mapping they
        cut into that no wanted page touches (a mapping is unmapped whole or not at all)."""
        if not ranges:
            return ranges
        pb = self._page_bytes[i]
        extra = []
        for lo, hi in ranges:
            for s, e in self.arena.mappings_over(off, lo, hi):
                if (s < lo or e > hi) and not any(
                        wanted(q) for q in range(s // pb, (e - 1) // pb + 1)):
                    extra.append((s, e))
        return _merged(ranges + extra, touching=True) if extra else ranges

    @property
    def committed_pages(self) -> frozenset[int]:
        """Pages committed by :meth:`commit_pages` and not given back since."""
        return frozenset(self._pages)

    def _cap_tokens(self, n: int) -> None:
        self.prefix_tokens = min(self.prefix_tokens, n)
        if self.final_tokens is not None:
            self.final_tokens = min(self.final_tokens, n)

    # -- sleep / wake ---------------------------------------------------------------------

    @property
    def asleep(self) -> bool:
        """True between :meth:`sleep` and :meth:`wake`."""
        return not self._closed and self.arena.asleep

    def sleep(self, backup: str | Backup | None = None, *, path: Any = None,
              keep_pool: bool = False) -> SleepResult:
        """Give every physical handle back, keeping the VA, the tensors and captured graphs.

        :meth:`wake` backs the same ranges at the same VA (with ``backup``, the same bytes);
        the owner's bookkeeping is kept and true again after it. While asleep the growth,
        shrink, page and slot calls refuse with :class:`~kvvmm.errors.AsleepError`;
        :meth:`close` works (and drops the backup). See :mod:`kvvmm.arena.sleep` for what
        the tensors read meanwhile.

        Args:
            backup: None (bytes dropped), ``"host"``, ``"disk"`` (a new file at ``path``), or
                a :class:`~kvvmm.arena.backup.Backup` (:mod:`kvvmm.arena.backup`).
            path: the file for ``backup="disk"``; it must not exist.
            keep_pool: keep the handle pool's idle handles (default: release them too).
        Returns:
            What :meth:`Arena.sleep <kvvmm.arena.Arena.sleep>` did (a ``SleepResult``).
        Raises:
            As :meth:`Arena.sleep <kvvmm.arena.Arena.sleep>`: a failed sleep leaves the owner
            awake with its contents; a release failing past the unmaps leaves it asleep.
        """
        self._check_open("sleep")
        self._charge("owner.sleep")
        with self._slots_lock:  # no page or slot change between the mappings and the mirror
            try:
                return self.arena.sleep(backup, path=path, keep_pool=keep_pool)
            finally:
                self._sync_backed()
                if self.arena.asleep:  # no fast path: even ensure_prefix(0) says asleep
                    self._covered = self._quiet = -1

    def wake(self) -> int:
        """End a :meth:`sleep`: back the same ranges again (same VA) and copy the bytes back.

        Returns:
            Bytes backed again.
        Raises:
            As :meth:`Arena.wake <kvvmm.arena.Arena.wake>`: a failed wake leaves the owner
            asleep with its backup intact; call :meth:`wake` again once the cause is gone.
        """
        self._check_open("wake")
        self._charge("owner.wake")
        with self._slots_lock:
            try:
                return self.arena.wake()
            finally:
                self._sync_backed()

    # -- captures (kvvmm.owner.captures) ----------------------------------------------------

    def capturing(self, name: str, *, keep: bool = False, fixed_capacity: bool = False,
                  survives_sleep: bool = False, on_conflict: ConflictHook | None = None
                  ) -> AbstractContextManager[Capture]:
        """A ``with`` block around a CUDA graph capture: every mapping now is recorded as
        capture ``name`` until the block ends (``keep``: until :meth:`release_capture`);
        an unmap under it is refused naming it. See :func:`kvvmm.owner.captures.capturing`.
        """
        from kvvmm.owner.captures import capturing

        return capturing(self, name, keep=keep, fixed_capacity=fixed_capacity,
                         survives_sleep=survives_sleep, on_conflict=on_conflict)

    def record_capture(self, name: str, ranges: Iterable[tuple[int, int]] | None = None, *,
                       fixed_capacity: bool = False, survives_sleep: bool = False,
                       on_conflict: ConflictHook | None = None) -> Capture:
        """Record a consumer (an NCCL or RDMA registration, a graph) of ``ranges`` (default:
        every mapping now), owned by this owner. See :func:`kvvmm.owner.captures.record`."""
        from kvvmm.owner.captures import record

        return record(self, name, ranges, fixed_capacity=fixed_capacity,
                      survives_sleep=survives_sleep, on_conflict=on_conflict)

    def release_capture(self, capture: Capture) -> None:
        """Release a capture this owner recorded.

        Raises:
            ArgumentError: not a live capture this owner recorded; nothing changed.
        """
        self.arena.release_capture(capture, by=self)

    # -- state ----------------------------------------------------------------------------

    @property
    def backed_bytes(self) -> int:
        """Bytes backed across all buffers (0 after close)."""
        return 0 if self._closed else self.arena.backed_bytes

    @property
    def backed_tokens(self) -> int:
        """The largest ``n`` for which :meth:`ensure_prefix` would back nothing (0 after
        close), capped at :attr:`max_prefix_tokens`; O(1)."""
        return 0 if self._closed else max(self._covered, 0)  # -1 asleep: see sleep()

    @property
    def closed(self) -> bool:
        return self._closed

    def snapshot(self) -> OwnerSnapshot:
        """Frozen view of the owner and its arena now."""
        arena = self.arena.snapshot()
        ps = self.page_size
        buffers = tuple(
            BufferInfo(
                name=d.name, offset=a.offset, shape=tuple(d.shape), reserved_span_bytes=span,
                aligned_bytes=a.size_bytes, backed_bytes=a.backed_bytes,
                page0_bytes=d.prefix_span_bytes(ps, ps),
                prefix_bytes=d.prefix_span_bytes(self.prefix_tokens, ps),
                final_bytes=None if self.final_tokens is None
                else d.final_span_bytes(self.final_tokens, ps),
            )
            for d, span, a in zip(self.descs, self._spans, arena.allocations, strict=True)
        )
        return OwnerSnapshot(arena=arena, dtype=self.dtype, page_size=ps,
                             reserved_tokens=self.reserved_tokens,
                             prefix_tokens=self.prefix_tokens, final_tokens=self.final_tokens,
                             policy=str(self.policy), buffers=buffers)

    def close(self) -> None:
        """Drop the tensors and close the arena (idempotent; see :meth:`Arena.close
        <kvvmm.arena.Arena.close>`: a DriverError with nothing given back leaves the owner
        usable)."""
        if self._closed:
            self.arena.close()  # retries a failed release, else a no-op
            return
        self.arena.check_close()  # a live capture: refused before anything changes
        self._charge("owner.close")
        self.tensors = []
        with self._slots_lock:  # a look-ahead's sync on the pool's thread cannot undo it
            self._closed = True
            self._quiet = -1
        try:
            self.arena.close()
        except DriverError:
            if not self.arena.closed:  # nothing was given back: usable as before
                self._closed = False
                self.tensors = [self.arena.tensor(o, d.shape, self.dtype)
                                for o, d in zip(self._offsets, self.descs, strict=True)]
            raise


def _merged(ranges: Iterable[tuple[int, int]], *, touching: bool = False) -> list[tuple[int, int]]:
    """Sorted ranges with overlapping ones joined (and touching ones, if asked)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and (lo < out[-1][1] or (touching and lo == out[-1][1])):
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


#: How a refused ``ensure_prefix`` names its bound (the owner's and the collective owner's).
PREFIX_BOUND = "max_prefix_tokens (reserved_tokens + page_size)"


def _tokens(name: str, value: object, *, lo: int, hi: int | None, what: str = "",
            hi_name: str = "reserved_tokens") -> int:
    if not is_int(value):
        raise ArgumentError(name, value, "an int (tokens)")
    if value < lo:
        named = what and what != str(lo)
        raise ArgumentError(name, value, f">= {what} ({lo})" if named else f">= {lo}")
    if hi is not None and value > hi:
        raise OutOfRangeError(name, value, f"<= {hi_name} ({hi})")
    return value


def _check_descs(descs: object) -> None:
    """A non-empty sequence of KvBufferDesc with unique names."""
    if isinstance(descs, (str, bytes)) or not isinstance(descs, Sequence) or not descs:
        raise ArgumentError("descs", descs, "a non-empty sequence of KvBufferDesc")
    for i, d in enumerate(descs):
        if not isinstance(d, KvBufferDesc):
            raise ArgumentError(f"descs[{i}]", d, "a KvBufferDesc")
    names = [d.name for d in descs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ArgumentError("descs", dup, "buffers with unique names")

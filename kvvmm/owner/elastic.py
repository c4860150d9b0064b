"""RangeBacking: elastic KV memory per request, with the driver work off the decode thread.

Measured on an H200 (issue 31): committing a request page by page over a per-layer owner is
``2 x layers`` mappings per page at ~80-110 us each, milliseconds per request on the decode
thread. The cost is in the number of mappings and in where they run. This module removes
both:

- **Ranges, not pages.** Each request gets a lease of contiguous *blocks* of token slots
  (:meth:`KvBufferOwner.slot_block_tokens`: a whole number of pages whose bytes are whole
  granules in every buffer) from a best-fit allocator (:class:`~kvvmm.layout.SlotRanges`).
  A fresh range is backed by :meth:`KvBufferOwner.commit_slots`: one handle per buffer, one
  handle in all with the interleaved layout (:func:`~kvvmm.layout.layer_interleaved`).
- **Deferred reclamation** (vAttention's): a released lease's blocks stay mapped, free for
  the next request (``cached``); admitting from them costs no driver call. They are given
  back only above ``high_bytes`` (down to ``reserve_bytes``), or when asked
  (:meth:`RangeBacking.reclaim`, the pressure call), on the backing thread.
- **A reserve mapped ahead** (kvcached's pre-allocation): the backing thread keeps at least
  ``reserve_bytes`` of free blocks mapped, so admissions find their memory ready; a lease
  that outruns it takes blocks of the refill in flight (it waits for that one commit, not
  for a commit of its own queued behind it), then fresh blocks mapped on the backing
  thread, and the decode step only checks :attr:`Lease.ready` (an attribute read).

Blocks are in exactly one of three states: leased (to a live lease), cached (free and
mapped) or fresh (free and unmapped). The mapped ones are grouped in *units*, one per
commit (what one handle per buffer backs): a unit is given back only when every block of it
is cached, so a decommit always covers whole mappings.

Threads: every public method may be called from the engine's thread; the driver calls run on
the backing thread (``executor=None``), on the caller's (``"inline"``), or through a callable
the caller gives (the workload lab's, which accounts the time as off the decode path). The
state lock is never held across a driver call.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvvmm.checks import int_arg, seconds_arg
from kvvmm.errors import ArgumentError, ClosedError, KvvmmError
from kvvmm.layout.ranges import RangesFullError, SlotRanges
from kvvmm.owner.buffers import KvBufferOwner

__all__ = ["BackingStats", "Lease", "RangeBacking"]

#: ``executor(job, waited)``: run ``job()`` (now or later, on any thread); ``waited`` says
#: whether a lease waits for it (True) or it is upkeep nobody waits for (False).
Executor = Callable[[Callable[[], None], bool], None]


class Lease:
    """A request's token slots: contiguous block ranges from one :class:`RangeBacking`.

    ``ready`` turns True once every block is mapped (at once when the blocks were cached);
    the decode step reads it, and :meth:`RangeBacking.wait` blocks on it.
    """

    __slots__ = ("_done", "_failed", "_pend", "_queued", "block_tokens", "error", "pending",
                 "pieces", "ready", "released", "tokens")

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.pieces: list[tuple[int, int]] = []  #: ``(first block, blocks)``, in order taken
        self.tokens = 0  #: slots asked for
        self.pending = 0  #: fresh pieces whose commit has not finished
        self.ready = True  #: every block mapped
        self.released = False
        self.error: BaseException | None = None  #: a failed commit's error
        self._pend: set[tuple[int, int]] = set()  # pieces whose commit runs
        self._failed: set[tuple[int, int]] = set()  # pieces whose commit failed (unbacked)
        # made when a commit is first queued for the lease (most admissions find cached
        # blocks and never wait); None means nothing was ever pending
        self._done: threading.Event | None = None
        self._queued: list[Callable[[], None]] = []  # its commits given to the backing thread

    def __repr__(self) -> str:
        return (f"Lease({self.tokens} tokens in {len(self.pieces)} ranges, "
                f"{'ready' if self.ready else 'pending'})")

    @property
    def blocks(self) -> int:
        return sum(n for _, n in self.pieces)

    @property
    def slots(self) -> list[tuple[int, int]]:
        """The lease's ``[start, stop)`` token-slot ranges, in order taken."""
        bt = self.block_tokens
        return [(s * bt, (s + n) * bt) for s, n in self.pieces]

    def pages(self, page_size: int) -> list[int]:
        """Page ids of the lease's slots, in order taken (what a page table lists)."""
        return [p for a, b in self.slots for p in range(a // page_size, b // page_size)]


@dataclass(frozen=True, slots=True)
class BackingStats:
    """What a :class:`RangeBacking` holds now, in bytes (all buffers together)."""

    leased_bytes: int  #: blocks of live leases
    cached_bytes: int  #: free blocks kept mapped (deferred reclamation and the reserve)
    pending_bytes: int  #: blocks whose commit is queued or running
    fresh_bytes: int  #: free blocks not backed
    units: int  #: mapped units (one handle per buffer each)
    fragmentation: float  #: of the free blocks, 1 - largest free range / free
    admits: int  #: leases admitted
    admits_ready: int  #: ... that needed no driver call on admission
    commits: int  #: commits run (admissions, growth, reserve refills)
    reclaims: int  #: units given back


class RangeBacking:
    """Request-granular backing of one owner, with deferred reclamation and a reserve.

    Args:
        owner: the :class:`KvBufferOwner` whose slots are leased (its ``commit_slots`` /
            ``decommit_slots`` do the backing; use the owner for nothing else that backs).
        reserve_bytes: keep at least this much free memory mapped ahead (0: none).
        high_bytes: give back cached blocks above this (down to ``reserve_bytes``; default
            ``2 * reserve_bytes``, 0 with no reserve: give back at release).
        executor: where driver calls run: None (a backing thread of this object),
            ``"inline"`` (the calling thread, as it calls), or ``executor(job, waited)``.
    Raises:
        ArgumentError: bad arguments.
    """

    def __init__(self, owner: KvBufferOwner, *, reserve_bytes: int = 0,
                 high_bytes: int | None = None,
                 executor: Executor | str | None = None) -> None:
        if not isinstance(owner, KvBufferOwner):
            raise ArgumentError("owner", owner, "a KvBufferOwner")
        if owner.closed:
            raise ClosedError("RangeBacking: the owner is closed")
        for name, v in (("reserve_bytes", reserve_bytes), ("high_bytes", high_bytes)):
            if v is not None:
                int_arg(name, v, lo=0, unit="bytes")
        if high_bytes is not None and high_bytes < reserve_bytes:
            raise ArgumentError("high_bytes", high_bytes,
                                f">= reserve_bytes ({reserve_bytes})")
        if not (executor is None or executor == "inline" or callable(executor)):
            raise ArgumentError("executor", executor, "None, 'inline' or a callable "
                                                      "executor(job, waited)")
        if owner.committed_pages:
            raise ArgumentError("owner", owner, "an owner with no pages committed beyond "
                                "slot 0's (a RangeBacking leases every other slot; it has "
                                f"{len(owner.committed_pages)} committed)")
        self.owner = owner
        bt = owner.slot_block_tokens()
        self.block_tokens = bt
        ps = owner.page_size
        self.blocks = (owner.pages * ps) // bt
        self.first = -(-ps // bt)  # block 0 holds slot 0's page: never leased
        if self.blocks <= self.first:
            raise ArgumentError("owner", owner, f"an owner holding at least two blocks of "
                                                f"{bt} slots (slot_block_tokens)")
        self.block_bytes = sum(rb * bt // tpr for tpr, rb in
                               ((d.tokens_per_row, d.row_bytes) for d in owner.descs))
        self.reserve_blocks = -(-reserve_bytes // self.block_bytes)
        high = 2 * reserve_bytes if high_bytes is None else high_bytes
        self.high_blocks = max(self.reserve_blocks, high // self.block_bytes)
        self._cached = SlotRanges(self.blocks, first=self.first, free=False)
        self._fresh = SlotRanges(self.blocks, first=self.first)
        self._units: dict[int, int] = {}  # mapped unit's first block -> blocks
        self._starts: list[int] = []  # the mapped units' first blocks, sorted (a bisect finds
        # the unit holding a block: no per-block index to keep, so a commit costs its pieces)
        self._pending = 0  # blocks in queued or running commits
        self._refill_job: Callable[[], None] | None = None  # the reserve refill queued or
        # running (one at a time); its blocks no admission has claimed (sorted pieces), and
        # the claims: an admission
        # that outruns the reserve on the backing thread takes blocks of the refill in flight
        # (ready when it ends) before fresh ones (a commit of its own, queued after it)
        self._inflight: list[tuple[int, int]] = []
        self._claims: list[tuple[Lease, tuple[int, int]]] = []
        self._reclaiming = False
        self._lock = threading.Lock()
        self._closed = False
        self._admits = self._admits_ready = self._commits = self._reclaims = 0
        self._leased = 0
        self._thread: threading.Thread | None = None
        self._jobs: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition(self._lock)
        self._busy = False
        self._stolen = 0  # queued jobs a waiting caller took to run itself, still running
        if executor is None:
            self._executor: Executor = self._submit
            self._thread = threading.Thread(target=self._loop, name="kvvmm-range-backing",
                                            daemon=True)
            self._thread.start()
        elif executor == "inline":
            self._executor = _inline
        else:
            assert callable(executor)
            self._executor = executor
        self._upkeep()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"RangeBacking(blocks of {self.block_tokens} slots, {s.leased_bytes} leased, "
                f"{s.cached_bytes} cached, {s.units} units)")

    # -- the backing thread ----------------------------------------------------------------

    def _submit(self, job: Callable[[], None], waited: bool) -> None:
        with self._lock:
            if waited:
                self._jobs.appendleft(job)  # a lease waits for it: before upkeep
            else:
                self._jobs.append(job)
            self._wake.notify_all()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                job()
            except BaseException:  # a job records its own failure; the thread goes on
                pass
            finally:
                with self._lock:
                    self._busy = False
                    self._wake.notify_all()

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until the backing thread has nothing queued or running (True) or timeout."""
        timeout_s = seconds_arg("timeout_s", timeout_s)
        if self._thread is None:
            return True
        with self._lock:
            return self._wake.wait_for(
                lambda: not self._jobs and not self._busy and not self._stolen, timeout_s)

    # -- leases ----------------------------------------------------------------------------

    def _check_tokens(self, tokens: object) -> int:
        n = int_arg("tokens", tokens, lo=1, limit="an int >= 1 (token slots)")
        cap = (self.blocks - self.first) * self.block_tokens
        if n > cap:
            raise RangesFullError("tokens", n, f"<= {cap}, the slots one lease can hold")
        return n

    def admit(self, tokens: int) -> Lease:
        """Lease slots for ``tokens`` tokens: cached blocks first (no driver call), then
        fresh ones, mapped on the backing thread (check :attr:`Lease.ready`).

        Raises:
            ArgumentError: bad ``tokens``.
            RangesFullError: not enough free blocks (nothing changed).
            ClosedError: after :meth:`close`.
        """
        tokens = self._check_tokens(tokens)
        lease = Lease(self.block_tokens)
        self._take(lease, -(-tokens // self.block_tokens), tokens)
        lease.tokens = tokens
        self._admits += 1
        if lease.ready:
            self._admits_ready += 1
        return lease

    def grow(self, lease: Lease, tokens: int) -> bool:
        """Make ``lease`` hold ``tokens`` slots (more than now): in place when the blocks
        after its last range are free, else in a new range. Returns whether it had to take
        blocks (False: its blocks already hold ``tokens``)."""
        tokens = self._check_tokens(tokens)
        if lease.released:
            raise ArgumentError("lease", lease, "a live lease (this one was released)")
        more = -(-tokens // self.block_tokens) - lease.blocks
        if more > 0:
            self._take(lease, more, tokens)  # raises with the lease as it was
        lease.tokens = max(lease.tokens, tokens)
        return more > 0

    def _take(self, lease: Lease, n: int, tokens: int) -> None:
        with self._lock:
            if self._closed:
                raise ClosedError("RangeBacking: admit after close()")
            cached, fresh = self._cached, self._fresh
            if n > cached.free_units + fresh.free_units:
                raise RangesFullError("tokens", tokens,
                                      f"what the free blocks hold ({cached.free_units} "
                                      f"cached and {fresh.free_units} fresh blocks of "
                                      f"{self.block_tokens} slots)")
            if lease.pieces:  # grow in place onto cached blocks: the range stays one range
                s, k = lease.pieces[-1]
                if (s, k) not in lease._pend and (s, k) not in lease._failed \
                        and s + k + n <= self.blocks and cached.is_free(s + k, n):
                    cached.take(s + k, n)
                    lease.pieces[-1] = (s, k + n)
                    self._leased += n
                    n = 0
            got: list[tuple[int, int]] = []
            new: list[tuple[int, int]] = []
            if n and cached.free_units:
                k = min(n, cached.free_units)
                got = cached.alloc_pieces(k)
                n -= k
            claimed: list[tuple[int, int]] = []
            if n and self._inflight and self._thread is not None:  # (an executor of the
                claimed, n = self._claim(lease, n)  # caller's may hold the refill back)
            if n:
                new = fresh.alloc_pieces(n)
            lease.pieces += got + claimed + new
            self._leased += sum(k for _, k in got) + sum(k for _, k in claimed) + \
                sum(k for _, k in new)
            if new:
                self._pending += sum(k for _, k in new)
                _await(lease, new, commit=True)
        if new:
            job = lambda: self._commit(lease, new)  # noqa: E731
            if self._thread is not None:
                lease._queued.append(job)  # wait() runs it itself if the thread has not begun
            self._executor(job, True)  # its end refills the reserve: not ahead of it
        else:
            self._upkeep()  # refill what the lease took from the reserve

    def _claim(self, lease: Lease, n: int) -> tuple[list[tuple[int, int]], int]:
        """Lease up to ``n`` blocks of the refill in flight to ``lease`` (the lock held):
        the pieces taken and the blocks still wanted. The lease waits for that refill (one
        commit already queued or running) instead of queueing a commit of its own behind it:
        in a burst of admissions, each waits for at most one commit, and the handles stay
        the reserve's size. The refill job moves to the front of the queue (a lease waits)."""
        job = self._refill_job
        assert job is not None
        taken: list[tuple[int, int]] = []
        left = self._inflight
        while n and left:
            s, k = left[0]
            m = min(k, n)
            taken.append((s, m))
            if m == k:
                left.pop(0)
            else:
                left[0] = (s + m, k - m)
            n -= m
        first = not any(c is lease for c, _ in self._claims)
        if first:  # the refill's end is one more commit the lease waits for
            lease._queued.append(job)  # wait() may run it itself if it has not begun
            if job in self._jobs:
                self._jobs.remove(job)
                self._jobs.appendleft(job)
        self._claims += [(lease, p) for p in taken]
        _await(lease, taken, commit=first)
        return taken, n

    def _refill_done(self, err: BaseException | None) -> None:
        """The refill in flight ended (the lock held): its unclaimed blocks join the cache
        (or go back to fresh on a failure), and each claiming lease gets its blocks."""
        ok = err is None
        for s, n in self._inflight:
            (self._cached if ok else self._fresh).free(s, n)
        claims, self._claims, self._inflight = self._claims, [], []
        self._refill_job = None
        by_lease: dict[int, tuple[Lease, list[tuple[int, int]]]] = {}
        for lease, p in claims:
            by_lease.setdefault(id(lease), (lease, []))[1].append(p)
        for lease, pieces in by_lease.values():
            self._pieces_done(lease, pieces, err)

    def _pieces_done(self, lease: Lease, pieces: list[tuple[int, int]],
                     err: BaseException | None) -> None:
        """One commit ``lease`` waited for ended (the lock held): its ``pieces`` are mapped
        or failed; a lease released meanwhile gives them back now; the last one makes the
        lease ready (or failed) and wakes its waiter."""
        lease._pend.difference_update(pieces)
        if err is not None:
            lease.error = err
            lease._failed.update(pieces)
        if lease.released:  # released while the commit ran: its pieces come back now
            for s, n in pieces:
                (self._cached if err is None else self._fresh).free(s, n)
        lease.pending -= 1
        if lease.pending == 0:
            lease.ready = lease.error is None
            lease._queued.clear()
            assert lease._done is not None  # made when the commit was queued
            lease._done.set()

    def _commit(self, lease: Lease | None, pieces: list[tuple[int, int]]) -> None:
        """Back fresh ``pieces`` (a job): one commit, one unit per piece."""
        bt = self.block_tokens
        err: BaseException | None = None
        try:
            self.owner.commit_slots([(s * bt, (s + n) * bt) for s, n in pieces])
        except BaseException as e:
            err = e
        with self._lock:
            self._pending -= sum(n for _, n in pieces)
            self._commits += 1
            if err is None:
                for s, n in pieces:
                    self._units[s] = n
                    bisect.insort(self._starts, s)
            pending = self._pending
            if lease is None:  # a reserve refill (the one in flight)
                self._refill_done(err)
            else:
                self._pieces_done(lease, pieces, err)
        # the reserve's refill (what the lease took from it) and any reclamation its release
        # made due: queued once the lease is mapped, so it never runs ahead of the lease's own
        # commit (on the thread it would hold the owner while a waiter's commit waits); a
        # refill's end leaves the next refill to the end of any commit still pending
        if lease is not None or not pending:
            self._upkeep()

    def ready(self, lease: Lease) -> bool:
        """The decode step's check: every block of ``lease`` mapped (an attribute read)."""
        return lease.ready

    def wait(self, lease: Lease, timeout_s: float = 30.0) -> Lease:
        """Block until ``lease`` is ready; raise its commit's error if one failed.

        Raises:
            KvvmmError: the commit failed (the lease keeps its blocks; release it), or the
                timeout passed.
            ArgumentError: ``timeout_s`` is not a finite number >= 0.
        """
        timeout_s = seconds_arg("timeout_s", timeout_s)
        if not lease.ready and lease._queued:
            self._run_queued(lease)
        done = lease._done
        if done is not None and not done.wait(timeout_s):
            raise KvvmmError(f"RangeBacking: lease not mapped within {timeout_s} s")
        if lease.error is not None:
            raise lease.error
        return lease

    def _run_queued(self, lease: Lease) -> None:
        """Run ``lease``'s commits the backing thread has not begun, here: a caller that
        waits does its own mapping instead of waiting for the thread to wake and take it
        (a thread hand-off costs tens of us; the commit is the same one, in the same order
        against other commits: the owner's lock orders them)."""
        with self._lock:
            mine = [j for j in lease._queued if j in self._jobs]
            for j in mine:
                self._jobs.remove(j)
            lease._queued.clear()
            self._stolen += len(mine)
        for i, j in enumerate(mine):
            try:
                j()  # a commit records its own failure on the lease
            except BaseException:  # not the commit's (a Ctrl-C): the rest go back to the thread
                with self._lock:
                    rest = mine[i + 1:]
                    self._jobs.extendleft(reversed(rest))
                    lease._queued += rest
                    self._stolen -= len(mine) - i
                    self._wake.notify_all()
                raise
            with self._lock:
                self._stolen -= 1
                self._wake.notify_all()

    def release(self, lease: Lease) -> None:
        """Give ``lease``'s blocks back: mapped ones stay mapped (cached) for the next
        admission, and the backing thread gives back what lies above ``high_bytes``. A lease
        whose commit is still running gives those blocks back when it ends. Idempotent."""
        if lease.released:
            return
        with self._lock:
            lease.released = True
            self._leased -= lease.blocks
            for p in lease.pieces:
                if p in lease._pend:
                    continue  # the running commit frees it at its end
                (self._fresh if p in lease._failed else self._cached).free(*p)
        self._upkeep()

    # -- upkeep: the reserve and reclamation -------------------------------------------

    def _upkeep(self) -> None:
        """Queue a refill of the reserve or a reclamation above the high mark, if due."""
        job: Callable[[], None] | None = None
        with self._lock:
            if self._closed:
                return
            # cached, and to be cached: the refill's blocks no admission claimed
            cached = self._cached.free_units + sum(k for _, k in self._inflight)
            if cached > self.high_blocks and not self._reclaiming:
                self._reclaiming = True
                job = self._reclaim_job
            elif cached < self.reserve_blocks and self._refill_job is None \
                    and self._fresh.free_units:
                want = min(self.reserve_blocks - cached, self._fresh.free_units)
                try:
                    pieces = self._fresh.alloc_pieces(want)
                except RangesFullError:
                    pieces = []
                if pieces:
                    self._pending += want
                    self._inflight = list(pieces)
                    job = lambda: self._commit(None, pieces)  # noqa: E731
                    self._refill_job = job
        if job is not None:
            self._executor(job, False)

    def _reclaim_job(self) -> None:
        try:
            self._reclaim(self.reserve_blocks)
        finally:
            with self._lock:
                self._reclaiming = False

    def reclaim(self, keep_bytes: int = 0) -> int:
        """Give back cached blocks (whole units) until at most ``keep_bytes`` stay cached,
        now, on the calling thread: the pressure call. Returns bytes given back."""
        int_arg("keep_bytes", keep_bytes, lo=0, unit="bytes")
        return self._reclaim(keep_bytes // self.block_bytes)

    def _reclaim(self, keep_blocks: int) -> int:
        """Take whole cached units (highest first) out of the cache, decommit them, free
        them as fresh. On a failed decommit the units go back to the cache."""
        with self._lock:
            excess = self._cached.free_units - keep_blocks
            if excess <= 0:
                return 0
            picked: list[tuple[int, int]] = []
            starts, units = self._starts, self._units
            for start, length in reversed(self._cached.extents):
                end = start + length
                # the unit holding ``start`` (cached blocks are mapped), then those after it
                i = max(bisect.bisect_right(starts, start) - 1, 0)
                while i < len(starts) and starts[i] < end and excess > 0:
                    u = starts[i]
                    n = units[u]
                    if u >= start and u + n <= end:
                        picked.append((u, n))
                        excess -= n
                    i += 1
                if excess <= 0:
                    break
            for s, n in picked:
                self._cached.take(s, n)
                del units[s]
                del starts[bisect.bisect_left(starts, s)]
        if not picked:
            return 0
        bt = self.block_tokens
        try:
            given = self.owner.decommit_slots([(s * bt, (s + n) * bt) for s, n in picked])
        except BaseException:
            with self._lock:
                for s, n in picked:  # still mapped (the decommit is a transaction)
                    self._units[s] = n
                    bisect.insort(self._starts, s)
                    self._cached.free(s, n)
            raise
        with self._lock:
            self._reclaims += len(picked)
            for s, n in picked:
                self._fresh.free(s, n)
        return given

    # -- state -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def stats(self) -> BackingStats:
        with self._lock:
            bb = self.block_bytes
            free = self._cached.free_units + self._fresh.free_units
            largest = max(self._cached.largest_free, self._fresh.largest_free)
            return BackingStats(
                leased_bytes=self._leased * bb, cached_bytes=self._cached.free_units * bb,
                pending_bytes=self._pending * bb, fresh_bytes=self._fresh.free_units * bb,
                units=len(self._units),
                fragmentation=1.0 - largest / free if free else 0.0,
                admits=self._admits, admits_ready=self._admits_ready,
                commits=self._commits, reclaims=self._reclaims)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the backing thread (after what it runs now). The owner's memory stays
        with the owner (``owner.close()`` gives it back). Idempotent."""
        timeout_s = seconds_arg("timeout_s", timeout_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.clear()
            self._wake.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)

    def __enter__(self) -> RangeBacking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _inline(job: Callable[[], None], waited: bool) -> None:
    job()


def _await(lease: Lease, pieces: list[tuple[int, int]], *, commit: bool) -> None:
    """``lease`` waits for ``pieces`` to be mapped (the lock held): by one more commit
    (``commit``), or by one it already waits for; its Event is made or cleared for it."""
    lease._pend.update(pieces)
    if commit:
        lease.pending += 1
    lease.ready = False
    if lease._done is None:
        lease._done = threading.Event()
    else:
        lease._done.clear()


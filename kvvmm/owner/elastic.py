"""RangeBacking: elastic KV memory per request, with the driver work off the decode thread.

Committing a request page by page costs ``2 x layers`` mappings per page on the decode
thread (docs/ELASTIC.md). This module cuts both the number of mappings and where they run:

- **Ranges, not pages.** Each request gets a lease of contiguous *blocks* of token slots
  (:meth:`KvBufferOwner.slot_block_tokens`) from a best-fit allocator
  (:class:`~kvvmm.layout.SlotRanges`); a fresh range is one :meth:`KvBufferOwner.commit_slots`.
- **Deferred reclamation.** A released lease's blocks stay mapped (``cached``) for the next
  request, which admits them with no driver call; they are given back above ``high_bytes``
  (down to ``reserve_bytes``), or when asked (:meth:`RangeBacking.reclaim`,
  :meth:`RangeBacking.give_back`), on the backing thread.
- **A reserve mapped ahead.** The backing thread keeps ``reserve_bytes`` of free blocks
  mapped. A lease that outruns it claims blocks of the refill in flight, then fresh blocks
  mapped on the backing thread; the decode step only reads :attr:`Lease.ready`.

Every block is leased, cached (free, mapped) or fresh (free, unmapped). Mapped blocks are
grouped in *units*, one per commit: a unit is given back only when all its blocks are cached,
so a decommit covers whole mappings. Which blocks are mapped is the owner's record
(:meth:`KvBufferOwner.mapped <kvvmm.owner.KvBufferOwner.mapped>`); the backing keeps only the
leases and which free blocks are cached or fresh.

Threads: every public method may be called from the engine's thread; driver calls run on the
backing thread (``executor=None``), the caller's (``"inline"``), or a caller's executor. The
state lock is never held across a driver call. A lease is its backing's until released:
anything else passed as a lease is refused before anything changes. A driver call that fails
while blocks are mapped or given back leaves the three states equal to the arena's mappings
(the error's notes say which blocks went).
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvvmm.checks import int_arg, seconds_arg
from kvvmm.errors import (
    ArgumentError,
    AsleepError,
    ClosedError,
    KvvmmError,
    OutOfRangeError,
    WrongTypeError,
)
from kvvmm.layout.ranges import RangesFullError, SlotRanges
from kvvmm.owner.buffers import KvBufferOwner

__all__ = ["BackingStats", "GiveBack", "Lease", "RangeBacking"]

#: The open backing of each owner (one at a time: each leases every slot of its owner).
_OWNERS: weakref.WeakKeyDictionary[KvBufferOwner, weakref.ref[RangeBacking]] = \
    weakref.WeakKeyDictionary()
_OWNERS_LOCK = threading.Lock()

#: ``executor(job, waited)``: run ``job()`` (now or later, on any thread); ``waited`` says
#: whether a lease waits for it (True) or it is upkeep nobody waits for (False).
Executor = Callable[[Callable[[], None], bool], None]


class Lease:
    """A request's token slots: contiguous block ranges from one :class:`RangeBacking`.

    ``ready`` turns True once every block is mapped; :meth:`RangeBacking.wait` blocks on it.
    Read-only: the backing alone moves its fields.
    """

    __slots__ = ("_bt", "_done", "_error", "_failed", "_maker", "_pend", "_pending",
                 "_pieces", "_queued", "_ready", "_released", "_tokens")

    def __init__(self, block_tokens: int) -> None:
        self._bt = block_tokens
        self._pieces: list[tuple[int, int]] = []  # (first block, blocks), in order taken
        self._tokens = 0
        self._pending = 0
        self._ready = True
        self._released = False
        self._error: BaseException | None = None
        self._pend: set[tuple[int, int]] = set()  # pieces whose commit runs
        self._failed: set[tuple[int, int]] = set()  # pieces whose commit failed (unbacked)
        self._done: threading.Event | None = None
        self._queued: list[Callable[[], None]] = []  # its commits given to the backing thread
        self._maker: object = None  # the RangeBacking that admitted it

    def __repr__(self) -> str:
        return (f"Lease({self._tokens} tokens in {len(self._pieces)} ranges, "
                f"{'ready' if self._ready else 'pending'})")

    @property
    def block_tokens(self) -> int:
        """Token slots per block."""
        return self._bt

    @property
    def pieces(self) -> list[tuple[int, int]]:
        """``(first block, blocks)`` ranges, in order taken (a copy)."""
        return list(self._pieces)

    @property
    def tokens(self) -> int:
        """Slots asked for."""
        return self._tokens

    @property
    def pending(self) -> int:
        """Commits the lease waits for that have not ended."""
        return self._pending

    @property
    def ready(self) -> bool:
        """Every block mapped."""
        return self._ready

    @property
    def released(self) -> bool:
        """Given back by :meth:`RangeBacking.release`."""
        return self._released

    @property
    def error(self) -> BaseException | None:
        """A failed commit's error (None while none failed)."""
        return self._error

    @property
    def blocks(self) -> int:
        return sum(n for _, n in self._pieces)

    @property
    def slots(self) -> list[tuple[int, int]]:
        """The lease's ``[start, stop)`` token-slot ranges, in order taken."""
        bt = self._bt
        return [(s * bt, (s + n) * bt) for s, n in self._pieces]

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
    givable_bytes: int = 0  #: whole units free and mapped: what :meth:`give_back` frees


#: Why a :class:`GiveBack` stopped.
STOPS = ("enough", "deadline", "empty", "error", "closed")


class GiveBack:
    """One :meth:`RangeBacking.give_back`: filled in on the backing thread, read anywhere.

    Once ``done``, ``stopped`` says why: ``"enough"``, ``"deadline"`` (the next unit would
    have passed it), ``"empty"`` (no whole cached unit left), ``"error"`` (:attr:`error`,
    raised by :meth:`wait`) or ``"closed"`` (the backing closed before it began).
    """

    __slots__ = ("_done", "asked_bytes", "deadline_s", "elapsed_s", "error", "freed_bytes",
                 "stopped", "unit_max_s", "units")

    def __init__(self, asked_bytes: int, deadline_s: float) -> None:
        self.asked_bytes = asked_bytes  #: what was asked (all cached units: -1)
        self.deadline_s = deadline_s  #: the bound, from the call, on the caller's clock
        self.freed_bytes = 0  #: given back so far (every buffer's bytes)
        self.units = 0  #: units (one handle per buffer each) given back so far
        self.elapsed_s = 0.0  #: from the call to the stop (queueing on the thread included)
        self.unit_max_s = 0.0  #: the longest one unit's decommit took
        self.stopped: str | None = None  #: one of :data:`STOPS` once done
        self.error: BaseException | None = None  #: a failed decommit's error
        self._done = threading.Event()

    def __repr__(self) -> str:
        state = f"stopped: {self.stopped}" if self.done else "running"
        return (f"GiveBack({self.freed_bytes} bytes in {self.units} units, "
                f"{self.elapsed_s * 1e3:.3f} ms, {state})")

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float = 30.0) -> GiveBack:
        """Block until it stopped; raise the failed decommit's error if one failed.

        Raises:
            KvvmmError: not stopped within ``timeout_s``.
            DriverError: a decommit failed (its notes say which units went).
            ClosedError: the backing closed before it began.
            ArgumentError: a bad ``timeout_s``.
        """
        timeout_s = seconds_arg("timeout_s", timeout_s)
        if not self._done.wait(timeout_s):
            raise KvvmmError(f"RangeBacking: give_back not done within {timeout_s} s")
        if self.error is not None:
            raise self.error
        return self


class RangeBacking:
    """Request-granular backing of one owner, with deferred reclamation and a reserve.

    Args:
        owner: the :class:`KvBufferOwner` whose slots are leased (use it for nothing else
            that backs).
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
        _check_args(owner, reserve_bytes, high_bytes, executor)
        self.owner = owner
        self._size_blocks(reserve_bytes, high_bytes)
        self._init_state()
        with _OWNERS_LOCK:  # two backings over one owner would lease the same slots twice
            held = _OWNERS.get(owner)
            other = held() if held is not None else None
            if other is not None and not other._closed:
                raise ArgumentError("owner", owner, "an owner no open RangeBacking leases "
                                    "from (close the other one first)")
            _OWNERS[owner] = weakref.ref(self)
        self._thread: threading.Thread | None = None
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
        try:
            self._upkeep()
        except BaseException:  # the executor refused the first refill: nothing is kept
            self.close()
            raise

    def _size_blocks(self, reserve_bytes: int, high_bytes: int | None) -> None:
        """Blocks, their bytes, and the reserve and high marks in blocks."""
        owner = self.owner
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
        # a unit is one mapping of the first buffer, read from the owner's record
        d0 = owner.descs[0]
        self._unit_bytes = (bt // d0.tokens_per_row * d0.row_bytes if d0.tokens_per_row > 1
                            else bt * d0.row_bytes)  # the first buffer's bytes of a block
        # a mark past what the buffers lease or the device holds is refused, not clamped
        cap = (self.blocks - self.first) * self.block_bytes
        total = owner.arena.driver.mem_info()[1]
        limit = min(cap, total)
        why = (f"the {cap} bytes of blocks these buffers lease" if cap <= total
               else f"the device's {total} bytes of memory")
        for name, v in (("reserve_bytes", reserve_bytes), ("high_bytes", high_bytes)):
            if v is not None and v > limit:
                raise OutOfRangeError(name, v, f"<= {limit} bytes ({why})")
        self.reserve_blocks = -(-reserve_bytes // self.block_bytes)
        high = min(2 * reserve_bytes, limit) if high_bytes is None else high_bytes
        self.high_blocks = max(self.reserve_blocks, high // self.block_bytes)

    def _init_state(self) -> None:
        """Every block free and fresh, nothing queued, no lease."""
        self._cached = SlotRanges(self.blocks, first=self.first, free=False)
        self._fresh = SlotRanges(self.blocks, first=self.first)
        self._pending = 0  # blocks in queued or running commits
        # the reserve refill queued or running (one at a time), its blocks no admission
        # claimed, and the claims
        self._refill_job: _Job | None = None
        self._inflight: list[tuple[int, int]] = []
        self._claims: list[tuple[Lease, tuple[int, int]]] = []
        self._reclaiming = False
        self._reclaim_again = False  # a release came while the reclamation ran
        self._refill_failed = False  # the last refill failed: none until the next call
        self._upkeep_error: BaseException | None = None
        self._live: dict[int, Lease] = {}  # id -> the leases this backing made, not released
        self._outstanding: set[_Job] = set()  # jobs given to the executor, not begun
        self._lock = threading.Lock()
        self._closed = False
        self._admits = self._admits_ready = self._commits = self._reclaims = 0
        self._leased = 0
        self._jobs: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition(self._lock)
        self._busy = False
        self._stolen = 0  # queued jobs a waiting caller took to run itself, still running
        # a hold on the reserve (give_back): no refill while it stands; lifted by relax(),
        # or once hold_clock() passes hold_until
        self._held = False
        self._hold_until = math.inf
        self._hold_clock: Callable[[], float] = time.monotonic

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

    def _own(self, lease: object, call: str) -> Lease:
        """``lease``, if this backing made it and has not released it; else refused."""
        if not isinstance(lease, Lease):
            raise WrongTypeError("lease", lease, f"a Lease from this RangeBacking's admit() "
                                                 f"({call}() takes one)")
        if self._live.get(id(lease)) is not lease:
            if lease._released and lease._maker is self:
                raise ArgumentError("lease", lease, f"a live lease ({call}() after release())")
            raise ArgumentError("lease", lease, f"a lease this RangeBacking issued ({call}() "
                                                f"got another backing's lease, or a copy)")
        return lease

    def admit(self, tokens: int) -> Lease:
        """Lease slots for ``tokens`` tokens: cached blocks first (no driver call), then
        fresh ones mapped by the executor (check :attr:`Lease.ready`).

        Raises:
            ArgumentError: bad ``tokens``.
            RangesFullError: not enough free blocks (nothing changed).
            ClosedError: after :meth:`close` (or the owner's).
            AsleepError: the owner is asleep.
            Exception: what a caller's executor raised taking the commit (nothing leased).
        """
        tokens = self._check_tokens(tokens)
        lease = Lease(self.block_tokens)
        lease._maker = self
        self._take(lease, tokens, admit=True)
        with self._lock:
            self._admits += 1
            if lease._ready:
                self._admits_ready += 1
        return lease

    def grow(self, lease: Lease, tokens: int) -> bool:
        """Make ``lease`` hold ``tokens`` slots: in place when the blocks after its last
        range are free, else in a new range. Returns whether it took blocks.

        Raises:
            ArgumentError: bad ``tokens``, or not a live lease of this backing.
            RangesFullError: not enough free blocks (the lease as it was).
            ClosedError: after :meth:`close`.
        """
        tokens = self._check_tokens(tokens)
        self._own(lease, "grow")
        return self._take(lease, tokens, admit=False)

    def _take(self, lease: Lease, tokens: int, *, admit: bool) -> bool:
        taken = self._take_blocks(lease, tokens, admit)
        if taken is None:
            return False
        undo, job = taken
        try:
            if job is not None:
                self._executor(job, True)  # its end refills the reserve: not ahead of it
            else:
                self._upkeep()  # refill what the lease took from the reserve
        except BaseException as e:  # the executor's: give back what was taken, then say so
            self._untake(lease, undo, job, admit, e)
            raise
        return True

    def _take_blocks(self, lease: Lease, tokens: int, admit: bool
                     ) -> tuple[_Taken, _Job | None] | None:
        """Under the lock: give ``lease`` the blocks ``tokens`` needs beyond its own, cached
        first, then the refill in flight, then fresh ones with a commit job (not yet given to
        the executor). None when its blocks already hold ``tokens``."""
        bt = self.block_tokens
        job: _Job | None = None
        with self._lock:
            what = "admit" if admit else "grow"
            if self._closed or self.owner.closed:
                raise ClosedError(f"RangeBacking: {what} after close() (of the backing or its "
                                  f"owner)")
            if self.owner.asleep:  # its cached blocks are not mapped until wake()
                raise AsleepError(f"RangeBacking: {what} while the owner is asleep; call "
                                  f"owner.wake() first")
            if not admit:
                self._own(lease, "grow")  # again under the lock: a release may have come
            n = -(-tokens // bt) - lease.blocks
            if n <= 0:
                lease._tokens = max(lease._tokens, tokens)
                return None
            cached, fresh = self._cached, self._fresh
            if n > cached.free_units + fresh.free_units:
                raise RangesFullError("tokens", tokens,
                                      f"what the free blocks hold ({cached.free_units} "
                                      f"cached and {fresh.free_units} fresh blocks of "
                                      f"{bt} slots)")
            self._refill_failed = False  # a new call: a failed refill may be tried again
            undo = _Taken(list(lease._pieces), lease._tokens)
            if lease._pieces:  # grow in place onto cached blocks: the range stays one range
                s, k = lease._pieces[-1]
                if (s, k) not in lease._pend and (s, k) not in lease._failed \
                        and s + k + n <= self.blocks and cached.is_free(s + k, n):
                    cached.take(s + k, n)
                    lease._pieces[-1] = (s, k + n)
                    undo.grown = (s + k, n)
                    n = 0
            if n and cached.free_units:
                k = min(n, cached.free_units)
                undo.got = cached.alloc_pieces(k)
                n -= k
            if n and self._inflight and self._thread is not None:  # (an executor of the
                undo.first = not any(c is lease for c, _ in self._claims)  # caller's may
                undo.claimed, n = self._claim(lease, n)  # hold the refill back)
            if n:
                undo.new = new = fresh.alloc_pieces(n)
            lease._pieces += undo.got + undo.claimed + undo.new
            self._leased += undo.blocks
            if undo.new:
                self._pending += sum(k for _, k in new)
                _await(lease, new, commit=True)
                job = _Job(self, lambda: self._commit(lease, new),
                           lambda err: self._commit_end(lease, new, err, ran=False))
                self._outstanding.add(job)
                if self._thread is not None:
                    lease._queued.append(job)  # wait() runs it itself if the thread has not
            lease._tokens = max(lease._tokens, tokens)
            if admit:
                self._live[id(lease)] = lease
        return undo, job

    def _untake(self, lease: Lease, undo: _Taken, job: _Job | None, admit: bool,
                err: BaseException) -> None:
        """Undo a take whose job the executor refused by raising ``err``: the lease as it
        was. A commit that began anyway cannot be taken back: then an admitted lease is
        released and a grown one keeps what it took (``wait()`` says how it went)."""
        with self._lock:
            began = job is not None and job.state != _QUEUED
            if job is not None and not began:
                job.state = _CANCELLED
                self._outstanding.discard(job)
                if job in self._jobs:
                    self._jobs.remove(job)
            exact = not began and all((lease, p) in self._claims for p in undo.claimed)
            if exact:
                for p in undo.claimed:
                    self._claims.remove((lease, p))
                self._inflight = _joined(self._inflight + undo.claimed)
                if undo.claimed and undo.first:
                    lease._pending -= 1
                    if self._refill_job in lease._queued:
                        lease._queued.remove(self._refill_job)
                if job is not None:
                    lease._pending -= 1
                    if job in lease._queued:
                        lease._queued.remove(job)
                    self._pending -= sum(k for _, k in undo.new)
                lease._pend.difference_update(undo.claimed + undo.new)
                for p in undo.new:
                    self._fresh.free(*p)
                for p in undo.got:
                    self._cached.free(*p)
                if undo.grown is not None:
                    self._cached.free(*undo.grown)
                self._leased -= undo.blocks
                lease._pieces, lease._tokens = undo.pieces, undo.tokens
                lease._ready = lease._pending == 0 and lease._error is None
                if lease._pending == 0 and lease._done is not None:
                    lease._done.set()
                if admit:
                    self._live.pop(id(lease), None)
                err.add_note("RangeBacking: the executor raised; the lease is as it was "
                             "before the call (nothing was taken)")
                return
            if job is not None and not began:
                self._commit_end(lease, undo.new, err, ran=False)  # its blocks: unbacked
            if admit:
                self._release_locked(lease)
                err.add_note("RangeBacking: the executor raised; the lease was given back "
                             "(blocks of a commit that began come back when it ends)")
            else:
                err.add_note("RangeBacking: the executor raised after the commit began; the "
                             "lease keeps the blocks it took: wait() says whether they are "
                             "mapped")

    def _claim(self, lease: Lease, n: int) -> tuple[list[tuple[int, int]], int]:
        """Lease up to ``n`` blocks of the refill in flight to ``lease`` (the lock held),
        which then waits for that refill instead of a commit of its own queued behind it.
        Returns the pieces taken and the blocks still wanted."""
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
            lease._error = err
            lease._failed.update(pieces)
        if lease._released:  # released while the commit ran: its pieces come back now
            for s, n in pieces:
                (self._cached if err is None else self._fresh).free(s, n)
        lease._pending -= 1
        if lease._pending == 0:
            lease._ready = lease._error is None
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
            self._settle(pieces, e, keep=False)  # a failed undo may have left mappings
        with self._lock:
            pending = self._commit_end(lease, pieces, err, ran=True)
        # upkeep queued once the lease is mapped, never ahead of its commit
        if lease is not None or not pending:
            self._upkeep_quietly()

    def _commit_end(self, lease: Lease | None, pieces: list[tuple[int, int]],
                    err: BaseException | None, *, ran: bool) -> int:
        """A commit of ``pieces`` ended (``ran``) or was dropped (the lock held); returns the
        blocks still pending."""
        self._pending -= sum(n for _, n in pieces)
        if ran:
            self._commits += 1
        if lease is None:  # a reserve refill (the one in flight)
            if err is not None:  # no other refill until the next call: no loop of failures
                self._refill_failed = True
                self._upkeep_error = err
            self._refill_done(err)
        else:
            self._pieces_done(lease, pieces, err)
        return self._pending

    def ready(self, lease: Lease) -> bool:
        """The decode step's check: every block of ``lease`` mapped (False while the owner
        sleeps or after it closed).

        Raises:
            ArgumentError: ``lease`` is not a live lease of this backing.
        """
        owner = self.owner
        return self._own(lease, "ready").ready and not (owner.closed or owner.asleep)

    def wait(self, lease: Lease, timeout_s: float = 30.0) -> Lease:
        """Block until ``lease`` is ready; raise its commit's error if one failed.

        Raises:
            KvvmmError: the commit failed (the lease keeps its blocks; release it), or the
                timeout passed.
            ClosedError: :meth:`close` dropped the lease's commit before it began.
            ArgumentError: a bad ``timeout_s``, or not a live lease of this backing.
        """
        timeout_s = seconds_arg("timeout_s", timeout_s)
        self._own(lease, "wait")
        if not lease._ready and lease._queued:
            self._run_queued(lease)
        done = lease._done
        if done is not None and not done.wait(timeout_s):
            raise KvvmmError(f"RangeBacking: lease not mapped within {timeout_s} s")
        if lease._error is not None:
            raise lease._error
        return lease

    def _run_queued(self, lease: Lease) -> None:
        """Run ``lease``'s commits the backing thread has not begun here, sparing a
        thread hand-off (the owner's lock orders them against other commits)."""
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
        """Give ``lease``'s blocks back: mapped ones stay cached for the next admission
        (above ``high_bytes`` the backing thread gives them back).

        Raises:
            ArgumentError: not a live lease of this backing; nothing changed.
            Exception: the reclamation it made due failed on the caller's thread, or the
                executor refused it; the release stands.
        """
        with self._lock:
            self._own(lease, "release")
            self._release_locked(lease)
            self._refill_failed = False
        try:
            self._upkeep()
        except BaseException as e:
            e.add_note("RangeBacking: the lease was released all the same")
            raise

    def _release_locked(self, lease: Lease) -> None:
        lease._released = True
        self._live.pop(id(lease), None)
        self._leased -= lease.blocks
        for p in lease._pieces:
            if p in lease._pend:
                continue  # the running commit frees it at its end
            (self._fresh if p in lease._failed else self._cached).free(*p)

    # -- upkeep: the reserve and reclamation -------------------------------------------

    @property
    def upkeep_error(self) -> BaseException | None:
        """The last failure of upkeep nobody waited for (a refill, a reclamation), or None."""
        return self._upkeep_error

    def _upkeep(self) -> None:
        """Queue a refill of the reserve or a reclamation above the high mark, if due.

        Raises what the executor raised taking the job (the job undone first)."""
        job: _Job | None = None
        with self._lock:
            if self._closed:
                return
            # cached, and to be cached: the refill's blocks no admission claimed
            cached = self._cached.free_units + sum(k for _, k in self._inflight)
            if cached > self.high_blocks:
                if self._reclaiming:  # it picked its units already: one more after it
                    self._reclaim_again = True
                else:
                    self._reclaiming = True
                    job = _Job(self, self._reclaim_job, self._reclaim_dropped)
            elif cached < self.reserve_blocks and self._refill_job is None \
                    and self._fresh.free_units and not self._refill_failed \
                    and not self._holding():
                want = min(self.reserve_blocks - cached, self._fresh.free_units)
                try:
                    pieces = self._fresh.alloc_pieces(want)
                except RangesFullError:
                    pieces = []
                if pieces:
                    self._pending += want
                    self._inflight = list(pieces)
                    job = _Job(self, lambda: self._commit(None, pieces),
                               lambda err: self._commit_end(None, pieces, err, ran=False))
                    self._refill_job = job
            if job is not None:
                self._outstanding.add(job)
        if job is not None:
            try:
                self._executor(job, False)
            except BaseException as e:
                with self._lock:
                    if job.cancel(e):
                        self._upkeep_error = e
                raise

    def _upkeep_quietly(self) -> None:
        """:meth:`_upkeep` where no caller waits to hear of it (the end of a job): a
        failure is kept in :attr:`upkeep_error`."""
        try:
            self._upkeep()
        except Exception as e:
            with self._lock:
                self._upkeep_error = e

    def _reclaim_dropped(self, err: BaseException) -> None:
        self._reclaiming = self._reclaim_again = False

    def _reclaim_job(self) -> None:
        ok = False
        try:
            self._reclaim(self.reserve_blocks)
            ok = True
        except BaseException as e:
            with self._lock:
                self._upkeep_error = e
            raise
        finally:
            with self._lock:
                self._reclaiming = False
                again, self._reclaim_again = self._reclaim_again, False
        if ok and again:  # releases came while it ran: their blocks may be above the mark
            self._upkeep_quietly()

    def reclaim(self, keep_bytes: int = 0) -> int:
        """Give back whole cached units until at most ``keep_bytes`` stay cached, on the
        calling thread. Returns bytes given back.

        Raises:
            ArgumentError: bad ``keep_bytes``.
            DriverError: a driver call failed (the notes say which units went).
        """
        int_arg("keep_bytes", keep_bytes, lo=0, unit="bytes")
        with self._lock:
            self._refill_failed = False
        return self._reclaim(keep_bytes // self.block_bytes)

    def _reclaim(self, keep_blocks: int) -> int:
        """Decommit whole cached units (highest first) down to ``keep_blocks``."""
        with self._lock:
            excess = self._cached.free_units - keep_blocks
            if excess <= 0:
                return 0
            picked: list[tuple[int, int]] = []
            for start, length in reversed(self._cached.extents):  # the top extent first
                for u, n in self._units_in(start, length):
                    if excess <= 0:
                        break
                    picked.append((u, n))
                    excess -= n
                if excess <= 0:
                    break
            for s, n in picked:
                self._cached.take(s, n)
        if not picked:
            return 0
        return self._decommit_units(picked)

    def _decommit_units(self, picked: list[tuple[int, int]]) -> int:
        """Decommit units already taken out of the cache; bytes given back. On a failure
        units still mapped are cached again, the others fresh (the error says which)."""
        bt = self.block_tokens
        try:
            given = self.owner.decommit_slots([(s * bt, (s + n) * bt) for s, n in picked])
        except BaseException as e:
            mapped, unmapped = self._settle(picked, e, keep=True)
            with self._lock:
                for s, n in mapped:
                    self._cached.free(s, n)
                self._reclaims += len(unmapped)
                for s, n in unmapped:
                    self._fresh.free(s, n)
            raise
        with self._lock:
            self._reclaims += len(picked)
            for s, n in picked:
                self._fresh.free(s, n)
        return given

    # -- giving back on pressure, within a bound -----------------------------------------

    def give_back(self, nbytes: int | None = None, *, deadline_s: float,
                  hold_s: float | None = None,
                  clock: Callable[[], float] | None = None) -> GiveBack:
        """Give back whole cached units (no contents lost), highest first, on the backing
        thread, within ``deadline_s``: the pressure call and a broker's shed.

        Returns at once a :class:`GiveBack` the executor fills in. It stops once ``nbytes``
        went, before a unit whose decommit would end past the deadline (judged by the
        longest unit so far), or when no whole cached unit is left. One unit per decommit;
        admissions go on meanwhile. The reserve is held from this call on (no refill) until
        :meth:`relax` (``hold_s=None``) or for ``hold_s`` seconds of ``clock`` (0: no hold).

        Args:
            nbytes: bytes wanted back (whole units: it may free up to a unit more); None:
                every cached unit.
            deadline_s: the bound, seconds of ``clock`` from this call.
            hold_s: how long the reserve stays held (None: until :meth:`relax`).
            clock: seconds, monotonic (default ``time.monotonic``).
        Raises:
            ArgumentError: a bad ``nbytes``, ``deadline_s``, ``hold_s`` or ``clock``.
            ClosedError: after :meth:`close`.
            Exception: what a caller's executor raised taking the job (nothing given back;
                the hold stands: :meth:`relax` lifts it).
        A decommit's failure is not raised here: :meth:`GiveBack.wait` raises it.
        """
        if nbytes is not None:
            int_arg("nbytes", nbytes, lo=0, unit="bytes")
        deadline = seconds_arg("deadline_s", deadline_s)
        hold = seconds_arg("hold_s", hold_s, none=True)
        if clock is None:
            clock = time.monotonic
        elif not callable(clock):
            raise ArgumentError("clock", clock, "a callable returning seconds (a float)")
        t0 = clock()
        res = GiveBack(-1 if nbytes is None else nbytes, deadline)
        want = None if nbytes is None else -(-nbytes // self.block_bytes)
        with self._lock:
            if self._closed:
                raise ClosedError("RangeBacking: give_back after close()")
            if hold > 0:
                self._held, self._hold_until, self._hold_clock = True, t0 + hold, clock
            self._refill_failed = False

            def cancelled(err: BaseException) -> None:
                res.stopped, res.error = "closed", err
                res.elapsed_s = clock() - t0
                res._done.set()

            job = _Job(self, lambda: self._give_back_job(res, want, t0, clock), cancelled)
            self._outstanding.add(job)
        try:
            self._executor(job, False)
        except BaseException as e:
            with self._lock:
                job.cancel(e)
            raise
        return res

    def _give_back_job(self, res: GiveBack, want: int | None, t0: float,
                       clock: Callable[[], float]) -> None:
        """The give-back on the executor; it records its error, never raises."""
        freed_blocks = 0
        try:
            while True:
                if want is not None and freed_blocks >= want:
                    res.stopped = "enough"
                    break
                elapsed = clock() - t0
                if elapsed >= res.deadline_s or (
                        res.units and elapsed + res.unit_max_s > res.deadline_s):
                    res.stopped = "deadline"
                    break
                with self._lock:
                    closed = self._closed
                    unit = None if closed else next(self._cached_units(), None)
                    if unit is not None:
                        self._cached.take(*unit)
                if unit is None:
                    res.stopped = "closed" if closed else "empty"
                    break
                u0 = clock()
                try:
                    res.freed_bytes += self._decommit_units([unit])
                finally:
                    res.unit_max_s = max(res.unit_max_s, clock() - u0)
                res.units += 1
                freed_blocks += unit[1]
        except BaseException as e:
            res.stopped, res.error = "error", e
            with self._lock:
                self._upkeep_error = e
        finally:
            res.elapsed_s = clock() - t0
            res._done.set()

    def _units_in(self, start: int, length: int) -> list[tuple[int, int]]:
        """The units wholly inside the cached extent ``[start, start + length)``."""
        return [(u, n) for u, n in self._units_over(start, start + length)
                if u >= start and u + n <= start + length]

    def _cached_units(self) -> Iterator[tuple[int, int]]:
        """The units wholly inside the cached blocks, highest first (the lock held)."""
        for start, length in reversed(self._cached.extents):
            yield from reversed(self._units_in(start, length))

    def _givable_blocks(self) -> int:
        return sum(n for _, n in self._cached_units())

    @property
    def leased_blocks(self) -> int:
        """Blocks of live leases now. No lock, as :attr:`cached_blocks`."""
        return self._leased

    @property
    def cached_blocks(self) -> int:
        """Free blocks kept mapped now (a lease of them is ready at once). No lock."""
        return self._cached.free_units

    @property
    def free_blocks(self) -> int:
        """Free blocks now, mapped or not (what an admission could lease). No lock."""
        return self._cached.free_units + self._fresh.free_units

    @property
    def givable_bytes(self) -> int:
        """What :meth:`give_back` could free now: whole cached units, every buffer's bytes."""
        with self._lock:
            return self._givable_blocks() * self.block_bytes

    def _holding(self) -> bool:
        """Whether the reserve is held (the lock held); a hold past its time lifts here."""
        if self._held and self._hold_clock() >= self._hold_until:
            self._held = False
        return self._held

    @property
    def held(self) -> bool:
        """Whether a :meth:`give_back`'s hold keeps the reserve from being refilled."""
        with self._lock:
            return self._holding()

    def relax(self) -> None:
        """The pressure is over: lift the reserve's hold and refill it.

        Raises:
            Exception: what a caller's executor raised taking the refill (the hold is lifted
                all the same).
        """
        with self._lock:
            self._held = False
            self._hold_until = math.inf
        self._upkeep()

    def _settle(self, pieces: list[tuple[int, int]], err: BaseException, *,
                keep: bool) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """After a driver step over ``pieces`` failed with ``err``, as the arena's mappings
        say: the pieces mapped in every buffer (kept with ``keep``) and the others, a piece
        only partly mapped given back; ``err`` gets a note saying what was left."""
        owner = self.owner
        if owner.closed or owner.asleep:  # refused before any driver call: nothing moved
            return (list(pieces), []) if keep else ([], list(pieces))
        bt = self.block_tokens
        mapped: list[tuple[int, int]] = []
        unmapped: list[tuple[int, int]] = []
        left = 0
        for p in pieces:
            state = self._mapped(p)
            if state == "all" and keep:
                mapped.append(p)
                continue
            if state != "none":
                try:
                    owner.decommit_slots([(p[0] * bt, (p[0] + p[1]) * bt)])
                except Exception as again:
                    err.add_note(f"RangeBacking: giving back what the failure left of blocks "
                                 f"[{p[0]}, {p[0] + p[1]}) failed too: {again}")
                    state = self._mapped(p)
                    if state == "all" and keep:
                        mapped.append(p)
                        continue
                    if state != "none":
                        left += p[1]
            unmapped.append(p)
        if keep or left:
            bb = self.block_bytes
            text = (f"RangeBacking: of {len(pieces)} units ({sum(n for _, n in pieces) * bb} "
                    f"bytes) being given back, {len(unmapped)} are unmapped (their blocks are "
                    f"free, unbacked) and {len(mapped)} still mapped (cached again)"
                    if keep else "RangeBacking: the failed commit's blocks are free, unbacked")
            kept = owner.arena.unreleased_bytes
            if kept:
                text += (f"; the arena holds {kept} bytes of handles it could not release: "
                         f"reclaim() or owner.close() releases them")
            if left:
                text += (f"; {left * bb} bytes of them stay mapped over free blocks (their next "
                         f"commit maps the rest; owner.close() gives them back)")
            err.add_note(text)
        return mapped, unmapped

    def _mapped(self, piece: tuple[int, int]) -> str:
        """``"all"``, ``"none"`` or ``"some"`` of ``piece``'s bytes mapped, every buffer."""
        bt = self.block_tokens
        s, n = piece
        return self.owner.slots_mapped(s * bt, (s + n) * bt)

    def _units_over(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """``(first block, blocks)`` of the mapped units (the first buffer's mappings) that
        overlap blocks ``[lo, hi)``."""
        ub = self._unit_bytes
        return [(a // ub, -(-b // ub) - a // ub)
                for a, b in self.owner.mapped(0, lo * ub, hi * ub)]

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
                units=len(self._units_over(self.first, self.blocks)),
                fragmentation=1.0 - largest / free if free else 0.0,
                admits=self._admits, admits_ready=self._admits_ready,
                commits=self._commits, reclaims=self._reclaims,
                givable_bytes=self._givable_blocks() * bb)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the backing thread after what it runs now (idempotent); the memory stays
        the owner's. Commits not begun are dropped: their leases fail with
        :class:`ClosedError`. Leases may still be released."""
        timeout_s = seconds_arg("timeout_s", timeout_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.clear()
            # the jobs not begun never will: their leases fail now, their waiters wake
            dropped = ClosedError("RangeBacking: close() came before this lease's commit "
                                  "began; its blocks are not mapped: release the lease")
            for job in list(self._outstanding):
                job.cancel(dropped)
            self._wake.notify_all()
        with _OWNERS_LOCK:
            held = _OWNERS.get(self.owner)
            if held is not None and held() is self:
                del _OWNERS[self.owner]
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)

    def __enter__(self) -> RangeBacking:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_args(owner: object, reserve_bytes: int, high_bytes: int | None,
                executor: object) -> None:
    """RangeBacking's arguments; the owner open, awake, with no pages committed."""
    if not isinstance(owner, KvBufferOwner):
        raise ArgumentError("owner", owner, "a KvBufferOwner")
    if owner.closed:
        raise ClosedError("RangeBacking: the owner is closed")
    if owner.asleep:
        raise AsleepError("RangeBacking: the owner is asleep; call owner.wake() first")
    for name, v in (("reserve_bytes", reserve_bytes), ("high_bytes", high_bytes)):
        if v is not None:
            int_arg(name, v, lo=0, unit="bytes")
    if high_bytes is not None and high_bytes < reserve_bytes:
        raise ArgumentError("high_bytes", high_bytes, f">= reserve_bytes ({reserve_bytes})")
    if not (executor is None or (isinstance(executor, str) and executor == "inline")
            or callable(executor)):
        raise ArgumentError("executor", executor, "None, 'inline' or a callable "
                                                  "executor(job, waited)")
    if owner.committed_pages:
        raise ArgumentError("owner", owner, "an owner with no pages committed beyond "
                            "slot 0's (a RangeBacking leases every other slot; it has "
                            f"{len(owner.committed_pages)} committed)")


def _inline(job: Callable[[], None], waited: bool) -> None:
    job()


_QUEUED, _STARTED, _CANCELLED = 0, 1, 2


class _Job:
    """A driver job given to the executor: it runs once, or is dropped before it begins
    (its ``on_cancel`` then settles its blocks); called after that, it does nothing."""

    __slots__ = ("backing", "on_cancel", "run", "state")

    def __init__(self, backing: RangeBacking, run: Callable[[], None],
                 on_cancel: Callable[[BaseException], object]) -> None:
        self.backing = backing
        self.run = run
        self.on_cancel = on_cancel
        self.state = _QUEUED

    def __call__(self) -> None:
        b = self.backing
        with b._lock:
            if self.state != _QUEUED:
                return
            self.state = _STARTED
            b._outstanding.discard(self)
        self.run()

    def cancel(self, err: BaseException) -> bool:
        """Drop the job if it has not begun (the backing's lock held); whether it was."""
        if self.state != _QUEUED:
            return False
        self.state = _CANCELLED
        b = self.backing
        b._outstanding.discard(self)
        if self in b._jobs:
            b._jobs.remove(self)
        self.on_cancel(err)
        return True


class _Taken:
    """What one admission or growth took, to give it back if its executor raises."""

    __slots__ = ("claimed", "first", "got", "grown", "new", "pieces", "tokens")

    def __init__(self, pieces: list[tuple[int, int]], tokens: int) -> None:
        self.pieces = pieces  # the lease's pieces before
        self.tokens = tokens
        self.grown: tuple[int, int] | None = None  # cached blocks its last range grew onto
        self.got: list[tuple[int, int]] = []  # cached pieces
        self.claimed: list[tuple[int, int]] = []  # pieces of the refill in flight
        self.first = False  # the claim made the lease wait for that refill
        self.new: list[tuple[int, int]] = []  # fresh pieces, committed for it

    @property
    def blocks(self) -> int:
        return (sum(n for _, n in self.got + self.claimed + self.new)
                + (self.grown[1] if self.grown else 0))


def _joined(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``pieces`` sorted, touching ones joined."""
    out: list[tuple[int, int]] = []
    for s, n in sorted(pieces):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return out


def _await(lease: Lease, pieces: list[tuple[int, int]], *, commit: bool) -> None:
    """``lease`` waits for ``pieces`` to be mapped (the lock held): by one more commit
    (``commit``), or by one it already waits for; its Event is made or cleared for it."""
    lease._pend.update(pieces)
    if commit:
        lease._pending += 1
    lease._ready = False
    if lease._done is None:
        lease._done = threading.Event()
    else:
        lease._done.clear()


"""HandlePool: physical handles made ahead of need, off the decode path.

A decode step that grows the KV cache waits for create + map + set access of every new
handle. The pool moves that work to a background thread: it keeps ``ready`` handles per size
class created ahead (growth only maps), retains the handles a decommit gives back up to
``retain_bytes`` (a decommit-then-commit costs unmap + map), and runs jobs such as an owner's
look-ahead (``lookahead_bytes``), which backs a bounded range beyond the prefix before
``ensure_prefix`` needs it.

One pool per driver, shared by the arenas of that driver (``Arena(..., pool=...)``). Under
pressure it gives memory back first: an arena's out-of-memory create calls :meth:`trim` and
tries once more.

Locks: no kvvmm lock is held across a driver call made by the thread (the drivers release
the GIL while CUDA works), and nobody waits on the pool while holding what the thread needs:
``take`` never waits (an empty class answers None and the caller creates), and a commit that
needs an in-flight look-ahead range waits on the arena's condition. The thread unmaps only
in the undo of a failed look-ahead.

A handle is one holder's at a time: :func:`handle_holder` says which arena maps it or which
pool holds it idle; :meth:`HandlePool.give` and :meth:`Arena.adopt
<kvvmm.arena.Arena.adopt>` refuse a handle another holds.

``threaded=False`` runs nothing in the background: :meth:`run_once` does the queued jobs and
one refill pass on the caller's thread (tests, the sim).
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvvmm.checks import bool_arg, int_arg, is_int, seconds_arg
from kvvmm.driver.base import Driver, check_driver
from kvvmm.errors import ArgumentError, ClosedError, DriverError
from kvvmm.units import GiB

if TYPE_CHECKING:
    from kvvmm.arena.state import _ArenaState

__all__ = ["HandlePool", "PoolStats", "PoolTag", "handle_holder", "live_pools", "register_arena"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolStats:
    """What a pool holds and has done (a record: nothing live)."""

    held_bytes: int  #: idle handles' memory: created, mapped nowhere
    held: dict[int, int]  #: size class (bytes) -> idle handles
    created: int  #: handles the pool created (refills)
    reused: int  #: handles taken from the pool (each saved a create)
    retained: int  #: handles given back and kept (each saved a release)
    released: int  #: handles the pool released (over the cap, trims, close)
    trimmed_bytes: int  #: memory given back under pressure
    jobs: int  #: background jobs run (look-ahead)
    errors: int  #: refills or jobs that failed (logged; the caller then creates itself)
    #: takes refused because every idle handle of the size held another owner's bytes
    withheld: int = 0


# -- who holds a handle --------------------------------------------------------------------
# Every arena and pool of this process (weakly), so a caller's handle another holds is refused.

_ARENAS: weakref.WeakSet[_ArenaState] = weakref.WeakSet()
_ARENAS_LOCK = threading.Lock()
class PoolTag:
    """An arena's identity in a shared :class:`HandlePool`: whose bytes an idle handle holds.

    An object, not a number, so that only who holds the arena can name it: a counted int could
    be guessed, and a caller naming another arena's tag would take that arena's idle handles,
    bytes and all.
    """

    __slots__ = ("number",)

    def __init__(self, number: int) -> None:
        self.number = number

    def __repr__(self) -> str:
        return f"PoolTag({self.number})"


_POOLS: weakref.WeakSet[HandlePool] = weakref.WeakSet()
_POOLS_LOCK = threading.Lock()


def live_pools() -> list[HandlePool]:
    """The pools of this process not yet garbage-collected."""
    with _POOLS_LOCK:
        return list(_POOLS)


def register_arena(arena: _ArenaState) -> None:
    """Count ``arena`` among those :func:`handle_holder` asks (``Arena.__init__`` does)."""
    with _ARENAS_LOCK:
        _ARENAS.add(arena)


def _base_driver(driver: Any) -> Any:
    """The driver under any wrappers (a FaultyDriver's handles are its inner driver's)."""
    while getattr(driver, "inner", None) is not None:
        driver = driver.inner
    return driver


def handle_holder(driver: Any, handle: int) -> str | None:
    """Who holds ``handle`` of ``driver`` (an arena that maps it or is giving it back, or a
    pool that holds it idle), described for a message; None: nobody in this process."""
    base = _base_driver(driver)
    with _ARENAS_LOCK:
        arenas = list(_ARENAS)
    for a in arenas:  # read without their locks: two adopts must not wait on each other
        if a._released or _base_driver(a.driver) is not base:
            continue
        for al in list(a._allocs):
            if any(m.handle == handle for m in list(al.maps)):
                return f"arena {a.name!r} maps it (in allocation {al.name!r})"
        if any(h == handle for h, _ in list(a._gone) + list(a._leftover)):
            return f"arena {a.name!r} is giving it back"
    for p in live_pools():
        if _base_driver(p.driver) is base and p.holds(handle):
            return "a HandlePool holds it idle (another owner's memory, handed out later)"
    return None


class HandlePool:
    """Idle handles per size class, refilled (and jobs run) by a background thread.

    Args:
        driver: the driver whose handles it holds (every arena using it must share it).
        ready: ``{size_bytes: count}``: handles of each size to keep created ahead.
        retain_bytes: most memory kept idle from handles given back (and refills), >= 0.
        threaded: run refills and jobs on a background thread (default); False: only when
            :meth:`run_once` is called (deterministic).
        share_across_owners: False (default): a handle an arena gave back is handed only to
            that arena again (no owner reads another's bytes through the pool). True: any
            arena takes any idle handle, old bytes and all.
    Raises:
        ArgumentError: bad ``ready`` sizes (not multiples of the granularity) or counts.
    """

    def __init__(self, driver: Driver, *, ready: Mapping[int, int] | None = None,
                 retain_bytes: int = 4 * GiB, threaded: bool = True,
                 share_across_owners: bool = False) -> None:
        check_driver(driver)  # None or a kind's name: an ArgumentError, not AttributeError
        self.driver = driver
        gran = driver.granularity()
        want = dict(ready or {})
        for size, count in want.items():
            if not is_int(size) or size <= 0 or size % gran:
                raise ArgumentError("ready", size, f"size classes that are positive multiples "
                                                   f"of the granularity {gran}")
            int_arg(f"ready[{size}]", count, lo=0, unit="handles")
        int_arg("retain_bytes", retain_bytes, lo=0, unit="bytes")
        bool_arg("share_across_owners", share_across_owners)
        self.retain_bytes = retain_bytes
        self.share_across_owners = share_across_owners
        # handle -> the owner (an arena's pool_tag) whose bytes it holds; absent: fresh
        self._written: dict[int, PoolTag] = {}
        self._want = want
        self._lock = threading.Lock()  # guards the lists only; never held across a driver call
        # drain waits on _wake; the thread waits on _kick, a C queue: a poke from the decode
        # thread is one C call, where Condition.notify_all is a dozen lines of Python.
        self._wake = threading.Condition(self._lock)
        self._kick: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._idle: dict[int, list[int]] = {}
        self._ids: set[int] = set()  # every idle handle: a handle is given to the pool once
        self._gran = gran
        self._held = 0
        self._jobs: deque[Callable[[], object]] = deque()
        self._busy = 0  # jobs or refills running right now
        self._closed = False
        self._stop = False
        self._backoff: set[int] = set()  # classes whose refill ran out of memory
        self._n = {"created": 0, "reused": 0, "retained": 0, "released": 0, "trimmed": 0,
                   "jobs": 0, "errors": 0, "withheld": 0}
        self._thread: threading.Thread | None = None
        with _POOLS_LOCK:
            _POOLS.add(self)
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="kvvmm-handle-pool",
                                            daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return (f"HandlePool({self.driver!r}, {self._held} bytes held, "
                f"{'threaded' if self._thread else 'stepped'})")

    # -- what arenas call -----------------------------------------------------------------

    @property
    def held_bytes(self) -> int:
        """Memory of idle handles (created, mapped nowhere): "held by the pool"."""
        return self._held

    def take(self, size: int, owner: PoolTag | None = None) -> int | None:
        """An idle handle of exactly ``size`` bytes, or None (never waits).

        ``owner`` (an arena's :attr:`~kvvmm.arena.Arena.pool_tag`): unless the pool shares
        across owners, only a fresh handle or one ``owner`` itself gave back is handed out.
        """
        if owner is not None and type(owner) is not PoolTag:
            raise ArgumentError("owner", owner, "an arena's pool_tag (a PoolTag) or None")
        with self._lock:
            got = self._idle.get(size)
            if not got:
                return None
            i = len(got) - 1
            if not self.share_across_owners:
                written = self._written
                while i >= 0 and written.get(got[i], owner) != owner:
                    i -= 1
                if i < 0:
                    self._n["withheld"] += 1
                    return None
            h = got.pop(i)
            self._ids.discard(h)
            self._written.pop(h, None)
            self._held -= size
            self._n["reused"] += 1
            self._backoff.discard(size)
        self._poke()  # a refill may be due
        return h

    def give(self, handle: int, size: int, owner: PoolTag | None = None) -> bool:
        """Keep an unmapped ``handle`` for reuse if it fits under the cap; False: release it.

        ``owner``: whose bytes the handle holds (an arena's
        :attr:`~kvvmm.arena.Arena.pool_tag`); None: a caller's own handle.

        Raises:
            ArgumentError: ``handle`` is not an int, is idle in the pool already, or (no
                ``owner``) an arena holds it; or ``size`` is not a positive multiple of the
                granularity; nothing changed.
        """
        if type(handle) is not int or type(size) is not int:  # bools and floats too
            if not is_int(handle):
                raise ArgumentError("handle", handle, "an int (a handle of the pool's driver)")
            int_arg("size", size, lo=1, unit="bytes")
        if owner is not None and type(owner) is not PoolTag:
            raise ArgumentError("owner", owner, "an arena's pool_tag (a PoolTag) or None")
        if size <= 0 or size % self._gran:
            raise ArgumentError("size", size, f"a positive multiple of the granularity "
                                              f"{self._gran} (the handle's size)")
        if owner is None:  # not an arena's own give-back: ask whose it is
            who = None if self.holds(handle) else handle_holder(self.driver, handle)
            if who is not None:
                raise ArgumentError("handle", handle, "a handle no arena or pool holds",
                                    f"{who}; nothing changed")
        with self._lock:
            if handle in self._ids:
                raise ArgumentError("handle", handle, "a handle the pool does not hold",
                                    "it is idle in the pool already: a handle is given once "
                                    "per take")
            if self._closed or self._held + size > self.retain_bytes:
                return False
            if owner is not None:
                self._written[handle] = owner
            self._ids.add(handle)
            self._idle.setdefault(size, []).append(handle)
            self._held += size
            self._n["retained"] += 1
            return True

    def holds(self, handle: object) -> bool:
        """True while ``handle`` is idle in the pool (the pool's, not any arena's)."""
        with self._lock:
            return handle in self._ids

    def trim(self, nbytes: int) -> int:
        """Release idle handles (largest first) until ``nbytes`` are freed or none is left.

        Called under memory pressure (an out-of-memory create). Returns the bytes released.
        """
        picked: list[tuple[int, int]] = []
        with self._lock:
            freed = 0
            for size in sorted(self._idle, reverse=True):
                got = self._idle[size]
                while got and freed < nbytes:
                    picked.append((got.pop(), size))
                    self._ids.discard(picked[-1][0])
                    freed += size
                    self._held -= size
            self._backoff.update(s for _, s in picked)  # no refill straight back up
        done = self._release(picked)
        with self._lock:
            self._n["trimmed"] += done
        return done

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` on the background thread (or at the next :meth:`run_once`).

        A job must make its driver calls with no kvvmm lock held (as
        :meth:`kvvmm.arena.Arena.prepare_ranges` does). Its errors are logged and counted.
        """
        with self._lock:
            if self._closed:
                raise ClosedError("HandlePool: submit after close()")
            self._jobs.append(job)
        if self._thread is not None:  # _poke, inlined: submit runs on the decode thread
            self._kick.put(None)

    def run_once(self) -> int:
        """Run every queued job, then refill every class once, on this thread.

        Returns:
            Jobs run plus handles created.
        """
        n = 0
        while True:
            job = self._pop_job()
            if job is None:
                break
            self._run_job(job)
            n += 1
        while True:
            size = self._due()
            if size is None:
                return n
            if not self._refill(size):
                return n
            n += 1

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until no job is queued or running and no refill is due; False on timeout."""
        timeout_s = seconds_arg("timeout_s", timeout_s)
        if self._thread is None:
            self.run_once()
            return True
        with self._wake:
            return self._wake.wait_for(
                lambda: not self._jobs and not self._busy and self._due_locked() is None,
                timeout=timeout_s)

    def stats(self) -> PoolStats:
        with self._lock:
            n = self._n
            return PoolStats(held_bytes=self._held,
                             held={s: len(h) for s, h in self._idle.items() if h},
                             created=n["created"], reused=n["reused"], retained=n["retained"],
                             released=n["released"], trimmed_bytes=n["trimmed"],
                             jobs=n["jobs"], errors=n["errors"], withheld=n["withheld"])

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread (after the job it runs), drop queued jobs, release idle handles.

        Idempotent. Arenas using the pool afterwards create and release as without one.

        Raises:
            DriverError: a release failed (the pool keeps that handle; close again).
            ArgumentError: ``timeout_s`` is not a finite number >= 0 (nothing closed).
        """
        timeout_s = seconds_arg("timeout_s", timeout_s)
        with self._lock:
            self._closed = True
            self._stop = True
            self._jobs.clear()
            self._wake.notify_all()
        self._poke()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)
        with self._lock:
            picked = [(h, s) for s, hs in self._idle.items() for h in hs]
            self._idle.clear()
            self._ids.clear()
            self._held = 0
        self._release(picked, keep_failed=True)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the thread ---------------------------------------------------------------------

    def _poke(self) -> None:
        """Wake the thread to look at the queue and the classes again (none: nothing to do)."""
        if self._thread is not None:
            self._kick.put(None)

    def _due_locked(self) -> int | None:
        if self._closed:
            return None
        for size, count in self._want.items():
            if (size not in self._backoff and len(self._idle.get(size, ())) < count
                    and self._held + size <= self.retain_bytes):
                return size
        return None

    def _due(self) -> int | None:
        with self._lock:
            return self._due_locked()

    def _refill(self, size: int) -> bool:
        """Create one handle of ``size`` with no lock held; False if the driver refused."""
        with self._lock:
            self._busy += 1
        try:
            h = self.driver.create(size)
        except DriverError as e:
            with self._lock:
                self._busy -= 1
                self._n["errors"] += 1
                self._backoff.add(size)  # until a take shows the class is used again
                self._wake.notify_all()
            log.info("handle pool: refill of %d bytes failed: %s", size, e)
            return False
        with self._lock:
            self._busy -= 1
            self._n["created"] += 1
            keep = not self._closed
            if keep:
                self._ids.add(h)
                self._idle.setdefault(size, []).append(h)
                self._held += size
            self._wake.notify_all()
        if not keep:
            self._release([(h, size)])
        return True

    def _pop_job(self) -> Callable[[], object] | None:
        """The next queued job, counted busy in the same hold of the lock (so :meth:`drain`
        never sees "no job queued, none running" while a job is between the two)."""
        with self._lock:
            if not self._jobs:
                return None
            self._busy += 1
            return self._jobs.popleft()

    def _run_job(self, job: Callable[[], object]) -> None:
        """Run a job :meth:`_pop_job` took (and counted busy)."""
        try:
            job()
            ok = True
        except Exception as e:  # a job's failure is its caller's to see later, not ours
            ok = False
            log.warning("handle pool: background job failed: %s", e)
        with self._lock:
            self._busy -= 1
            self._n["jobs" if ok else "errors"] += 1
            self._wake.notify_all()

    def _loop(self) -> None:
        kick = self._kick
        while True:
            # Drop the pokes already made: the state read below sees what each one announced,
            # and one made after it wakes the get at the bottom (a SimpleQueue loses none).
            while True:
                try:
                    kick.get_nowait()
                except queue.Empty:
                    break
            if self._stop:
                return
            job = self._pop_job()
            if job is not None:
                self._run_job(job)
                continue
            size = self._due()
            if size is not None:
                self._refill(size)
                continue
            kick.get()

    def _release(self, picked: list[tuple[int, int]], *, keep_failed: bool = True) -> int:
        """Release handles with no lock held; returns bytes released (a failed one and the
        rest stay idle in the pool: nothing is dropped unreleased)."""
        done = 0
        for i, (h, size) in enumerate(picked):
            try:
                self.driver.release(h)
            except DriverError:
                if keep_failed:
                    with self._lock:
                        for h2, s2 in picked[i:]:
                            self._ids.add(h2)
                            self._idle.setdefault(s2, []).append(h2)
                            self._held += s2
                raise
            done += size
            with self._lock:
                self._n["released"] += 1
                self._written.pop(h, None)  # the driver may hand its id out again
        return done

"""The per-GPU ledger: one small file every tenant process reads and writes under one lock.

Why a file in ``/dev/shm`` (or a folder the caller names) locked with ``flock``: the kernel
releases a ``flock`` when its holder dies, however it dies, so a tenant killed while it held
the lock cannot wedge the others, and there is no daemon to start, supervise or lose. Every
change is made under the lock, and no derived value is stored (the GPU's booked bytes are
the sum of the tenants' at each check), so a holder killed between two writes leaves each
tenant's own record at worst stale, never a total out of step with it; a slot that was being
registered or freed is recognised and freed.

The file is untrusted input (:mod:`kvvmm.budget.ledger_file`): opened without following
links and only when no other user may write it, read whole into this process under the lock
and checked on every read (never mapped: a truncated file cannot fault), its lock waited for
at most ``lock_timeout_s``. A ``fork``'s child gets its own open file (it would share the
parent's lock otherwise) and may not use the parent's tenants: it registers its own.

What fits and whom a shortfall is asked of are :mod:`kvvmm.budget.rules`' (docs/BUDGET.md
states them); the waiting, deadlines, withdrawal and the sweep of dead tenants are here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvvmm.budget.errors import (
    BudgetExceededError,
    ForeignTenantError,
    LedgerCorruptError,
    LedgerError,
    LedgerLockTimeoutError,
)
from kvvmm.budget.ledger_file import (
    BACKED,
    FILE_BYTES,
    FREE,
    H_BUDGET,
    H_MAGIC,
    H_SEQ,
    H_SLOTS,
    H_VERSION,
    LIMIT,
    LIVE,
    MAGIC,
    MAX_BYTES,
    NAME_BYTES,
    NAMES,
    PID,
    REGISTERING,
    SERIAL,
    SHED,
    SHED_DL,
    SHED_DONE,
    SLOTS,
    START,
    STATE,
    VERSION,
    WORD_MAX,
    LedgerFile,
    name_problem,
    resolve_group,
)
from kvvmm.budget.liveness import alive, start_ticks
from kvvmm.budget.rules import TenantState, refusal, shed_plan
from kvvmm.checks import int_arg, seconds_arg
from kvvmm.errors import ArgumentError, BusyError, ClosedError, OutOfRangeError

if TYPE_CHECKING:
    from kvvmm.budget.tenant import Tenant

__all__ = ["LOCK_TIMEOUT_S", "MAX_BYTES", "MAX_WAIT_S", "NAME_BYTES", "SLOTS", "BudgetSnapshot",
           "Ledger", "TenantInfo", "default_path", "wait_arg"]

log = logging.getLogger(__name__)

#: how long a ledger call waits for the file's lock by default (an honest holder keeps it
#: for microseconds; one that keeps it a second is stopped, stuck or hostile)
LOCK_TIMEOUT_S = 1.0

#: the longest wait any ledger call takes (a day): longer ones are refused, not overflowed
MAX_WAIT_S = 86400.0

#: how often a waiting asker looks again (seconds)
_POLL_S = 0.001
#: the shortest wait for the lock a charge asked to wait makes (seconds)
_MIN_LOCK_WAIT_S = 0.05
# Every column of a slot but its state, in the order a slot is freed.
_FIELDS = (PID, START, LIMIT, BACKED, SHED, SHED_DL, SHED_DONE, SERIAL)
_NAME_RULE = (f"a str of 1 to {NAME_BYTES} bytes of UTF-8, printable characters only (no "
              f"control character, newline or escape), no space at either end")

# Every open Ledger of this process, so that a fork's child gives each its own open file
# before anything else runs in it.
_LEDGERS: weakref.WeakSet[Ledger] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for led in list(_LEDGERS):
        led._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def wait_arg(name: str, value: object, *, zero: bool = True) -> float:
    """``value`` as seconds in [0, MAX_WAIT_S] ((0, MAX_WAIT_S] without ``zero``).

    Raises:
        ArgumentError: not a finite number in range (a bool, NaN, negative, past a day).
    """
    wait = seconds_arg(name, value, zero=zero)
    if wait > MAX_WAIT_S:
        raise ArgumentError(name, value, f"a number of seconds in {'[' if zero else '('}0, "
                                         f"{MAX_WAIT_S:g}]")
    return wait


def _deadline_ns(wait_s: float) -> int:
    """The monotonic clock ``wait_s`` from now, in ns (inside int64: the file's range)."""
    return min(time.monotonic_ns() + round(wait_s * 1e9), WORD_MAX)


def default_path(key: str = "gpu0", folder: str | os.PathLike[str] = "/dev/shm") -> Path:
    """The ledger file of one GPU: ``/dev/shm/kvvmm-budget-<key>``.

    Every process sharing the GPU must name the same file. ``CUDA_VISIBLE_DEVICES``
    renumbers devices per process, so where processes see different ordinals pass the
    card's UUID (``nvidia-smi -L``) as ``key``.
    """
    text = str(key)
    if not text or not all(ch.isalnum() or ch in "-_." for ch in text) or len(text) > 100:
        raise ArgumentError("key", key, "1 to 100 letters, digits, '-', '_' or '.'")
    return Path(folder) / f"kvvmm-budget-{text}"


@dataclass(frozen=True, slots=True)
class TenantInfo:
    """One tenant as the ledger holds it (a record: nothing live)."""

    name: str
    pid: int
    alive: bool  #: its process (pid and start time) still runs
    limit_bytes: int
    backed_bytes: int  #: charged: created through its driver and not yet released
    shed_bytes: int  #: asked of it and not yet given back (0 when no request stands)
    shed_left_s: float  #: seconds until the standing request expires (0.0 without one)
    shed_done_bytes: int  #: given back while a request stood, in all


@dataclass(frozen=True, slots=True)
class BudgetSnapshot:
    """The whole ledger at one moment (a record: nothing live)."""

    path: str
    budget_bytes: int
    tenants: tuple[TenantInfo, ...]

    @property
    def backed_bytes(self) -> int:
        """Bytes booked by every tenant."""
        return sum(t.backed_bytes for t in self.tenants)

    @property
    def free_bytes(self) -> int:
        """The budget's unbooked bytes (0 when a lowered budget is over-booked)."""
        return max(self.budget_bytes - self.backed_bytes, 0)


class Ledger:
    """One GPU's budget ledger, opened (and created, the first time) in this process.

    Args:
        path: the ledger file (see :func:`default_path`); its folder must exist, and be one
            nobody else may swap the file out of (owned by this user or root; sticky if
            others may write it).
        budget_bytes: the GPU's budget, set when this call creates the ledger; None to open
            an existing one. Opening an existing ledger with another budget is refused (set
            it with :meth:`set_budget` or ``kvvmm budget init``).
        group: a group (name or gid) this process is in, through which processes of several
            users share the file: it is created 0660 in that group, and a file of that group
            that its members may write is trusted. None (default): only this user's file,
            which nobody else may write.
        lock_timeout_s: the longest any call waits for the file's lock (> 0, at most a day).
    Raises:
        ArgumentError: a bad budget, group or timeout, or a budget that differs from the
            ledger's.
        LedgerUntrustedError: a link at the path, not a regular file, or a file (or folder)
            that another user owns or may write.
        LedgerCorruptError: the file is not a kvvmm ledger, or holds values none has.
        LedgerLockTimeoutError: the lock stayed held for ``lock_timeout_s``.
        LedgerError: None was passed and no ledger exists.
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike[str], *, budget_bytes: int | None = None,
                 group: str | int | None = None,
                 lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        if budget_bytes is not None:
            int_arg("budget_bytes", budget_bytes, lo=1, hi=MAX_BYTES,
                    limit=f"an int in [1, {MAX_BYTES}] (bytes)")
        if not isinstance(path, (str, os.PathLike)) or not str(path) or "\0" in str(path):
            raise ArgumentError("path", path, "a file's path (str or os.PathLike, no NUL)")
        self.lock_timeout_s = wait_arg("lock_timeout_s", lock_timeout_s, zero=False)
        gid = resolve_group(group)
        self.path = Path(path)
        # One lock per process-side object: flock excludes other open files (other
        # processes, other Ledger objects), this lock the threads sharing this one.
        self._tlock = threading.Lock()
        self._closed = False
        self._broken: LedgerError | None = None  # a fork's child that could not reopen
        self._tenants: list[Tenant] = []
        self._pid = os.getpid()
        self._me = (self._pid, start_ticks())  # this process: alive without a /proc read
        self._file = LedgerFile(self.path, create=budget_bytes is not None, gid=gid)
        try:
            self._open(budget_bytes)
        except BaseException:
            self._file.close()
            raise
        _LEDGERS.add(self)

    def _open(self, budget_bytes: int | None) -> None:
        f = self._file
        f.lock(self.lock_timeout_s)
        try:
            size = f.size()
            fresh = size == 0 or (size == FILE_BYTES
                                  and os.pread(f.fd, 8, H_MAGIC * 8) == bytes(8))
            if fresh and budget_bytes is not None:
                # A new file (or one whose maker died before its magic): zeros, then the
                # header, the magic last of all.
                os.ftruncate(f.fd, FILE_BYTES)
                f.write_bytes(0, bytes(FILE_BYTES))
                for index, value in ((H_VERSION, VERSION), (H_SLOTS, SLOTS),
                                     (H_BUDGET, budget_bytes), (H_MAGIC, MAGIC)):
                    f.write_word(index, value)
            elif size != FILE_BYTES:
                raise LedgerCorruptError(str(self.path), f"{size} bytes, a ledger has "
                                                         f"{FILE_BYTES}", foreign=True)
            q = f.read()
            if budget_bytes is not None and q[H_BUDGET] != budget_bytes:
                raise ArgumentError("budget_bytes", budget_bytes,
                                    f"None or the ledger's budget {q[H_BUDGET]} (change it "
                                    f"with set_budget or kvvmm budget init)")
        finally:
            f.unlock()

    def _after_fork(self) -> None:
        """In a fork's child: its own locks and open file; the parent's tenants left behind
        (they are the parent's: using one here is refused)."""
        self._tlock = threading.Lock()
        self._tenants = []
        self._pid = os.getpid()
        self._me = (self._pid, start_ticks())
        if not self._closed:
            try:
                self._file.reopen()
            except LedgerError as e:
                self._broken = e

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r}{', closed' if self._closed else ''})"

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the lock ----------------------------------------------------------------------

    def _acquire(self, wait_s: float | None = None) -> memoryview:
        """Lock the file (waiting at most ``wait_s``, default ``lock_timeout_s``) and read it
        whole, checked: a writable image of its words. :meth:`_release` ends it."""
        wait = self.lock_timeout_s if wait_s is None else wait_s
        if self._pid != os.getpid():
            self._after_fork()  # a fork that did not run the at-fork hook
        if not self._tlock.acquire(timeout=wait):
            raise LedgerLockTimeoutError(str(self.path), wait, "another thread of this process")
        try:
            if self._closed:
                raise ClosedError(f"ledger {str(self.path)!r} used after close()")
            if self._broken is not None:
                raise LedgerError(str(self._broken))
            self._file.lock(wait)
        except BaseException:
            self._tlock.release()
            raise
        try:
            return self._file.read()
        except BaseException:
            self._release(None)
            raise

    def _release(self, left: memoryview | None) -> None:
        """Unlock; ``left`` is the image as this call left the file (None after a failure
        part way: then the next read checks the file again)."""
        try:
            self._file.leave(left)
            self._file.unlock()
        finally:
            self._tlock.release()

    @contextlib.contextmanager
    def _locked(self, wait_s: float | None = None) -> Iterator[memoryview]:
        """:meth:`_acquire` ... :meth:`_release` around a block."""
        q = self._acquire(wait_s)
        left = None
        try:
            yield q
            left = q
        finally:
            self._release(left)

    def _set(self, q: memoryview, index: int, value: int) -> None:
        """Store one word in the file and in this call's image of it."""
        self._file.write_word(index, value)
        q[index] = value

    def _put(self, q: memoryview, index: int, value: int, point: str) -> None:
        """A write that :class:`~kvvmm.budget.faults.FaultyLedger` can make fail: ``point``
        names the change (``"charge"``, ``"credit"``, ...)."""
        self._set(q, index, value)

    def _bump(self, q: memoryview) -> int:
        """Count a change; return the new count."""
        seq = min(q[H_SEQ] + 1, WORD_MAX)
        self._set(q, H_SEQ, seq)
        return seq

    def _free_slot(self, q: memoryview, s: int, point: str | None = None) -> None:
        """Zero slot ``s`` (a free slot holds zeros only). The state says "registering"
        while the other words are zeroed, so a holder killed part way leaves a slot the
        next sweep recognises as half-made and finishes freeing."""
        if q[STATE + s] != REGISTERING:
            if point is None:
                self._set(q, STATE + s, REGISTERING)
            else:
                self._put(q, STATE + s, REGISTERING, point)
        for col in _FIELDS:
            if q[col + s]:
                self._set(q, col + s, 0)
        if self._raw_name(q, s):
            self._set_name(q, s, b"")
        self._set(q, STATE + s, FREE)

    def _set_name(self, q: memoryview, s: int, raw: bytes) -> None:
        """Store slot ``s``'s name, NUL-padded, in the file and in this call's image."""
        at, padded = NAMES + s * NAME_BYTES, raw.ljust(NAME_BYTES, b"\0")
        self._file.write_bytes(at, padded)
        q[at // 8:(at + NAME_BYTES) // 8] = memoryview(padded).cast("Q")

    # -- tenants -----------------------------------------------------------------------

    def register(self, name: str, *, limit_bytes: int | None = None,
                 shed_wait_s: float = 0.0) -> Tenant:
        """Add this process as tenant ``name`` and return its :class:`Tenant`.

        A tenant of that name whose process is gone is reclaimed first and its slot reused.

        Args:
            name: 1 to 64 bytes of UTF-8, printable (no control character, newline or
                terminal escape), no space at either end; unique among the ledger's live
                tenants.
            limit_bytes: the most this tenant may book (default: the GPU's budget).
            shed_wait_s: how long a charge that finds the GPU's budget taken asks the
                others to shed and waits (0: refuse at once).
        Raises:
            ArgumentError: a bad or taken name, a bad limit or wait.
            LedgerError: every slot is held by a live tenant, or a write failed (and its
                subclasses: the file is corrupt, its lock stayed held).
        """
        from kvvmm.budget.tenant import Tenant

        raw = _name_bytes(name)
        if limit_bytes is not None:
            int_arg("limit_bytes", limit_bytes, lo=0, hi=MAX_BYTES,
                    limit=f"an int in [0, {MAX_BYTES}] (bytes)")
        wait = wait_arg("shed_wait_s", shed_wait_s)
        with self._locked() as q:
            pid, ticks = self._me  # a fork's child learns its own pid in _locked
            self._sweep(q)
            if self._find(q, raw) is not None:
                raise ArgumentError("name", name, "a name no live tenant of this ledger has",
                                    f"tenants: {self._names(q)}")
            free = [s for s in range(SLOTS) if q[STATE + s] == FREE]
            if not free:
                raise LedgerError(f"ledger {str(self.path)!r} is full: {SLOTS} live tenants "
                                  f"({self._names(q)[:8]}...); close tenants that are done")
            s = free[0]
            limit = q[H_BUDGET] if limit_bytes is None else limit_bytes
            serial = min(q[H_SEQ] + 1, WORD_MAX)
            try:
                # The state first: a holder killed before the last write leaves a slot
                # that is recognisably half-made (REGISTERING), which a sweep frees.
                for index, value in ((STATE + s, REGISTERING), (PID + s, pid),
                                     (START + s, ticks), (LIMIT + s, limit),
                                     (BACKED + s, 0), (SHED + s, 0), (SHED_DL + s, 0),
                                     (SHED_DONE + s, 0), (SERIAL + s, serial)):
                    self._put(q, index, value, "register")
                self._set_name(q, s, raw)
                self._set(q, H_SEQ, serial)  # a live slot's serial is never past the count
                self._put(q, STATE + s, LIVE, "register")
            except BaseException as e:
                try:  # undo: the slot was never live
                    self._free_slot(q, s)
                except Exception as undo:
                    e.add_note(f"undo: freeing slot {s} also failed ({undo}); the next "
                               f"sweep frees it")
                raise
            tenant = Tenant(self, s, str(name), pid, ticks=ticks, serial=serial,
                            shed_wait_s=wait)
        self._tenants.append(tenant)
        return tenant

    def _names(self, q: memoryview) -> list[str]:
        return [self._name_of(q, s) for s in range(SLOTS) if q[STATE + s] == LIVE]

    @staticmethod
    def _raw_name(q: memoryview, s: int) -> bytes:
        at = (NAMES + s * NAME_BYTES) // 8
        return q[at:at + NAME_BYTES // 8].tobytes().rstrip(b"\0")

    def _name_of(self, q: memoryview, s: int) -> str:
        # Checked on read (UTF-8, printable): decoding cannot fail.
        return self._raw_name(q, s).decode("utf-8", "replace")

    def _find(self, q: memoryview, raw: bytes) -> int | None:
        for s in range(SLOTS):
            if q[STATE + s] == LIVE and self._raw_name(q, s) == raw:
                return s
        return None

    def _own(self, q: memoryview, tenant: Tenant) -> None:
        """Refuse unless ``tenant``'s slot is still the one it registered (under the lock)."""
        s = tenant.slot
        if (q[STATE + s], q[PID + s], q[START + s], q[SERIAL + s]) != (
                LIVE, tenant.pid, tenant.ticks, tenant.serial):
            now = (f"holds tenant {self._name_of(q, s)!r} of pid {q[PID + s]}"
                   if q[STATE + s] == LIVE else "is free")
            raise ForeignTenantError(tenant.name, f"its slot {s} in {str(self.path)!r} was "
                                                  f"reclaimed or rewritten by another process "
                                                  f"(it {now}); register again")

    def _sweep(self, q: memoryview) -> list[str]:
        """Free the slots of tenants whose process is gone and half-made slots; clear
        expired shed requests. Under the lock."""
        gone = []
        me, my_ticks = self._me
        now = time.monotonic_ns()
        for s in range(SLOTS):
            state = q[STATE + s]
            if state == FREE:
                continue
            if state == REGISTERING:  # its registrar (or freer) died or failed mid-write
                self._free_slot(q, s)
                continue
            pid = q[PID + s]
            # Our own pid with another start time: a dead process whose pid we now have.
            mine = pid == me and q[START + s] == my_ticks
            if not mine and not alive(pid, q[START + s]):
                gone.append(self._name_of(q, s))
                log.info("budget ledger %s: tenant %r (pid %d) is gone; its %d bytes are "
                         "reclaimed", self.path, gone[-1], pid, q[BACKED + s])
                self._free_slot(q, s)
            elif q[SHED + s] and q[SHED_DL + s] <= now:
                self._set(q, SHED + s, 0)
        if gone:
            self._bump(q)
        return gone

    def sweep(self) -> tuple[str, ...]:
        """Reclaim the share of every tenant whose process is gone; return their names."""
        with self._locked() as q:
            return tuple(self._sweep(q))

    # -- charge and credit (a Tenant's calls) -------------------------------------------

    def _try_charge(self, q: memoryview, s: int, n: int) -> tuple[str, int, int, int] | None:
        """Book ``n`` bytes to slot ``s`` if they fit; else (reason, limit, backed, free)."""
        backed = q[BACKED + s]
        limit = q[LIMIT + s]
        free = q[H_BUDGET] - sum(q[BACKED:BACKED + SLOTS])
        reason = refusal(TenantState("", s, limit, backed), n, free_bytes=free)
        if reason is not None:
            return (reason, limit, backed, max(free, 0))
        self._put(q, BACKED + s, backed + n, "charge")
        return None

    def _charge(self, tenant: Tenant, n: int, wait_s: float) -> None:
        s = tenant.slot
        # A charge asked to wait for room waits no longer for the lock (a held lock is as
        # good as no room); one that will not wait for room still waits out an honest
        # holder, up to lock_timeout_s. Never under 50 ms: a holder descheduled on a busy
        # machine is not a stuck one.
        lock_wait = self.lock_timeout_s if wait_s <= 0 else min(
            self.lock_timeout_s, max(wait_s, _MIN_LOCK_WAIT_S))
        # Not the context manager: this is every create's path, and its frames show.
        q = self._acquire(lock_wait)
        left = None
        try:
            self._own(q, tenant)
            tenant._flush(q)
            refused = self._try_charge(q, s, n)
            if refused is not None and refused[0] == "budget" and self._sweep(q):
                refused = self._try_charge(q, s, n)  # a dead tenant's share came back
            left = q  # every write of this call is made
            if refused is None:
                return
            if refused[0] == "limit" or wait_s <= 0:
                raise self._refusal(q, tenant, n, refused)
            left = None
            deadline = _deadline_ns(wait_s)
            asked = self._post_shed(q, refused[3], n, exclude=s, deadline_ns=deadline)
            left = q
        finally:
            self._release(left)
        try:
            while True:
                time.sleep(_POLL_S)
                with self._locked(lock_wait) as q:
                    self._own(q, tenant)
                    tenant._flush(q)
                    self._sweep(q)
                    refused = self._try_charge(q, s, n)
                    if refused is None or refused[0] == "limit" \
                            or time.monotonic_ns() >= deadline:
                        self._withdraw(q, asked)
                        asked = {}
                        if refused is None:
                            return
                        raise self._refusal(q, tenant, n, refused, deadline=True)
        finally:
            if asked:  # interrupted (Ctrl-C, a ledger error) while waiting: take them back
                try:
                    with self._locked() as q:
                        self._withdraw(q, asked)
                except (LedgerError, ClosedError, OSError) as e:
                    log.warning("budget ledger %s: shed requests of tenant %r not withdrawn "
                                "(%s); they expire at their deadline", self.path,
                                tenant.name, e)

    def _refusal(self, q: memoryview, tenant: Tenant, n: int,
                 refused: tuple[str, int, int, int], *,
                 deadline: bool = False) -> BudgetExceededError:
        reason, limit, backed, free = refused
        if deadline and reason == "budget":
            reason = "deadline"
        return BudgetExceededError(tenant.name, n, limit, backed, free, q[H_BUDGET], reason)

    def _post_shed(self, q: memoryview, free: int, n: int, *, exclude: int,
                   deadline_ns: int) -> dict[tuple[int, int], int]:
        """Ask the others for the shortfall in the order :func:`~kvvmm.budget.rules.shed_plan`
        gives; return what was asked of whom (``{(slot, pid): bytes}``) so that it can be
        withdrawn."""
        others = (TenantState("", s, q[LIMIT + s], q[BACKED + s], q[SHED + s])
                  for s in range(SLOTS) if s != exclude and q[STATE + s] == LIVE)
        asked: dict[tuple[int, int], int] = {}
        for ask in shed_plan(others, n - free):
            s, add = ask.index, ask.nbytes
            self._put(q, SHED + s, q[SHED + s] + add, "shed")
            self._put(q, SHED_DL + s, max(q[SHED_DL + s], deadline_ns), "shed")
            asked[(s, q[PID + s])] = add
        self._bump(q)
        return asked

    def _withdraw(self, q: memoryview, asked: dict[tuple[int, int], int]) -> None:
        for (s, pid), add in asked.items():
            if q[STATE + s] == LIVE and q[PID + s] == pid and q[SHED + s]:
                self._set(q, SHED + s, max(q[SHED + s] - add, 0))

    def _credit_checked(self, tenant: Tenant, n: int) -> None:
        """Book ``n`` bytes back to ``tenant`` (with the credits still waiting), refused
        when that is more than it books. A failed write keeps them waiting in the tenant."""
        q = self._acquire()  # not the context manager: every release's path
        left = None
        try:
            self._own(q, tenant)
            backed = q[BACKED + tenant.slot]
            with tenant._plock:
                waiting = tenant._pending
                if waiting + n > backed:
                    raise OutOfRangeError(
                        "nbytes", n, f"at most the {max(backed - waiting, 0)} bytes tenant "
                                     f"{tenant.name!r} books", "nothing was booked back")
                tenant._pending += n
            try:
                tenant._flush(q)
                left = q
            except OSError as e:
                log.warning("budget: tenant %r could not credit %d bytes now (%s); kept for "
                            "the next ledger call", tenant.name, n, e)
        finally:
            self._release(left)

    def _credit_now(self, tenant: Tenant) -> None:
        """Book the tenant's waiting credits."""
        with self._locked() as q:
            self._own(q, tenant)
            tenant._flush(q)

    def _credit(self, q: memoryview, s: int, n: int) -> None:
        backed = q[BACKED + s]
        if n > backed:  # credits kept while the ledger could not be read: never below zero
            log.error("budget ledger %s: slot %d credits %d bytes but books %d", self.path,
                      s, n, backed)
            n = backed
        # The request before the booking, so that a holder killed between the two leaves
        # a request no larger than the booking.
        shed = q[SHED + s]
        if shed:
            self._put(q, SHED + s, max(shed - n, 0), "credit")
        self._put(q, BACKED + s, backed - n, "credit")
        if shed:
            self._set(q, SHED_DONE + s, min(q[SHED_DONE + s] + min(shed, n), WORD_MAX))

    def _unregister(self, tenant: Tenant) -> None:
        with self._locked() as q:
            s = tenant.slot
            try:
                self._own(q, tenant)
            except ForeignTenantError:
                return  # already reclaimed: nothing of it is left in the file
            tenant._flush(q)
            if q[BACKED + s]:
                raise BusyError(f"tenant {tenant.name!r} still books {q[BACKED + s]} bytes: "
                                f"close its owners and pools (which release, and credit) "
                                f"first")
            self._free_slot(q, s, "unregister")
            self._bump(q)
        if tenant in self._tenants:
            self._tenants.remove(tenant)

    # -- operator calls ----------------------------------------------------------------

    def snapshot(self, *, sweep: bool = True) -> BudgetSnapshot:
        """Every tenant and the budget now (dead tenants reclaimed first unless ``sweep``
        is False)."""
        now = time.monotonic_ns()
        with self._locked() as q:
            if sweep:
                self._sweep(q)
            tenants = tuple(
                TenantInfo(
                    name=self._name_of(q, s), pid=q[PID + s],
                    alive=(q[PID + s], q[START + s]) == self._me
                    or alive(q[PID + s], q[START + s]),
                    limit_bytes=q[LIMIT + s], backed_bytes=q[BACKED + s],
                    shed_bytes=q[SHED + s] if q[SHED_DL + s] > now else 0,
                    shed_left_s=max(q[SHED_DL + s] - now, 0) / 1e9 if q[SHED + s] else 0.0,
                    shed_done_bytes=q[SHED_DONE + s])
                for s in range(SLOTS) if q[STATE + s] == LIVE)
            return BudgetSnapshot(str(self.path), q[H_BUDGET], tenants)

    def backed_bytes(self) -> int:
        """Bytes booked by every tenant (no sweep: a sampler's call)."""
        with self._locked() as q:
            return sum(q[BACKED:BACKED + SLOTS])

    @property
    def budget_bytes(self) -> int:
        """The GPU's budget."""
        with self._locked() as q:
            return int(q[H_BUDGET])

    def set_limit(self, name: str, limit_bytes: int, *, shed_wait_s: float = 1.0) -> int:
        """Change tenant ``name``'s limit, live; return the old one.

        Below what it backs, the tenant is asked to shed the excess within ``shed_wait_s``
        (nothing is taken from it: shedding is cooperative), and its charges are refused
        until it is under the limit.

        Raises:
            ArgumentError: a bad limit or wait, or no live tenant of that name.
            LedgerError: a write failed (the limit is as it was).
        """
        int_arg("limit_bytes", limit_bytes, lo=0, hi=MAX_BYTES,
                limit=f"an int in [0, {MAX_BYTES}] (bytes)")
        wait = wait_arg("shed_wait_s", shed_wait_s)
        with self._locked() as q:
            self._sweep(q)
            s = self._find(q, name.encode("utf-8", "replace")) if isinstance(name, str) \
                else None
            if s is None:
                raise ArgumentError("tenant", name, "a live tenant of this ledger",
                                    f"tenants: {self._names(q)}")
            old = q[LIMIT + s]
            self._put(q, LIMIT + s, limit_bytes, "limit")
            excess = q[BACKED + s] - limit_bytes - q[SHED + s]
            if excess > 0 and wait > 0:
                self._set(q, SHED + s, q[SHED + s] + excess)
                self._set(q, SHED_DL + s, max(q[SHED_DL + s], _deadline_ns(wait)))
            self._bump(q)
            return int(old)

    def set_budget(self, budget_bytes: int, *, shed_wait_s: float = 1.0) -> int:
        """Change the GPU's budget, live; return the old one.

        Below what the tenants book, the excess is asked of them (the most backed first)
        within ``shed_wait_s``; charges are refused until they are under it.

        Raises:
            ArgumentError: a bad budget or wait.
            LedgerError: a write failed (the budget is as it was).
        """
        int_arg("budget_bytes", budget_bytes, lo=1, hi=MAX_BYTES,
                limit=f"an int in [1, {MAX_BYTES}] (bytes)")
        wait = wait_arg("shed_wait_s", shed_wait_s)
        with self._locked() as q:
            self._sweep(q)
            old = q[H_BUDGET]
            self._put(q, H_BUDGET, budget_bytes, "budget")
            over = sum(q[BACKED:BACKED + SLOTS]) - budget_bytes
            if over > 0 and wait > 0:
                self._post_shed(q, 0, over, exclude=-1, deadline_ns=_deadline_ns(wait))
            self._bump(q)
            return int(old)

    def close(self) -> None:
        """Close the file (idempotent). Tenants still registered here stay in the ledger
        until they close or their process ends; their objects stop working."""
        with self._tlock:
            if self._closed:
                return
            self._closed = True
        _LEDGERS.discard(self)
        for t in list(self._tenants):
            t._stop_watch()
        self._file.close()

    @property
    def closed(self) -> bool:
        return self._closed


def _name_bytes(name: object) -> bytes:
    """A tenant name's UTF-8, refused unless it is one (:func:`name_problem`)."""
    if not isinstance(name, str):
        raise ArgumentError("name", name, _NAME_RULE)
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise ArgumentError("name", name, _NAME_RULE, "not encodable as UTF-8") from None
    why = name_problem(raw)
    if why is not None:
        raise ArgumentError("name", name, _NAME_RULE, why)
    return raw

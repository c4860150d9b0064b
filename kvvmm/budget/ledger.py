"""The per-GPU ledger: one small file every tenant process maps, guarded by one file lock.

Why a file in ``/dev/shm`` (or a folder the caller names) mapped with ``mmap`` and locked
with ``flock``: the kernel releases a ``flock`` when its holder dies, however it dies, so a
tenant killed while it held the lock cannot wedge the others, and there is no daemon to
start, supervise or lose. Every change is made under the lock, and no derived value is
stored (the GPU's booked bytes are the sum of the tenants' at each check), so a holder
killed between two writes leaves each tenant's own record at worst stale, never a total out
of step with it; a slot that was being registered is recognised and freed.

The file (fixed layout, little-endian 64-bit words; docs/BUDGET.md draws it): a header
(magic, version, slot count, the GPU budget, a change counter), then one column of
``SLOTS`` words per field (state, pid, start ticks, limit, backed, shed request, shed
deadline, bytes shed), then ``SLOTS`` names of 64 bytes.

Rules (the lab models the same; docs/BUDGET.md states them):

- a charge of ``n`` bytes fits when ``backed + n <= limit`` (the tenant's own) and
  ``sum(backed of every tenant) + n <= budget`` (the GPU's);
- a charge past the limit is refused at once; a charge past the GPU's free budget is
  refused at once with ``shed_wait_s == 0``, else the shortfall is asked of the other
  tenants, the most backed first, each for at most what it backs, and the asker waits up to
  ``shed_wait_s`` for room, then is refused;
- a tenant whose process is gone (pid and start time) is reclaimed at the next sweep: every
  charge that does not fit, every wait, ``snapshot``, ``set_limit``, ``set_budget``,
  ``register`` and a tenant's watcher sweep.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvvmm.budget.errors import BudgetExceededError, LedgerError
from kvvmm.budget.liveness import alive, start_ticks
from kvvmm.checks import int_arg, seconds_arg
from kvvmm.errors import ArgumentError, BusyError, ClosedError

if TYPE_CHECKING:
    from kvvmm.budget.tenant import Tenant

__all__ = ["MAX_BYTES", "NAME_BYTES", "SLOTS", "BudgetSnapshot", "Ledger", "TenantInfo",
           "default_path"]

log = logging.getLogger(__name__)

MAGIC = int.from_bytes(b"KVVMMBG1", "little")
VERSION = 1
#: tenants one ledger holds (one GPU rarely hosts more than a handful of engines)
SLOTS = 64
#: bytes of a tenant's name, UTF-8 (NUL-padded in the file)
NAME_BYTES = 64
#: the largest budget, limit or charge (64 PiB): sums of 64 of them stay exact in a u64
MAX_BYTES = 1 << 56

# Header words.
_H_MAGIC, _H_VERSION, _H_SLOTS, _H_BUDGET, _H_SEQ = 0, 1, 2, 3, 4
_HEADER_WORDS = 16
# Columns, each SLOTS words.
(_C_STATE, _C_PID, _C_START, _C_LIMIT, _C_BACKED, _C_SHED, _C_SHED_DL,
 _C_SHED_DONE) = range(8)
_COLUMNS = 8
_FREE, _REGISTERING, _LIVE = 0, 1, 2


def _col(c: int) -> int:
    return _HEADER_WORDS + c * SLOTS


_STATE, _PID, _START, _LIMIT, _BACKED, _SHED, _SHED_DL, _SHED_DONE = (
    _col(c) for c in range(_COLUMNS))
_NAMES = (_HEADER_WORDS + _COLUMNS * SLOTS) * 8
FILE_BYTES = _NAMES + SLOTS * NAME_BYTES

#: how often a waiting asker looks again (seconds)
_POLL_S = 0.001


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
        path: the ledger file (see :func:`default_path`); its folder must exist.
        budget_bytes: the GPU's budget, set when this call creates the ledger; None to open
            an existing one. Opening an existing ledger with another budget is refused (set
            it with :meth:`set_budget` or ``kvvmm budget init``).
    Raises:
        ArgumentError: a bad budget, or one that differs from the ledger's.
        LedgerError: the file is not a kvvmm ledger, or None was passed and none exists.
        OSError: the file cannot be opened or mapped.
    """

    def __init__(self, path: str | os.PathLike[str], *, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None:
            int_arg("budget_bytes", budget_bytes, lo=1, hi=MAX_BYTES,
                    limit=f"an int in [1, {MAX_BYTES}] (bytes)")
        self.path = Path(path)
        # One lock per process-side object: flock excludes other open files (other
        # processes, other Ledger objects), this lock the threads sharing this one.
        self._tlock = threading.Lock()
        self._closed = False
        self._tenants: list[Tenant] = []
        self._me = (os.getpid(), start_ticks())  # this process: alive without a /proc read
        flags = os.O_RDWR | (os.O_CREAT if budget_bytes is not None else 0)
        try:
            self._fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise LedgerError(f"no budget ledger at {str(self.path)!r}: create it with a "
                              f"budget (Ledger(path, budget_bytes=...) or kvvmm budget init "
                              f"BYTES)") from None
        try:
            self._open(budget_bytes)
        except BaseException:
            os.close(self._fd)
            raise

    def _open(self, budget_bytes: int | None) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            size = os.fstat(self._fd).st_size
            if size == 0 and budget_bytes is not None:
                os.ftruncate(self._fd, FILE_BYTES)
                size = FILE_BYTES
            if size != FILE_BYTES:
                raise LedgerError(f"{str(self.path)!r} is not a kvvmm budget ledger "
                                  f"({size} bytes, a ledger has {FILE_BYTES}); remove it or "
                                  f"pick another path")
            self._mm = mmap.mmap(self._fd, FILE_BYTES)
            self._q = memoryview(self._mm).cast("Q")
            q = self._q
            if q[_H_MAGIC] == 0 and budget_bytes is not None:
                # A fresh file (zeros): the header last, the magic last of all.
                q[_H_VERSION] = VERSION
                q[_H_SLOTS] = SLOTS
                q[_H_BUDGET] = budget_bytes
                q[_H_MAGIC] = MAGIC
            if q[_H_MAGIC] != MAGIC or q[_H_VERSION] != VERSION or q[_H_SLOTS] != SLOTS:
                self._unmap()
                raise LedgerError(f"{str(self.path)!r} is not a kvvmm budget ledger of "
                                  f"version {VERSION} (magic, version or slot count differ); "
                                  f"remove it or pick another path")
            if budget_bytes is not None and q[_H_BUDGET] != budget_bytes:
                have = q[_H_BUDGET]
                self._unmap()
                raise ArgumentError("budget_bytes", budget_bytes,
                                    f"None or the ledger's budget {have} (change it with "
                                    f"set_budget or kvvmm budget init)")
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _unmap(self) -> None:
        self._q.release()
        self._mm.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"Ledger({str(self.path)!r}, closed)"
        return f"Ledger({str(self.path)!r}, budget {self._q[_H_BUDGET]} bytes)"

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the lock ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[memoryview]:
        with self._tlock:
            if self._closed:
                raise ClosedError(f"ledger {str(self.path)!r} used after close()")
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self._q
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _put(self, q: memoryview, index: int, value: int, point: str) -> None:
        """Every write to the file: one aligned 64-bit store. ``point`` names the change
        (``"charge"``, ``"credit"``, ...) for :class:`~kvvmm.budget.faults.FaultyLedger`."""
        q[index] = value

    # -- tenants -----------------------------------------------------------------------

    def register(self, name: str, *, limit_bytes: int | None = None,
                 shed_wait_s: float = 0.0) -> Tenant:
        """Add this process as tenant ``name`` and return its :class:`Tenant`.

        A tenant of that name whose process is gone is reclaimed first and its slot reused.

        Args:
            name: 1 to 64 bytes of UTF-8, no NUL; unique among the ledger's live tenants.
            limit_bytes: the most this tenant may book (default: the GPU's budget).
            shed_wait_s: how long a charge that finds the GPU's budget taken asks the
                others to shed and waits (0: refuse at once).
        Raises:
            ArgumentError: a bad or taken name, a bad limit or wait.
            LedgerError: every slot is held by a live tenant, or a write failed.
        """
        from kvvmm.budget.tenant import Tenant

        raw = _name_bytes(name)
        if limit_bytes is not None:
            int_arg("limit_bytes", limit_bytes, lo=0, hi=MAX_BYTES,
                    limit=f"an int in [0, {MAX_BYTES}] (bytes)")
        wait = seconds_arg("shed_wait_s", shed_wait_s)
        pid, ticks = os.getpid(), start_ticks()
        with self._locked() as q:
            self._sweep(q)
            if self._find(q, name) is not None:
                raise ArgumentError("name", name, "a name no live tenant of this ledger has",
                                    f"tenants: {self._names(q)}")
            free = [s for s in range(SLOTS) if q[_STATE + s] == _FREE]
            if not free:
                raise LedgerError(f"ledger {str(self.path)!r} is full: {SLOTS} live tenants "
                                  f"({self._names(q)[:8]}...); close tenants that are done")
            s = free[0]
            limit = q[_H_BUDGET] if limit_bytes is None else limit_bytes
            try:
                # The state first: a holder killed before the last write leaves a slot
                # that is recognisably half-made (REGISTERING), which a sweep frees.
                for index, value in ((_STATE + s, _REGISTERING), (_PID + s, pid),
                                     (_START + s, ticks), (_LIMIT + s, limit),
                                     (_BACKED + s, 0), (_SHED + s, 0), (_SHED_DL + s, 0),
                                     (_SHED_DONE + s, 0)):
                    self._put(q, index, value, "register")
                at = _NAMES + s * NAME_BYTES
                self._mm[at:at + NAME_BYTES] = raw.ljust(NAME_BYTES, b"\0")
                self._put(q, _STATE + s, _LIVE, "register")
                q[_H_SEQ] += 1
            except BaseException:
                q[_STATE + s] = _FREE  # undo: the slot was never live
                raise
            tenant = Tenant(self, s, str(name), pid, shed_wait_s=wait)
        self._tenants.append(tenant)
        return tenant

    def _names(self, q: memoryview) -> list[str]:
        return [self._name_of(s) for s in range(SLOTS) if q[_STATE + s] == _LIVE]

    def _name_of(self, s: int) -> str:
        at = _NAMES + s * NAME_BYTES
        return bytes(self._mm[at:at + NAME_BYTES]).rstrip(b"\0").decode("utf-8", "replace")

    def _find(self, q: memoryview, name: str) -> int | None:
        for s in range(SLOTS):
            if q[_STATE + s] == _LIVE and self._name_of(s) == name:
                return s
        return None

    def _sweep(self, q: memoryview) -> list[str]:
        """Free the slots of tenants whose process is gone and half-made slots; clear
        expired shed requests. Under the lock."""
        gone = []
        me, my_ticks = self._me
        if me != os.getpid():  # a fork's child: it is another process
            self._me = me, my_ticks = os.getpid(), start_ticks()
        now = time.monotonic_ns()
        for s in range(SLOTS):
            state = q[_STATE + s]
            if state == _FREE:
                continue
            if state == _REGISTERING:  # its registrar died (or failed) mid-write
                q[_BACKED + s] = 0
                q[_STATE + s] = _FREE
                continue
            pid = q[_PID + s]
            # Our own pid with another start time: a dead process whose pid we now have.
            mine = pid == me and q[_START + s] == my_ticks
            if not mine and not alive(pid, q[_START + s]):
                gone.append(self._name_of(s))
                log.info("budget ledger %s: tenant %r (pid %d) is gone; its %d bytes are "
                         "reclaimed", self.path, gone[-1], pid, q[_BACKED + s])
                q[_STATE + s] = _FREE  # first: the slot stops counting as a tenant
                q[_BACKED + s] = 0
                q[_SHED + s] = 0
            elif q[_SHED + s] and q[_SHED_DL + s] <= now:
                q[_SHED + s] = 0
        if gone:
            q[_H_SEQ] += 1
        return gone

    def sweep(self) -> tuple[str, ...]:
        """Reclaim the share of every tenant whose process is gone; return their names."""
        with self._locked() as q:
            return tuple(self._sweep(q))

    # -- charge and credit (a Tenant's calls) -------------------------------------------

    def _try_charge(self, q: memoryview, s: int, n: int) -> tuple[str, int, int, int] | None:
        """Book ``n`` bytes to slot ``s`` if they fit; else (reason, limit, backed, free)."""
        backed = q[_BACKED + s]
        limit = q[_LIMIT + s]
        if backed + n > limit:
            return ("limit", limit, backed, max(q[_H_BUDGET] - sum(q[_BACKED:_BACKED + SLOTS]),
                                                0))
        free = q[_H_BUDGET] - sum(q[_BACKED:_BACKED + SLOTS])
        if n > free:
            return ("budget", limit, backed, max(free, 0))
        self._put(q, _BACKED + s, backed + n, "charge")
        return None

    def _charge(self, tenant: Tenant, n: int, wait_s: float) -> None:
        s = tenant.slot
        # The fast path (it fits, nothing to flush): the lock by hand, no context manager,
        # one pass over the file. Everything else goes the general way below.
        fd, q = self._fd, self._q
        with self._tlock:
            if self._closed:
                raise ClosedError(f"ledger {str(self.path)!r} used after close()")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if not tenant._pending:
                    backed = q[_BACKED + s]
                    if backed + n <= q[_LIMIT + s] \
                            and sum(q[_BACKED:_BACKED + SLOTS]) + n <= q[_H_BUDGET]:
                        self._put(q, _BACKED + s, backed + n, "charge")
                        return
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        with self._locked() as q:
            tenant._flush(q)
            refused = self._try_charge(q, s, n)
            if refused is None:
                return
            if refused[0] == "budget" and self._sweep(q):
                refused = self._try_charge(q, s, n)  # a dead tenant's share came back
                if refused is None:
                    return
            if refused[0] == "limit" or wait_s <= 0:
                raise self._refusal(tenant, n, refused)
            deadline = time.monotonic_ns() + int(wait_s * 1e9)
            asked = self._post_shed(q, refused[3], n, exclude=s, deadline_ns=deadline)
        try:
            while True:
                time.sleep(_POLL_S)
                with self._locked() as q:
                    tenant._flush(q)
                    self._sweep(q)
                    refused = self._try_charge(q, s, n)
                    if refused is None or refused[0] == "limit" \
                            or time.monotonic_ns() >= deadline:
                        self._withdraw(q, asked)
                        asked = {}
                        if refused is None:
                            return
                        raise self._refusal(tenant, n, refused, deadline=True)
        finally:
            if asked:  # interrupted (Ctrl-C) while waiting: take the requests back
                with self._locked() as q:
                    self._withdraw(q, asked)

    def _refusal(self, tenant: Tenant, n: int, refused: tuple[str, int, int, int], *,
                 deadline: bool = False) -> BudgetExceededError:
        reason, limit, backed, free = refused
        if deadline and reason == "budget":
            reason = "deadline"
        return BudgetExceededError(tenant.name, n, limit, backed, free, self._q[_H_BUDGET],
                                   reason)

    def _post_shed(self, q: memoryview, free: int, n: int, *, exclude: int,
                   deadline_ns: int) -> dict[tuple[int, int], int]:
        """Ask the others for the shortfall, the most backed first; return what was asked
        of whom (``{(slot, pid): bytes}``) so that it can be withdrawn."""
        short = n - free
        order = sorted((s for s in range(SLOTS)
                        if s != exclude and q[_STATE + s] == _LIVE and q[_BACKED + s]),
                       key=lambda s: (-q[_BACKED + s], s))
        asked: dict[tuple[int, int], int] = {}
        for s in order:
            if short <= 0:
                break
            room = q[_BACKED + s] - q[_SHED + s]
            add = min(max(room, 0), short)
            if add <= 0:
                continue
            self._put(q, _SHED + s, q[_SHED + s] + add, "shed")
            self._put(q, _SHED_DL + s, max(q[_SHED_DL + s], deadline_ns), "shed")
            asked[(s, q[_PID + s])] = add
            short -= add
        q[_H_SEQ] += 1
        return asked

    def _withdraw(self, q: memoryview, asked: dict[tuple[int, int], int]) -> None:
        for (s, pid), add in asked.items():
            if q[_STATE + s] == _LIVE and q[_PID + s] == pid:
                q[_SHED + s] = max(q[_SHED + s] - add, 0)

    def _credit_now(self, tenant: Tenant) -> None:
        """Book the tenant's waiting credits (the lock by hand: the release path)."""
        fd = self._fd
        with self._tlock:
            if self._closed:
                raise ClosedError(f"ledger {str(self.path)!r} used after close()")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                tenant._flush(self._q)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _credit(self, q: memoryview, s: int, n: int) -> None:
        backed = q[_BACKED + s]
        if n > backed:  # a bug, not the caller's input: never book below zero
            log.error("budget ledger %s: slot %d credits %d bytes but books %d", self.path,
                      s, n, backed)
            n = backed
        self._put(q, _BACKED + s, backed - n, "credit")
        shed = q[_SHED + s]
        if shed:
            q[_SHED + s] = max(shed - n, 0)
            q[_SHED_DONE + s] += min(shed, n)

    def _unregister(self, tenant: Tenant) -> None:
        with self._locked() as q:
            tenant._flush(q)
            s = tenant.slot
            if q[_PID + s] != tenant.pid or q[_STATE + s] != _LIVE:
                return  # already reclaimed
            if q[_BACKED + s]:
                raise BusyError(f"tenant {tenant.name!r} still books {q[_BACKED + s]} bytes: "
                                f"close its owners and pools (which release, and credit) "
                                f"first")
            self._put(q, _STATE + s, _FREE, "unregister")
            q[_H_SEQ] += 1
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
                    name=self._name_of(s), pid=q[_PID + s],
                    alive=(q[_PID + s], q[_START + s]) == self._me
                    or alive(q[_PID + s], q[_START + s]),
                    limit_bytes=q[_LIMIT + s], backed_bytes=q[_BACKED + s],
                    shed_bytes=q[_SHED + s] if q[_SHED_DL + s] > now else 0,
                    shed_left_s=max(q[_SHED_DL + s] - now, 0) / 1e9 if q[_SHED + s] else 0.0,
                    shed_done_bytes=q[_SHED_DONE + s])
                for s in range(SLOTS) if q[_STATE + s] == _LIVE)
            return BudgetSnapshot(str(self.path), q[_H_BUDGET], tenants)

    def backed_bytes(self) -> int:
        """Bytes booked by every tenant (no sweep: a sampler's call)."""
        with self._locked() as q:
            return sum(q[_BACKED:_BACKED + SLOTS])

    @property
    def budget_bytes(self) -> int:
        """The GPU's budget."""
        return int(self._q[_H_BUDGET])

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
        wait = seconds_arg("shed_wait_s", shed_wait_s)
        with self._locked() as q:
            self._sweep(q)
            s = self._find(q, name)
            if s is None:
                raise ArgumentError("tenant", name, "a live tenant of this ledger",
                                    f"tenants: {self._names(q)}")
            old = q[_LIMIT + s]
            self._put(q, _LIMIT + s, limit_bytes, "limit")
            excess = q[_BACKED + s] - limit_bytes - q[_SHED + s]
            if excess > 0 and wait > 0:
                q[_SHED + s] += excess
                q[_SHED_DL + s] = max(q[_SHED_DL + s], time.monotonic_ns() + int(wait * 1e9))
            q[_H_SEQ] += 1
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
        wait = seconds_arg("shed_wait_s", shed_wait_s)
        with self._locked() as q:
            self._sweep(q)
            old = q[_H_BUDGET]
            self._put(q, _H_BUDGET, budget_bytes, "budget")
            over = sum(q[_BACKED:_BACKED + SLOTS]) - budget_bytes
            if over > 0 and wait > 0:
                self._post_shed(q, 0, over, exclude=-1,
                                deadline_ns=time.monotonic_ns() + int(wait * 1e9))
            q[_H_SEQ] += 1
            return int(old)

    def close(self) -> None:
        """Unmap the file (idempotent). Tenants still registered here stay in the ledger
        until they close or their process ends; their objects stop working."""
        with self._tlock:
            if self._closed:
                return
            self._closed = True
        for t in list(self._tenants):
            t._stop_watch()
        self._unmap()
        os.close(self._fd)

    @property
    def closed(self) -> bool:
        return self._closed


def _name_bytes(name: object) -> bytes:
    if not isinstance(name, str):
        raise ArgumentError("name", name, f"a str of 1 to {NAME_BYTES} UTF-8 bytes")
    raw = name.encode("utf-8")
    if not 1 <= len(raw) <= NAME_BYTES or b"\0" in raw:
        raise ArgumentError("name", name, f"1 to {NAME_BYTES} bytes of UTF-8, no NUL",
                            f"{len(raw)} bytes")
    return raw


"""A tenant: one process's account in a GPU's ledger (charge, credit, shed requests)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvvmm.arena.reclaim import TorchAllocatorCap, TorchCapError
from kvvmm.budget.errors import BudgetExceededError, ForeignTenantError, LedgerError
from kvvmm.budget.ledger import wait_arg
from kvvmm.budget.ledger_file import BACKED, H_BUDGET, LIMIT, MAX_BYTES, SHED, SHED_DL, SLOTS
from kvvmm.budget.rules import kv_claim, shed_answer
from kvvmm.checks import int_arg, seconds_arg
from kvvmm.errors import ArgumentError, ClosedError, OutOfRangeError
from kvvmm.owner.elastic import GiveBack, RangeBacking

if TYPE_CHECKING:
    from kvvmm.budget.ledger import Ledger

__all__ = ["ShedCallback", "ShedRequest", "ShedTrim", "Tenant"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShedRequest:
    """Other tenants (or the operator) ask this tenant to give memory back (a record)."""

    tenant: str
    shed_bytes: int  #: bytes asked and not yet given back
    left_s: float  #: seconds until the request expires (the asker stops waiting)


@dataclass(frozen=True, slots=True)
class ShedTrim:
    """What :meth:`Tenant.trim` gave back from the range backings' cache and reserve."""

    asked_bytes: int  #: the request's bytes when it was read
    trim_bytes: int  #: of those, what the cache and reserve were asked for
    freed_bytes: int  #: given back (each release through a BudgetedDriver booked back)
    elapsed_s: float  #: from the call to the last backing's stop
    stops: tuple[str, ...]  #: each backing's :attr:`GiveBack.stopped`, in order


#: a shed callback: gets the request, gives memory back through its owners and pools
#: (``HandlePool.trim``, ``KvBufferOwner.release_beyond`` / ``shrink``, ``sleep``); each
#: release through a :class:`~kvvmm.budget.driver.BudgetedDriver` credits the ledger.
ShedCallback = Callable[[ShedRequest], object]


class Tenant:
    """This process's account in a ledger; made by :meth:`Ledger.register`.

    ``charge`` before creating memory, ``credit`` after releasing it (a
    :class:`~kvvmm.budget.driver.BudgetedDriver` does both for every create and release).
    Every method may be called from any thread of the process that registered it; in a
    ``fork``'s child every call is refused with
    :class:`~kvvmm.budget.errors.ForeignTenantError` (the child registers its own tenant),
    and so is every call after another process reclaimed or rewrote its slot.
    """

    def __init__(self, ledger: Ledger, slot: int, name: str, pid: int, *, ticks: int,
                 serial: int, shed_wait_s: float) -> None:
        self.ledger = ledger
        self.slot = slot  #: its slot in the ledger file
        self.name = name
        self.pid = pid  #: the process that registered it (the only one it works in)
        self.ticks = ticks  #: that process's start time (with the pid: that process)
        self.serial = serial  #: this registration's number in the ledger (its slot's own)
        self.shed_wait_s = shed_wait_s  #: the default wait of :meth:`charge`
        self._pending = 0  # credits a failed ledger write left to book (retried first)
        self._plock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._closed = False
        self._cap: TorchAllocatorCap | None = None  # torch's allocator, kept to the claim
        self._claim = 0  # the KV claim last read under the ledger's lock
        self._cap_lock = threading.Lock()
        self._cap_error: Exception | None = None

    def __repr__(self) -> str:
        return f"Tenant({self.name!r}, slot {self.slot}, pid {self.pid})"

    def _check(self) -> None:
        """Refuse a call of a closed tenant or ledger, or one made in another process."""
        if self._closed:
            raise ClosedError(f"tenant {self.name!r} used after close()")
        if self.pid != os.getpid():
            raise ForeignTenantError(self.name, f"it was registered by process {self.pid} "
                                                f"and this is process {os.getpid()} (a "
                                                f"fork's child): register the child as its "
                                                f"own tenant")
        if self.ledger.closed:
            raise ClosedError(f"tenant {self.name!r}: its ledger {str(self.ledger.path)!r} "
                              f"was closed")

    # -- charge and credit ---------------------------------------------------------------

    def charge(self, nbytes: int, *, wait_s: float | None = None) -> None:
        """Book ``nbytes`` to this tenant before they are created.

        Args:
            nbytes: bytes, > 0.
            wait_s: when the GPU's budget is short, ask the other tenants to shed and wait
                this long for room (default: the tenant's ``shed_wait_s``; 0: refuse now).
                Above 0 it also bounds the wait for the ledger's lock (at least 50 ms, at
                most the ledger's ``lock_timeout_s``, which bounds it otherwise).
        Raises:
            BudgetExceededError: it does not fit (nothing booked).
            LedgerError: the ledger could not be read or written, its lock stayed held
                (``LedgerLockTimeoutError``) or its file is corrupt (``LedgerCorruptError``);
                nothing booked.
            ArgumentError: a bad size or wait.
            ClosedError: after :meth:`close`.
            ForeignTenantError: in a fork's child, or the slot is no longer this tenant's.
        """
        int_arg("nbytes", nbytes, lo=1, hi=MAX_BYTES,
                limit=f"an int in [1, {MAX_BYTES}] (bytes)")
        wait = self.shed_wait_s if wait_s is None else wait_arg("wait_s", wait_s)
        self._check()
        try:
            self.ledger._charge(self, nbytes, wait)
        except (BudgetExceededError, ArgumentError, ClosedError, LedgerError):
            raise
        except OSError as e:
            raise LedgerError(f"ledger {str(self.ledger.path)!r}: charging {nbytes} bytes to "
                              f"tenant {self.name!r} failed ({e}); nothing was booked") from e
        finally:
            self._follow()

    def credit(self, nbytes: int) -> None:
        """Book ``nbytes`` back after they were released.

        Never raises for the ledger's state: a write that fails, a lock that stays held or
        a file that cannot be read keeps the credit here and books it at the next charge,
        credit or sweep of this tenant (until then the ledger books more than is backed,
        never less). A credit the ledger could not check then is booked at most down to
        zero.

        Raises:
            ArgumentError: not an int in [1, MAX_BYTES].
            OutOfRangeError: more than the tenant books (with the credits still waiting):
                nothing is booked back.
            ClosedError: after :meth:`close`.
            ForeignTenantError: in a fork's child, or the slot is no longer this tenant's.
        """
        int_arg("nbytes", nbytes, lo=1, hi=MAX_BYTES,
                limit=f"an int in [1, {MAX_BYTES}] (bytes)")
        self._check()
        try:
            self.ledger._credit_checked(self, nbytes)
        except (ArgumentError, ClosedError, ForeignTenantError):
            raise
        except (LedgerError, OSError) as e:
            # The memory is already released: keep the credit rather than fail the release.
            with self._plock:
                self._pending += nbytes
            log.warning("budget: tenant %r could not credit %d bytes now (%s); kept for the "
                        "next ledger call", self.name, nbytes, e)
        self._follow()

    def _flush(self, q: memoryview) -> None:
        """Book the credits still waiting here (under the ledger's lock)."""
        with self._plock:
            n = self._pending
        if n:
            self.ledger._credit(q, self.slot, n)
            with self._plock:
                self._pending -= n
        self._observe(q)

    def _observe(self, q: memoryview) -> None:
        """Note this tenant's KV claim as the file holds it now (under the ledger's lock;
        :meth:`_follow` applies it after)."""
        if self._cap is not None:
            self._claim = self._claim_in(q)

    def _claim_in(self, q: memoryview) -> int:
        """This tenant's KV claim as the file holds it (under the ledger's lock)."""
        s = self.slot
        return kv_claim(q[LIMIT + s], q[BACKED + s], q[H_BUDGET])

    @property
    def pending_credit_bytes(self) -> int:
        """Credits a failed ledger write left to book (0 normally)."""
        return self._pending

    def _read(self, index: int) -> int:
        """One word of this tenant's slot, read (and the whole file checked) under the lock."""
        self._check()
        with self.ledger._locked() as q:
            self.ledger._own(q, self)
            self._observe(q)
            value = int(q[index + self.slot])
        self._follow()
        return value

    @property
    def backed_bytes(self) -> int:
        """What the ledger books to this tenant now."""
        return self._read(BACKED)

    @property
    def limit_bytes(self) -> int:
        """This tenant's limit now (the operator may change it at any time)."""
        return self._read(LIMIT)

    def room_bytes(self) -> int:
        """What one charge could book now without shedding: min(limit room, GPU free)."""
        self._check()
        with self.ledger._locked() as q:
            self.ledger._own(q, self)
            self._flush(q)
            s = self.slot
            free = q[H_BUDGET] - sum(q[BACKED:BACKED + SLOTS])
            room = max(min(q[LIMIT + s] - q[BACKED + s], free), 0)
        self._follow()
        return room

    # -- shedding ------------------------------------------------------------------------

    def poll(self) -> ShedRequest | None:
        """The shed request standing against this tenant, if any (call it where the engine
        already decides: between decode steps, at admission)."""
        self._check()
        with self.ledger._locked() as q:
            self.ledger._own(q, self)
            self._observe(q)
            shed, deadline = q[SHED + self.slot], q[SHED_DL + self.slot]
        self._follow()
        now = time.monotonic_ns()
        if not shed or deadline <= now:
            return None
        return ShedRequest(self.name, int(shed), (deadline - now) / 1e9)

    def trim(self, request: ShedRequest, backings: Iterable[RangeBacking], *,
             deadline_s: float | None = None) -> ShedTrim:
        """Answer ``request`` from what loses nothing first (:func:`~kvvmm.budget.rules.
        shed_answer`): the range backings' deferred cache and reserve, given back on their
        backing threads (:meth:`RangeBacking.give_back`, all at once, the most givable
        first) within the request's time left (or ``deadline_s``, if shorter), their
        reserves held until the request expires. What is left of the ask (:meth:`poll`
        again) is for what loses work. Blocks the calling thread (the watcher's, or the
        engine's where it polls) until every give-back stopped; never the decode thread's.

        Raises:
            ArgumentError: not a ShedRequest, a backing that is not a RangeBacking, a bad
                ``deadline_s``.
            DriverError: a decommit failed (raised after every give-back stopped; what the
                others freed stands and is booked back).
        """
        if not isinstance(request, ShedRequest):
            raise ArgumentError("request", request, "a ShedRequest (Tenant.poll())")
        found = _range_backings(backings)
        bound = request.left_s if deadline_s is None else min(
            seconds_arg("deadline_s", deadline_s), request.left_s)
        t0 = time.monotonic()
        open_ = [(b.givable_bytes, i, b) for i, b in enumerate(found) if not b.closed]
        open_.sort(key=lambda x: (-x[0], x[1]))
        plan = shed_answer(request.shed_bytes, givable_bytes=sum(g for g, _, _ in open_))
        left = plan.trim_bytes
        runs: list[GiveBack] = []
        for givable, _, b in open_:
            if left <= 0:
                break
            ask = min(left, givable)
            if ask <= 0:
                continue
            runs.append(b.give_back(ask, deadline_s=bound, hold_s=request.left_s))
            left -= ask
        first: BaseException | None = None
        for r in runs:
            try:
                r.wait(bound + 1.0)  # its deadline, and a second for the unit in flight
            except Exception as e:
                first = first or e
        freed = sum(r.freed_bytes for r in runs)
        if first is not None:
            first.add_note(f"budget: tenant {self.name!r}'s trim gave back {freed} bytes "
                           f"before this failure stopped it")
            raise first
        return ShedTrim(asked_bytes=request.shed_bytes, trim_bytes=plan.trim_bytes,
                        freed_bytes=freed, elapsed_s=time.monotonic() - t0,
                        stops=tuple(r.stopped or "" for r in runs))

    def watch(self, callback: ShedCallback, *, interval_s: float = 0.005,
              sweep_s: float = 0.1, backings: Iterable[RangeBacking] = ()) -> None:
        """Call ``callback(request)`` on a background thread whenever a shed request stands,
        and sweep the ledger for dead tenants every ``sweep_s``.

        With ``backings``, a standing request is first answered from their deferred cache
        and reserve (:meth:`trim`: nothing is lost), and ``callback`` gets what is still
        asked after that (none: it is not called).

        The callback runs on that thread: give memory back there only through calls that
        may come from another thread (``HandlePool.trim``; the owner's page and slot calls);
        otherwise :meth:`poll` from the engine's thread instead.

        Raises:
            ArgumentError: bad intervals, a backing that is not a RangeBacking, or a
                watcher already runs.
        """
        every = wait_arg("interval_s", interval_s, zero=False)
        sweep_every = wait_arg("sweep_s", sweep_s, zero=False)
        if not callable(callback):
            raise ArgumentError("callback", callback, "a callable taking a ShedRequest")
        found = _range_backings(backings)
        if self._watcher is not None:
            raise ArgumentError("callback", callback, "one watcher per tenant (one runs)")

        def loop() -> None:
            next_sweep = time.monotonic() + sweep_every
            last = ""  # the last failure logged: one line per new failure, not per poll
            while not self._stop.wait(every):
                try:
                    req = self.poll()
                    if req is not None and found:
                        self.trim(req, found)
                        req = self.poll()  # what the trim did not cover
                    if req is not None:
                        callback(req)
                    if time.monotonic() >= next_sweep:
                        next_sweep = time.monotonic() + sweep_every
                        self.ledger.sweep()
                        self.ledger._credit_now(self)
                    last = ""
                except (ClosedError, ForeignTenantError):
                    return
                except Exception as e:  # a watcher must outlive a bad callback or ledger
                    if str(e) != last:
                        log.error("budget: tenant %r's watcher: %s", self.name, e)
                    last = str(e)

        self._watcher = threading.Thread(target=loop, name=f"kvvmm-budget-{self.name}",
                                         daemon=True)
        self._watcher.start()

    def _stop_watch(self) -> None:
        self._stop.set()
        w, self._watcher = self._watcher, None
        if w is not None and w is not threading.current_thread():
            w.join()

    # -- torch's allocator ----------------------------------------------------------------

    def cap_torch(self, device: int = 0, *, headroom_bytes: int = 0,
                  total_bytes: int | None = None,
                  set_fraction: Callable[[float, int], object] | None = None,
                  ) -> TorchAllocatorCap:
        """Keep torch's caching allocator in this process out of this tenant's KV share.

        Caps torch at ``total - claim - headroom`` of device ``device``
        (:class:`~kvvmm.arena.reclaim.TorchAllocatorCap`), where the claim is
        :func:`~kvvmm.budget.rules.kv_claim`: ``max(booked, min(limit, budget))``. The cap
        follows the claim at every ledger call of this tenant (charge, credit, :meth:`poll`,
        the watcher's every ``interval_s``), so a limit or budget the operator changes, and
        a booking shed back under them, move it; a failure to follow is logged and kept
        (:attr:`torch_cap_error`), never raised into a create or release. :meth:`close` (or
        the cap's own ``close``) lifts the cap.

        Args:
            device: the CUDA ordinal torch allocates on.
            headroom_bytes: kept from torch as well (CUDA context, NCCL buffers, what other
                processes on the device hold).
            total_bytes: the device's memory (default: torch's).
            set_fraction: in place of ``torch.cuda.set_per_process_memory_fraction`` (tests).
        Returns:
            The cap, already set.
        Raises:
            TorchCapError: torch cannot cap the device here (not installed, a CPU build, no
                CUDA device) or refused the fraction; nothing was set.
            OutOfRangeError: the claim leaves torch nothing of the device; nothing was set.
            ArgumentError: a bad size, or a cap already follows this tenant.
            ClosedError, ForeignTenantError, LedgerError: as :meth:`poll`.
        """
        self._check()
        if self._cap is not None:
            raise ArgumentError("cap_torch", device, "one torch cap per tenant (one follows "
                                                     "it: close that one first)")
        cap = TorchAllocatorCap(device, total_bytes=total_bytes,
                                headroom_bytes=headroom_bytes, set_fraction=set_fraction)
        with self._cap_lock:
            with self.ledger._locked() as q:
                self.ledger._own(q, self)
                claim = self._claim_in(q)
            cap.follow(claim)
            self._claim, self._cap, self._cap_error = claim, cap, None
        return cap

    @property
    def torch_cap(self) -> TorchAllocatorCap | None:
        """The torch cap following this tenant (:meth:`cap_torch`), or None."""
        return self._cap

    @property
    def torch_cap_error(self) -> Exception | None:
        """Why the torch cap last failed to follow the claim (None: it follows)."""
        return self._cap_error

    def _follow(self) -> None:
        """Bring the torch cap to the claim last read (outside the ledger's lock; never
        raises: a create or release must not fail for it)."""
        cap = self._cap
        if cap is None:
            return
        with self._cap_lock:
            if cap.closed:
                self._cap = None  # lifted by its own close: this tenant stops following
                return
            claim = self._claim
            if claim == cap.kv_bytes:
                return
            try:
                cap.follow(claim)
                self._cap_error = None
            except (OutOfRangeError, TorchCapError) as e:
                if str(e) != str(self._cap_error):
                    log.error("budget: tenant %r's torch cap stays at fraction %s: %s",
                              self.name, cap.fraction, e)
                self._cap_error = e

    # -- close -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Leave the ledger (idempotent) and lift the torch cap. Close the owners and pools
        that book to this tenant first.

        Raises:
            TorchCapError: torch refused to lift the cap (the tenant has left).
            BusyError: the tenant still books memory (nothing changed).
            ForeignTenantError: in a fork's child (the tenant is the parent's).
            LedgerError: the ledger could not be written.
        """
        if self._closed:
            return
        if self.pid != os.getpid():
            self._check()  # raises: the parent's tenant is the parent's to close
        try:
            self.ledger._unregister(self)
        except OSError as e:
            raise LedgerError(f"ledger {str(self.ledger.path)!r}: tenant {self.name!r} could "
                              f"not leave ({e})") from e
        self._closed = True
        self._stop_watch()
        cap, self._cap = self._cap, None
        if cap is not None:
            cap.close()


def _range_backings(backings: Iterable[RangeBacking]) -> list[RangeBacking]:
    """``backings`` as a list, refused unless each is a RangeBacking."""
    found = list(backings)
    for i, b in enumerate(found):
        if not isinstance(b, RangeBacking):
            raise ArgumentError(f"backings[{i}]", b, "a RangeBacking")
    return found

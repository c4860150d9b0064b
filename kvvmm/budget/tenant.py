"""A tenant: one process's account in a GPU's ledger (charge, credit, shed requests)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvvmm.budget.errors import BudgetExceededError, LedgerError
from kvvmm.budget.ledger import _BACKED, _H_BUDGET, _LIMIT, _SHED, _SHED_DL, MAX_BYTES, SLOTS
from kvvmm.checks import int_arg, seconds_arg
from kvvmm.errors import ArgumentError, ClosedError

if TYPE_CHECKING:
    from kvvmm.budget.ledger import Ledger

__all__ = ["ShedCallback", "ShedRequest", "Tenant"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShedRequest:
    """Other tenants (or the operator) ask this tenant to give memory back (a record)."""

    tenant: str
    shed_bytes: int  #: bytes asked and not yet given back
    left_s: float  #: seconds until the request expires (the asker stops waiting)


#: a shed callback: gets the request, gives memory back through its owners and pools
#: (``HandlePool.trim``, ``KvBufferOwner.release_beyond`` / ``shrink``, ``sleep``); each
#: release through a :class:`~kvvmm.budget.driver.BudgetedDriver` credits the ledger.
ShedCallback = Callable[[ShedRequest], object]


class Tenant:
    """This process's account in a ledger; made by :meth:`Ledger.register`.

    ``charge`` before creating memory, ``credit`` after releasing it (a
    :class:`~kvvmm.budget.driver.BudgetedDriver` does both for every create and release).
    Every method may be called from any thread.
    """

    def __init__(self, ledger: Ledger, slot: int, name: str, pid: int, *,
                 shed_wait_s: float) -> None:
        self.ledger = ledger
        self.slot = slot  #: its slot in the ledger file
        self.name = name
        self.pid = pid
        self.shed_wait_s = shed_wait_s  #: the default wait of :meth:`charge`
        self._pending = 0  # credits a failed ledger write left to book (retried first)
        self._plock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"Tenant({self.name!r}, slot {self.slot}, pid {self.pid})"

    # -- charge and credit ---------------------------------------------------------------

    def charge(self, nbytes: int, *, wait_s: float | None = None) -> None:
        """Book ``nbytes`` to this tenant before they are created.

        Args:
            nbytes: bytes, > 0.
            wait_s: when the GPU's budget is short, ask the other tenants to shed and wait
                this long for room (default: the tenant's ``shed_wait_s``; 0: refuse now).
        Raises:
            BudgetExceededError: it does not fit (nothing booked).
            LedgerError: the ledger could not be written (nothing booked).
            ArgumentError: a bad size or wait.
            ClosedError: after :meth:`close`.
        """
        if self._closed:
            raise ClosedError(f"tenant {self.name!r}: charge after close()")
        int_arg("nbytes", nbytes, lo=1, hi=MAX_BYTES,
                limit=f"an int in [1, {MAX_BYTES}] (bytes)")
        wait = self.shed_wait_s if wait_s is None else seconds_arg("wait_s", wait_s)
        try:
            self.ledger._charge(self, nbytes, wait)
        except (BudgetExceededError, ArgumentError, ClosedError):
            raise
        except OSError as e:
            raise LedgerError(f"ledger {str(self.ledger.path)!r}: charging {nbytes} bytes to "
                              f"tenant {self.name!r} failed ({e}); nothing was booked") from e

    def credit(self, nbytes: int) -> None:
        """Book ``nbytes`` back after they were released. Never raises for the ledger: a
        failed write keeps the credit here and books it at the next charge, credit or
        sweep of this tenant (until then the ledger books more than is backed, never less).
        """
        int_arg("nbytes", nbytes, lo=1, hi=MAX_BYTES,
                limit=f"an int in [1, {MAX_BYTES}] (bytes)")
        with self._plock:
            self._pending += nbytes
        try:
            self.ledger._credit_now(self)
        except Exception as e:
            log.warning("budget: tenant %r could not credit %d bytes now (%s); kept for the "
                        "next ledger call", self.name, nbytes, e)

    def _flush(self, q: memoryview) -> None:
        """Book the credits still waiting here (under the ledger's lock)."""
        with self._plock:
            n = self._pending
        if n:
            self.ledger._credit(q, self.slot, n)
            with self._plock:
                self._pending -= n

    @property
    def pending_credit_bytes(self) -> int:
        """Credits a failed ledger write left to book (0 normally)."""
        return self._pending

    @property
    def backed_bytes(self) -> int:
        """What the ledger books to this tenant now."""
        self._check_ledger()
        return int(self.ledger._q[_BACKED + self.slot])

    @property
    def limit_bytes(self) -> int:
        """This tenant's limit now (the operator may change it at any time)."""
        self._check_ledger()
        return int(self.ledger._q[_LIMIT + self.slot])

    def room_bytes(self) -> int:
        """What one charge could book now without shedding: min(limit room, GPU free)."""
        with self.ledger._locked() as q:
            self._flush(q)
            s = self.slot
            free = q[_H_BUDGET] - sum(q[_BACKED:_BACKED + SLOTS])
            return max(min(q[_LIMIT + s] - q[_BACKED + s], free), 0)

    def _check_ledger(self) -> None:
        if self.ledger.closed:
            raise ClosedError(f"tenant {self.name!r}: its ledger {str(self.ledger.path)!r} "
                              f"was closed")

    # -- shedding ------------------------------------------------------------------------

    def poll(self) -> ShedRequest | None:
        """The shed request standing against this tenant, if any (call it where the engine
        already decides: between decode steps, at admission)."""
        self._check_ledger()
        q = self.ledger._q
        shed, deadline = q[_SHED + self.slot], q[_SHED_DL + self.slot]
        now = time.monotonic_ns()
        if not shed or deadline <= now:
            return None
        return ShedRequest(self.name, int(shed), (deadline - now) / 1e9)

    def watch(self, callback: ShedCallback, *, interval_s: float = 0.005,
              sweep_s: float = 0.1) -> None:
        """Call ``callback(request)`` on a background thread whenever a shed request stands,
        and sweep the ledger for dead tenants every ``sweep_s``.

        The callback runs on that thread: give memory back there only through calls that
        may come from another thread (``HandlePool.trim``; the owner's page and slot calls);
        otherwise :meth:`poll` from the engine's thread instead.

        Raises:
            ArgumentError: bad intervals, or a watcher already runs.
        """
        every = seconds_arg("interval_s", interval_s, zero=False)
        sweep_every = seconds_arg("sweep_s", sweep_s, zero=False)
        if not callable(callback):
            raise ArgumentError("callback", callback, "a callable taking a ShedRequest")
        if self._watcher is not None:
            raise ArgumentError("callback", callback, "one watcher per tenant (one runs)")

        def loop() -> None:
            next_sweep = time.monotonic() + sweep_every
            while not self._stop.wait(every):
                try:
                    req = self.poll()
                    if req is not None:
                        callback(req)
                    if time.monotonic() >= next_sweep:
                        next_sweep = time.monotonic() + sweep_every
                        self.ledger.sweep()
                        with self.ledger._locked() as q:
                            self._flush(q)
                except ClosedError:
                    return
                except Exception as e:  # a watcher must outlive a bad callback
                    log.error("budget: tenant %r's shed callback failed: %s", self.name, e)

        self._watcher = threading.Thread(target=loop, name=f"kvvmm-budget-{self.name}",
                                         daemon=True)
        self._watcher.start()

    def _stop_watch(self) -> None:
        self._stop.set()
        w, self._watcher = self._watcher, None
        if w is not None and w is not threading.current_thread():
            w.join()

    # -- close -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Leave the ledger (idempotent). Close the owners and pools that book to this
        tenant first.

        Raises:
            BusyError: the tenant still books memory (nothing changed).
            LedgerError: the ledger could not be written.
        """
        if self._closed:
            return
        try:
            self.ledger._unregister(self)
        except OSError as e:
            raise LedgerError(f"ledger {str(self.ledger.path)!r}: tenant {self.name!r} could "
                              f"not leave ({e})") from e
        self._closed = True
        self._stop_watch()

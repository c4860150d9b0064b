"""The budget broker's errors: who should react to each, and how."""

from __future__ import annotations

from typing import Any

from kvvmm.driver.base import CUDA_ERROR_OUT_OF_MEMORY
from kvvmm.errors import DriverOutOfMemoryError, KvvmmError

__all__ = ["BudgetExceededError", "ForeignTenantError", "LedgerCorruptError", "LedgerError",
           "LedgerLockTimeoutError", "LedgerUntrustedError"]


class BudgetExceededError(DriverOutOfMemoryError):
    """A create was refused by the per-GPU budget: nothing was created, nothing charged.

    ``reason`` says which bound: ``"limit"`` (the tenant's own limit: raise it with
    ``kvvmm budget set``, or give memory back), ``"budget"`` (the GPU's budget is taken by
    other tenants and none was asked to shed: pass ``shed_wait_s`` > 0) or ``"deadline"``
    (other tenants were asked to shed and had not freed enough when the wait ran out).
    A :class:`~kvvmm.errors.DriverOutOfMemoryError`, so an arena reacts to it as to an
    out-of-memory create (it trims its handle pool, which credits the ledger, and tries once
    more) and an engine that already handles out of memory (preempt, reject) keeps working.
    """

    def __init__(self, tenant: str, asked_bytes: int, limit_bytes: int, backed_bytes: int,
                 free_bytes: int, budget_bytes: int, reason: str) -> None:
        self.tenant = tenant  #: the tenant whose create was refused
        self.asked_bytes = asked_bytes  #: what the create asked for
        self.limit_bytes = limit_bytes  #: the tenant's limit
        self.backed_bytes = backed_bytes  #: what the tenant had charged when refused
        self.free_bytes = free_bytes  #: the GPU budget's unbooked bytes, every tenant counted
        self.budget_bytes = budget_bytes  #: the GPU's budget
        self.budget_reason = reason  #: ``"limit"``, ``"budget"`` or ``"deadline"``
        why = {
            "limit": f"it would pass the tenant's limit ({backed_bytes} + {asked_bytes} > "
                     f"{limit_bytes} bytes); raise the limit (kvvmm budget set) or give "
                     f"memory back",
            "budget": f"the GPU budget has {free_bytes} of {budget_bytes} bytes free; other "
                      f"tenants hold the rest (pass shed_wait_s > 0 to ask them to shed)",
            "deadline": f"other tenants were asked to shed but the GPU budget still had only "
                        f"{free_bytes} of {budget_bytes} bytes free when the wait ran out",
        }.get(reason, reason)
        super().__init__(
            "create", {"size": asked_bytes}, CUDA_ERROR_OUT_OF_MEMORY,
            f"budget: tenant {tenant!r} asked {asked_bytes} bytes, backs {backed_bytes} of "
            f"its limit {limit_bytes}; refused because {why}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tenant, self.asked_bytes, self.limit_bytes,
                             self.backed_bytes, self.free_bytes, self.budget_bytes,
                             self.budget_reason), self.__dict__)


class LedgerError(KvvmmError):
    """The budget ledger cannot be used: absent, full, untrusted, corrupt, locked, or a
    write failed (the subclasses say which).

    The message names the file and the cause. Nothing was charged by the call that raised
    it: a commit that met it has been undone by its arena. Remove a file that is not a
    ledger (or pick another path); for a full ledger, close tenants that are done.
    """


class LedgerUntrustedError(LedgerError):
    """The ledger file is not one this process may trust, so it was not opened.

    A symbolic link at its path, not a regular file, more than one name, owned by another
    user or writable by others (without the shared group passed), or a folder others could
    swap it out of. Remove it, or pick a path in a folder only you (or the shared group)
    may write; docs/BUDGET.md says what the file is trusted for.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path  #: the ledger file
        self.reason = reason  #: what was refused
        super().__init__(f"ledger {path!r} is not trusted: {reason}; it was not opened "
                         f"(remove it or pick another path)")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.reason), self.__dict__)


class LedgerCorruptError(LedgerError):
    """The ledger file holds what no kvvmm ledger holds: refused, nothing changed.

    Not a ledger of this version (``foreign``), truncated or grown, or a value out of its
    range (a budget of 0, bytes booked in a free slot, a name with a control character...).
    Someone other than kvvmm wrote the file: remove it (every tenant registers again) or
    pick another path.
    """

    def __init__(self, path: str, what: str, foreign: bool = False) -> None:
        self.path = path  #: the ledger file
        self.what = what  #: the first value found out of range
        self.foreign = foreign  #: not a kvvmm ledger of this version at all
        if foreign:
            msg = (f"{path!r} is not a kvvmm budget ledger ({what}); remove it or pick another "
                   f"path")
        else:
            msg = (f"ledger {path!r} is corrupt: {what}; nothing was changed (remove it, and "
                   f"register the tenants again, or pick another path)")
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.what, self.foreign), self.__dict__)


class LedgerLockTimeoutError(LedgerError):
    """The ledger's lock was held for the whole wait asked: nothing was changed.

    An honest holder keeps it for microseconds; one that keeps it longer is stopped, stuck or
    hostile, and blocks every tenant of the ledger. ``holder`` names it when the kernel says
    (``/proc/locks``): end it, or wait longer (``lock_timeout_s``, ``--lock-timeout``).
    """

    def __init__(self, path: str, wait_s: float, holder: str) -> None:
        self.path = path  #: the ledger file
        self.wait_s = wait_s  #: how long this call waited
        self.holder = holder  #: who holds the lock ("" when unknown)
        super().__init__(f"ledger {path!r}: its lock was still held after {wait_s:g} s "
                         f"(the wait asked), by {holder or 'a holder /proc/locks does not name'}"
                         f"; nothing was changed")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.wait_s, self.holder), self.__dict__)


class ForeignTenantError(LedgerError):
    """A :class:`~kvvmm.budget.tenant.Tenant` used where its ledger slot is not its own.

    In a ``fork``'s child (the parent registered it: register the child as its own tenant
    with the inherited or a new ``Ledger``), or after its slot was reclaimed or rewritten by
    another process. Nothing was changed.
    """

    def __init__(self, tenant: str, why: str) -> None:
        self.tenant = tenant  #: the tenant's name
        self.why = why  #: why its slot is not its own
        super().__init__(f"tenant {tenant!r}: {why}; nothing was changed")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.tenant, self.why), self.__dict__)

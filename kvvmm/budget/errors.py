"""The budget broker's errors: who should react to each, and how."""

from __future__ import annotations

from typing import Any

from kvvmm.driver.base import CUDA_ERROR_OUT_OF_MEMORY
from kvvmm.errors import DriverOutOfMemoryError, KvvmmError

__all__ = ["BudgetExceededError", "LedgerError"]


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
    """The budget ledger cannot be used: not a kvvmm ledger file, full, or a write failed.

    The message names the file and the cause. Nothing was charged by the call that raised
    it: a commit that met it has been undone by its arena. Remove a file that is not a
    ledger (or pick another path); for a full ledger, close tenants that are done.
    """

"""The per-GPU budget broker: several processes' owners sharing one GPU's memory.

A ledger file every tenant process reads and writes (:class:`Ledger`, :func:`default_path`)
holds the GPU's budget and, per tenant, its limit, what it backs and what it is asked to shed. A
:class:`BudgetedDriver` charges each create to its :class:`Tenant` and credits each release,
so any owner or arena built on it books every byte it backs. docs/BUDGET.md is the contract.

    >>> from kvvmm.budget import Ledger, BudgetedDriver          # doctest: +SKIP
    >>> ledger = Ledger("/dev/shm/kvvmm-budget-gpu0", budget_bytes=100 << 30)
    >>> tenant = ledger.register("llama", limit_bytes=60 << 30, shed_wait_s=0.5)
    >>> owner = KvBufferOwner(driver=BudgetedDriver(open_driver("cuda"), tenant), ...)
"""

from __future__ import annotations

from kvvmm.budget.driver import BudgetedDriver
from kvvmm.budget.errors import (
    BudgetExceededError,
    ForeignTenantError,
    LedgerCorruptError,
    LedgerError,
    LedgerLockTimeoutError,
    LedgerUntrustedError,
)
from kvvmm.budget.faults import FaultyLedger
from kvvmm.budget.ledger import (
    LOCK_TIMEOUT_S,
    MAX_BYTES,
    SLOTS,
    BudgetSnapshot,
    Ledger,
    TenantInfo,
    default_path,
)
from kvvmm.budget.tenant import ShedCallback, ShedRequest, Tenant

__all__ = ["LOCK_TIMEOUT_S", "MAX_BYTES", "SLOTS", "BudgetExceededError", "BudgetSnapshot",
           "BudgetedDriver", "FaultyLedger", "ForeignTenantError", "Ledger", "LedgerCorruptError",
           "LedgerError", "LedgerLockTimeoutError", "LedgerUntrustedError", "ShedCallback",
           "ShedRequest", "Tenant", "TenantInfo", "default_path"]

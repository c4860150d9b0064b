"""BudgetedDriver: a driver whose creates are charged to a tenant and releases credited.

The narrowest hook that sees every byte of physical memory a process makes: every path
that creates memory (an arena's commit, a wake, a handle pool's refill, a collective's
prepared handles) calls ``driver.create``, and every path that gives it back calls
``driver.release``. So the charge sits there, and nowhere else: no edit of the arena or the
owner, and nothing added to the calls that make no memory.

A :class:`~kvvmm.driver.wrapper.DriverWrapper` that overrides ``create``, ``release`` and
``mem_info``. Every other call is a field holding the wrapped driver's own bound method
(CudaDriver's C functions), set at construction, in place of the wrapper's forwarding
methods (a Python frame or two each): a map, an unmap or a set access costs exactly what it
costs on the driver itself.

Transactional: the charge comes before the create (a refusal creates nothing), a failed
create is credited back, and a release is credited after the driver released it (a failed
release books nothing back: the memory is still there). Imported handles
(``import_handle``) are memory another process created and books: never charged here, never
credited when released.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvvmm.budget.tenant import Tenant
from kvvmm.checks import is_int
from kvvmm.driver.base import Driver, DriverStats
from kvvmm.driver.wrapper import DriverWrapper
from kvvmm.errors import ArgumentError

__all__ = ["BudgetedDriver"]


class BudgetedDriver(DriverWrapper):
    """``inner`` with every create charged to ``tenant`` and every release credited.

    Args:
        inner: the driver to account (CudaDriver on a GPU; host or sim in tests).
        tenant: the process's :class:`~kvvmm.budget.tenant.Tenant` in the GPU's ledger.
    Raises:
        ArgumentError: ``inner`` is not a driver or ``tenant`` not a Tenant.

    ``create`` raises :class:`~kvvmm.budget.errors.BudgetExceededError` (an out-of-memory
    :class:`~kvvmm.errors.DriverError`) when the budget refuses, and
    :class:`~kvvmm.budget.errors.LedgerError` when the ledger cannot be written; nothing is
    created then. ``mem_info`` answers the device's free memory or the tenant's room in the
    budget, whichever is less, so a plan or a pressure poll over this driver sees the budget.
    """

    # The calls the budget does not see: fields, not methods, each the inner driver's bound
    # method (set below), so no frame of ours is on them. Slots over DriverWrapper's
    # forwarding methods; each takes the arguments of the protocol's call of its name.
    __slots__ = ("export_handle", "free", "granularity", "import_handle", "map", "pin",
                 "reserve", "set_access", "stats", "unmap", "unpin")
    granularity: Callable[..., int]
    reserve: Callable[..., int]
    free: Callable[..., None]
    map: Callable[..., None]
    unmap: Callable[..., None]
    set_access: Callable[..., None]
    stats: Callable[..., DriverStats]
    export_handle: Callable[..., int]
    import_handle: Callable[..., int]
    pin: Callable[..., None]
    unpin: Callable[..., None]

    def __init__(self, inner: Driver, tenant: Tenant) -> None:
        super().__init__(inner)  # checks inner: a typed error, not an AttributeError
        if not isinstance(tenant, Tenant):
            raise ArgumentError("tenant", tenant, "a kvvmm.budget.Tenant (Ledger.register)")
        self.tenant = tenant
        self._sizes: dict[int, int] = {}  # handle -> bytes charged, for handles made here
        self._lock = threading.Lock()
        self._create: Callable[[int], int] = inner.create
        self._release: Callable[[int], None] = inner.release
        self.granularity, self.stats = inner.granularity, inner.stats
        self.reserve, self.free = inner.reserve, inner.free
        self.map, self.unmap, self.set_access = inner.map, inner.unmap, inner.set_access
        self.export_handle, self.import_handle = inner.export_handle, inner.import_handle
        self.pin, self.unpin = inner.pin, inner.unpin

    def __repr__(self) -> str:
        return f"BudgetedDriver({self.inner!r}, tenant {self.tenant.name!r})"

    def create(self, size: int) -> int:
        if not is_int(size) or size <= 0:
            return self._create(size)  # the driver's own refusal (DriverArgumentError, ...)
        self.tenant.charge(size)
        try:
            h = self._create(size)
        except BaseException:
            self.tenant.credit(size)
            raise
        with self._lock:
            self._sizes[h] = size
        return h

    def release(self, handle: int) -> None:
        self._release(handle)
        with self._lock:
            size = self._sizes.pop(handle, 0)
        if size:
            self.tenant.credit(size)

    def mem_info(self) -> tuple[int, int]:
        free, total = self.inner.mem_info()
        return min(int(free), self.tenant.room_bytes()), int(total)

    @property
    def charged_bytes(self) -> int:
        """Bytes of the handles this driver created and has not released."""
        with self._lock:
            return sum(self._sizes.values())

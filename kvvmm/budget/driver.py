"""BudgetedDriver: a driver whose creates are charged to a tenant and releases credited.

The narrowest hook that sees every byte of physical memory a process makes: every path
that creates memory (an arena's commit, a wake, a handle pool's refill, a collective's
prepared handles) calls ``driver.create``, and every path that gives it back calls
``driver.release``. So the charge sits there, and nowhere else: no edit of the arena or the
owner, and nothing added to the calls that make no memory.

Not a :class:`~kvvmm.driver.wrapper.DriverWrapper` (a Python frame or two on every call):
the wrapped driver's own bound methods (CudaDriver's C functions) are this object's
attributes for every call but ``create``, ``release`` and ``mem_info``, so a map, an unmap
or a set access costs exactly what it costs on the driver itself.

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
from kvvmm.driver.base import Driver, DriverStats, MemoryKind, check_driver
from kvvmm.errors import ArgumentError

__all__ = ["BudgetedDriver"]


class BudgetedDriver(Driver):
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

    def __init__(self, inner: Driver, tenant: Tenant) -> None:
        check_driver(inner, "inner")
        if not isinstance(tenant, Tenant):
            raise ArgumentError("tenant", tenant, "a kvvmm.budget.Tenant (Ledger.register)")
        self.inner = inner
        self.tenant = tenant
        self.kind: str = inner.kind
        self.device: int = inner.device
        self.name: str = inner.name
        self.memory: MemoryKind = inner.memory
        self._sizes: dict[int, int] = {}  # handle -> bytes charged, for handles made here
        self._lock = threading.Lock()
        self._create: Callable[[int], int] = inner.create
        self._release: Callable[[int], None] = inner.release
        # The inner driver's bound methods as attributes: no frame of ours on these calls.
        self.__dict__.update(
            granularity=inner.granularity, reserve=inner.reserve, free=inner.free,
            map=inner.map, unmap=inner.unmap, set_access=inner.set_access,
            stats=inner.stats, export_handle=inner.export_handle,
            import_handle=inner.import_handle, pin=inner.pin, unpin=inner.unpin)

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

    # Declared for the protocol; the instance's attributes (the inner driver's) answer.
    def granularity(self) -> int:
        return self.inner.granularity()

    def stats(self) -> DriverStats:
        return self.inner.stats()

    @property
    def clock_us(self) -> float:
        return self.inner.clock_us

    @property
    def handle_type(self) -> str:
        """The inner driver's: the budget does not change what its handles are."""
        return self.inner.handle_type

    @property
    def granularity_min(self) -> int:
        return self.inner.granularity_min

    @property
    def fast_path(self) -> bool | None:
        return self.inner.fast_path

    @property  # the inner driver's bound method itself, so work_hook sees through
    def library_work(self) -> Callable[[str, int], None]:  # type: ignore[override]
        return self.inner.library_work

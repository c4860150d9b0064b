"""The driver protocol, the rules every driver enforces, and their shared bookkeeping.

A driver is the narrow waist of kvvmm: a few methods over plain ints, one per CUDA VMM entry
point (``cuMemAddressReserve``, ``cuMemCreate``, ``cuMemMap``, ...). Three implementations
exist (``SimDriver``, ``HostDriver``, ``CudaDriver``) plus wrappers on
:class:`~kvvmm.driver.wrapper.DriverWrapper` (``FaultyDriver``, ``TracingDriver``,
``TimedDriver``, ``BudgetedDriver``); everything above this layer is written against
:class:`Driver` only. Its optional calls (``clock_us``, ``handle_type``, ``granularity_min``,
``fast_path``, ``library_work``, ``pin``, ``unpin``, ``close``) have defaults that every
driver inherits.

The rules (cuda.core's VMM design lists the driver behaviour they come from):

- sizes and addresses are multiples of the granularity; a reservation's alignment is 0 or a
  power of two;
- a map attaches a whole handle at offset 0 (partial-handle maps are refused with
  CUDA_ERROR_NOT_SUPPORTED, as an H200 answers; GB300 refuses them too),
  only inside a reservation, only over unmapped VA;
- an unmap covers whole mappings, never part of one (it may cover several);
- free takes exactly one whole reservation (its exact address and size), with nothing mapped;
- release while mapped is legal; the memory goes when the last mapping goes;
- create beyond the device's free memory is out of memory;
- set access for other devices (peers) takes device ordinals the process can see
  (CUDA_ERROR_INVALID_VALUE otherwise: what an H200 answers for a missing ordinal) whose peer
  access to the memory's device is possible (``cuDeviceCanAccessPeer``;
  CUDA_ERROR_INVALID_DEVICE otherwise, cuMemSetAccess's documented answer, not measured: no
  two-GPU machine yet); access is only ever given to mapped VA, whole mappings, like the
  driver's own device's;
- an exported handle is a POSIX file descriptor the caller owns; an import takes one (on
  success the driver owns it) and gives a handle mapped like any other, whose memory was
  counted by the driver that created it. ``handle_type`` says what the driver's handles can
  be shared as (:data:`HANDLE_TYPES`): ``export_handle`` gives a descriptor only where it is
  ``"posix_fd"``.

Arguments (:func:`check_call_ints`, the one check every driver runs before any syscall or CUDA
call, so a refused call changes nothing and leaks nothing):

- sizes, addresses, alignments, handles, file descriptors and device ordinals are ints.
  Anything ``operator.index`` accepts (a numpy integer) counts as its int value; a ``bool``,
  ``float``, ``str``, ``None`` or any other object is refused with
  :class:`~kvvmm.errors.DriverArgumentError`: an :class:`~kvvmm.errors.ArgumentError`
  (naming the value and what it must be) that is also a ``DriverError`` with
  CUDA_ERROR_INVALID_VALUE, so code catching either keeps working (cuda-python itself would
  raise ``TypeError``: CUDA never sees such a value);
- an int CUDA cannot take is refused with ``DriverError(CUDA_ERROR_INVALID_VALUE)``, as
  CUDA answers: a negative value, or one that does not fit the 64 bits of ``size_t`` /
  ``CUdeviceptr`` (``>= 2**64``; the host driver would otherwise truncate it to a smaller
  size at the ``mmap``), a range ``[va, va+size)`` that wraps past ``2**64``, a file
  descriptor past ``2**31 - 1``;
- zero is refused where CUDA refuses it (sizes), and accepted where CUDA takes it (an
  alignment of 0 means "the granularity"; address 0 and handle 0 are refused as not a
  reservation / not live by the rules above).

Thread safety: every driver is safe to share between threads. Each call's check and act on
the driver's book run under one lock per driver (one per :class:`~kvvmm.driver.sim.SimNode`,
whose devices share a VA space), so concurrent calls are applied one after the other.

:class:`~kvvmm.driver.book.VmmBook` enforces them in pure Python. The simulated and host
drivers share it, so they refuse exactly the same calls with exactly the same CUDA error names.
"""

from __future__ import annotations

import enum
import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from kvvmm.errors import (
    ArgumentError,
    BusyError,
    DriverArgumentError,
    DriverError,
    DriverOutOfMemoryError,
)

__all__ = [
    "CALLS",
    "CUDA_ERROR_INVALID_DEVICE",
    "CUDA_ERROR_INVALID_VALUE",
    "CUDA_ERROR_NOT_SUPPORTED",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "DRIVER_KINDS",
    "HANDLE_TYPES",
    "OPTIONAL_CALLS",
    "U64_LIMIT",
    "Driver",
    "DriverStats",
    "MemoryKind",
    "Pins",
    "check_call_ints",
    "check_driver",
    "driver_error",
    "locked",
    "refuse_close",
    "work_hook",
]

CUDA_ERROR_INVALID_VALUE = "CUDA_ERROR_INVALID_VALUE"
CUDA_ERROR_OUT_OF_MEMORY = "CUDA_ERROR_OUT_OF_MEMORY"
CUDA_ERROR_NOT_SUPPORTED = "CUDA_ERROR_NOT_SUPPORTED"
#: cuMemSetAccess's documented answer for a device that cannot reach the memory (no peer path).
CUDA_ERROR_INVALID_DEVICE = "CUDA_ERROR_INVALID_DEVICE"

#: The protocol's calls, in the order a commit or teardown makes them; the handle-sharing
#: calls (between processes) last.
CALLS = ("reserve", "free", "create", "release", "map", "unmap", "set_access", "mem_info",
         "export_handle", "import_handle")

#: The drivers there are, by ``Driver.kind``: the simulator (no memory), Linux host memory,
#: a CUDA GPU; from the one that runs anywhere to the one that needs the card. This is the
#: one list: ``open_driver`` takes these and ``"auto"``, the lab's panels and the CLI offer
#: them, ``OwnerSnapshot.driver`` is one of them.
DRIVER_KINDS = ("sim", "host", "cuda")


#: What a driver's handles can be shared between processes as (``Driver.handle_type``):
#: ``"none"`` (not at all), ``"posix_fd"`` (a POSIX file descriptor: ``export_handle``), or
#: ``"fabric"`` (CUDA's 64-byte ``CUmemFabricHandle``, across the nodes of an NVLink fabric;
#: kvvmm's ``export_handle`` does not pass those).
HANDLE_TYPES = ("none", "posix_fd", "fabric")

#: CUDA's sizes and addresses are 64-bit (``size_t``, ``CUdeviceptr``): no value reaches this.
U64_LIMIT = 1 << 64
#: The largest file descriptor (a C ``int``).
FD_LIMIT = (1 << 31) - 1

#: What each kind of argument must be, as an :class:`ArgumentError` states it.
_KIND_LIMIT = {
    "fd": "an int file descriptor in [0, 2**31)",
    "handle": "an int handle (from create or import_handle)",
    "device": "an int device ordinal",
}


def _not_int(call: str, name: str, value: object) -> DriverArgumentError:
    limit = _KIND_LIMIT.get(name, "an int in [0, 2**64) (bytes)")
    detail = "not a file descriptor" if name == "fd" else "CUDA_ERROR_INVALID_VALUE"
    return DriverArgumentError(call, name, value, limit, detail)


def _as_int(call: str, name: str, value: object) -> int:
    """``value`` as an int; refuse (DriverArgumentError) what is not one."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or value is None:
        raise _not_int(call, name, value)
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise _not_int(call, name, value) from None


def check_call_ints(call: str, **values: object) -> dict[str, int]:
    """Check a driver call's int arguments; return them as plain ints, in the order given.

    The one check every driver (sim, host, cuda's Python path, and so its C path's fallback)
    runs first, before any syscall or CUDA call: see the module docstring for what is refused
    and with which error. ``va``/``size`` pairs are also checked not to wrap past ``2**64``.

    Raises:
        DriverArgumentError: a value that is not an int (bool, float, str, None, ...).
        DriverError: CUDA_ERROR_INVALID_VALUE for an int CUDA cannot take.
    """
    out = {k: _as_int(call, k, v) for k, v in values.items()}
    for k, v in out.items():
        hi = FD_LIMIT if k == "fd" else U64_LIMIT - 1
        if v < 0 or v > hi:
            raise driver_error(call, out, CUDA_ERROR_INVALID_VALUE,
                               f"{k}={v} is outside [0, {hi}]: "
                               + ("not a file descriptor" if k == "fd" else
                                  "CUDA takes 64-bit unsigned sizes and addresses"))
    va, size = out.get("va"), out.get("size")
    if va is not None and size is not None and va + size > U64_LIMIT:
        raise driver_error(call, out, CUDA_ERROR_INVALID_VALUE,
                           f"[{va:#x}, {va + size:#x}) wraps past the end of the 64-bit VA")
    return out


_F = TypeVar("_F", bound=Callable[..., Any])


def locked(fn: _F) -> _F:
    """Run a driver method under ``self._lock``: its check and act on the book as one step.

    The lock is held for the call's syscalls too (mmap and friends are short, and never
    wait on a device).
    """
    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kw: Any) -> Any:
        with self._lock:
            return fn(self, *args, **kw)
    return call  # type: ignore[return-value]


class Pins:
    """Pins per reservation start: how many views (tensors) can still reach its memory.

    The host and CUDA drivers refuse ``free`` of a pinned reservation and ``close()`` while
    any is pinned (:class:`BusyError`): unmapping VA under a live tensor would crash the
    process or alias its bytes. Not locked: the driver calls it under its own lock.
    """

    __slots__ = ("_n",)

    def __init__(self) -> None:
        self._n: dict[int, int] = {}

    def add(self, va: int) -> None:
        """One more view reaches the reservation at ``va``."""
        self._n[va] = self._n.get(va, 0) + 1

    def drop(self, va: int) -> None:
        """One view fewer (a no-op if it has none)."""
        n = self._n.get(va, 0)
        if n <= 1:
            self._n.pop(va, None)
        else:
            self._n[va] = n - 1

    def forget(self, va: int) -> None:
        """The reservation at ``va`` was freed."""
        self._n.pop(va, None)

    def pinned(self) -> int:
        """How many reservations are pinned."""
        return sum(1 for n in self._n.values() if n)

    def check_free(self, va: int, size: int) -> None:
        """Raise :class:`BusyError` if the reservation at ``va`` is pinned."""
        if self._n.get(va):
            raise BusyError(f"free({va:#x}, {size}) refused: the reservation is pinned (a "
                            "tensor can still reach it); nothing was freed")


def refuse_close(kind: str, stats: DriverStats, pinned: int) -> None:
    """Raise :class:`BusyError` if ``pinned`` reservations still have tensors over them."""
    if pinned:
        raise BusyError(
            f"{kind} driver: close() refused: {pinned} reservations are pinned (a tensor or "
            f"other view can still reach their memory; live: {stats}). Drop the tensors and "
            "close their arenas first; nothing was given back"
        )


class MemoryKind(enum.Enum):
    """What kind of memory a driver's VA reaches; the arena picks its tensor factory by it."""

    NONE = "none"  #: no memory at all (SimDriver): tensors are ``meta`` tensors
    HOST = "host"  #: host memory at the VA (HostDriver): ``torch.frombuffer``
    DEVICE = "device"  #: CUDA device memory at the VA (CudaDriver): DLPack


@dataclass(frozen=True, slots=True)
class DriverStats:
    """A driver's own accounting of what is live; all zero when nothing leaked."""

    reservations: int  #: reservations not yet freed
    reserved_bytes: int  #: VA bytes in them
    handles: int  #: handles created and not yet released
    mappings: int  #: live mappings
    mapped_bytes: int  #: VA bytes mapped
    #: memory held: unreleased handles plus released-but-mapped ones, of the handles this
    #: driver created (an imported handle's memory counts for the driver that created it)
    physical_bytes: int

    @property
    def clean(self) -> bool:
        """True when nothing is held (no reservation, handle, mapping or memory)."""
        return not (self.reservations or self.handles or self.mappings or self.physical_bytes)


@runtime_checkable
class Driver(Protocol):
    """A CUDA-VMM-shaped driver over plain ints. Failures raise :class:`DriverError`.

    Attributes:
        kind: one of :data:`DRIVER_KINDS`: ``"sim"``, ``"host"`` or ``"cuda"``.
        device: device ordinal this driver works on.
        name: device or profile name (``"NVIDIA H200"``).
        memory: what tensors over its VA are (:class:`MemoryKind`).
    """

    kind: str
    device: int
    name: str
    memory: MemoryKind

    def granularity(self) -> int:
        """Allocation unit in bytes; every size, address and alignment is a multiple."""
        ...

    def reserve(self, size: int, align: int = 0) -> int:
        """Reserve ``size`` bytes of VA aligned to ``align`` (0: the granularity); return it."""
        ...

    def free(self, va: int, size: int) -> None:
        """Give back one whole reservation: its exact address and size."""
        ...

    def create(self, size: int) -> int:
        """Create a physical allocation of ``size`` bytes; return its handle."""
        ...

    def release(self, handle: int) -> None:
        """Drop a handle; its memory goes when its last mapping goes."""
        ...

    def map(self, va: int, size: int, handle: int) -> None:
        """Map the whole of ``handle`` (``size`` == its size) at ``va`` inside a reservation."""
        ...

    def unmap(self, va: int, size: int) -> None:
        """Unmap ``[va, va+size)``, which must cover whole mappings only."""
        ...

    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        """Make mapped ``[va, va+size)`` readable and writable by devices.

        ``devices=None`` (every existing caller): this driver's device only. Otherwise each
        listed device ordinal gets read/write access (peers: other GPUs of the process);
        devices not listed keep the access they had, as with ``cuMemSetAccess``.
        """
        ...

    def mem_info(self) -> tuple[int, int]:
        """Return ``(free_bytes, total_bytes)`` of the device's physical memory."""
        ...

    def stats(self) -> DriverStats:
        """What this driver holds right now, by its own accounting."""
        ...

    def export_handle(self, handle: int) -> int:
        """A new POSIX file descriptor for ``handle``'s memory; the caller owns (closes) it."""
        ...

    def import_handle(self, fd: int, size: int) -> int:
        """A handle for the ``size`` bytes another process exported as ``fd``.

        On success the driver owns ``fd`` (the caller must not close it); on failure it is
        still the caller's. The memory counts for the driver that created it, not this one.
        """
        ...

    # -- optional calls: declared here with the defaults a driver without the feature has.
    # SimDriver, HostDriver, CudaDriver and DriverWrapper subclass Driver and inherit them,
    # so the arena and owner call them directly (no getattr on a driver).

    @property
    def clock_us(self) -> float:
        """Simulated time spent in driver calls, in µs: the simulator's clock; 0.0 elsewhere."""
        return 0.0

    @property
    def handle_type(self) -> str:
        """What this driver's handles can be shared as, one of :data:`HANDLE_TYPES`.

        ``"posix_fd"`` by default, what :meth:`export_handle` promises: the simulator and the
        host driver; CudaDriver says what it asked CUDA for (``handle_type=``), and a wrapper
        says what the driver it wraps does.
        """
        return "posix_fd"

    @property
    def granularity_min(self) -> int:
        """The device's minimum allocation granularity in bytes: :meth:`granularity` by
        default; CudaDriver says what CUDA reports (its ``granularity`` may be the larger
        recommended one), and a wrapper says what the driver it wraps does."""
        return self.granularity()

    @property
    def fast_path(self) -> bool | None:
        """Whether the hot calls run in C (CudaDriver's ``_cudafast``): True or False on
        CudaDriver, None (no C path at all) elsewhere; a wrapper says its inner driver's."""
        return None

    def library_work(self, op: str, units: int = 1) -> None:
        """Charge kvvmm's own work for one arena or owner operation (``op``, ``units``
        handles, mappings or buffers) to a simulated clock. A no-op except on the simulator;
        :func:`work_hook` tells the hot paths to skip the call where it is one."""
        return None

    def pin(self, va: int) -> None:
        """A view (a tensor) can reach the reservation at ``va``: drivers whose freed VA would
        crash a reader (host, CUDA) refuse its ``free`` and ``close()`` until :meth:`unpin`.
        A no-op where nothing given out can crash a reader (sim)."""
        return None

    def unpin(self, va: int) -> None:
        """One view fewer reaches the reservation at ``va`` (see :meth:`pin`)."""
        return None

    def close(self) -> None:
        """Give back everything still held (idempotent). A no-op where nothing is held for
        real (sim) and on wrappers (the wrapped driver is its owner's to close)."""
        return None


#: The optional calls of :class:`Driver` (with their defaults there).
OPTIONAL_CALLS = ("clock_us", "handle_type", "granularity_min", "fast_path", "library_work",
                  "pin", "unpin", "close")


def work_hook(driver: Driver) -> Callable[[str, int], None] | None:
    """``driver.library_work``, or None where it is the protocol's no-op default.

    The arena and the owner take it once, at construction, and skip the charge when it is
    None: a real driver's decode step then makes no call at all. Wrappers hand out their
    inner driver's ``library_work`` itself, so a wrapper of a real driver gives None too.
    """
    fn = driver.library_work
    return None if getattr(fn, "__func__", None) is Driver.library_work else fn


def driver_error(call: str, args: dict[str, int], cuda_error: str, reason: str) -> DriverError:
    """Build the right :class:`DriverError` subclass for a CUDA error name."""
    if cuda_error == CUDA_ERROR_OUT_OF_MEMORY:
        return DriverOutOfMemoryError(call, args, cuda_error, reason)
    return DriverError(call, args, cuda_error, reason)


def check_driver(driver: object, name: str = "driver") -> None:
    """Refuse what is not a driver object (None, a kind's name) before it is first called.

    Raises:
        ArgumentError: naming ``name``; a kind's name gets the hint to open it first, an
            object with the required calls but not the optional ones the hint to subclass
            :class:`Driver` (which has their defaults).
    """
    if isinstance(driver, Driver):
        return
    missing = [m for m in OPTIONAL_CALLS if not hasattr(driver, m)]
    if missing and all(hasattr(driver, m) for m in _REQUIRED):
        raise ArgumentError(name, driver, f"a driver object with the protocol's optional calls "
                                          f"(it lacks {missing}): subclass kvvmm.driver.Driver "
                                          f"to inherit their defaults")
    hint = (f"; open it first: kvvmm.open_driver({driver!r})"
            if driver in ("auto", *DRIVER_KINDS) else "")
    raise ArgumentError(name, driver, f"a driver object (SimDriver, HostDriver, CudaDriver, "
                                      f"or a wrapper of one){hint}")


#: What :func:`check_driver` requires of a driver (its optional calls have defaults).
_REQUIRED = ("kind", "device", "name", "memory", "granularity", "reserve", "free", "create",
             "release", "map", "unmap", "set_access", "mem_info", "stats", "export_handle",
             "import_handle")

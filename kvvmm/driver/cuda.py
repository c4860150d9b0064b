"""CudaDriver: the driver protocol on a real GPU, through cuda-python's ``cuda.bindings.driver``.

The only module of kvvmm that imports ``cuda.bindings``. Every call is one CUDA VMM entry
point in the device's *primary* context, the one torch uses. The hot calls (create, map, set
access, unmap, release) run in C when ``_cudafast.c`` is built; the Python methods here are
its slow path and the whole driver without it. Optionally (``zero_page``) unbacked VA reads as
zeros through a read-only zero cover (:mod:`kvvmm.driver.zerocover` plans it,
:mod:`kvvmm.driver.cuda_zero` runs it). Each part of the driver that is an idea of its own
is one of ``CudaDriver``'s bases, in a module beside this one: the C fast path's Python side
(``cuda_fast``), the synchronize before an unmap (``cuda_capture``), peer access
(``cuda_peers``) and the zero cover (``cuda_zero``); the cuda.bindings module they call
through is this module's ``_drv``.

The design (the rules checked here that CUDA does not check, cost and the C fast path, unmap
and graph capture, contexts, peers, handles between processes, arguments, threads, the zero
page) is ``docs/CUDA_DRIVER.md``; the measurements it cites are ``docs/MEASUREMENTS.md``.
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_right, insort
from collections.abc import Callable, Sequence
from typing import Any

from kvvmm.checks import int_arg, is_int
from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    HANDLE_TYPES,
    Driver,
    DriverStats,
    MemoryKind,
    Pins,
    check_call_ints,
    driver_error,
    locked,
    refuse_close,
)
from kvvmm.driver.cuda_capture import SynchronizeMixin
from kvvmm.driver.cuda_fast import FastPathMixin, _Handle, _PyBook

# The C extension, or None when it is not built (tests/drivers.py and tests/gpu look here).
from kvvmm.driver.cuda_fast import _cudafast as _cudafast
from kvvmm.driver.cuda_peers import PeerAccessMixin
from kvvmm.driver.cuda_zero import ZeroPageMixin
from kvvmm.driver.zerocover import ZeroCover
from kvvmm.errors import ArgumentError, DriverError, DriverUnavailableError

try:  # Imported here (not lazily) because this module is itself imported lazily.
    from cuda.bindings import driver as _drv
except ImportError as _e:  # pragma: no cover - depends on the environment
    _drv = None
    _IMPORT_ERROR = f"{type(_e).__name__}: {_e}"
else:
    _IMPORT_ERROR = ""

__all__ = ["CudaDriver"]

_FALLBACK = 'open_driver("sim") works everywhere; open_driver("host") gives real bytes on Linux'



def _unavailable(what: str) -> DriverUnavailableError:
    return DriverUnavailableError(f"the CUDA driver cannot run here: {what}. {_FALLBACK}.")


#: ``handle_type=`` -> the ``CUmemAllocationHandleType`` it asks ``cuMemCreate`` for.
_CU_HANDLE_TYPES = {
    "none": "CU_MEM_HANDLE_TYPE_NONE",
    "posix_fd": "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    "fabric": "CU_MEM_HANDLE_TYPE_FABRIC",
}
#: What ``handle_type="auto"`` tries, in order: SGLang 0.5.23's candidates
#: (``get_device_allocation_handle_type``, ``sglang/srt/utils/cuda_vmm_utils.py``).
AUTO_HANDLE_ORDER = ("fabric", "posix_fd", "none")


def _handle_type_arg(handle_type: object) -> str:
    """The handle type asked for: ``"auto"`` or one of :data:`HANDLE_TYPES`.

    Raises:
        ArgumentError: an unknown ``handle_type``.
    """
    if not isinstance(handle_type, str) or handle_type not in ("auto", *HANDLE_TYPES):
        raise ArgumentError("handle_type", handle_type,
                            "'none', 'posix_fd', 'fabric' or 'auto' (as SGLang probes: FABRIC, "
                            "then POSIX fd, then none)")
    return handle_type


def _pick_handle_type(
    want: str, probe: Callable[[str], DriverError | None]
) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The handle type a CudaDriver asked for ``want`` gets, and what each probe answered.

    ``"auto"`` probes as SGLang 0.5.23 does: FABRIC, then POSIX fd, then none; the first
    that CUDA takes wins, and any refusal (out of memory too) moves on to the next, as there.
    ``"fabric"`` is probed alone: where CUDA refuses it (no NVLink fabric, no IMEX channel)
    the driver is not made. ``"posix_fd"`` and ``"none"`` are taken as asked, unprobed (Linux
    always has POSIX fds).

    Args:
        want: ``"auto"`` or one of :data:`~kvvmm.driver.base.HANDLE_TYPES`.
        probe: tries one handle type; None when CUDA took it, else CUDA's refusal.
    Returns:
        The handle type, and ``(type, "ok" or CUDA's error name)`` per probe made.
    Raises:
        DriverError: CUDA refused ``"fabric"``, or under ``"auto"`` all three (the last
            refusal, with a note naming each type and what CUDA answered).
    """
    if want not in ("auto", "fabric"):
        return want, ()
    answers: list[tuple[str, str]] = []
    err: DriverError | None = None
    for name in AUTO_HANDLE_ORDER if want == "auto" else ("fabric",):
        err = probe(name)
        answers.append((name, "ok" if err is None else err.cuda_error))
        if err is None:
            return name, tuple(answers)
    assert err is not None  # the loop made at least one probe, and every one was refused
    if want == "fabric":
        err.add_note("FABRIC handles need an NVLink-fabric system (GB200/GB300 NVL) with IMEX "
                     "channels; handle_type='auto' falls back to 'posix_fd' as SGLang does")
    else:
        err.add_note("handle_type='auto' tried " + ", ".join(f"{n} ({a})" for n, a in answers)
                     + ": CUDA took none of them")
    raise err


def _find_device(drv: Any, device: int) -> tuple[Any, str, int] | str:
    """``device``'s handle, name and the number of visible devices; or the problem, when
    there is no usable GPU or it has no virtual memory management.

    Raises:
        ArgumentError: ``device`` is past the visible devices.
    """
    ok = drv.CUresult.CUDA_SUCCESS
    err = drv.cuInit(0)[0]
    if err != ok:
        return f"cuInit failed with {_name(err)} (no usable GPU or driver)"
    err, count = drv.cuDeviceGetCount()
    if err != ok or count == 0:
        return "no CUDA device is visible (CUDA_VISIBLE_DEVICES? a GPU machine?)"
    if device >= count:
        raise ArgumentError("device", device, f"in [0, {count}) (the visible devices)")
    err, dev = drv.cuDeviceGet(device)
    if err != ok:
        return f"cuDeviceGet({device}) failed with {_name(err)}"
    err, raw_name = drv.cuDeviceGetName(256, dev)
    name = raw_name.split(b"\0", 1)[0].decode() if err == ok else f"cuda:{device}"
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    err, vmm = drv.cuDeviceGetAttribute(attr, dev)
    if err != ok or not vmm:
        return f"{name} (device {device}) does not support CUDA virtual memory management"
    return dev, name, int(count)


class CudaDriver(ZeroPageMixin, PeerAccessMixin, SynchronizeMixin, FastPathMixin, Driver):
    """CUDA VMM on a real GPU, in the device's primary context (torch's).

    Args:
        device: CUDA device ordinal.
        granularity: ``"minimum"`` or ``"recommended"`` (``cuMemGetAllocationGranularity``
            with that flag; both are 2 MiB on H100/H200), or an int: a multiple of the
            minimum, to work in larger units.
        handle_type: what every handle is created shareable as (``requestedHandleTypes``):
            ``"none"`` (the default: not shareable), ``"posix_fd"`` (a POSIX file descriptor,
            so ``export_handle`` works), ``"fabric"`` (a ``CUmemFabricHandle``, across an
            NVLink fabric: needs IMEX channels, and ``export_handle`` refuses it), or
            ``"auto"``: as SGLang 0.5.23 picks, FABRIC, then POSIX fd, then none, each probed
            with a ``cuMemCreate`` of one recommended granule released at once.
            :attr:`handle_type` says what it got, :attr:`handle_type_probe` what each probe
            answered. The granularities are queried with the type it got, as SGLang's are.
        zero_page: keep reserved VA that is not mapped readable as zeros, for this device
            (see "Zero page" in docs/CUDA_DRIVER.md). ``False`` (the default): unbacked VA
            faults on any touch (an illegal-address fault kills the CUDA context). ``True``:
            on, with blocks of :data:`~kvvmm.driver.cuda_zero.ZERO_PAGE_BLOCK` (64 MiB). An
            int: the block size in bytes, the granularity times a power of two (the
            granularity itself: granule pieces only). The zero memory (twice the block, less
            one granule) is taken at construction; reserve, free, map and unmap then cost
            more, and map and free synchronize (so either during CUDA graph capture is
            refused). Peer devices get no zero cover: a peer reading unbacked VA still faults.
    Raises:
        DriverUnavailableError: no cuda-python, no NVIDIA driver library, no usable GPU, or
            a GPU without VMM support (one message; no CUDA traceback chained to it).
        ArgumentError: ``device`` out of range, an unknown ``granularity``, or a
            ``zero_page`` that is not a bool or such a block size.
        ArgumentError: an unknown ``handle_type``.
        DriverError: ``zero_page`` on and the zero handles could not be made (out of memory);
            ``handle_type="fabric"`` and CUDA refused it (no NVLink fabric or IMEX channel
            here: the error names the type), or ``"auto"`` and CUDA refused all three.

    Attributes:
        granularity_min: the device's minimum granularity in bytes.
        granularity_recommended: the device's recommended granularity in bytes.
        handle_type: what the handles are shareable as: ``"none"``, ``"posix_fd"`` or
            ``"fabric"`` (``"auto"`` resolved).
        handle_type_probe: ``(type, "ok" or CUDA's error name)`` per probe ``"auto"`` or
            ``"fabric"`` made, in order; empty for ``"none"`` and ``"posix_fd"``.
        zero_page: the zero cover's block size in bytes, 0 when off
            (:meth:`zero_stats` says what the cover holds; :meth:`stats` counts real
            mappings and memory only).
    """

    kind = "cuda"
    memory = MemoryKind.DEVICE
    handle_type = "none"  #: a plain attribute here (the protocol's default is a property)
    granularity_min = 0  #: set by the constructor (a plain attribute, as handle_type)
    fast_path = False  #: set by the constructor (a plain attribute, as handle_type)

    # The hot calls are fields, not methods: each driver's own, chosen once at construction
    # (_choose_hot_calls) from the C fast path's functions, the zero cover's methods
    # (_zp_map, _zp_unmap) and the Python methods (_py_*). A slot's read is a C member
    # lookup, so a call reaches C with no Python frame of ours.
    __slots__ = ("create", "map", "release", "set_access", "unmap")
    # Each takes the arguments of the protocol's call of its name (Driver.create, ...).
    create: Callable[..., int]
    release: Callable[..., None]
    map: Callable[..., None]
    unmap: Callable[..., None]
    set_access: Callable[..., None]

    def __init__(
        self, *, device: int = 0, granularity: str | int = "minimum",
        zero_page: bool | int = False, handle_type: str = "none",
    ) -> None:
        want = _handle_type_arg(handle_type)
        if not isinstance(zero_page, bool):  # a flag, or else a block size
            int_arg("zero_page", zero_page, lo=1,
                    limit="True, False, or a block size in bytes (> 0)")
        self._zero: ZeroCover | None = None
        self.zero_page = 0
        problem = ""
        try:
            # POSIX fds are asked for here; "auto" and "fabric" are probed once it is open.
            problem = self._open(device, want == "posix_fd")
        except (ArgumentError, DriverUnavailableError):
            raise
        except Exception as e:  # DynamicLibNotFoundError, OSError, RuntimeError, ...
            # Keep only the text: raised outside this block, no CUDA traceback is chained.
            problem = (
                "libcuda, the NVIDIA driver library, could not be loaded: this machine has "
                f"no usable NVIDIA GPU driver ({type(e).__name__}: {e})"
            )
        if problem:
            raise _unavailable(problem)
        try:
            got, self.handle_type_probe = _pick_handle_type(want, self._probe_handle_type)
        except DriverError:
            self.close()
            raise
        self.handle_type = got
        self.exportable = got == "posix_fd"  # what export_handle needs
        self._set_granularity(granularity)
        if zero_page is not False:
            self._start_zero_page(zero_page)
        self._choose_hot_calls()

    def _choose_hot_calls(self) -> None:
        """Set the five hot calls, once, before the driver is handed out.

        C's when the fast path starts (:meth:`_start_fast_path`), the Python methods
        otherwise; with the zero cover on, map and unmap are always the cover's (C knows
        nothing of it), while create, release and set access (which sees real mappings
        only) still run in C.
        """
        fast = self._start_fast_path()
        if fast is not None:
            self.create, self.release, self.set_access = (
                fast.create, fast.release, fast.set_access)
        else:
            self.create, self.release, self.set_access = (
                self._py_create, self._py_release, self._py_set_access)
        if self._zero is not None:
            self.map, self.unmap = self._zp_map, self._zp_unmap
        elif fast is not None:
            self.map, self.unmap = fast.map, fast.unmap
        else:
            self.map, self.unmap = self._py_map, self._py_unmap

    def _probe_handle_type(self, name: str) -> DriverError | None:
        """Try handle type ``name`` as SGLang 0.5.23 does: the granularity asked with it, then
        a ``cuMemCreate`` of one recommended granule, released at once. None when CUDA took
        it: every create then asks for it, and the granularities are its. Else the refusal,
        a DriverError naming the type."""
        drv = _drv
        ok = self._ok
        prop = self._prop
        cu = _CU_HANDLE_TYPES[name]
        what = f"handle_type={name!r} ({cu})"
        enum = getattr(drv.CUmemAllocationHandleType, cu, None)
        if enum is None:  # a cuda-bindings older than the handle type (FABRIC: CUDA 12.3)
            return driver_error("create", {}, CUDA_ERROR_NOT_SUPPORTED,
                                f"{what}: this cuda-bindings does not have it")
        prop.requestedHandleTypes = enum
        flags = drv.CUmemAllocationGranularity_flags
        err, gmin = drv.cuMemGetAllocationGranularity(
            prop, flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        if err == ok:
            err, grec = drv.cuMemGetAllocationGranularity(
                prop, flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        if err != ok:
            return driver_error("create", {}, _name(err), f"{what}: "
                                f"cuMemGetAllocationGranularity returned it: {_describe(err)}")
        size = int(grec)
        err, raw = drv.cuMemCreate(size, prop, 0)
        if err != ok:
            return driver_error("create", {"size": size}, _name(err), f"{what}: cuMemCreate "
                                f"of one granule returned it: {_describe(err)}")
        (err,) = drv.cuMemRelease(raw)
        if err != ok:
            return driver_error("create", {"size": size}, _name(err), f"{what}: cuMemRelease "
                                f"of the probe's granule returned it: {_describe(err)}")
        self.granularity_min, self.granularity_recommended = int(gmin), size
        return None

    # -- construction -----------------------------------------------------------------

    def _open(self, device: int, exportable: bool) -> str:
        """Bind the device and its primary context; return a problem, or '' when usable."""
        drv = _drv
        if drv is None:
            return (
                f"cuda-python is not installed ({_IMPORT_ERROR}); install it with "
                "`pip install cuda-python`"
            )
        int_arg("device", device, lo=0, limit="an int >= 0")
        found = _find_device(drv, device)
        if isinstance(found, str):
            return found
        dev, name, count = found
        ok = drv.CUresult.CUDA_SUCCESS
        # The primary context is the one torch (the runtime API) uses for this device.
        err, ctx = drv.cuDevicePrimaryCtxRetain(dev)
        if err != ok:
            return f"cuDevicePrimaryCtxRetain({device}) failed with {_name(err)}"
        # Make it current only on a thread that has none: forcing it over another device's
        # context would silently switch torch's current device on this thread.
        err, cur = drv.cuCtxGetCurrent()
        if err == ok and int(cur) == 0:
            drv.cuCtxSetCurrent(ctx)
        self._start_book(drv, device, name, dev, ctx, ok)
        self._describe_memory(drv, device, exportable, int(count))
        problem = self._query_granularity(drv)
        if problem:
            drv.cuDevicePrimaryCtxRelease(dev)
        return problem

    def _start_book(self, drv: Any, device: int, name: str, dev: Any, ctx: Any,
                    ok: Any) -> None:
        """The driver's identity, context, lock, the CUDA calls it makes bound once, and
        its empty book."""
        self.device = device
        self.name = name
        self._dev = dev
        self._ctx = ctx
        self._ctx_int = int(ctx)
        self._closed = False
        self._ok = ok
        self._lock = threading.RLock()
        self._pins = Pins()  # reservation start -> pins (views that reach it)
        # Bound once: the hot calls read them from self without a module lookup.
        self._cuMemMap = drv.cuMemMap
        self._cuMemUnmap = drv.cuMemUnmap
        self._cuMemCreate = drv.cuMemCreate
        self._cuMemRelease = drv.cuMemRelease
        self._cuMemSetAccess = drv.cuMemSetAccess
        self._cuCtxSynchronize = drv.cuCtxSynchronize
        self._cuCtxGetCurrent = drv.cuCtxGetCurrent
        self._cuMemRetainAllocationHandle = drv.cuMemRetainAllocationHandle
        self._cuStreamIsCapturing = drv.cuStreamIsCapturing
        self._legacy = drv.CUstream(drv.CU_STREAM_LEGACY)
        self._capture_none = drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        self._implicit = drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
        self._res: dict[int, int] = {}  # reservation start -> size
        self._res_starts: list[int] = []  # sorted reservation starts (for the slow lookup)
        # Counters and the last map's reservation (see _PyBook); a _cudafast.Fast, holding
        # the same ones, once the fast path is on.
        self._b: Any = _PyBook()
        self.fast_path = False  #: whether the hot calls run in C (_cudafast)
        # Live handles only: a released handle that is still mapped lives on in _maps.
        self._handles: dict[int, Any] = {}  # our handle id -> record (_Handle)
        # Mapping start -> its handle; a mapping's size is its handle's (maps take whole ones).
        self._maps: dict[int, Any] = {}

    def _describe_memory(self, drv: Any, device: int, exportable: bool, count: int) -> None:
        """What every create asks for (``CUmemAllocationProp``) and every set access gives
        (read/write on this device)."""
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        if exportable:
            prop.requestedHandleTypes = (
                drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            )
        self.exportable = exportable
        self._posix_fd = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._device_count = count
        self._prop = prop
        acc = drv.CUmemAccessDesc()
        acc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = device
        acc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [acc]
        self._access_lists: dict[tuple[int, ...], list[Any]] = {(device,): self._access}
        self._peer_ok: dict[int, bool] = {}  # device -> cuDeviceCanAccessPeer(device, ours)

    def _query_granularity(self, drv: Any) -> str:
        """Set the minimum and recommended granularities; return a problem, or ''."""
        flags = drv.CUmemAllocationGranularity_flags
        ok = self._ok
        err, gmin = drv.cuMemGetAllocationGranularity(
            self._prop, flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        )
        err2, grec = drv.cuMemGetAllocationGranularity(
            self._prop, flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        )
        if err != ok or err2 != ok:
            return f"cuMemGetAllocationGranularity failed with {_name(err if err != ok else err2)}"
        self.granularity_min = int(gmin)
        self.granularity_recommended = int(grec)
        return ""

    def _set_granularity(self, granularity: str | int) -> None:
        gmin = self.granularity_min
        if granularity == "minimum":
            gran = gmin
        elif granularity == "recommended":
            gran = self.granularity_recommended
        elif is_int(granularity) and granularity > 0 and granularity % gmin == 0:
            gran = granularity
        else:
            self.close()
            raise ArgumentError(
                "granularity", granularity,
                f"'minimum', 'recommended' or a positive multiple of {gmin} (the minimum)",
            )
        self._gran = gran

    def __repr__(self) -> str:
        zero = f", zero_page={self.zero_page}" if self.zero_page else ""
        return (f"CudaDriver(device={self.device}, name={self.name!r}, "
                f"granularity={self._gran}, handle_type={self.handle_type!r}{zero})")

    # -- errors -----------------------------------------------------------------------

    def _cuda_error(self, call: str, args: dict[str, int], fn: str, err: Any) -> DriverError:
        """The error for a CUDA call that failed: CUDA's name, and its description."""
        return driver_error(call, args, _name(err), f"{fn} returned it: {_describe(err)}")

    @staticmethod
    def _refuse(call: str, args: dict[str, int], reason: str) -> DriverError:
        return driver_error(call, args, CUDA_ERROR_INVALID_VALUE, reason)

    def _misaligned(self, call: str, args: dict[str, int]) -> DriverError | None:
        """The refusal for the first size/address/alignment in ``args`` that breaks the rule."""
        g = self._gran
        for key, value in args.items():
            if key == "handle":
                continue
            if key == "size" and value <= 0:
                return self._refuse(call, args, f"size must be > 0, got {value}")
            if value < 0 or value % g:
                return self._refuse(
                    call, args, f"{key}={value:#x} is not a multiple of the granularity {g:#x}"
                )
        return None

    def _alignment_error(self, call: str, args: dict[str, int]) -> DriverError:
        bad = self._misaligned(call, args)
        return bad if bad is not None else self._refuse(call, args, "misaligned")

    def _unmapped(self, h: Any) -> None:
        h.maps -= 1
        if not h.maps and not h.live and not h.imported:  # released while mapped: now
            self._b.physical_bytes -= h.size

    # -- the protocol -----------------------------------------------------------------

    def granularity(self) -> int:
        return self._gran

    @locked
    def reserve(self, size: int, align: int = 0) -> int:
        size, align = check_call_ints("reserve", size=size, align=align).values()
        args = {"size": size, "align": align}
        bad = self._misaligned("reserve", {"size": size})
        if bad is not None:
            raise bad
        # As the H200 answers (and the rule book): 0 or any power of two, 4 KiB included,
        # the VA aligned to at least the granularity; 3 x 2 MiB is INVALID_VALUE.
        if align < 0 or align & (align - 1):
            raise self._refuse("reserve", args, f"align={align:#x} is not 0 or a power of two")
        want = max(align, self._gran)
        z = self._zero
        if z is not None and not z.block & (z.block - 1):
            want = max(want, z.block)  # block-aligned VA: the pieces align in absolute terms
        err, ptr = _drv.cuMemAddressReserve(size, want, 0, 0)
        if err != self._ok:
            raise self._cuda_error("reserve", args, "cuMemAddressReserve", err)
        va = int(ptr)
        self._res[va] = size
        insort(self._res_starts, va)
        if z is not None:
            self._cover_reservation(va, size, args)
        return va

    @locked
    def free(self, va: int, size: int) -> None:
        va, size = check_call_ints("free", va=va, size=size).values()
        args = {"va": va, "size": size}
        if self._b.hot_lo == va:
            # First: from now on the C map of this reservation takes the slow path (the lock).
            self._b.hot_lo = self._b.hot_hi = 0
        got = self._res.get(va)
        if got is None:
            raise self._refuse("free", args, f"{va:#x} is not the start of a reservation")
        if got != size:
            raise self._refuse(
                "free", args, f"the reservation at {va:#x} is {got} bytes, not {size}"
            )
        end = va + size
        inside = sum(1 for s, m in self._maps.items() if s < end and s + m.size > va)
        if inside:
            raise self._refuse("free", args, f"{inside} mappings are still in it")
        self._pins.check_free(va, size)
        z = self._zero
        cover = self._uncover_reservation(va, size, args) if z is not None else []
        (err,) = _drv.cuMemAddressFree(va, size)
        if err != self._ok:
            e = self._cuda_error("free", args, "cuMemAddressFree", err)
            if cover:
                self._recover_reservation(e, cover, va, end)
            raise e
        if z is not None:
            z.drop_reservation(va)
        del self._res[va]
        self._res_starts.remove(va)
        self._pins.forget(va)

    # The hot calls in Python: the whole driver without the C fast path, and its slow path
    # with it (C calls these for anything but the common valid case).

    @locked
    def _py_create(self, size: int) -> int:
        (size,) = check_call_ints("create", size=size).values()
        if size <= 0 or size % self._gran:
            raise self._alignment_error("create", {"size": size})
        err, obj = self._cuMemCreate(size, self._prop, 0)
        if err:  # CUDA_SUCCESS is 0: the cheapest test
            raise self._cuda_error("create", {"size": size}, "cuMemCreate", err)
        self._b.physical_bytes += size
        return self._record(int(obj), size, imported=False)

    def _record(self, raw: int, size: int, *, imported: bool) -> int:
        """Keep a new live handle; return its id."""
        b = self._b
        handle: int = b.next_handle
        b.next_handle = handle + 1
        self._handles[handle] = _Handle(raw, size, imported=imported)
        return handle

    @locked
    def _py_release(self, handle: int) -> None:
        (handle,) = check_call_ints("release", handle=handle).values()
        h = self._handles.pop(handle, None)  # taken out first: no other call can use it now
        if h is None:
            raise self._refuse("release", {"handle": handle}, f"handle {handle} is not live")
        (err,) = self._cuMemRelease(h.raw)
        if err:  # CUDA_SUCCESS is 0: the cheapest test
            self._handles[handle] = h
            raise self._cuda_error("release", {"handle": handle}, "cuMemRelease", err)
        h.live = False
        if not h.maps and not h.imported:  # a mapped handle keeps its memory till unmapped
            self._b.physical_bytes -= h.size

    @locked
    def _py_map(self, va: int, size: int, handle: int) -> None:
        va, size, handle = check_call_ints("map", va=va, size=size, handle=handle).values()
        h: Any = self._handles.get(handle)
        b = self._b
        if (h is None or h.size != size or va < b.hot_lo or va + size > b.hot_hi
                or va % self._gran):
            h = self._map_slow(va, size, handle, h)
        # Booked first (a release of the handle meanwhile, on the C path, sees it mapped),
        # unless a mapping starts here already: then CUDA refuses and that record stays.
        booked = va not in self._maps
        if booked:
            self._maps[va] = h
            h.maps += 1
        (err,) = self._cuMemMap(va, size, 0, h.raw, 0)
        if err:  # CUDA_SUCCESS is 0: the cheapest test
            if booked and va in self._maps and self._maps[va] is h:
                del self._maps[va]
                h.maps -= 1
            args = {"va": va, "size": size, "handle": handle}
            raise self._cuda_error("map", args, "cuMemMap", err)
        if not booked:  # CUDA took a map over a mapping's start (it does not): book it now
            self._maps[va] = h
            h.maps += 1

    def _map_slow(self, va: int, size: int, handle: int, h: Any) -> Any:
        """Check a map the fast test did not pass: raise, or return the handle to map."""
        args = {"va": va, "size": size, "handle": handle}
        bad = self._misaligned("map", {"va": va, "size": size})
        if bad is not None:
            raise bad
        if h is None:
            raise self._refuse("map", args, f"handle {handle} is not live")
        if h.size != size:
            # What CUDA itself answers on an H200 (driver 580, CUDA 13.0) for size != the
            # handle's size, or offset != 0; GB300 refuses these too.
            raise driver_error(
                "map", args, CUDA_ERROR_NOT_SUPPORTED,
                f"size {size} != the handle's {h.size} bytes: maps take whole handles",
            )
        # CUDA does not check this one: on an H200 a map straddling a reservation's end, into
        # a freed reservation, or across two adjacent reservations succeeds.
        i = bisect_right(self._res_starts, va) - 1
        start = self._res_starts[i] if i >= 0 else 0
        end = start + self._res.get(start, 0)
        if i < 0 or va + size > end:
            raise self._refuse("map", args, "the range is not inside one reservation")
        self._b.hot_lo, self._b.hot_hi = start, end
        return h

    def _tiling(self, call: str, va: int, size: int) -> list[int]:
        """Mapping starts that exactly tile ``[va, va+size)``; raise unless they do."""
        va, size = check_call_ints(call, va=va, size=size).values()
        args = {"va": va, "size": size}
        bad = self._misaligned(call, args)
        if bad is not None:
            raise bad
        maps = self._maps
        out: list[int] = []
        pos, end = va, va + size
        while pos < end:
            m = maps.get(pos)
            if m is None:
                inner = [s for s, n in maps.items() if s < pos < s + n.size]
                if inner:
                    raise self._refuse(
                        call, args, f"{pos:#x} is inside the mapping at {inner[0]:#x}"
                    )
                raise self._refuse(call, args, f"nothing is mapped at {pos:#x}")
            if pos + m.size > end:
                raise self._refuse(
                    call, args,
                    f"the mapping at {pos:#x} ({m.size} bytes) ends past {end:#x}: "
                    "part of a mapping",
                )
            out.append(pos)
            pos += m.size
        return out

    @locked
    def _py_unmap(self, va: int, size: int) -> None:
        va, size = check_call_ints("unmap", va=va, size=size).values()
        maps = self._maps
        m = maps.get(va)
        starts = [va] if m is not None and m.size == size else self._tiling("unmap", va, size)
        self._synchronize("unmap", va, size)
        # Taken out of the book before CUDA is called (the C path cannot pick them up), put
        # back if CUDA refuses.
        taken = [(s, maps.pop(s)) for s in starts]
        (err,) = self._cuMemUnmap(va, size)
        if err:  # CUDA_SUCCESS is 0: the cheapest test
            maps.update(taken)
            raise self._cuda_error("unmap", {"va": va, "size": size}, "cuMemUnmap", err)
        for _, h in taken:
            self._unmapped(h)

    @locked
    def _py_set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        va, size = check_call_ints("set_access", va=va, size=size).values()
        if devices is not None:
            self._set_access_for(va, size, devices)
            return
        maps = self._maps
        m = maps.get(va)
        if m is None or m.size != size:
            self._tiling("set_access", va, size)
        (err,) = self._cuMemSetAccess(va, size, self._access, 1)
        if err:  # CUDA_SUCCESS is 0: the cheapest test
            raise self._cuda_error("set_access", {"va": va, "size": size}, "cuMemSetAccess", err)

    # -- handles shared between processes -----------------------------------------------

    @locked
    def export_handle(self, handle: int) -> int:
        """A POSIX file descriptor for ``handle`` (``cuMemExportToShareableHandle``).

        The caller owns the descriptor: send it (``multiprocessing.reduction.send_handle``)
        and close it. Needs a driver made with ``handle_type="posix_fd"`` (or ``"auto"`` where
        that is what it got). FABRIC handles are refused before CUDA is called
        (CUDA_ERROR_NOT_SUPPORTED): what they export is a 64-byte ``CUmemFabricHandle``, not
        a descriptor, and kvvmm does not pass those between processes.
        """
        (handle,) = check_call_ints("export_handle", handle=handle).values()
        args = {"handle": handle}
        h = self._handles.get(handle)
        if h is None:
            raise self._refuse("export_handle", args, f"handle {handle} is not live")
        if self.handle_type == "fabric":
            raise driver_error(
                "export_handle", args, CUDA_ERROR_NOT_SUPPORTED,
                "this CudaDriver's handles are FABRIC handles (handle_type='fabric'), which "
                "export as a 64-byte CUmemFabricHandle, not a POSIX file descriptor; kvvmm "
                "does not pass those: open the driver with handle_type='posix_fd'")
        err, fd = _drv.cuMemExportToShareableHandle(h.raw, self._posix_fd, 0)
        if err != self._ok:
            e = self._cuda_error("export_handle", args, "cuMemExportToShareableHandle", err)
            if not self.exportable:
                e.add_note("this CudaDriver creates handles that are not shareable "
                           f"(handle_type={self.handle_type!r}): open it with "
                           "handle_type='posix_fd' (open_driver('cuda', handle_type='posix_fd'))")
            raise e
        return int(fd)

    @locked
    def import_handle(self, fd: int, size: int) -> int:
        """A handle for the memory another process exported as ``fd``.

        ``cuMemImportFromShareableHandle``; on success ``fd`` is closed (the handle holds the
        memory), on failure it is still the caller's. CUDA cannot tell the allocation's
        size: ``size`` must be the exported handle's (a map of any other size is refused).
        """
        fd, size = check_call_ints("import_handle", fd=fd, size=size).values()
        args = {"fd": fd, "size": size}
        if size <= 0 or size % self._gran:
            raise self._alignment_error("import_handle", {"size": size})
        err, obj = _drv.cuMemImportFromShareableHandle(fd, self._posix_fd)
        if err != self._ok:
            raise self._cuda_error("import_handle", args, "cuMemImportFromShareableHandle", err)
        os.close(fd)
        return self._record(int(obj), size, imported=True)

    @locked
    def mem_info(self) -> tuple[int, int]:
        # cuMemGetInfo reads the current context: make ours current for the call.
        drv = _drv
        drv.cuCtxPushCurrent(self._ctx)
        try:
            err, free_bytes, total_bytes = drv.cuMemGetInfo()
        finally:
            drv.cuCtxPopCurrent()
        if err != self._ok:
            raise self._cuda_error("mem_info", {}, "cuMemGetInfo", err)
        return int(free_bytes), int(total_bytes)

    @locked
    def stats(self) -> DriverStats:
        return DriverStats(
            reservations=len(self._res),
            reserved_bytes=sum(self._res.values()),
            handles=len(self._handles),
            mappings=len(self._maps),
            mapped_bytes=sum(h.size for h in self._maps.values()),  # O(n), off the hot path
            physical_bytes=self._b.physical_bytes,
        )

    def close(self) -> None:
        """Unmap, release and free everything still held, then drop the context reference.

        Idempotent. Tensors over this driver's VA must be gone first (the arena sees to it):
        touching unmapped VA is an illegal-address fault.
        """
        if getattr(self, "_closed", True):
            return
        with self._lock:
            self._close()

    @locked
    def pin(self, va: int) -> None:
        """Mark the reservation at ``va`` as reachable by a view: ``free`` and ``close()``
        of it are refused (:class:`BusyError`) until :meth:`unpin`. Pins count."""
        (va,) = check_call_ints("pin", va=va).values()
        if va not in self._res:
            raise self._refuse("pin", {"va": va}, f"{va:#x} is not the start of a reservation")
        self._pins.add(va)

    @locked
    def unpin(self, va: int) -> None:
        """Drop one pin of the reservation at ``va`` (a no-op if it has none)."""
        (va,) = check_call_ints("unpin", va=va).values()
        self._pins.drop(va)

    def _close(self) -> None:
        refuse_close("cuda", self.stats(), self._pins.pinned())
        for va, h in sorted(self._maps.items(), key=lambda item: item[0]):
            if self._zero is not None:  # no re-cover: free unmaps the cover next
                self._zp_unmap(va, h.size, recover=False)
            else:
                self.unmap(va, h.size)
        for handle in list(self._handles):
            self.release(handle)
        for va, size in list(self._res.items()):
            self.free(va, size)
        if self._zero is not None:  # the zero handles last: nothing maps them now
            self._release_zero_handles()
        self._closed = True
        _drv.cuDevicePrimaryCtxRelease(self._dev)


def _name(err: Any) -> str:
    """CUDA's name for an error code (``"CUDA_ERROR_OUT_OF_MEMORY"``)."""
    try:
        res, raw = _drv.cuGetErrorName(err)
        if res == _drv.CUresult.CUDA_SUCCESS and raw:
            return str(raw.decode() if isinstance(raw, bytes) else raw)
    except Exception:  # the name must not hide the error it names
        pass
    return str(getattr(err, "name", f"CUDA_ERROR_{int(err)}"))


def _describe(err: Any) -> str:
    try:
        res, raw = _drv.cuGetErrorString(err)
        if res == _drv.CUresult.CUDA_SUCCESS and raw:
            return str(raw.decode() if isinstance(raw, bytes) else raw)
    except Exception:
        pass
    return "no description"

"""CudaDriver: the driver protocol on a real GPU, through cuda-python's ``cuda.bindings.driver``.

The only module of kvvmm that imports ``cuda.bindings``. Every call is one CUDA VMM entry
point in the device's *primary* context, the one torch uses. The hot calls (create, map, set
access, unmap, release) run in C when ``_cudafast.c`` is built; the Python methods here are
its slow path and the whole driver without it. Optionally (``zero_page``) unbacked VA reads as
zeros through a read-only zero cover (:mod:`kvvmm.driver.zerocover` plans it).

The design (the rules checked here that CUDA does not check, cost and the C fast path, unmap
and graph capture, contexts, peers, handles between processes, arguments, threads, the zero
page) is ``docs/CUDA_DRIVER.md``; the measurements it cites are ``docs/MEASUREMENTS.md``.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from bisect import bisect_right, insort
from collections.abc import Callable, Sequence
from typing import Any

from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_DEVICE,
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
from kvvmm.driver.zerocover import Piece, ZeroCover, ZeroCoverStats, runs
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

#: ``zero_page=True``'s block: the largest granularity-times-a-power-of-two up to this. 64 MiB:
#: a 246 GiB reservation is ~3,936 zero mappings (~40 µs of cuMemSetAccess each, ~0.17 s),
#: for 2 x 64 MiB - 2 MiB = 126 MiB of zero memory (0.09% of an H200); 32 MiB would halve
#: the memory and double the cover's cost.
ZERO_PAGE_BLOCK = 64 << 20


class _PyHandle:
    """One ``cuMemCreate`` allocation as this driver tracks it (``_cudafast.Handle`` in C)."""

    __slots__ = ("imported", "live", "maps", "raw", "size")

    def __init__(self, raw: int, size: int, imported: bool = False) -> None:
        self.raw = raw  #: the ``CUmemGenericAllocationHandle`` as an int
        self.size = size  #: bytes
        self.maps = 0  #: live mappings of it
        self.live = True  #: not yet released
        #: from another process (``import_handle``): its memory is not this driver's to count
        self.imported = imported


class _PyBook:
    """The driver's counters, when the C fast path is not in use (``_cudafast.Fast`` holds
    the same ones when it is)."""

    __slots__ = ("capture_check", "hot_hi", "hot_lo", "next_handle", "physical_bytes")

    def __init__(self) -> None:
        # The reservation the last map landed in, as [hot_lo, hot_hi): maps mostly land in
        # the reservation the previous one did, so the hot path compares two ints, no bisect.
        self.hot_lo = self.hot_hi = 0
        self.next_handle = 1
        self.physical_bytes = 0
        self.capture_check: Any = None  # torch's "current stream capturing?", once seen


# The hot calls in C (kvvmm/driver/_cudafast.c), built with the package when a C compiler
# and Python's headers are there; without it every call runs the Python below, which gives
# the same answers (tests/test_cudafast.py, tests/gpu/test_gpu_parity.py run both).
try:
    from kvvmm.driver import _cudafast
except ImportError:  # pragma: no cover - depends on the build
    _cudafast = None  # type: ignore[assignment]

_Handle: Any = _cudafast.Handle if _cudafast is not None else _PyHandle

#: The libcuda entry points the C fast path calls, in the order ``_cudafast.Fast`` takes them.
_FAST_FUNCTIONS = ("cuMemMap", "cuMemUnmap", "cuMemCreate", "cuMemRelease", "cuMemSetAccess",
                   "cuCtxGetCurrent", "cuCtxSynchronize", "cuStreamIsCapturing")


def _libcuda_functions() -> tuple[int, ...] | None:
    """Addresses of ``_FAST_FUNCTIONS`` in the libcuda that cuda-python already loaded.

    ``RTLD_NOLOAD``: the very library the bindings call, never a second copy. These names
    have one ABI each (the versioned ``_v2`` functions are other symbols), and
    ``cuStreamIsCapturing`` without ``_ptsz`` is the legacy-stream one, as passed.
    """
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        out = tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value or 0
                    for n in _FAST_FUNCTIONS)
    except (OSError, AttributeError):
        return None
    return out if all(out) else None


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


def _handle_type_arg(handle_type: object, exportable: object) -> str:
    """The handle type asked for, from ``handle_type=`` and the deprecated ``exportable=``.

    Raises:
        ArgumentError: an unknown ``handle_type``, an ``exportable`` that is not a bool, or
            one that says otherwise than ``handle_type``.
    """
    if not isinstance(handle_type, str) or handle_type not in ("auto", *HANDLE_TYPES):
        raise ArgumentError("handle_type", handle_type,
                            "'none', 'posix_fd', 'fabric' or 'auto' (as SGLang probes: FABRIC, "
                            "then POSIX fd, then none)")
    if exportable is None:
        return handle_type
    if not isinstance(exportable, bool):
        raise ArgumentError("exportable", exportable, "True or False")
    implied = "posix_fd" if exportable else "none"
    warnings.warn(f"CudaDriver(exportable={exportable}) is deprecated (0.3, goes in 0.4): pass "
                  f"handle_type={implied!r}", DeprecationWarning, stacklevel=3)
    if handle_type not in ("none", implied):
        raise ArgumentError("exportable", exportable,
                            f"left out with handle_type={handle_type!r} (exportable=True is "
                            "handle_type='posix_fd', False is 'none')")
    return implied


def _pick_handle_type(
    want: str, probe: Callable[[str], DriverError | None]
) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The handle type a CudaDriver asked for ``want`` gets, and what each probe answered.

    ``"auto"`` probes as SGLang 0.5.23 does: FABRIC, then POSIX fd, then none; the first
    that CUDA takes wins, and any refusal (out of memory too) moves on to the next, as there.
    ``"fabric"`` is probed alone: where CUDA refuses it (no NVLink fabric, no IMEX channel)
    the driver is not made. ``"posix_fd"`` and ``"none"`` are taken as asked, unprobed (Linux
    always has POSIX fds; what ``exportable=`` did).

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


class CudaDriver(Driver):
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
        exportable: deprecated (0.3, goes in 0.4): ``True`` is ``handle_type="posix_fd"``,
            ``False`` is ``"none"``.
        zero_page: keep reserved VA that is not mapped readable as zeros, for this device
            (see "Zero page" in docs/CUDA_DRIVER.md). ``False`` (the default): unbacked VA
            faults on any touch (an illegal-address fault kills the CUDA context). ``True``:
            on, with blocks of ``ZERO_PAGE_BLOCK`` (64 MiB). An int: the block size in
            bytes, the granularity times a power of two (the granularity itself: granule
            pieces only). The zero memory (twice the block, less one granule) is taken at
            construction; reserve, free, map and unmap then cost more, and map and free
            synchronize (so either during CUDA graph capture is refused). Peer devices get no zero
            cover: a peer reading unbacked VA still faults.
    Raises:
        DriverUnavailableError: no cuda-python, no NVIDIA driver library, no usable GPU, or
            a GPU without VMM support (one message; no CUDA traceback chained to it).
        ArgumentError: ``device`` out of range, an unknown ``granularity``, or a
            ``zero_page`` that is not a bool or such a block size.
        ArgumentError: an unknown ``handle_type``, or an ``exportable`` that contradicts it.
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

    def __init__(
        self, *, device: int = 0, granularity: str | int = "minimum",
        exportable: bool | None = None, zero_page: bool | int = False,
        handle_type: str = "none",
    ) -> None:
        want = _handle_type_arg(handle_type, exportable)
        if not isinstance(zero_page, int) or (type(zero_page) is not bool and zero_page <= 0):
            raise ArgumentError("zero_page", zero_page,
                                "True, False, or a block size in bytes (> 0)")
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
        self._start_fast_path()

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
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ArgumentError("device", device, "an int >= 0")
        err = drv.cuInit(0)[0]
        if err != drv.CUresult.CUDA_SUCCESS:
            return f"cuInit failed with {_name(err)} (no usable GPU or driver)"
        ok = err  # success as the bindings return it
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
        # The primary context is the one torch (the runtime API) uses for this device.
        err, ctx = drv.cuDevicePrimaryCtxRetain(dev)
        if err != ok:
            return f"cuDevicePrimaryCtxRetain({device}) failed with {_name(err)}"
        # Make it current only on a thread that has none: forcing it over another device's
        # context would silently switch torch's current device on this thread.
        err, cur = drv.cuCtxGetCurrent()
        if err == ok and int(cur) == 0:
            drv.cuCtxSetCurrent(ctx)

        self.device = device
        self.name = name
        self._dev = dev
        self._ctx = ctx
        self._ctx_int = int(ctx)
        self._closed = False
        self._ok = ok
        self._lock = threading.RLock()
        self._pins = Pins()  # reservation start -> pins (views that reach it)

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
        self._device_count = int(count)
        self._prop = prop
        acc = drv.CUmemAccessDesc()
        acc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = device
        acc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [acc]
        self._access_lists: dict[tuple[int, ...], list[Any]] = {(device,): self._access}
        self._peer_ok: dict[int, bool] = {}  # device -> cuDeviceCanAccessPeer(device, ours)
        flags = drv.CUmemAllocationGranularity_flags
        err, gmin = drv.cuMemGetAllocationGranularity(
            prop, flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        )
        err2, grec = drv.cuMemGetAllocationGranularity(
            prop, flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        )
        if err != ok or err2 != ok:
            drv.cuDevicePrimaryCtxRelease(dev)
            return f"cuMemGetAllocationGranularity failed with {_name(err if err != ok else err2)}"
        self.granularity_min = int(gmin)
        self.granularity_recommended = int(grec)

        # Bound once: the hot calls read them from self without a module lookup.
        self._cuMemMap = drv.cuMemMap
        self._cuMemUnmap = drv.cuMemUnmap
        self._cuMemCreate = drv.cuMemCreate
        self._cuMemRelease = drv.cuMemRelease
        self._cuMemSetAccess = drv.cuMemSetAccess
        self._cuCtxSynchronize = drv.cuCtxSynchronize
        self._cuCtxGetCurrent = drv.cuCtxGetCurrent
        self._cuMemRetainAllocationHandle = drv.cuMemRetainAllocationHandle
        ro = drv.CUmemAccessDesc()
        ro.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        ro.location.id = device
        ro.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ
        self._ro_access = [ro]  # the zero cover's access: read-only, this device only
        self._zraw: dict[int, int] = {}  # zero piece size -> its zero handle (raw)
        # mapping start -> the access list a set_access with devices= gave it (zero page on
        # only: an undo that maps a real handle back gives it the same access again)
        self._peer_access: dict[int, list[Any]] = {}

        self._res: dict[int, int] = {}  # reservation start -> size
        self._res_starts: list[int] = []  # sorted reservation starts (for the slow lookup)
        # Counters and the last map's reservation (see _PyBook); a _cudafast.Fast, holding
        # the same ones, once the fast path is on.
        self._b: Any = _PyBook()
        self.fast_path = False  #: whether the hot calls run in C (_cudafast)
        self._legacy = drv.CUstream(drv.CU_STREAM_LEGACY)
        self._cuStreamIsCapturing = drv.cuStreamIsCapturing
        self._capture_none = drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        self._implicit = drv.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
        # Live handles only: a released handle that is still mapped lives on in _maps.
        self._handles: dict[int, Any] = {}  # our handle id -> record (_Handle)
        # Mapping start -> its handle; a mapping's size is its handle's (maps take whole ones).
        self._maps: dict[int, Any] = {}
        return ""

    def _start_fast_path(self) -> None:
        """Hand the hot calls to C (``_cudafast``) when it is built and libcuda's entry
        points are found; ``KVVMM_CUDA_FASTPATH=0`` keeps them in Python."""
        if _cudafast is None or os.environ.get("KVVMM_CUDA_FASTPATH", "1") == "0":
            return
        fns = _libcuda_functions()
        if fns is None:
            return
        # Called from __init__, before any call: the fresh book has nothing to carry over.
        fast = _cudafast.Fast(
            fns, self._ctx_int, int(self._prop.getPtr()), int(self._access[0].getPtr()),
            self._gran, self._handles, self._maps, self, _cudafast.Handle,
        )
        self._b = fast
        # Instance attributes over the class's methods: a call reaches C with no Python
        # frame. The class's methods stay the slow path (``_py_*``), called from C. With the
        # zero cover on, map and unmap stay in Python (C knows nothing of the cover); create,
        # release and set access (which sees only real mappings, ``_maps``) run in C.
        calls = dict(create=fast.create, release=fast.release, set_access=fast.set_access)
        if self._zero is None:
            calls.update(map=fast.map, unmap=fast.unmap)
        self.__dict__.update(calls)
        self.fast_path = True

    def _fast_failed(self, call: str, fn: str, args: tuple[int, ...], err: int) -> None:
        """Raise the DriverError for a CUDA call the C fast path made and CUDA refused."""
        names = {"map": ("va", "size", "handle"), "unmap": ("va", "size"), "create": ("size",),
                 "release": ("handle",), "set_access": ("va", "size")}[call]
        res = _drv.CUresult(err)
        kw = dict(zip(names, args, strict=True))
        if fn == "cuCtxSynchronize":
            raise driver_error(
                call, kw, _name(res),
                f"cuCtxSynchronize before the unmap returned it ({_describe(res)}); nothing "
                "was unmapped",
            )
        raise self._cuda_error(call, kw, fn, res)

    def _set_granularity(self, granularity: str | int) -> None:
        gmin = self.granularity_min
        if granularity == "minimum":
            gran = gmin
        elif granularity == "recommended":
            gran = self.granularity_recommended
        elif (
            isinstance(granularity, int)
            and not isinstance(granularity, bool)
            and granularity > 0
            and granularity % gmin == 0
        ):
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

    # -- the zero cover (zero_page) -----------------------------------------------------

    def _start_zero_page(self, zero_page: bool | int) -> None:
        """Check the block size, create and zero the zero handles, route map/unmap here."""
        g = self._gran
        if zero_page is True:
            block = g
            while block * 2 <= ZERO_PAGE_BLOCK:
                block *= 2
        else:
            block = int(zero_page)
            ratio = block // g
            if block % g or ratio & (ratio - 1):
                self.close()
                raise ArgumentError(
                    "zero_page", zero_page,
                    f"True, False, or a block size in bytes: the granularity ({g}) times a "
                    "power of two",
                )
        cover = ZeroCover(g, block)
        raws: dict[int, int] = {}
        try:
            for n in cover.sizes:
                err, obj = self._cuMemCreate(n, self._prop, 0)
                if err != self._ok:
                    raise self._cuda_error("zero_page", {"size": n}, "cuMemCreate", err)
                raws[n] = int(obj)
            self._zero_fill(raws)
        except BaseException:
            for raw in raws.values():
                _drv.cuMemRelease(raw)
            self.close()
            raise
        self._zero = cover
        self._zraw = raws
        self.zero_page = block
        # Instance attributes over the class's map and unmap (the fast path leaves them).
        self.__dict__.update(map=self._zp_map, unmap=self._zp_unmap)

    def _zero_fill(self, raws: dict[int, int]) -> None:
        """Zero the zero handles once: cuMemCreate memory holds whatever it last held.

        Each is mapped read/write at a temporary reservation, one ``cuMemsetD8`` over all of
        them runs in this device's primary context, synchronized, then unmapped and freed.
        """
        drv = _drv
        total = sum(raws)
        args = {"size": total}
        err, ptr = drv.cuMemAddressReserve(total, self._gran, 0, 0)
        if err != self._ok:
            raise self._cuda_error("zero_page", args, "cuMemAddressReserve", err)
        tmp = int(ptr)
        mapped: list[tuple[int, int]] = []
        try:
            pos = tmp
            for n, raw in raws.items():
                (err,) = self._cuMemMap(pos, n, 0, raw, 0)
                if err != self._ok:
                    raise self._cuda_error("zero_page", args, "cuMemMap", err)
                mapped.append((pos, n))
                pos += n
            (err,) = self._cuMemSetAccess(tmp, total, self._access, 1)
            if err != self._ok:
                raise self._cuda_error("zero_page", args, "cuMemSetAccess", err)
            drv.cuCtxPushCurrent(self._ctx)
            try:
                (err,) = drv.cuMemsetD8(tmp, 0, total)
                (err2,) = drv.cuCtxSynchronize()  # also after a failed memset: then unmap
            finally:
                drv.cuCtxPopCurrent()
            if err != self._ok or err2 != self._ok:
                bad = err if err != self._ok else err2
                fn = "cuMemsetD8" if err != self._ok else "cuCtxSynchronize"
                raise self._cuda_error("zero_page", args, fn, bad)
        finally:
            for pos, n in mapped:
                drv.cuMemUnmap(pos, n)
            drv.cuMemAddressFree(tmp, total)

    def _cover_reservation(self, va: int, size: int, args: dict[str, int]) -> None:
        """Cover a new reservation; undo it (free the VA) if the cover fails."""
        z = self._zero
        assert z is not None
        z.add_reservation(va, size)
        notes: list[str] = []
        fail = self._z_put(z.cover(va, va + size), notes)
        if fail is None:
            return
        e = self._z_error("reserve", args, fail, [])
        if z.overlapping(va, va + size):  # the undo left pieces: keep the VA in the book
            e.add_note(f"the reservation at {va:#x} ({size} bytes) stays in this driver's book "
                       "with what is still mapped in it: close() gives it back")
            self._note(e, notes, va, va + size)
            raise e
        z.drop_reservation(va)
        del self._res[va]
        self._res_starts.remove(va)
        (err,) = _drv.cuMemAddressFree(va, size)
        if err != self._ok:
            e.add_note(f"undo: cuMemAddressFree({va:#x}) returned {_name(err)}: that VA leaks")
        raise e

    def _z_put(self, pieces: list[Piece], notes: list[str]) -> tuple[str, Any] | None:
        """Map zero pieces, then read-only access per run; all or none. Returns the failed
        call (its name and CUDA's error) after undoing, or None. Records what is mapped."""
        if not pieces:
            return None
        z = self._zero
        assert z is not None
        raw = self._zraw
        done: list[Piece] = []
        fail: tuple[str, Any] | None = None
        for s, n in pieces:
            (err,) = self._cuMemMap(s, n, 0, raw[n], 0)
            if err:
                fail = ("cuMemMap", err)
                break
            done.append((s, n))
        z.add(done)
        if fail is None:
            for lo, hi in runs(done):
                (err,) = self._cuMemSetAccess(lo, hi - lo, self._ro_access, 1)
                if err:
                    fail = ("cuMemSetAccess", err)
                    break
        if fail is not None and done:
            undo = self._z_take(done)
            if undo is not None:
                left = [(s, s + n) for s, n in done if (s, n) in z]
                notes.append(
                    f"undo: {undo[0]} returned {_name(undo[1])}: {len(left)} zero mappings "
                    f"from {left[0][0]:#x} stay mapped, some perhaps without read access"
                )
        return fail

    def _z_reput(self, pieces: list[Piece], notes: list[str]) -> None:
        """``_z_put`` as an undo step: a failure becomes a note (the caller raises the
        original error)."""
        fail = self._z_put(pieces, notes)
        if fail is not None:
            notes.append(f"undo: {fail[0]} returned {_name(fail[1])} while covering "
                         f"{len(pieces)} zero pieces again")

    def _z_take(self, pieces: list[Piece]) -> tuple[str, Any] | None:
        """Unmap zero pieces, one call per run; stop at the first failure (returned, as
        ``_z_put``'s). Records each run that went."""
        z = self._zero
        assert z is not None
        for lo, hi in runs(pieces):
            (err,) = self._cuMemUnmap(lo, hi - lo)
            if err:
                return ("cuMemUnmap", err)
            z.remove([p for p in pieces if lo <= p[0] < hi])
        return None

    def _z_error(self, call: str, args: dict[str, int], fail: tuple[str, Any],
                 notes: list[str]) -> DriverError:
        e = self._cuda_error(call, args, fail[0], fail[1])
        for n in notes:
            e.add_note(n)
        return e

    def _note(self, e: DriverError, notes: list[str], lo: int, hi: int) -> None:
        """Add the undo's notes, and which VA of ``[lo, hi)`` is now left uncovered."""
        for n in notes:
            e.add_note(n)
        z = self._zero
        if z is None:
            return
        holes = [(a, b) for a, b in z.gaps(lo, hi)
                 if not any(s < b and a < s + m.size for s, m in self._maps.items())]
        if holes:
            e.add_note("left uncovered (reading it faults; a map over it works): "
                       + ", ".join(f"[{a:#x}, {b:#x})" for a, b in holes))

    @locked
    def _zp_map(self, va: int, size: int, handle: int) -> None:
        """map with the zero cover on: synchronize, unmap the zero pieces over
        ``[va, va+size)``, re-cover what they covered outside it, map the handle."""
        va, size, handle = check_call_ints("map", va=va, size=size, handle=handle).values()
        args = {"va": va, "size": size, "handle": handle}
        h = self._map_slow(va, size, handle, self._handles.get(handle))
        z = self._zero
        assert z is not None
        end = va + size
        for a, b in z.gaps(va, end):  # a real mapping there, or a hole an undo left
            for s, m in self._maps.items():
                if s < b and a < s + m.size:
                    raise self._refuse("map", args, f"{s:#x} is already mapped there")
        self._synchronize("map", va, size)
        if not h.live:  # released (on the C path, which takes no lock) while we waited
            raise self._refuse("map", args, f"handle {handle} is not live")
        old, new = z.uncover(va, end)
        notes: list[str] = []
        fail = self._z_take(old)
        if fail is None:
            fail = self._z_put(new, notes)
            if fail is None:
                self._maps[va] = h
                h.maps += 1
                (err,) = self._cuMemMap(va, size, 0, h.raw, 0)
                if not err:
                    return
                del self._maps[va]
                h.maps -= 1
                fail = ("cuMemMap", err)
        # Undo: the re-cover out, the old pieces back.
        e = self._z_error("map", args, fail, [])
        undo = self._z_take([p for p in new if p in z])
        if undo is not None:
            notes.append(f"undo: {undo[0]} returned {_name(undo[1])}")
            # The old pieces cannot all go back: cover what is not covered instead.
            lo = old[0][0] if old else va
            hi = old[-1][0] + old[-1][1] if old else end
            for a, b in z.gaps(lo, hi):
                self._z_reput(z.cover(a, b), notes)
        else:
            self._z_reput([p for p in old if p not in z], notes)
        if old:
            self._note(e, notes, old[0][0], old[-1][0] + old[-1][1])
        raise e

    @locked
    def _zp_unmap(self, va: int, size: int, recover: bool = True) -> None:
        """unmap with the zero cover on: unmap, then cover ``[va, va+size)`` read-only (if
        that fails, map the handles back with the access they had)."""
        va, size = check_call_ints("unmap", va=va, size=size).values()
        args = {"va": va, "size": size}
        maps = self._maps
        m = maps.get(va)
        starts = [va] if m is not None and m.size == size else self._tiling("unmap", va, size)
        self._synchronize("unmap", va, size)
        taken = [(s, maps.pop(s)) for s in starts]
        # A released handle's memory goes with its last mapping: hold a reference across
        # the unmap so that an undo can map it back.
        held: list[int] = []
        for s, h in taken:
            if not h.live:
                err, obj = self._cuMemRetainAllocationHandle(s)
                if err:
                    maps.update(taken)
                    self._drop_refs(held)
                    raise self._cuda_error("unmap", args, "cuMemRetainAllocationHandle", err)
                held.append(int(obj))
        (err,) = self._cuMemUnmap(va, size)
        if err:
            maps.update(taken)
            self._drop_refs(held)
            raise self._cuda_error("unmap", args, "cuMemUnmap", err)
        notes: list[str] = []
        z = self._zero
        assert z is not None
        fail = self._z_put(z.cover(va, va + size), notes) if recover else None
        if fail is not None:
            e = self._z_error("unmap", args, fail, [])
            for s, h in taken:  # map the real handles back, with their bytes and access
                (err,) = self._cuMemMap(s, h.size, 0, h.raw, 0)
                if err:
                    notes.append(f"undo: cuMemMap of the handle back at {s:#x} returned "
                                 f"{_name(err)}: that mapping is gone")
                    self._unmapped(h)
                    continue
                maps[s] = h
                (err,) = self._cuMemSetAccess(s, h.size, self._access, 1)
                peers = self._peer_access.get(s)
                if not err and peers is not None:
                    (err,) = self._cuMemSetAccess(s, h.size, peers, len(peers))
                if err:
                    notes.append(f"undo: cuMemSetAccess of the mapping back at {s:#x} "
                                 f"returned {_name(err)}: it is mapped but not accessible")
            self._drop_refs(held)
            self._note(e, notes, va, va + size)
            raise e
        self._drop_refs(held)
        for s, h in taken:
            self._peer_access.pop(s, None)
            self._unmapped(h)

    def _unmapped(self, h: Any) -> None:
        h.maps -= 1
        if not h.maps and not h.live and not h.imported:  # released while mapped: now
            self._b.physical_bytes -= h.size

    def _drop_refs(self, held: list[int]) -> None:
        """Release the references ``cuMemRetainAllocationHandle`` gave."""
        for raw in held:
            self._cuMemRelease(raw)

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
        cover = z.overlapping(va, end) if z is not None else []
        if z is not None and cover:
            # A kernel may still read the cover (a tensor over it dropped before its kernel
            # ended): wait for the device first, as an unmap does.
            self._synchronize("free", va, size)
            notes: list[str] = []
            fail = self._z_take(cover)
            if fail is not None:
                self._z_reput([p for p in cover if p not in z], notes)
                e = self._z_error("free", args, fail, [])
                self._note(e, notes, va, end)
                raise e
        (err,) = _drv.cuMemAddressFree(va, size)
        if err != self._ok:
            e = self._cuda_error("free", args, "cuMemAddressFree", err)
            if cover:
                notes = []
                self._z_reput(cover, notes)
                self._note(e, notes, va, end)
            raise e
        if z is not None:
            z.drop_reservation(va)
        del self._res[va]
        self._res_starts.remove(va)
        self._pins.forget(va)

    @locked
    def create(self, size: int) -> int:
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
    def release(self, handle: int) -> None:
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
    def map(self, va: int, size: int, handle: int) -> None:
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
    def unmap(self, va: int, size: int) -> None:
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

    def _synchronize(self, call: str, va: int, size: int) -> None:
        """Wait for all work in this device's context; refuse while a capture is seen.

        Before an unmap, and (zero cover on) before a map or a free, which unmap zero pieces
        a kernel may be reading.
        """
        done, act = {"map": ("mapped", "Map"), "free": ("freed", "Free")}.get(
            call, ("unmapped", "Unmap"))
        drv = _drv
        err, cur = self._cuCtxGetCurrent()
        pushed = int(cur) != self._ctx_int
        if pushed:  # another context (or none) is current on this thread: sync ours
            drv.cuCtxPushCurrent(self._ctx)
        try:
            capturing = self._capturing()
            if not capturing:
                (err,) = self._cuCtxSynchronize()
        finally:
            if pushed:
                drv.cuCtxPopCurrent()
        if capturing:
            raise driver_error(
                call, {"va": va, "size": size}, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                f"a CUDA graph capture is underway ({capturing}); nothing was {done} and the "
                f"capture is untouched. {act} after the capture ends",
            )
        if err != self._ok:
            raise driver_error(
                call, {"va": va, "size": size}, _name(err),
                f"cuCtxSynchronize before the {call} returned it ({_describe(err)}); nothing "
                f"was {done}",
            )

    def _capturing(self) -> str:
        """Where a capture was seen ('' if none): torch's current stream, or a blocking one.

        Measured on an H200: ``cuCtxSynchronize`` while any stream of the context captures
        fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED *and invalidates the capture*, even
        with the thread's capture mode relaxed. So look first. torch captures on a non-blocking
        stream that it makes current; the legacy stream's query sees blocking streams only.
        A capture on another non-blocking stream is not seen and is invalidated by the sync.
        """
        fn = self._b.capture_check
        if fn is None:
            torch = sys.modules.get("torch")  # only if the process uses torch: never import
            if torch is not None and torch.cuda.is_initialized():
                # torch's current stream on *this driver's* device, as a raw pointer (torch's
                # own is_current_stream_capturing looks at its current device, which may be
                # another); the C fast path calls it too, once it is known.
                raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
                if raw is not None:
                    fn = functools.partial(raw, self.device)
                else:  # an older torch: its current device's stream, as a bool
                    fn = torch.cuda.is_current_stream_capturing
                self._b.capture_check = fn
        if fn is not None:
            got = fn()
            if isinstance(got, bool):
                if got:
                    return "on torch's current stream"
            elif self._stream_capturing(_drv.CUstream(got)):
                return f"on torch's current stream of device {self.device}"
        if self._stream_capturing(self._legacy):
            return "on a blocking stream"
        return ""

    def _stream_capturing(self, stream: Any) -> bool:
        """``cuStreamIsCapturing`` says a capture is underway (or one on a blocking stream
        makes the legacy stream's query implicit); any other error: the synchronize
        reports it."""
        err, status = self._cuStreamIsCapturing(stream)
        return bool(err == self._implicit or (err == self._ok and status != self._capture_none))

    @locked
    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
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

    def _set_access_for(self, va: int, size: int, devices: Sequence[int]) -> None:
        """Set access for each listed device: the peer rules, then one cuMemSetAccess."""
        try:
            key = tuple(devices)
            # Exact ints only: (False,) and (0.0,) equal (0,) as dict keys.
            access = (self._access_lists.get(key)
                      if all(type(d) is int for d in key) else None)
        except TypeError:  # not iterable, or unhashable items: _access_list says why
            access = None
        if access is None:
            access = self._access_list(va, size, devices)
        m = self._maps.get(va)
        starts = [va] if m is not None and m.size == size else self._tiling("set_access", va,
                                                                             size)
        (err,) = self._cuMemSetAccess(va, size, access, len(access))
        if err:
            raise self._cuda_error("set_access", {"va": va, "size": size}, "cuMemSetAccess", err)
        if self._zero is not None:  # what an undo that maps them back must give them again
            for s in starts:
                self._peer_access[s] = access

    def _access_list(self, va: int, size: int, devices: Sequence[int]) -> list[Any]:
        """Check ``devices`` and build (and cache) their CUmemAccessDesc list."""
        if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices:
            raise ArgumentError("devices", devices, "a non-empty sequence of device ordinals")
        args = {"va": va, "size": size}
        n = self._device_count
        devices = [check_call_ints("set_access", device=d)["device"] for d in devices]
        for d in devices:
            if not 0 <= d < n:
                # What raw cuMemSetAccess answers on an H200 for an ordinal it does not have
                # (tests/gpu/test_gpu_peer.py, bench/results/h200-export-peer-1gpu.json).
                raise driver_error(
                    "set_access", args, CUDA_ERROR_INVALID_VALUE,
                    f"device {d!r} is not a device this process sees (0..{n - 1})",
                )
            if d != self.device and not self.can_access_peer(d):
                raise driver_error(
                    "set_access", args, CUDA_ERROR_INVALID_DEVICE,
                    f"device {d} cannot access device {self.device}'s memory "
                    f"(cuDeviceCanAccessPeer({d}, {self.device}) is 0: no NVLink or PCIe "
                    "peer path between them)",
                )
        drv = _drv
        out = []
        for d in dict.fromkeys(devices):  # each device once, in the order given
            acc = drv.CUmemAccessDesc()
            acc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            acc.location.id = d
            acc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            out.append(acc)
        self._access_lists[tuple(devices)] = out
        return out

    # The Python implementations, which the C fast path calls for anything but the common
    # valid case (and which run every call when it is off).
    _py_create = create
    _py_release = release
    _py_map = map
    _py_unmap = unmap
    _py_set_access = set_access

    def can_access_peer(self, device: int) -> bool:
        """``cuDeviceCanAccessPeer(device, this device)``: can ``device`` use our memory?

        False for this device itself (CUDA answers 0 there) and for ordinals out of range.
        Asked once per device, then cached.
        """
        ok = self._peer_ok.get(device)
        if ok is None:
            ok = False
            if device != self.device and 0 <= device < self._device_count:
                err, dev = _drv.cuDeviceGet(device)
                if err == self._ok:
                    err, can = _drv.cuDeviceCanAccessPeer(dev, self._dev)
                    ok = err == self._ok and bool(can)
            self._peer_ok[device] = ok
        return ok

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

    @locked
    def zero_stats(self) -> ZeroCoverStats | None:
        """What the zero cover holds (None when ``zero_page`` is off): its mappings, the VA
        they cover, the device memory of the zero handles, and any reserved VA left neither
        mapped nor covered (0 unless an undo failed). :meth:`stats` leaves all of it out."""
        z = self._zero
        if z is None:
            return None
        real = sum(h.size for h in self._maps.values())
        return ZeroCoverStats(
            block=z.block, piece_sizes=z.sizes, zero_bytes=sum(z.sizes), mappings=len(z),
            covered_bytes=z.covered_bytes,
            uncovered_bytes=sum(self._res.values()) - z.covered_bytes - real,
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
        for raw in self._zraw.values():  # the zero handles last: nothing maps them now
            _drv.cuMemRelease(raw)
        self._zraw = {}
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

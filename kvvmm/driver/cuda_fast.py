"""The C fast path's side in Python, for :class:`~kvvmm.driver.cuda.CudaDriver`.

The hot calls (create, map, set access on this device, unmap, release) run in C when
``kvvmm/driver/_cudafast.c`` is built: it checks the same records in the same dicts as the
Python methods, takes only the common valid case and hands anything else to them
(``CudaDriver._py_*``). Here: the records both paths keep (a handle; the driver's counters),
the lookup of libcuda's entry points C calls, the start of the C path at construction
(whose functions ``CudaDriver`` then takes as its hot calls; ``KVVMM_CUDA_FASTPATH=0`` keeps
them in Python), and the error C raises through. The design is "Cost and the C fast path"
in docs/CUDA_DRIVER.md.

:class:`FastPathMixin` is one of ``CudaDriver``'s bases, not a driver of its own.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvvmm.driver.base import driver_error
from kvvmm.driver.cuda_capture import _cuda
from kvvmm.driver.zerocover import ZeroCover
from kvvmm.errors import DriverError

__all__ = ["FastPathMixin"]



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
# the same answers (tests/driver/test_cudafast.py, tests/gpu/test_gpu_parity.py run both).
try:
    from kvvmm.driver import _cudafast as _cudafast
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

class FastPathMixin:
    """``CudaDriver``'s hand-over of its hot calls to C, and C's way back for CUDA's errors.

    Attributes:
        fast_path: whether the hot calls run in C (``_cudafast``).
    """

    # What this uses of CudaDriver (set by its constructor; declared for the type checker).
    fast_path: bool
    _b: Any  # a _PyBook, or the _cudafast.Fast holding the same counters
    _ctx_int: int
    _prop: Any
    _access: list[Any]
    _gran: int
    _handles: dict[int, Any]
    _maps: dict[int, Any]
    _zero: ZeroCover | None

    if TYPE_CHECKING:  # CudaDriver's own method, which C's errors go through
        def _cuda_error(self, call: str, args: dict[str, int], fn: str,
                        err: Any) -> DriverError: ...

    def _start_fast_path(self) -> Any:
        """Start the C fast path (``_cudafast.Fast``, over this driver's own dicts) when it
        is built and libcuda's entry points are found; return it, or None: the hot calls
        stay in Python (``KVVMM_CUDA_FASTPATH=0`` asks for that). The caller
        (``CudaDriver._choose_hot_calls``) makes its functions the driver's hot calls; the
        ``_py_*`` methods stay the slow path C calls."""
        if _cudafast is None or os.environ.get("KVVMM_CUDA_FASTPATH", "1") == "0":
            return None
        fns = _libcuda_functions()
        if fns is None:
            return None
        # Called from __init__, before any call: the fresh book has nothing to carry over.
        fast = _cudafast.Fast(
            fns, self._ctx_int, int(self._prop.getPtr()), int(self._access[0].getPtr()),
            self._gran, self._handles, self._maps, self, _cudafast.Handle,
        )
        self._b = fast
        self.fast_path = True
        return fast

    def _fast_failed(self, call: str, fn: str, args: tuple[int, ...], err: int) -> None:
        """Raise the DriverError for a CUDA call the C fast path made and CUDA refused."""
        names = {"map": ("va", "size", "handle"), "unmap": ("va", "size"), "create": ("size",),
                 "release": ("handle",), "set_access": ("va", "size")}[call]
        cuda = _cuda()
        res = cuda._drv.CUresult(err)
        kw = dict(zip(names, args, strict=True))
        if fn == "cuCtxSynchronize":
            raise driver_error(
                call, kw, cuda._name(res),
                f"cuCtxSynchronize before the unmap returned it ({cuda._describe(res)}); nothing "
                "was unmapped",
            )
        raise self._cuda_error(call, kw, fn, res)

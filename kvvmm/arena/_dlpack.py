"""Torch tensors over raw addresses through a DLPack capsule built with ctypes: nothing compiled.

``torch.as_tensor`` of a ``__cuda_array_interface__`` refuses VA that is not mapped yet, and
an arena hands out tensors before it backs them; a DLPack capsule is accepted over unmapped
VA, and writes land once the range is mapped.

Lifetime: torch calls the capsule's deleter when the last tensor (or view) over the memory
dies; until then a module-level table keeps the struct, its shape array and the caller's
``owner`` alive. The deleter is a ctypes callback (it takes the GIL), callable from any thread.

dtypes whose DLPack codes differ across torch versions travel as the signed integer of the
same size and are re-viewed with ``Tensor.view(dtype)`` (no copy). torch is imported inside
the functions only.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from typing import TYPE_CHECKING, Any

from kvvmm.checks import is_int
from kvvmm.errors import (
    ArgumentError,
    DriverUnavailableError,
    OutOfRangeError,
    UnknownDtypeError,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DL_CPU", "DL_CUDA", "device_tensor"]

DL_CPU = 1  #: ``kDLCPU``
DL_CUDA = 2  #: ``kDLCUDA``

# DLDataTypeCode
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BOOL = 0, 1, 2, 6


class _DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # NULL: compact row-major
        ("byte_offset", ctypes.c_uint64),
    )


class _DLManagedTensor(ctypes.Structure):
    pass


# The argument is the DLManagedTensor*, taken as a plain address (cheapest to convert).
_DELETER_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DLManagedTensor._fields_ = (
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER_T),
)

#: Address of each live DLManagedTensor -> what must outlive it (struct, shape, owner).
_LIVE: dict[int, tuple[Any, ...]] = {}


def _on_delete(address: int | None) -> None:
    # Called by torch (through ctypes, with the GIL held) when its last tensor goes. Never
    # raise: an exception in a C callback is only printed.
    try:  # noqa: SIM105 - no module lookups here: this may run at interpreter shutdown
        _LIVE.pop(address or 0, None)
    except Exception:  # pragma: no cover
        pass


#: Kept at module level: the C function pointer is valid only while this object lives.
_DELETER = _DELETER_T(_on_delete)

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)
_CAPSULE_NAME = b"dltensor"  # the capsule stores this pointer: a module constant outlives it


def live_capsules() -> int:
    """How many capsules' memory torch still holds (their deleter has not run yet)."""
    return len(_LIVE)


def _dl_code(dtype: torch.dtype) -> tuple[int, int, bool]:
    """``(DLPack code, bits, re-view needed)`` for a torch dtype."""
    import torch

    native = {
        torch.float16: _DL_FLOAT, torch.float32: _DL_FLOAT, torch.float64: _DL_FLOAT,
        torch.int8: _DL_INT, torch.int16: _DL_INT, torch.int32: _DL_INT, torch.int64: _DL_INT,
        torch.uint8: _DL_UINT, torch.bool: _DL_BOOL,
    }
    bits = dtype.itemsize * 8
    code = native.get(dtype)
    if code is not None:
        return code, bits, False
    if dtype.itemsize not in (1, 2, 4, 8) or dtype.is_complex:
        raise UnknownDtypeError(
            "dtype", dtype, "a real dtype of 1, 2, 4 or 8 bytes (bf16, fp8, fp16, fp32, ...)"
        )
    return _DL_INT, bits, True  # bf16, float8_*, uint16/32/64: same-size int, then .view()


def _capsule(
    ptr: int, shape: tuple[int, ...], code: int, bits: int, device_type: int, device_id: int,
    owner: object,
) -> Any:
    """A ``"dltensor"`` capsule over ``ptr``; ``owner`` stays alive until torch deletes it.

    The caller must hand the capsule to ``torch.utils.dlpack.from_dlpack`` (which takes over
    the deleter) or call :func:`_drop` with it on failure.
    """
    ndim = len(shape)
    dims = (ctypes.c_int64 * max(ndim, 1))(*shape)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(
        ptr, _DLDevice(device_type, device_id), ndim, _DLDataType(code, bits, 1),
        ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64)), None, 0,
    )
    managed.deleter = _DELETER
    address = ctypes.addressof(managed)
    _LIVE[address] = (managed, dims, owner)
    return _capsule_new(address, _CAPSULE_NAME, None)


def _tensor(
    ptr: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype, device_type: int,
    device_id: int, owner: object,
) -> torch.Tensor:
    """The tensor over ``[ptr, ptr+nbytes)`` for :func:`device_tensor` (and CPU tests)."""
    import torch.utils.dlpack

    if not isinstance(dtype, torch.dtype):
        raise UnknownDtypeError("dtype", dtype, "a torch.dtype")
    dims = tuple(shape)
    if any(not is_int(d) or d < 0 for d in dims):
        raise ArgumentError("shape", shape, "a tuple of ints >= 0")
    need = math.prod(dims) * dtype.itemsize
    if need > nbytes:
        raise OutOfRangeError(
            "shape", shape,
            f"at most {nbytes} bytes of {dtype} ({nbytes // dtype.itemsize} elements)",
            f"{need} bytes needed",
        )
    if ptr <= 0 and need:
        raise ArgumentError("ptr", ptr, "a non-null address")
    code, bits, review = _dl_code(dtype)
    cap = _capsule(ptr, dims, code, bits, device_type, device_id, owner)
    try:
        t = torch.utils.dlpack.from_dlpack(cap)
    except BaseException:
        _drop(cap)
        raise
    return t.view(dtype) if review else t


def _drop(cap: Any) -> None:
    """Forget a capsule torch never took (its deleter will not run)."""
    # A ValueError means the capsule was renamed "used_dltensor": torch took it and owns
    # the deleter.
    with contextlib.suppress(ValueError):
        _LIVE.pop(_capsule_pointer(cap, _CAPSULE_NAME) or 0, None)


def device_tensor(
    ptr: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype, device_index: int,
    owner: object,
) -> torch.Tensor:
    """A CUDA tensor over device VA ``[ptr, ptr+nbytes)``, zero copy, nothing compiled.

    The VA need not be mapped yet (touch only what is mapped and accessible).

    Args:
        ptr: device virtual address of element 0.
        nbytes: bytes the tensor may span from ``ptr``; ``shape`` must fit in them.
        shape: tensor shape (compact, row-major).
        dtype: any real torch dtype of 1, 2, 4 or 8 bytes (bf16 and fp8 included).
        device_index: CUDA device ordinal the VA is accessible from.
        owner: kept alive until the last tensor or view over this memory is gone.
    Returns:
        The tensor, on ``cuda:<device_index>``.
    Raises:
        OutOfRangeError: ``shape`` needs more than ``nbytes``.
        UnknownDtypeError: a dtype DLPack cannot carry (complex, sub-byte).
        ArgumentError: a bad shape or a null pointer.
        DriverUnavailableError: this torch build has no CUDA.
    """
    import torch

    if torch.version.cuda is None:
        # a CPU build would fail inside from_dlpack, the deleter running with an error pending
        raise DriverUnavailableError(
            f"torch {torch.__version__} is built without CUDA: it cannot hold device memory"
        )
    return _tensor(ptr, nbytes, shape, dtype, DL_CUDA, device_index, owner)

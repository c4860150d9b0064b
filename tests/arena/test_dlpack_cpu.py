"""The DLPack capsule of ``kvvmm.arena._dlpack``, proven on the CPU.

The GPU path (``device_tensor``) builds the very same capsule with device type kDLCUDA; here it
is built with kDLCPU over a ctypes buffer, so aliasing, lifetime and dtype handling are tested
on every machine. ``tests/gpu/test_dlpack.py`` repeats the essentials on a GPU.
"""

from __future__ import annotations

import ctypes
import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from kvvmm.arena import _dlpack  # noqa: E402
from kvvmm.errors import (  # noqa: E402
    ArgumentError,
    DriverUnavailableError,
    OutOfRangeError,
    UnknownDtypeError,
)

NBYTES = 4096


class Owner:
    """Stands in for the arena's keeper: something the tensor must keep alive."""


@pytest.fixture
def buf() -> ctypes.Array[ctypes.c_uint8]:
    return (ctypes.c_uint8 * NBYTES)()


def cpu_tensor(buf: ctypes.Array[ctypes.c_uint8], shape: tuple[int, ...], dtype: object,
               owner: object = None, offset: int = 0) -> torch.Tensor:
    return _dlpack._tensor(ctypes.addressof(buf) + offset, NBYTES - offset, shape, dtype,
                           _dlpack.DL_CPU, 0, owner)


def test_the_tensor_aliases_the_memory_it_was_built_over(buf: ctypes.Array[ctypes.c_uint8]):
    t = cpu_tensor(buf, (16, 4), torch.int32)
    assert t.data_ptr() == ctypes.addressof(buf)
    assert t.shape == (16, 4) and t.dtype == torch.int32 and t.device.type == "cpu"
    t[0, 0] = 0x01020304
    assert bytes(buf[:4]) == b"\x04\x03\x02\x01"
    buf[4] = 7
    assert t[0, 1].item() == 7


def test_a_tensor_at_an_offset_starts_there(buf: ctypes.Array[ctypes.c_uint8]):
    t = cpu_tensor(buf, (8,), torch.uint8, offset=256)
    t.fill_(9)
    assert list(buf[255:265]) == [0] + [9] * 8 + [0]


def test_the_owner_lives_while_the_tensor_or_a_view_of_it_lives(
    buf: ctypes.Array[ctypes.c_uint8],
):
    owner = Owner()
    gone = weakref.ref(owner)
    before = _dlpack.live_capsules()
    t = cpu_tensor(buf, (64,), torch.float32, owner)
    del owner
    gc.collect()
    assert gone() is not None
    view = t[8:16].view(2, 4)
    del t
    gc.collect()
    assert gone() is not None, "a view keeps the memory, so the owner must stay"
    assert _dlpack.live_capsules() == before + 1
    del view
    gc.collect()
    assert gone() is None, "the owner is released once the last view is gone"
    assert _dlpack.live_capsules() == before


def test_the_owner_is_released_without_a_garbage_collection(
    buf: ctypes.Array[ctypes.c_uint8],
):
    owner = Owner()
    gone = weakref.ref(owner)
    t = cpu_tensor(buf, (4,), torch.int64, owner)
    del owner
    del t  # refcounting alone must run the deleter
    assert gone() is None


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float16"])
def test_bf16_and_fp8_tensors_reinterpret_the_bytes(
    buf: ctypes.Array[ctypes.c_uint8], name: str
):
    dtype = getattr(torch, name)
    t = cpu_tensor(buf, (4, 8), dtype)
    assert t.dtype == dtype and t.shape == (4, 8)
    assert t.data_ptr() == ctypes.addressof(buf)
    t[0, 0] = 1.0
    expected = torch.tensor([1.0], dtype=dtype).view(torch.uint8).tolist()
    assert list(buf[: dtype.itemsize]) == expected


@pytest.mark.parametrize("name", ["float32", "float64", "int8", "int16", "int64", "uint8",
                                  "bool", "uint16", "uint32"])
def test_other_real_dtypes_round_trip(buf: ctypes.Array[ctypes.c_uint8], name: str):
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    t = cpu_tensor(buf, (2, 3), dtype)
    assert t.dtype == dtype and t.shape == (2, 3)
    assert t.data_ptr() == ctypes.addressof(buf)


def test_a_zero_dimensional_tensor_has_one_element(buf: ctypes.Array[ctypes.c_uint8]):
    buf[0] = 42
    t = cpu_tensor(buf, (), torch.uint8)
    assert t.shape == () and t.item() == 42


def test_a_shape_larger_than_the_bytes_is_refused_and_leaks_nothing(
    buf: ctypes.Array[ctypes.c_uint8],
):
    before = _dlpack.live_capsules()
    with pytest.raises(OutOfRangeError, match="4096 bytes"):
        cpu_tensor(buf, (NBYTES // 4 + 1,), torch.float32)
    assert _dlpack.live_capsules() == before


def test_bad_shapes_and_dtypes_are_refused(buf: ctypes.Array[ctypes.c_uint8]):
    with pytest.raises(ArgumentError):
        cpu_tensor(buf, (-1,), torch.float32)
    with pytest.raises(UnknownDtypeError):
        cpu_tensor(buf, (2,), torch.complex64)
    with pytest.raises(UnknownDtypeError):
        cpu_tensor(buf, (2,), "float32")


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch build")
def test_a_device_tensor_on_a_cpu_only_torch_says_why(buf: ctypes.Array[ctypes.c_uint8]):
    before = _dlpack.live_capsules()
    with pytest.raises(DriverUnavailableError, match="without CUDA"):
        _dlpack.device_tensor(ctypes.addressof(buf), NBYTES, (4,), torch.float32, 0, Owner())
    assert _dlpack.live_capsules() == before


def test_importing_the_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, kvvmm.arena._dlpack; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

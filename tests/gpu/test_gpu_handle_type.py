"""CudaDriver's handle-type probe on a real card: what SGLang 0.5.23 picks, kvvmm picks.

Whether this card takes FABRIC handles is asked of CUDA directly here (cuda-python, no kvvmm:
a ``cuMemCreate`` of one recommended granule with ``CU_MEM_HANDLE_TYPE_FABRIC``), then:
``handle_type="auto"`` must get FABRIC exactly where CUDA takes it and POSIX fd otherwise (a
single H200, no NVLink fabric: POSIX fd), with the granularities of that type;
``handle_type="fabric"`` must be refused with a DriverError naming the type where CUDA refuses
it, and work where it takes it; and the handles ``"auto"`` made must still export and import.
What CUDA answered is written to ``$OUT/handle_type.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import gc
import json
import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvvmm.driver.base import CUDA_ERROR_NOT_SUPPORTED  # noqa: E402
from kvvmm.driver.cuda import CudaDriver  # noqa: E402
from kvvmm.errors import DriverError  # noqa: E402

pytestmark = pytest.mark.usefixtures("needs_torch_cuda")

ANSWERS: dict[str, Any] = {}


def _record(name: str, value: Any) -> None:
    ANSWERS[name] = value
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "handle_type.json"), "w") as f:
            json.dump(ANSWERS, f, indent=1, sort_keys=True)


def _raw_fabric_answer() -> str:
    """CUDA's own answer to a FABRIC create of one recommended granule on device 0."""
    from cuda.bindings import driver as drv

    torch.empty(1, device="cuda")  # the primary context, current
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    err, gran = drv.cuMemGetAllocationGranularity(prop, flag)
    if err == drv.CUresult.CUDA_SUCCESS:
        err, raw = drv.cuMemCreate(int(gran), prop, 0)
        if err == drv.CUresult.CUDA_SUCCESS:
            drv.cuMemRelease(raw)
            return "ok"
    return str(err.name)


@pytest.fixture(scope="module")
def fabric_answer() -> str:
    answer = _raw_fabric_answer()
    _record("raw cuMemCreate, CU_MEM_HANDLE_TYPE_FABRIC, one recommended granule", answer)
    _record("gpu", torch.cuda.get_device_name(0))
    return answer


def test_auto_gets_fabric_exactly_where_cuda_takes_it_else_posix_fd(fabric_answer: str) -> None:
    d = CudaDriver(handle_type="auto")
    try:
        _record("auto: handle_type", d.handle_type)
        _record("auto: probe", [list(p) for p in d.handle_type_probe])
        assert d.handle_type_probe[0] == ("fabric", fabric_answer)
        if fabric_answer == "ok":
            assert d.handle_type == "fabric" and len(d.handle_type_probe) == 1
        else:  # a single H200: no NVLink fabric
            assert d.handle_type == "posix_fd" and d.exportable
            assert d.handle_type_probe[1] == ("posix_fd", "ok")
        assert f"handle_type={d.handle_type!r}" in repr(d)
        assert d.granularity_recommended % d.granularity_min == 0
    finally:
        d.close()


def test_fabric_asked_for_is_refused_naming_it_or_works(fabric_answer: str) -> None:
    if fabric_answer != "ok":
        with pytest.raises(DriverError) as info:
            CudaDriver(handle_type="fabric")
        err = info.value
        _record("fabric asked for: refusal", str(err))
        assert err.cuda_error == fabric_answer and "handle_type='fabric'" in str(err)
        assert any("IMEX" in n for n in err.__notes__)
        return
    d = CudaDriver(handle_type="fabric")
    try:
        g = d.granularity()
        va = d.reserve(4 * g)
        h = d.create(g)
        d.map(va, g, h)
        d.set_access(va, g)
        with pytest.raises(DriverError) as info:
            d.export_handle(h)  # a CUmemFabricHandle is no descriptor: refused, typed
        assert info.value.cuda_error == CUDA_ERROR_NOT_SUPPORTED
        assert "handle_type='fabric'" in str(info.value)
        d.unmap(va, g)
        d.release(h)
        d.free(va, 4 * g)
        assert d.stats().clean
    finally:
        d.close()


def test_the_handles_auto_makes_still_export_and_import(fabric_answer: str) -> None:
    if fabric_answer == "ok":
        pytest.skip("auto gets FABRIC here: export_handle refuses it (the test above)")
    d = CudaDriver(handle_type="auto")
    plain = CudaDriver()  # importing needs no shareable handles of its own
    try:
        g = d.granularity()
        va, vb = d.reserve(2 * g), plain.reserve(2 * g)
        h = d.create(g)
        d.map(va, g, h)
        d.set_access(va, g)
        h2 = plain.import_handle(d.export_handle(h), g)
        plain.map(vb, g, h2)
        plain.set_access(vb, g)
        from kvvmm.arena._dlpack import device_tensor

        a = device_tensor(va, g, (g,), torch.uint8, 0, object())
        b = device_tensor(vb, g, (g,), torch.uint8, 0, object())
        a[:4] = torch.tensor([5, 6, 7, 8], dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        assert b[:4].tolist() == [5, 6, 7, 8], "the import does not alias the export"
        del a, b
        gc.collect()
        plain.unmap(vb, g)
        plain.release(h2)
        plain.free(vb, 2 * g)
        d.unmap(va, g)
        d.release(h)
        d.free(va, 2 * g)
        assert d.stats().clean and plain.stats().clean
    finally:
        plain.close()
        d.close()


def test_a_plain_driver_probes_nothing_and_says_none() -> None:
    d = CudaDriver()
    try:
        assert d.handle_type == "none" and d.handle_type_probe == () and not d.exportable
    finally:
        d.close()

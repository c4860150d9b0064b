"""vLLM 0.34's own ExtensibleTensor over kvvmm's CudaDriver, side by side with vLLM's own
CudaVmmDriver on the same GPU: the same granules, bytes, pointers and refusals.

vLLM's files come from ``../shared/reference/vllm-0.34.0`` (``KVVMM_VLLM_DIR``), loaded as
``tests/integrations/test_vllm_reference.py`` loads them (its logger stood in for; nothing of
torch: a GPU is here). Skipped without them or without a GPU.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
from integrations.test_vllm_reference import vllm_dir, vllm_loaded

from kvvmm.integrations import vllm as kv

MiB = 1 << 20
STEPS = (1, 3 * MiB, 3 * MiB + 1, 9 * MiB, 16 * MiB)


def observe(v: types.SimpleNamespace) -> dict[str, Any]:
    """Grow vLLM's tensor through whatever driver its factory gives now; what it saw."""
    import torch

    et = v.extensible_tensor.ExtensibleTensor(64 * MiB, "cuda:0", num_segments=4)
    base, seen = et.base_ptr, []
    old = 0
    kept: list[torch.Tensor] = []
    for n in STEPS:
        et.resize_per_segment_(n, zero_new=True)
        views = [et.segment_view(i) for i in range(4)]
        for i, view in enumerate(views):
            assert view.data_ptr() == base + et.segment_offsets[i]
            if kept:
                assert torch.equal(view[:old], kept[i])  # kept across growth
            assert not view[old:].any()  # vLLM zeroes what it adds
            view[old:] = (i + n) % 251
        kept = [view.clone() for view in views]
        torch.cuda.synchronize()
        seen.append((sorted(et._buffer._mapped_granules), et.physical_bytes,
                     et.num_physical_chunks, et.base_ptr == base))
        old = n
    et.release_physical()
    et.resize_per_segment_(2 * MiB)
    assert not et.segment_view(0).any()  # vLLM recommits zeros after its release
    et.free()
    return {"steps": seen, "granularity": et.granularity}


def refusal(driver: Any) -> str:
    with pytest.raises(RuntimeError) as e:
        driver.create(1 << 50, 0)  # a petabyte: out of memory on any card
    return str(e.value).split(" (")[0]


def test_vllms_tensor_over_cudadriver_answers_as_over_vllms_own_cuda_driver() -> None:
    import torch

    from kvvmm.driver.cuda import CudaDriver

    with vllm_loaded(vllm_dir()) as v:
        torch.cuda.init()
        own = observe(v)
        own_refusal = refusal(v.vmm_driver.get_vmm_driver())
        d = CudaDriver(granularity="minimum")
        try:
            adapter = kv.install(d)
            assert v.extensible_tensor.get_vmm_driver() is adapter
            assert adapter.dlpack_device_type == v.vmm_driver.CudaVmmDriver.dlpack_device_type
            ours = observe(v)
            assert ours == own
            assert refusal(adapter) == own_refusal == "GPU driver error 2: out of memory"
            assert v.vmm_driver.vmm_unavailable_reason() is None  # vLLM's own probe
            assert d.stats().clean
        finally:
            kv.uninstall()
            d.close()


def test_kv_bytes_survive_sleep_and_wake_on_the_gpu_under_vllms_tensor() -> None:
    import torch

    from kvvmm.driver.cuda import CudaDriver

    with vllm_loaded(vllm_dir()) as v:
        d = CudaDriver(granularity="minimum")
        try:
            adapter = kv.install(d)
            et = v.extensible_tensor.ExtensibleTensor(64 * MiB, "cuda:0", num_segments=2)
            et.resize_per_segment_(9 * MiB)
            for i in range(2):
                et.segment_view(i).copy_(torch.randint(0, 255, (9 * MiB,), dtype=torch.uint8,
                                                       device="cuda"))
            before = [et.segment_view(i).clone() for i in range(2)]
            free0 = torch.cuda.mem_get_info()[0]
            adapter.sleep()
            # Given back to the device, less what pinning the host backup costs it (0.19%).
            gained = torch.cuda.mem_get_info()[0] - free0
            assert gained >= et.physical_bytes - et.physical_bytes // 100
            adapter.wake()
            assert all(torch.equal(et.segment_view(i), before[i]) for i in range(2))
            et.free()
            assert d.stats().clean
        finally:
            kv.uninstall()
            d.close()

"""One physical allocation per segment, contents kept, under vLLM 0.34's own ExtensibleTensor.

RDMA registration needs each segment in one allocation; vLLM's own remap drops the bytes. The
adapter's ``consolidate`` keeps them, the VA and vLLM's handle ids, as one transaction.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
from integrations.conftest import contents

from kvvmm.driver.faults import Fault, FaultyDriver
from kvvmm.errors import ArgumentError, AsleepError, DriverError, DriverOutOfMemoryError
from kvvmm.integrations import vllm as kv
from kvvmm.units import MiB


def grown(v: types.SimpleNamespace, *, fill: bool = True) -> Any:
    """vLLM's two-segment tensor, each segment grown in three steps (three chunks each)."""
    import torch

    et = v.extensible_tensor.ExtensibleTensor(64 * MiB, "cuda:0", num_segments=2)
    for nbytes in (2 * MiB, 6 * MiB, 10 * MiB):
        et.resize_per_segment_(nbytes)
    if fill:
        for i in range(2):
            view = et.segment_view(i)
            view.copy_((torch.arange(view.numel()) * (i + 5) % 253).to(torch.uint8))
    return et


def segments(et: Any) -> list[tuple[int, int]]:
    return [(off, et.bytes_per_segment) for off in et.segment_offsets]


def test_a_consolidated_segment_is_one_allocation_with_its_bytes_and_vllm_carries_on(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    import torch

    host = make_driver("host")
    adapter = kv.install(host)
    et = grown(vllm)
    before, ptr = contents(et), et.segment_view(0).data_ptr()
    assert [b.allocations for b in adapter.backing(et.base_ptr, segments(et))] == [3, 3]
    after = adapter.consolidate(et.base_ptr, segments(et)[0])
    assert after.allocations == 1 and after.rdma_ready
    assert [b.allocations for b in adapter.backing(et.base_ptr, segments(et))] == [1, 3]
    assert host.stats().handles == 4 and host.stats().physical_bytes == et.physical_bytes
    assert et.segment_view(0).data_ptr() == ptr
    assert all(torch.equal(a, b) for a, b in zip(before, contents(et), strict=True))
    assert adapter.consolidate(et.base_ptr, segments(et)[0]) == after  # already one
    et.resize_per_segment_(14 * MiB, zero_new=True)  # vLLM grows it again ...
    assert torch.equal(et.segment_view(0)[:10 * MiB], before[0])
    assert adapter.consolidate(et.base_ptr, segments(et)[0]).allocations == 1  # ... and again
    assert torch.equal(et.segment_view(0)[:10 * MiB], before[0])
    adapter.sleep()
    adapter.wake()
    assert torch.equal(et.segment_view(1)[:10 * MiB], before[1])
    assert adapter.backing(et.base_ptr, segments(et))[0].allocations == 1
    et.free()  # vLLM unmaps and releases its own (still valid) ids, chunk by chunk
    assert host.stats().clean


def test_every_single_driver_fault_in_a_consolidation_leaves_bytes_and_mappings_as_before(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    import torch

    host = make_driver("host")
    faulty = FaultyDriver(host)
    adapter = kv.install(faulty)
    learn = grown(vllm, fill=False)  # the driver calls one consolidation makes
    n = len(faulty.calls)
    adapter.consolidate(learn.base_ptr, segments(learn)[1])
    seen = faulty.calls[n:]
    learn.free()
    et = grown(vllm)
    before, snap, handles = contents(et), adapter.snapshot(et.base_ptr), host.stats().handles
    steps = [(c, k) for c in dict.fromkeys(seen) if c != "release"
             for k in range(1, seen.count(c) + 1)]
    assert {c for c, _ in steps} >= {"create", "unmap", "map", "set_access"}
    for call, nth in steps:
        faulty.arm(Fault(call, nth=nth, error="CUDA_ERROR_UNKNOWN"))
        with pytest.raises(DriverError):
            adapter.consolidate(et.base_ptr, segments(et)[1])
        faulty.disarm()
        assert adapter.snapshot(et.base_ptr) == snap, (call, nth)
        assert host.stats().handles == handles, (call, nth)
        assert all(torch.equal(a, b) for a, b in zip(before, contents(et), strict=True))
    et.free()
    assert host.stats().clean


def test_a_failed_release_of_an_old_chunk_keeps_the_consolidation_and_free_retries_it(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    import torch

    host = make_driver("host")
    faulty = FaultyDriver(host)
    adapter = kv.install(faulty)
    et = grown(vllm)
    before = contents(et)
    faulty.arm(Fault("release", nth=2))
    with pytest.raises(DriverError):
        adapter.consolidate(et.base_ptr, segments(et)[0])
    faulty.disarm()
    assert adapter.backing(et.base_ptr, segments(et))[0].allocations == 1
    assert all(torch.equal(a, b) for a, b in zip(before, contents(et), strict=True))
    assert host.stats().handles == 1 + 2 + 3  # the new one, two old ones kept, segment 1's
    adapter.consolidate(et.base_ptr, segments(et)[1])  # retries the release first
    assert host.stats().handles == 2
    assert all(torch.equal(a, b) for a, b in zip(before, contents(et), strict=True))
    et.free()
    assert host.stats().clean


def test_no_room_for_the_copy_is_a_typed_refusal_naming_the_bytes(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    host = make_driver("host")
    faulty = FaultyDriver(host)
    adapter = kv.install(faulty)
    et = grown(vllm, fill=False)
    snap = adapter.snapshot(et.base_ptr)
    faulty.arm(Fault("create"))
    with pytest.raises(DriverOutOfMemoryError) as e:
        adapter.consolidate(et.base_ptr, segments(et)[0])
    assert str(10 * MiB) in " ".join(e.value.__notes__)
    faulty.disarm()
    assert adapter.snapshot(et.base_ptr) == snap
    et.free()
    assert host.stats().clean


def test_consolidation_is_refused_while_asleep_and_for_segments_not_wholly_mapped(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    host = make_driver("host")
    adapter = kv.install(host)
    et = grown(vllm, fill=False)
    snap = adapter.snapshot(et.base_ptr)
    off = et.segment_offsets[0]
    for bad in [(off, 12 * MiB), (off + 2 * MiB, 6 * MiB), (off, 0), (off, -1), "x",
                (et.capacity_bytes, 2 * MiB)]:
        with pytest.raises(ArgumentError):
            adapter.consolidate(et.base_ptr, bad)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError):
        adapter.consolidate(12345, (0, 2 * MiB))
    assert adapter.snapshot(et.base_ptr) == snap
    adapter.sleep()
    with pytest.raises(AsleepError):
        adapter.consolidate(et.base_ptr, segments(et)[0])
    adapter.wake()
    assert adapter.snapshot(et.base_ptr) == snap
    et.free()
    assert host.stats().clean


def test_on_the_simulator_it_remaps_with_nothing_to_keep(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    sim = make_driver("sim")
    adapter = kv.install(sim)
    et = grown(vllm, fill=False)
    assert adapter.consolidate(et.base_ptr, segments(et)[1]).allocations == 1
    et.free()
    assert sim.stats().clean


def test_after_a_consolidation_a_chunks_id_maps_nowhere_else_and_unmaps_whole_chunks_only(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    host = make_driver("host")
    adapter = kv.install(host)
    et = grown(vllm, fill=False)
    adapter.consolidate(et.base_ptr, segments(et)[0])
    snap, stats = adapter.snapshot(et.base_ptr), host.stats()
    hid, off, size = et._buffer._handles[0]
    spare = et.base_ptr + et.segment_offsets[1] + 20 * MiB
    with pytest.raises(RuntimeError, match=r"^GPU driver error 1:.*consolidated segment"):
        adapter.map(spare, size, hid)
    for ptr, n in [(et.base_ptr + off, size + 2 * MiB), (et.base_ptr + off + 2 * MiB, size)]:
        with pytest.raises(RuntimeError, match=r"^GPU driver error 1:"):
            adapter.unmap(ptr, n)
    assert adapter.snapshot(et.base_ptr) == snap and host.stats() == stats
    adapter.unmap(et.base_ptr + off, size)  # one chunk: the segment's memory stays mapped
    assert host.stats().physical_bytes == stats.physical_bytes
    assert adapter.backing(et.base_ptr, segments(et))[0].allocations == 1
    et._buffer._handles.pop(0)
    adapter.release(hid)
    et.free()
    assert host.stats().clean

"""Sleep that keeps the KV contents, under vLLM 0.34's own ExtensibleTensor (host driver).

vLLM's own sleep drops the KV pages and recommits zeros; the adapter's ``sleep`` / ``wake``
give every physical byte back and map new memory at the same VA under the same handle ids,
with the bytes copied back, so vLLM's views, pointers and handle records stay true.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
from integrations.conftest import contents

from kvvmm.driver.faults import Fault, FaultyDriver
from kvvmm.errors import AsleepError, DriverError, SleepRefusedError
from kvvmm.integrations import vllm as kv
from kvvmm.units import MiB


def filled(v: types.SimpleNamespace, nbytes: int, segments: int = 2) -> Any:
    """vLLM's tensor of ``segments`` segments grown to ``nbytes`` each, every byte written."""
    import torch

    et = v.extensible_tensor.ExtensibleTensor(32 * MiB * segments, "cuda:0",
                                              num_segments=segments)
    et.resize_per_segment_(nbytes)
    for i in range(segments):
        view = et.segment_view(i)
        view.copy_((torch.arange(view.numel()) * (i + 3) % 251).to(torch.uint8))
    return et


def test_kv_bytes_are_equal_after_sleep_and_wake_under_vllms_tensor(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    import torch

    host = make_driver("host")
    adapter = kv.install(host)
    et = filled(vllm, 5 * MiB)
    et.resize_per_segment_(9 * MiB)  # two chunks per segment: growth before the sleep
    before, chunks = contents(et), et.num_physical_chunks
    views = [et.segment_view(i) for i in range(2)]  # made before the sleep, read after
    res = adapter.sleep()
    assert (res.mappings, res.backup, res.pool_bytes) == (chunks, "host", 0)
    assert res.given_bytes == res.backup_bytes == et.physical_bytes
    assert host.stats().physical_bytes == 0 and host.stats().reservations == 1
    assert not et.segment_view(0).any()  # asleep: the host driver shows zeros
    assert adapter.wake() == et.physical_bytes
    assert all(torch.equal(a, b) for a, b in zip(before, contents(et), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, views, strict=True))
    del views
    # vLLM carries on: grows, keeps the bytes, releases its (same) handle ids, frees.
    et.resize_per_segment_(20 * MiB, zero_new=True)
    assert torch.equal(et.segment_view(1)[:9 * MiB], before[1])
    et.free()
    assert host.stats().clean


def test_the_snapshot_shows_where_a_wake_maps_the_memory_again(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    from kvvmm.viz import va_map

    adapter = kv.install(make_driver("host"))
    et = filled(vllm, 3 * MiB)
    awake = adapter.snapshot(et.base_ptr)
    adapter.sleep(backup=None)
    asleep = adapter.snapshot(et.base_ptr)
    assert asleep.mappings == () and asleep.backed_bytes == 0
    assert asleep.asleep_mappings == awake.mappings and asleep.asleep_bytes == awake.backed_bytes
    assert adapter.snapshot(et.base_ptr).asleep_bytes
    va_map(asleep)  # the lab draws it
    adapter.wake()
    assert adapter.snapshot(et.base_ptr) == awake
    assert not et.segment_view(0).any()  # backup=None: the contents were dropped
    et.free()


def test_vllms_calls_on_a_sleeping_reservation_are_refused_and_leave_nothing(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    host = make_driver("host")
    adapter = kv.install(host)
    et = filled(vllm, 3 * MiB)
    adapter.sleep()
    with pytest.raises(RuntimeError, match=r"^GPU driver error 800: operation not permitted") as e:
        et.resize_per_segment_(7 * MiB)
    assert isinstance(e.value, AsleepError)
    assert host.stats().handles == 0  # vLLM released the handle its refused map left
    for call in (et.release_physical, et.free):
        with pytest.raises(RuntimeError, match="error 800"):
            call()
    with pytest.raises(SleepRefusedError):
        adapter.sleep()
    adapter.wake()
    with pytest.raises(SleepRefusedError):
        adapter.wake([et.base_ptr])
    et._buffer._freed = False  # vLLM marked its buffer freed before the refused release
    et.free()
    assert host.stats().clean


def test_a_failed_wake_leaves_it_asleep_with_its_backup_and_a_retry_brings_the_bytes(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    import torch

    host = make_driver("host")
    faulty = FaultyDriver(host)
    adapter = kv.install(faulty)
    et = filled(vllm, 5 * MiB)
    et.resize_per_segment_(9 * MiB)
    before = contents(et)
    adapter.sleep()
    faulty.arm(Fault("create", nth=3))
    with pytest.raises(DriverError):
        adapter.wake()
    assert adapter.snapshot(et.base_ptr).asleep_bytes and host.stats().handles == 0
    faulty.disarm()
    adapter.wake()
    assert all(torch.equal(a, b) for a, b in zip(before, contents(et), strict=True))
    et.free()
    assert host.stats().clean


def test_a_failed_unmap_in_a_sleep_maps_everything_back_with_its_bytes(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    import torch

    host = make_driver("host")
    faulty = FaultyDriver(host)
    adapter = kv.install(faulty)
    et = filled(vllm, 9 * MiB)
    before, snap = contents(et), adapter.snapshot(et.base_ptr)
    faulty.arm(Fault("unmap", nth=2))
    with pytest.raises(DriverError):
        adapter.sleep()
    assert not adapter.snapshot(et.base_ptr).asleep_bytes and adapter.snapshot(et.base_ptr) == snap
    assert all(torch.equal(a, b) for a, b in zip(before, contents(et), strict=True))
    et.free()
    assert host.stats().clean


def test_sleep_takes_known_reservations_only(vllm: types.SimpleNamespace,
                                             make_driver: Any) -> None:
    adapter = kv.install(make_driver("sim"))
    from kvvmm.errors import ArgumentError

    for bad in ([12345], "x", 7):
        with pytest.raises(ArgumentError):
            adapter.sleep(bad)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError):
        adapter.snapshot(0)


def test_a_reservation_with_nothing_mapped_sleeps_and_wakes_and_an_empty_pick_makes_no_file(
        vllm: types.SimpleNamespace, make_driver: Any, tmp_path: Any) -> None:
    host = make_driver("host")
    adapter = kv.install(host)
    et = vllm.extensible_tensor.ExtensibleTensor(16 * MiB, "cuda:0")
    res = adapter.sleep(backup="disk", path=tmp_path / "kv.bin")
    assert (res.mappings, res.given_bytes) == (0, 0)
    assert adapter.wake() == 0 and not (tmp_path / "kv.bin").exists()
    assert adapter.sleep([], backup="disk", path=tmp_path / "none.bin").mappings == 0
    assert not (tmp_path / "none.bin").exists()
    et.free()
    assert host.stats().clean


@pytest.mark.parametrize("kind", ["host", "sim"])
def test_a_disk_backup_brings_the_bytes_back_and_goes_with_the_wake(
        vllm: types.SimpleNamespace, make_driver: Any, tmp_path: Any, kind: str) -> None:
    import torch

    inner = make_driver(kind)
    adapter = kv.install(inner)
    et = vllm.extensible_tensor.ExtensibleTensor(32 * MiB, "cuda:0", num_segments=2)
    et.resize_per_segment_(5 * MiB)
    if kind == "host":
        et.segment_view(1).fill_(9)
    res = adapter.sleep(backup="disk", path=tmp_path / "kv.bin")
    assert res.backup == "disk" and inner.stats().physical_bytes == 0
    assert adapter.wake([et.base_ptr]) == et.physical_bytes == inner.stats().physical_bytes
    assert not (tmp_path / "kv.bin").exists()
    if kind == "host":
        assert torch.equal(et.segment_view(1), torch.full((5 * MiB,), 9, dtype=torch.uint8))
    et.free()
    assert inner.stats().clean

"""vLLM 0.34's own ExtensibleTensor over kvvmm's host and sim drivers, through the adapter.

vLLM's ``vmm_driver.py`` and ``extensible_tensor.py`` run unchanged (loaded from
``../shared/reference``: see ``test_vllm_reference.py`` for what is stood in for), with
``kvvmm.integrations.vllm.install`` behind their factory. What vLLM expects of its driver is
checked against what kvvmm's driver holds: the granules vLLM counts committed are the ones
mapped, the bytes it counts physical are the driver's, pointers do not move as it grows, the
bytes written through its views are kept across growth (and zeroed after its release, as vLLM
recommits zeros), and every refusal reaches vLLM as the RuntimeError its CudaVmmDriver raises.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from kvvmm.driver.faults import Fault, FaultyDriver
from kvvmm.driver.wrapper import DriverWrapper
from kvvmm.errors import ArgumentError, DriverError, DriverOutOfMemoryError
from kvvmm.integrations import vllm as kv
from kvvmm.record.tracing import TracingDriver
from kvvmm.units import MiB
from kvvmm.viz import describe

G = 2 * MiB


def granules_of(snapshot: Any, granule: int) -> set[int]:
    """The granule indices kvvmm's mappings cover."""
    return {g for m in snapshot.mappings
            for g in range(m.offset // granule, m.end // granule)}


def expected_granules(offsets: list[int], committed: list[int], granule: int) -> set[int]:
    """The granules a segment's committed prefix needs, as vLLM's docstring states them."""
    return {g for off, n in zip(offsets, committed, strict=True) if n
            for g in range(off // granule, -(-(off + n) // granule))}


def test_install_puts_the_adapter_behind_vllms_factory_and_the_names_bound_to_it(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    original = vllm.vmm_driver.get_vmm_driver
    adapter = kv.install(make_driver("sim"))
    assert vllm.vmm_driver.get_vmm_driver() is adapter
    assert vllm.extensible_tensor.get_vmm_driver() is adapter  # bound by name at its import
    again = kv.install(make_driver("sim"))  # installing again replaces the adapter
    assert vllm.extensible_tensor.get_vmm_driver() is again
    assert kv.uninstall() and not kv.uninstall()
    assert vllm.vmm_driver.get_vmm_driver is original
    assert vllm.extensible_tensor.get_vmm_driver is original


@pytest.mark.parametrize("kind", ["host", "sim"])
def test_vllms_tensor_grows_over_kvvmm_with_the_granules_bytes_and_pointers_vllm_counts(
        vllm: types.SimpleNamespace, make_driver: Any, kind: str) -> None:
    inner = make_driver(kind)
    traced = TracingDriver(inner)
    adapter = kv.install(traced)
    et = vllm.extensible_tensor.ExtensibleTensor(64 * MiB, "cuda:0", num_segments=4)
    base = et.base_ptr
    assert et.granularity == G and et.capacity_bytes == 64 * MiB
    for n in (1, 3 * MiB, 3 * MiB + 1, 9 * MiB, 9 * MiB, 16 * MiB):
        et.resize_per_segment_(n, zero_new=kind == "host")
        snap = adapter.snapshot(base)
        snap.check()
        stats = inner.stats()
        want = expected_granules(et.segment_offsets, [n] * 4, G)
        assert et._buffer._mapped_granules == want == granules_of(snap, G)
        assert et.physical_bytes == snap.backed_bytes == stats.mapped_bytes
        assert stats.physical_bytes == et.physical_bytes
        assert et.num_physical_chunks == len(snap.mappings) == stats.handles
        assert et.base_ptr == base == snap.base and stats.reservations == 1
    # kvvmm's trace holds every call vLLM made: its reservation, each chunk's map at its VA.
    events = traced.trace.events
    calls = [e.op for e in events]
    assert calls.count("reserve") == 1 and events[0].result == base
    assert calls.count("create") == calls.count("map") == et.num_physical_chunks
    assert sorted(e.args["va"] - base for e in events if e.op == "map") == [
        m.offset for m in snap.mappings]
    traced.trace.validate()
    assert "backed" in describe(snap)
    et.free()
    assert inner.stats().clean
    with pytest.raises(ArgumentError):
        adapter.snapshot(base)  # gone with vLLM's free
    assert [e.op for e in traced.trace.events][-1] == "free"


def test_bytes_written_through_vllms_views_are_kept_as_it_grows(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    import torch

    kv.install(make_driver("host"))
    et = vllm.extensible_tensor.ExtensibleTensor(32 * MiB, "cuda:0", num_segments=2)
    et.resize_per_segment_(3 * MiB, zero_new=True)
    views = [et.segment_view(i) for i in range(2)]
    assert [v.data_ptr() for v in views] == [et.base_ptr + o for o in et.segment_offsets]
    for i, v in enumerate(views):
        v.copy_(torch.arange(v.numel(), dtype=torch.int64).to(torch.uint8) + i)
    kept = [v.clone() for v in views]
    et.resize_per_segment_(11 * MiB, zero_new=True)
    for i in range(2):
        grown = et.segment_view(i)
        assert grown.data_ptr() == views[i].data_ptr() and grown.numel() == 11 * MiB
        assert torch.equal(grown[:3 * MiB], kept[i])
        assert not grown[3 * MiB:].any()  # vLLM zeroes what it adds
    assert et.full_view().data_ptr() == et.base_ptr
    del views, grown
    et.free()


def test_vllms_release_keeps_the_pointers_and_recommits_zeros(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    host = make_driver("host")
    kv.install(host)
    et = vllm.extensible_tensor.ExtensibleTensor(16 * MiB, "cuda:0")
    et.resize_per_segment_(5 * MiB)
    et.segment_view(0).fill_(7)
    et.release_physical()
    assert host.stats().handles == host.stats().mappings == 0
    assert vllm.accelerator.get("synchronize") == 1  # vLLM waits before unmapping
    et.resize_per_segment_(5 * MiB)
    view = et.segment_view(0)
    assert view.data_ptr() == et.base_ptr and not view.any()
    del view
    et.free()
    assert host.stats().clean


def test_segment_backing_answers_as_vllms_one_chunk_check(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    adapter = kv.install(make_driver("sim"))
    et = vllm.extensible_tensor.ExtensibleTensor(24 * MiB, "cuda:0",
                                                 segment_capacities=[8 * MiB, 16 * MiB])
    for sizes in ([2 * MiB, 4 * MiB], [6 * MiB, 4 * MiB], [6 * MiB, 12 * MiB]):
        et.resize_segments_(sizes)
        got = adapter.backing(et.base_ptr, list(zip(et.segment_offsets, sizes, strict=True)))
        assert [b.rdma_ready for b in got] == et.segments_backed_by_one_chunk(sizes)
        assert [b.backed_bytes for b in got] == sizes
    assert [b.allocations for b in got] == [2, 2]  # each segment grew twice
    et.free()


# -- refusals: what vLLM's CudaVmmDriver raises, and nothing left behind -----------------------


@pytest.mark.parametrize("kind", ["host", "sim"])
def test_out_of_memory_reaches_vllm_as_its_drivers_runtime_error_after_its_one_retry(
        vllm: types.SimpleNamespace, make_driver: Any, kind: str) -> None:
    inner = make_driver(kind, capacity_bytes=8 * MiB)
    kv.install(inner)
    et = vllm.extensible_tensor.ExtensibleTensor(64 * MiB, "cuda:0")
    et.resize_per_segment_(4 * MiB)
    with pytest.raises(RuntimeError, match=r"^GPU driver error 2: out of memory") as e:
        et.resize_per_segment_(16 * MiB)
    assert isinstance(e.value, DriverOutOfMemoryError) and e.value.code == 2
    assert vllm.accelerator.get("empty_cache") == 1  # vLLM's retry ran, and failed too
    assert et.num_bytes == 4 * MiB and et.physical_bytes == inner.stats().physical_bytes
    et.free()
    assert inner.stats().clean


@pytest.mark.parametrize("call", ["map", "set_access"])
def test_a_failed_map_or_access_leaves_kvvmm_holding_what_vllm_records(
        vllm: types.SimpleNamespace, make_driver: Any, call: str) -> None:
    host = make_driver("host")
    faulty = FaultyDriver(host, Fault(call, error="CUDA_ERROR_INVALID_VALUE"))
    adapter = kv.install(faulty)
    et = vllm.extensible_tensor.ExtensibleTensor(16 * MiB, "cuda:0")
    with pytest.raises(RuntimeError, match=r"^GPU driver error 1: invalid argument"):
        et.resize_per_segment_(4 * MiB)
    assert host.stats().handles == et.num_physical_chunks  # map: released; access: kept
    assert host.stats().mapped_bytes == len(adapter.snapshot(et.base_ptr).mappings) * 4 * MiB
    et.free()
    assert host.stats().clean


def test_another_device_is_refused_as_cuda_refuses_an_ordinal(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    sim = make_driver("sim")
    adapter = kv.install(sim)
    with pytest.raises(RuntimeError, match=r"^GPU driver error 101: invalid device ordinal"):
        vllm.extensible_tensor.ExtensibleTensor(16 * MiB, "cuda:1")
    assert sim.stats().clean
    assert adapter.unusable_runtime_reason(1) and adapter.unusable_runtime_reason(0)  # sim
    for bad in (adapter.create, lambda n, d: adapter.granularity(d)):
        with pytest.raises(RuntimeError, match="error 101"):
            bad(G, 3)


class _NoExport(DriverWrapper):
    """A driver whose handles cannot be shared (a CudaDriver opened with handle_type='none')."""

    @property
    def handle_type(self) -> str:
        return "none"


def test_exported_handles_are_refused_where_the_driver_cannot_share_them(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    vd = vllm.vmm_driver
    sim = make_driver("sim")
    kv.install(_NoExport(sim))
    fd = vllm.extensible_tensor.ExtensibleTensor(
        16 * MiB, "cuda:0", export_handle_types=vd.MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    with pytest.raises(RuntimeError, match=r"^GPU driver error 801: operation not supported"):
        fd.resize_per_segment_(G)
    fd.free()
    # FABRIC is dropped where the driver has none, as vLLM's driver drops it.
    fabric = vllm.extensible_tensor.ExtensibleTensor(
        16 * MiB, "cuda:0", export_handle_types=vd.MEM_HANDLE_TYPE_FABRIC)
    fabric.resize_per_segment_(G)
    assert fabric.num_physical_chunks == 1
    fabric.free()
    assert sim.stats().clean
    assert (kv.MEM_HANDLE_TYPE_FABRIC, kv.MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == (
        vd.MEM_HANDLE_TYPE_FABRIC, vd.MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)


def test_handles_and_reservations_it_never_made_are_refused_as_invalid_values(
        vllm: types.SimpleNamespace, make_driver: Any) -> None:
    sim = make_driver("sim")
    adapter = kv.install(sim)
    va = adapter.reserve(4 * G)
    h = adapter.create(G, 0)
    for call in (lambda: adapter.map(va, G, h + 1), lambda: adapter.release(h + 1),
                 lambda: adapter.free_reserved(va + G, G), lambda: adapter.map(va + 1, G, h)):
        with pytest.raises(RuntimeError, match=r"^GPU driver error 1: invalid argument") as e:
            call()
        assert isinstance(e.value, DriverError)
    adapter.release(h)
    with pytest.raises(RuntimeError, match="error 1"):
        adapter.release(h)  # twice
    adapter.free_reserved(va, 4 * G)
    assert sim.stats().clean


def test_error_strings_are_cudas_for_the_codes_it_raises(vllm: types.SimpleNamespace,
                                                         make_driver: Any) -> None:
    adapter = kv.install(make_driver("sim"))
    assert [adapter.error_string(c) for c in (1, 2, 101, 800, 801, 999, 12345)] == [
        "invalid argument", "out of memory", "invalid device ordinal",
        "operation not permitted", "operation not supported", "unknown error",
        "unknown error"]


def test_vllms_own_availability_probe_runs_its_round_trip_over_the_adapter(
        vllm: types.SimpleNamespace, make_driver: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    host = make_driver("host")
    kv.install(host)
    # vLLM asks torch for a device first; with none here, say there is one.
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert vllm.vmm_driver.vmm_unavailable_reason() is None
    assert host.stats().clean


def test_install_without_vllm_is_a_typed_import_error_and_changes_nothing(
        make_driver: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, kv.VLLM_MODULE, None)  # import of it raises ImportError
    with pytest.raises(kv.VllmUnavailableError, match=r"vllm\.utils\.vmm_driver") as e:
        kv.install(make_driver("sim"))
    assert isinstance(e.value, ImportError) and not kv.uninstall()
    with pytest.raises(ArgumentError):
        kv.install("cuda")  # type: ignore[arg-type]  # a kind's name, not a driver


def test_an_unmap_of_several_mappings_drops_each_record_and_one_of_one_mapping_drops_it(
        make_driver: Any) -> None:
    sim = make_driver("sim")
    adapter = kv.KvvmmVmmDriver(sim)
    va = adapter.reserve(4 * G)
    hs = [adapter.create(G, 0) for _ in range(3)]
    for i, h in enumerate(hs):
        adapter.map(va + i * G, G, h)
        adapter.set_access(va + i * G, G, 0)
    adapter.unmap(va, 2 * G)  # two whole mappings in one call: both records go
    assert [(m.offset, m.handle_id) for m in adapter.snapshot(va).mappings] == [(2 * G, hs[2])]
    adapter.unmap(va + 2 * G, G)  # exactly one mapping: its record goes
    assert adapter.snapshot(va).mappings == ()
    for h in hs:
        adapter.release(h)
    with pytest.raises(RuntimeError, match="error 1"):
        adapter.map(va, G, hs[0])  # released and unmapped: forgotten
    adapter.free_reserved(va, 4 * G)
    assert sim.stats().clean and adapter._handles == {} and adapter._res == {}
    with pytest.raises(AttributeError):
        adapter.driver = make_driver("sim")  # type: ignore[misc]  # its calls are bound


def test_every_refused_call_gives_the_lock_back_for_other_threads(make_driver: Any) -> None:
    import threading

    sim = make_driver("sim")
    adapter = kv.KvvmmVmmDriver(sim)
    va = adapter.reserve(2 * G)
    h = adapter.create(G, 0)
    refused = {"reserve": lambda: adapter.reserve(G + 1),
               "create": lambda: adapter.create(G + 1, 0),
               "map": lambda: adapter.map(va, G, h + 7),
               "set_access": lambda: adapter.set_access(va, G, 0),  # nothing mapped there
               "unmap": lambda: adapter.unmap(va, G),
               "release": lambda: adapter.release(h + 7),
               "free_reserved": lambda: adapter.free_reserved(va, G)}
    for call, refuse in refused.items():
        with pytest.raises(RuntimeError, match=r"^GPU driver error"):
            refuse()
        # The lock is re-entrant: only another thread notices one a refusal left held.
        other = threading.Thread(target=lambda: adapter.release(adapter.create(G, 0)),
                                 daemon=True)  # a kept lock fails the test, never hangs it
        other.start()
        other.join(timeout=10)
        assert not other.is_alive(), f"a refused {call} kept the adapter's lock"
    adapter.release(h)
    adapter.free_reserved(va, 2 * G)
    assert sim.stats().clean and adapter._handles == {} and adapter._res == {}

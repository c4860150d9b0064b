"""Every driver rule on the real CUDA driver, and the accounting that goes with it.

Each forbidden call goes through the ``observe`` fixture, which records the CUDA error name
and whether kvvmm refused the call before CUDA saw it ("kvvmm") or CUDA refused it ("cuda");
the summary at the end of the run prints the table (``conftest.py``).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    MemoryKind,
)
from kvvmm.errors import ArgumentError, DriverOutOfMemoryError

MiB = 1 << 20
GiB = 1 << 30


def expect_refused(observe: Any, rule: str, fn: Any, *args: Any,
                   name: str = CUDA_ERROR_INVALID_VALUE) -> Any:
    """Call ``fn(*args)``, which the rules forbid; it must raise a DriverError named ``name``.

    ``name`` defaults to what raw CUDA answers on an H200 for every rule violation except a
    partial-handle map (NOT_SUPPORTED) and out of memory (bench/results/h200-cuda-rules.json).
    """
    err = observe(rule, fn, *args)
    assert err is not None, f"{rule}: the call was ACCEPTED; the rules say it must be refused"
    assert err.cuda_error == name, f"{rule}: {err.cuda_error}, expected {name}: {err}"
    return err


def clean_but_reserved(cuda: Any, reservations: int) -> None:
    s = cuda.stats()
    assert (s.reservations, s.handles, s.mappings, s.mapped_bytes, s.physical_bytes) == (
        reservations, 0, 0, 0, 0,
    ), s


# -- the driver itself ----------------------------------------------------------------


def test_the_driver_names_its_device_and_kind(cuda: Any):
    assert cuda.kind == "cuda" and cuda.memory is MemoryKind.DEVICE and cuda.device == 0
    assert isinstance(cuda.name, str) and cuda.name and "\0" not in cuda.name
    free_bytes, total_bytes = cuda.mem_info()
    assert 0 < free_bytes <= total_bytes


def test_both_granularities_are_queried_and_one_is_chosen(cuda: Any):
    from kvvmm.driver.cuda import CudaDriver

    gmin, grec = cuda.granularity_min, cuda.granularity_recommended
    assert gmin > 0 and grec % gmin == 0
    assert cuda.granularity() == gmin
    rec = CudaDriver(granularity="recommended")
    big = CudaDriver(granularity=4 * gmin)
    try:
        assert rec.granularity() == grec
        assert big.granularity() == 4 * gmin
    finally:
        rec.close()
        big.close()
    with pytest.raises(ArgumentError, match="granularity"):
        CudaDriver(granularity="huge")
    with pytest.raises(ArgumentError, match="granularity"):
        CudaDriver(granularity=gmin + 4096)


def test_a_full_commit_and_teardown_leaves_nothing_held(cuda: Any):
    g = cuda.granularity()
    va = cuda.reserve(64 * g)
    assert va % g == 0
    h = cuda.create(4 * g)
    cuda.map(va + 8 * g, 4 * g, h)
    cuda.set_access(va + 8 * g, 4 * g)
    s = cuda.stats()
    assert (s.reservations, s.reserved_bytes, s.handles, s.mappings) == (1, 64 * g, 1, 1)
    assert s.mapped_bytes == s.physical_bytes == 4 * g
    cuda.unmap(va + 8 * g, 4 * g)
    cuda.release(h)
    cuda.free(va, 64 * g)
    assert cuda.stats().clean


def test_reserve_honours_an_alignment_that_is_a_multiple(cuda: Any):
    g = cuda.granularity()
    va = cuda.reserve(4 * g, align=16 * g)
    assert va % (16 * g) == 0
    cuda.free(va, 4 * g)


# -- the rules ------------------------------------------------------------------------


def test_misaligned_sizes_and_addresses_are_refused(cuda: Any, observe: Any):
    g = cuda.granularity()
    expect_refused(observe, "reserve: size not a multiple", cuda.reserve, g + 4096)
    expect_refused(observe, "reserve: size 0", cuda.reserve, 0)
    expect_refused(observe, "reserve: align not a multiple (1.5 gran)", cuda.reserve, g, g + g // 2)
    expect_refused(observe, "reserve: align not a power of two (3 gran)", cuda.reserve, g, 3 * g)
    expect_refused(observe, "create: size not a multiple", cuda.create, g + 4096)
    expect_refused(observe, "create: size 0", cuda.create, 0)
    va = cuda.reserve(8 * g)
    h = cuda.create(g)
    expect_refused(observe, "map: va not a multiple", cuda.map, va + 4096, g, h)
    cuda.map(va, g, h)
    expect_refused(observe, "unmap: size not a multiple", cuda.unmap, va, 4096)
    expect_refused(observe, "set_access: size not a multiple", cuda.set_access, va, 4096)
    cuda.unmap(va, g)
    cuda.release(h)
    cuda.free(va, 8 * g)
    assert cuda.stats().clean


def test_a_map_of_part_of_a_handle_is_refused(cuda: Any, observe: Any):
    g = cuda.granularity()
    va = cuda.reserve(8 * g)
    h = cuda.create(2 * g)
    # CUDA's own answer on an H200 (bench/results/h200-cuda-rules.json): NOT_SUPPORTED.
    expect_refused(observe, "map: size < the handle's (partial handle)", cuda.map, va, g, h,
                   name=CUDA_ERROR_NOT_SUPPORTED)
    expect_refused(observe, "map: size > the handle's", cuda.map, va, 4 * g, h,
                   name=CUDA_ERROR_NOT_SUPPORTED)
    clean_but_reserved_with_handle(cuda)
    cuda.release(h)
    cuda.free(va, 8 * g)


def clean_but_reserved_with_handle(cuda: Any) -> None:
    s = cuda.stats()
    assert (s.mappings, s.mapped_bytes, s.handles) == (0, 0, 1), s


def test_a_map_over_mapped_va_is_refused(cuda: Any, observe: Any):
    g = cuda.granularity()
    va = cuda.reserve(8 * g)
    h1, h2, h3 = cuda.create(2 * g), cuda.create(2 * g), cuda.create(2 * g)
    cuda.map(va, 2 * g, h1)
    expect_refused(observe, "map: exactly over a mapping", cuda.map, va, 2 * g, h2)
    expect_refused(observe, "map: overlapping the end of a mapping", cuda.map, va + g, 2 * g, h3)
    s = cuda.stats()
    assert (s.mappings, s.mapped_bytes) == (1, 2 * g), "a refused map must not be recorded"
    cuda.unmap(va, 2 * g)
    for h in (h1, h2, h3):
        cuda.release(h)
    cuda.free(va, 8 * g)
    assert cuda.stats().clean


def test_a_map_outside_a_reservation_is_refused(cuda: Any, observe: Any):
    # Raw CUDA accepts a map straddling a reservation's end and one into a freed reservation
    # on an H200 (bench/results/h200-cuda-rules.json): kvvmm refuses them itself.
    g = cuda.granularity()
    va = cuda.reserve(4 * g)
    h = cuda.create(2 * g)
    cuda.map(va, 2 * g, h)  # warms the "last reservation" cache on this one
    cuda.unmap(va, 2 * g)
    expect_refused(observe, "map: just past the reservation's end", cuda.map, va + 4 * g, 2 * g, h)
    expect_refused(observe, "map: straddling the reservation's end", cuda.map, va + 3 * g, 2 * g, h)
    # Reserved only now: CUDA may place it right after the first (adjacent ranges are common),
    # and a map there is then legal. Straddling both stays refused: one reservation per map.
    other = cuda.reserve(4 * g)
    if other == va + 4 * g:
        expect_refused(observe, "map: across two adjacent reservations",
                       cuda.map, va + 3 * g, 2 * g, h)
    cuda.map(other, 2 * g, h)  # another reservation: found by the slow lookup
    cuda.unmap(other, 2 * g)
    cuda.free(va, 4 * g)
    expect_refused(observe, "map: into a freed reservation", cuda.map, va, 2 * g, h)
    assert cuda.stats().mappings == 0
    cuda.release(h)
    cuda.free(other, 4 * g)
    assert cuda.stats().clean


def test_an_unmap_of_part_of_a_mapping_is_refused(cuda: Any, observe: Any):
    g = cuda.granularity()
    va = cuda.reserve(8 * g)
    h = cuda.create(2 * g)
    cuda.map(va, 2 * g, h)
    expect_refused(observe, "unmap: first half of a mapping", cuda.unmap, va, g)
    expect_refused(observe, "unmap: second half of a mapping", cuda.unmap, va + g, g)
    expect_refused(observe, "unmap: a mapping and unmapped VA after it", cuda.unmap, va, 4 * g)
    expect_refused(observe, "unmap: VA with nothing mapped", cuda.unmap, va + 4 * g, g)
    assert cuda.stats().mappings == 1
    cuda.unmap(va, 2 * g)
    cuda.release(h)
    cuda.free(va, 8 * g)
    assert cuda.stats().clean


def test_an_unmap_may_cover_several_whole_mappings_but_no_hole(cuda: Any, observe: Any):
    g = cuda.granularity()
    va = cuda.reserve(8 * g)
    hs = [cuda.create(g) for _ in range(3)]
    cuda.map(va, g, hs[0])
    cuda.map(va + g, g, hs[1])
    cuda.map(va + 3 * g, g, hs[2])  # hole at va + 2g
    expect_refused(observe, "unmap: two mappings with a hole between", cuda.unmap, va, 4 * g)
    assert cuda.stats().mappings == 3
    cuda.set_access(va, 2 * g)  # two adjacent whole mappings in one call
    expect_refused(observe, "set_access: a range with a hole", cuda.set_access, va, 4 * g)
    expect_refused(observe, "set_access: unmapped VA", cuda.set_access, va + 5 * g, g)
    cuda.unmap(va, 2 * g)  # two adjacent whole mappings in one call
    s = cuda.stats()
    assert (s.mappings, s.mapped_bytes) == (1, g)
    cuda.unmap(va + 3 * g, g)
    for h in hs:
        cuda.release(h)
    cuda.free(va, 8 * g)
    assert cuda.stats().clean


def test_set_access_on_part_of_a_mapping_is_refused(cuda: Any, observe: Any):
    # The simulator's rule; raw CUDA may accept it (bench/probe_cuda_rules.py records that).
    g = cuda.granularity()
    va = cuda.reserve(4 * g)
    h = cuda.create(2 * g)
    cuda.map(va, 2 * g, h)
    expect_refused(observe, "set_access: first half of a mapping", cuda.set_access, va, g)
    cuda.set_access(va, 2 * g)
    cuda.unmap(va, 2 * g)
    cuda.release(h)
    cuda.free(va, 4 * g)


def test_free_takes_exactly_one_whole_reservation(cuda: Any, observe: Any):
    g = cuda.granularity()
    va = cuda.reserve(8 * g)
    expect_refused(observe, "free: smaller size", cuda.free, va, 4 * g)
    expect_refused(observe, "free: larger size", cuda.free, va, 16 * g)
    expect_refused(observe, "free: not the start", cuda.free, va + g, 7 * g)
    assert cuda.stats().reservations == 1
    cuda.free(va, 8 * g)
    expect_refused(observe, "free: twice", cuda.free, va, 8 * g)
    assert cuda.stats().clean


def test_free_with_a_mapping_still_in_it_is_refused(cuda: Any, observe: Any):
    g = cuda.granularity()
    va = cuda.reserve(8 * g)
    h = cuda.create(g)
    cuda.map(va + 2 * g, g, h)
    expect_refused(observe, "free: with a mapping inside", cuda.free, va, 8 * g)
    assert cuda.stats().reservations == 1
    cuda.unmap(va + 2 * g, g)
    cuda.release(h)
    cuda.free(va, 8 * g)
    assert cuda.stats().clean


def test_release_of_an_unknown_or_released_handle_is_refused(cuda: Any, observe: Any):
    g = cuda.granularity()
    expect_refused(observe, "release: unknown handle", cuda.release, 987654321)
    h = cuda.create(g)
    cuda.release(h)
    expect_refused(observe, "release: twice", cuda.release, h)
    assert cuda.stats().clean


def test_create_beyond_the_device_memory_is_out_of_memory(cuda: Any, observe: Any):
    g = cuda.granularity()
    free_bytes, total_bytes = cuda.mem_info()
    over = (total_bytes // g + 1) * g
    err = expect_refused(observe, "create: capacity + granularity", cuda.create, over,
                         name=CUDA_ERROR_OUT_OF_MEMORY)
    assert isinstance(err, DriverOutOfMemoryError)
    over_free = (free_bytes // g + 1) * g
    err = observe("create: free + granularity", cuda.create, over_free)
    if err is None:  # accepted: give it back before failing
        held = cuda.stats().handles
        for hid in list(cuda._handles):
            cuda.release(hid)
        pytest.fail(f"create({over_free}) past the free memory succeeded ({held} handle)")
    assert isinstance(err, DriverOutOfMemoryError)
    assert cuda.stats().clean


def test_release_while_mapped_keeps_the_memory_until_the_unmap(cuda: Any, observe: Any):
    g = cuda.granularity()
    size = (1 * GiB // g) * g
    va = cuda.reserve(4 * size)
    free0, _ = cuda.mem_info()
    h = cuda.create(size)
    cuda.map(va, size, h)
    cuda.set_access(va, size)
    free1, _ = cuda.mem_info()
    assert free0 - free1 >= size - 64 * MiB
    cuda.release(h)
    s = cuda.stats()
    assert (s.handles, s.mappings, s.physical_bytes) == (0, 1, size)
    free2, _ = cuda.mem_info()
    assert abs(free2 - free1) < 64 * MiB, "released but mapped: the memory is still held"
    expect_refused(observe, "map: released-but-mapped handle at another VA",
                   cuda.map, va + size, size, h)
    cuda.unmap(va, size)
    free3, _ = cuda.mem_info()
    assert free3 - free2 >= size - 64 * MiB, "the last unmap gives the memory back"
    clean_but_reserved(cuda, 1)
    cuda.free(va, 4 * size)


def test_one_handle_may_be_mapped_at_two_addresses(cuda: Any):
    g = cuda.granularity()
    va = cuda.reserve(8 * g)
    h = cuda.create(2 * g)
    cuda.map(va, 2 * g, h)
    cuda.map(va + 4 * g, 2 * g, h)
    cuda.set_access(va, 2 * g)
    cuda.set_access(va + 4 * g, 2 * g)
    cuda.release(h)
    cuda.unmap(va, 2 * g)
    assert cuda.stats().physical_bytes == 2 * g, "one mapping left: the memory stays"
    cuda.unmap(va + 4 * g, 2 * g)
    clean_but_reserved(cuda, 1)
    cuda.free(va, 8 * g)


def test_calls_work_from_a_thread_with_no_current_context(cuda: Any):
    g = cuda.granularity()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            va = cuda.reserve(4 * g)
            h = cuda.create(g)
            cuda.map(va, g, h)
            cuda.set_access(va, g)
            cuda.mem_info()
            cuda.unmap(va, g)
            cuda.release(h)
            cuda.free(va, 4 * g)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    assert cuda.stats().clean


def test_close_gives_back_everything_and_is_idempotent():
    from kvvmm.driver.cuda import CudaDriver

    d = CudaDriver()
    g = d.granularity()
    free0, _ = d.mem_info()
    va = d.reserve(8 * g)
    h = d.create(4 * g)
    d.map(va, 4 * g, h)
    d.set_access(va, 4 * g)
    d.create(2 * g)
    d.close()
    assert d.stats().clean
    d.close()
    probe = CudaDriver()
    try:
        free1, _ = probe.mem_info()
    finally:
        probe.close()
    assert abs(free1 - free0) < 64 * MiB


def test_unmap_during_cuda_graph_capture_is_refused_and_the_capture_survives(
    cuda: Any, observe: Any, needs_torch_cuda: None
):
    import torch

    g = cuda.granularity()
    va = cuda.reserve(4 * g)
    h = cuda.create(g)
    x = torch.zeros(16, device="cuda")
    # One unmap before the capture: it finds torch's capture check, and from then on the C
    # fast path (when on) makes the check itself; the refusal below is then its doing.
    cuda.map(va, g, h)
    cuda.unmap(va, g)
    assert cuda._b.capture_check is not None
    cuda.map(va, g, h)
    cuda.set_access(va, g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    err: Any = None
    with torch.cuda.graph(graph):  # raises at its end if the capture was invalidated
        x.add_(1)
        err = observe("unmap: during CUDA graph capture", cuda.unmap, va, g)
    assert err is not None, "unmap during capture must be refused"
    assert err.cuda_error == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", err
    assert cuda.stats().mappings == 1, "nothing was unmapped"
    graph.replay()
    torch.cuda.synchronize()
    assert x[0].item() == 2.0  # the warm-up and the replay; a capture runs nothing
    cuda.unmap(va, g)
    cuda.release(h)
    cuda.free(va, 4 * g)


def test_the_c_fast_path_is_on_wherever_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvvmm.driver import cuda as cuda_mod

    monkeypatch.delenv("KVVMM_CUDA_FASTPATH", raising=False)
    d = cuda_mod.CudaDriver()
    try:
        assert d.fast_path == (cuda_mod._cudafast is not None)
        if d.fast_path:  # the hot calls are C methods, no Python frame
            assert type(d.map).__name__ == "builtin_function_or_method"
    finally:
        d.close()

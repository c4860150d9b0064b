"""The driver rules (``kvvmm/driver/base.py``), proven on the simulator and the host driver.

Each call the CUDA driver refuses is refused here too: a :class:`DriverError` whose
``cuda_error`` is the name CUDA uses, whose message names the call and its address in hex,
and after which the driver's own accounting (``stats()``) is exactly as before. The host
driver also shows that its bytes are real, and that touching VA with no memory behind it
kills the process with SIGSEGV, as an illegal address does on a GPU (in a subprocess, so the
crash cannot take the test session with it).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from kvvmm.driver import PROFILES, Driver, SimDriver, get_profile
from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
)
from kvvmm.errors import DriverError, DriverOutOfMemoryError
from kvvmm.units import MiB

ROOT = Path(__file__).resolve().parents[1]
MakeDriver = Callable[..., Driver]
host_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                               reason="the host driver needs Linux")


def refused(driver: Driver, call: str, *args: int, cuda_error: str = CUDA_ERROR_INVALID_VALUE
            ) -> DriverError:
    """Make ``call``; assert CUDA's refusal and that the driver's accounting did not move."""
    before = driver.stats()
    with pytest.raises(DriverError) as info:
        getattr(driver, call)(*args)
    err = info.value
    assert err.cuda_error == cuda_error, str(err)
    assert err.call == call
    assert str(err).startswith(f"{call}("), str(err)
    assert cuda_error in str(err)
    if "va" in err.call_args:
        assert f"va={err.call_args['va']:#x}" in str(err), str(err)
    assert driver.stats() == before
    return err


def mapped(driver: Driver, va: int, size: int) -> int:
    """Create a handle of ``size`` bytes, map it at ``va`` and make it accessible."""
    h = driver.create(size)
    driver.map(va, size, h)
    driver.set_access(va, size)
    return h


# -- reserve ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size_in_pages", [1, 511, 513, -512])
def test_reserve_of_a_size_that_is_not_a_multiple_of_the_granularity_is_refused(
    driver: Driver, size_in_pages: int
) -> None:
    size = size_in_pages * 4096  # -512 pages: a negative multiple of 2 MiB
    refused(driver, "reserve", size)


def test_reserve_of_zero_bytes_is_refused_with_invalid_value(driver: Driver) -> None:
    err = refused(driver, "reserve", 0)
    assert "size" in str(err)


@pytest.mark.parametrize("align", [3 * MiB, 6 * MiB, -2 * MiB])
def test_reserve_with_an_alignment_that_is_not_a_power_of_two_is_refused(
    driver: Driver, align: int
) -> None:
    # As an H200 answered: align 1.5x or 3x the granularity is CUDA_ERROR_INVALID_VALUE.
    refused(driver, "reserve", driver.granularity(), align)


@pytest.mark.parametrize("align", [4096, 1 * MiB])
def test_reserve_with_a_power_of_two_alignment_below_the_granularity_is_accepted(
    driver: Driver, align: int
) -> None:
    # As on an H200: accepted, and the VA is aligned to the granularity anyway.
    g = driver.granularity()
    va = driver.reserve(g, align)
    assert va % g == 0
    driver.free(va, g)


def test_reserve_returns_an_address_aligned_to_the_requested_alignment(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(2 * g, 8 * g)
    assert va % (8 * g) == 0
    assert driver.stats().reservations == 1
    assert driver.stats().reserved_bytes == 2 * g
    driver.free(va, 2 * g)
    assert driver.stats().clean


# -- free -------------------------------------------------------------------------------------


def test_free_of_an_address_that_does_not_start_a_reservation_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    err = refused(driver, "free", va + g, 3 * g)
    assert f"{va + g:#x}" in str(err)
    refused(driver, "free", va + 64 * g, 4 * g)


@pytest.mark.parametrize("delta_granules", [-1, 1, -3])
def test_free_of_the_wrong_size_is_refused_with_invalid_value(
    driver: Driver, delta_granules: int
) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    err = refused(driver, "free", va, 4 * g + delta_granules * g)
    assert str(4 * g) in str(err)  # names the reservation's real size
    driver.free(va, 4 * g)
    assert driver.stats().clean


def test_free_of_a_reservation_with_mappings_inside_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    h = mapped(driver, va + g, g)
    refused(driver, "free", va, 4 * g)
    driver.unmap(va + g, g)
    driver.release(h)
    driver.free(va, 4 * g)
    assert driver.stats().clean


def test_free_of_a_reservation_twice_is_refused_the_second_time(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(2 * g)
    driver.free(va, 2 * g)
    refused(driver, "free", va, 2 * g)


# -- create -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size_in_pages", [1, 100, 513, 0, -512])
def test_create_of_a_size_that_is_not_a_positive_multiple_of_the_granularity_is_refused(
    driver: Driver, size_in_pages: int
) -> None:
    refused(driver, "create", size_in_pages * 4096)


def test_create_beyond_capacity_is_out_of_memory(driver_kind: str, make_driver: MakeDriver
                                                 ) -> None:
    g = 2 * MiB
    d = make_driver(driver_kind, capacity_bytes=4 * g)
    h = d.create(3 * g)
    err = refused(d, "create", 2 * g, cuda_error=CUDA_ERROR_OUT_OF_MEMORY)
    assert isinstance(err, DriverOutOfMemoryError)
    assert str(2 * g) in str(err) and str(g) in str(err)  # asked, and what is free
    h2 = d.create(g)  # exactly what is left still fits
    refused(d, "create", g, cuda_error=CUDA_ERROR_OUT_OF_MEMORY)
    d.release(h)
    d.release(h2)
    assert d.stats().clean
    d.release(d.create(4 * g))  # the memory came back


def test_create_larger_than_the_whole_device_is_out_of_memory(driver: Driver) -> None:
    g = driver.granularity()
    _, total = driver.mem_info()
    err = refused(driver, "create", (total // g + 1) * g, cuda_error=CUDA_ERROR_OUT_OF_MEMORY)
    assert isinstance(err, DriverOutOfMemoryError)


def test_sim_create_counts_memory_used_by_others(make_driver: MakeDriver) -> None:
    g = 2 * MiB
    d = make_driver("sim", capacity_bytes=8 * g, used_bytes=6 * g)
    assert d.mem_info() == (2 * g, 8 * g)
    refused(d, "create", 3 * g, cuda_error=CUDA_ERROR_OUT_OF_MEMORY)
    d.release(d.create(2 * g))


# -- map --------------------------------------------------------------------------------------


@pytest.mark.parametrize("map_granules", [1, 3])
def test_map_of_part_of_a_handle_is_refused_as_not_supported(
    driver: Driver, map_granules: int
) -> None:
    # CUDA_ERROR_NOT_SUPPORTED is what an H200 answers (bench/results/h200-cuda-rules.json).
    g = driver.granularity()
    va = driver.reserve(4 * g)
    h = driver.create(2 * g)
    err = refused(driver, "map", va, map_granules * g, h, cuda_error=CUDA_ERROR_NOT_SUPPORTED)
    assert "whole handles" in str(err)


def test_map_outside_any_reservation_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    h = driver.create(g)
    refused(driver, "map", va + 4 * g + 1024 * g, g, h)  # well past the end
    refused(driver, "map", va - 1024 * g, g, h)  # well before the start
    driver.free(va, 4 * g)
    refused(driver, "map", va, g, h)  # inside a reservation that was freed


def test_map_straddling_the_end_of_a_reservation_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    h = driver.create(2 * g)
    err = refused(driver, "map", va + 3 * g, 2 * g, h)
    assert "reservation" in str(err)
    refused(driver, "map", va - g, 2 * g, h)  # straddling its start


def test_map_straddling_two_adjacent_reservations_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    first = driver.reserve(2 * g)
    second = driver.reserve(2 * g)
    h = driver.create(2 * g)
    low, high = sorted((first, second))
    if driver.kind == "sim":  # the simulator hands reservations out back to back
        assert high == low + 2 * g
    refused(driver, "map", low + g, 2 * g, h)


@pytest.mark.parametrize(
    ("new_at", "new_granules"),
    [(1, 2), (2, 2), (0, 2), (1, 1), (0, 4), (2, 1)],
    ids=["same-range", "overlaps-its-end", "overlaps-its-start", "inside", "around",
         "its-last-granule"],
)
def test_map_over_mapped_va_is_refused(driver: Driver, new_at: int, new_granules: int) -> None:
    g = driver.granularity()
    va = driver.reserve(8 * g)
    mapped(driver, va + g, 2 * g)  # [g, 3g)
    h = driver.create(new_granules * g)
    err = refused(driver, "map", va + new_at * g, new_granules * g, h)
    assert "already mapped" in str(err)


def test_map_right_after_a_mapping_is_allowed(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(8 * g)
    mapped(driver, va + g, 2 * g)
    mapped(driver, va + 3 * g, g)
    mapped(driver, va, g)
    assert driver.stats().mappings == 3
    assert driver.stats().mapped_bytes == 4 * g


def test_map_of_a_released_handle_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    h = driver.create(g)
    driver.release(h)
    err = refused(driver, "map", va, g, h)
    assert f"handle {h}" in str(err)
    refused(driver, "map", va, g, h + 1000)  # never created


def test_map_at_a_misaligned_address_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    h = driver.create(g)
    err = refused(driver, "map", va + 4096, g, h)
    assert f"{va + 4096:#x}" in str(err)
    refused(driver, "map", va, 0, h)


# -- unmap ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("at", "granules"), [(1, 1), (3, 1), (2, 1), (1, 4), (2, 3), (0, 2)],
    ids=["first-part", "last-part", "middle", "whole-and-past-its-end", "part-and-past-its-end",
         "from-before-it-into-it"],
)
def test_unmap_of_part_of_a_mapping_is_refused(driver: Driver, at: int, granules: int) -> None:
    g = driver.granularity()
    va = driver.reserve(8 * g)
    mapped(driver, va + g, 3 * g)  # [g, 4g)
    refused(driver, "unmap", va + at * g, granules * g)


def test_unmap_of_unmapped_va_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    err = refused(driver, "unmap", va, g)
    assert f"{va:#x}" in str(err)
    refused(driver, "unmap", va + 64 * g, g)  # outside any reservation


def test_unmap_covering_two_adjacent_whole_mappings_is_allowed(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(8 * g)
    h1 = mapped(driver, va, g)
    h2 = mapped(driver, va + g, 2 * g)
    driver.unmap(va, 3 * g)
    s = driver.stats()
    assert (s.mappings, s.mapped_bytes, s.handles, s.physical_bytes) == (0, 0, 2, 3 * g)
    driver.release(h1)
    driver.release(h2)
    driver.free(va, 8 * g)
    assert driver.stats().clean


def test_unmap_of_a_range_with_a_hole_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(8 * g)
    mapped(driver, va, g)
    mapped(driver, va + 2 * g, g)  # hole at [g, 2g)
    err = refused(driver, "unmap", va, 3 * g)
    assert "not mapped" in str(err)


def test_unmap_at_a_misaligned_address_or_of_zero_bytes_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    mapped(driver, va, g)
    refused(driver, "unmap", va + 4096, g - 4096)
    refused(driver, "unmap", va, 0)


# -- set access -------------------------------------------------------------------------------


def test_set_access_on_unmapped_va_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    refused(driver, "set_access", va, g)
    mapped(driver, va, g)
    refused(driver, "set_access", va, 2 * g)  # runs past the mapping into unmapped VA


def test_set_access_on_part_of_a_mapping_is_refused(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    driver.map(va, 2 * g, driver.create(2 * g))
    refused(driver, "set_access", va + g, g)
    driver.set_access(va, 2 * g)


def test_set_access_covering_two_adjacent_mappings_is_allowed(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    driver.map(va, g, driver.create(g))
    driver.map(va + g, g, driver.create(g))
    before = driver.stats()
    driver.set_access(va, 2 * g)
    assert driver.stats() == before


# -- release ----------------------------------------------------------------------------------


def test_release_twice_is_refused_the_second_time(driver: Driver) -> None:
    g = driver.granularity()
    h = driver.create(g)
    driver.release(h)
    err = refused(driver, "release", h)
    assert f"handle {h}" in str(err)
    refused(driver, "release", 987654)  # never created


def test_release_while_mapped_is_legal_and_memory_goes_with_the_last_mapping(
    driver: Driver,
) -> None:
    g = driver.granularity()
    va = driver.reserve(8 * g)
    h = driver.create(2 * g)
    driver.map(va, 2 * g, h)
    driver.map(va + 4 * g, 2 * g, h)  # one handle may be mapped at several addresses
    driver.release(h)
    s = driver.stats()
    assert (s.handles, s.mappings, s.physical_bytes) == (0, 2, 2 * g)
    refused(driver, "release", h)  # released once is released
    refused(driver, "map", va + 2 * g, 2 * g, h)  # and cannot be mapped again
    driver.unmap(va, 2 * g)
    assert driver.stats().physical_bytes == 2 * g  # the second mapping still holds it
    driver.unmap(va + 4 * g, 2 * g)
    assert driver.stats().physical_bytes == 0
    driver.free(va, 8 * g)
    assert driver.stats().clean


def test_release_while_mapped_keeps_the_memory_counted_against_capacity(
    driver_kind: str, make_driver: MakeDriver
) -> None:
    g = 2 * MiB
    d = make_driver(driver_kind, capacity_bytes=2 * g)
    va = d.reserve(2 * g)
    h = d.create(2 * g)
    d.map(va, 2 * g, h)
    d.release(h)
    refused(d, "create", g, cuda_error=CUDA_ERROR_OUT_OF_MEMORY)
    d.unmap(va, 2 * g)
    d.release(d.create(2 * g))


# -- messages ---------------------------------------------------------------------------------


def test_a_refusal_names_the_call_its_arguments_and_the_address_in_hex(driver: Driver) -> None:
    g = driver.granularity()
    va = driver.reserve(4 * g)
    h = driver.create(2 * g)
    err = refused(driver, "map", va + 3 * g, 2 * g, h)  # straddles the reservation's end
    text = str(err)
    assert text.startswith(f"map(va={va + 3 * g:#x}, size={2 * g}, handle={h}) failed: ")
    assert err.call_args == {"va": va + 3 * g, "size": 2 * g, "handle": h}
    assert err.reason and err.reason in text


# -- accounting -------------------------------------------------------------------------------


def test_mem_info_agrees_with_stats(driver: Driver) -> None:
    g = driver.granularity()
    free0, total = driver.mem_info()
    assert 0 < free0 <= total
    h = driver.create(4 * g)
    free1, total1 = driver.mem_info()
    assert total1 == total
    assert driver.stats().physical_bytes == 4 * g
    if driver.kind == "sim":
        assert free1 == free0 - 4 * g
    else:  # the host also caps by what the machine has available right now
        assert free1 <= total - driver.stats().physical_bytes
    driver.release(h)


def test_sim_mem_info_is_capacity_minus_used_minus_physical(make_driver: MakeDriver) -> None:
    g = 2 * MiB
    d = make_driver("sim", capacity_bytes=64 * g, used_bytes=10 * g)
    va = d.reserve(8 * g)
    h = d.create(4 * g)
    d.map(va, 4 * g, h)
    d.release(h)  # released but mapped: still held
    assert d.mem_info() == (64 * g - 10 * g - d.stats().physical_bytes, 64 * g)
    assert d.stats().physical_bytes == 4 * g


# -- the simulator ----------------------------------------------------------------------------


def _script(d: Driver) -> list[object]:
    g = d.granularity()
    out: list[object] = []
    a = d.reserve(16 * g)
    b = d.reserve(8 * g, 4 * g)
    out += [a, b]
    for i in range(3):
        h = d.create((i + 1) * g)
        d.map(a + 4 * i * g, (i + 1) * g, h)
        out.append(h)
    try:
        d.map(a, g, 999)
    except DriverError as e:
        out.append(str(e))
    d.unmap(a, g)
    out.append(d.create(g))
    out.append(d.reserve(2 * g))
    out.append(d.mem_info())
    out.append(d.stats())
    return out


def test_two_fresh_sim_drivers_give_identical_addresses_and_handles() -> None:
    one, two = SimDriver(), SimDriver()
    assert _script(one) == _script(two)
    assert one.clock_us == two.clock_us


@pytest.mark.parametrize("key", ["h100", "h200", "b200", "gb300"])
def test_sim_profiles_exist_with_capacity_granularity_and_a_source(key: str) -> None:
    p = PROFILES[key]
    assert p.key == key
    assert p.capacity_bytes > 64 * 2**30
    assert p.granularity_bytes > 0 and p.granularity_bytes % 4096 == 0
    assert p.source.strip() and p.name.strip()
    d = SimDriver(key)
    assert d.granularity() == p.granularity_bytes
    assert d.mem_info() == (p.capacity_bytes, p.capacity_bytes)
    assert get_profile(key.upper()) is p


def test_sim_cost_clock_advances_with_every_call() -> None:
    d = SimDriver()
    g = d.granularity()
    seen = [d.clock_us]

    def tick() -> None:
        assert d.clock_us > seen[-1]
        seen.append(d.clock_us)

    va = d.reserve(64 * g)
    tick()
    h = d.create(g)
    tick()
    d.map(va, g, h)
    tick()
    d.set_access(va, g)
    tick()
    d.mem_info()
    tick()
    d.unmap(va, g)
    tick()
    d.release(h)
    tick()
    d.free(va, 64 * g)
    tick()
    big, small = SimDriver(), SimDriver()
    big.create(2048 * g)
    small.create(g)
    assert big.clock_us > small.clock_us  # a 4 GiB create costs more than a 2 MiB one


# -- the host driver: real bytes, real faults -------------------------------------------------


@host_only
def test_host_bytes_written_through_a_mapping_read_back(make_driver: MakeDriver) -> None:
    d = make_driver("host")
    g = d.granularity()
    va = d.reserve(4 * g)
    mapped(d, va + g, 2 * g)
    payload = bytes(range(256)) * 64
    ctypes.memmove(va + g, payload, len(payload))
    ctypes.memmove(va + 3 * g - len(payload), payload, len(payload))
    assert ctypes.string_at(va + g, len(payload)) == payload
    assert ctypes.string_at(va + 3 * g - len(payload), len(payload)) == payload
    assert ctypes.string_at(va + g + len(payload), 16) == bytes(16)  # fresh memory is zero


@host_only
def test_host_a_handle_mapped_twice_shows_the_same_bytes_at_both_addresses(
    make_driver: MakeDriver,
) -> None:
    d = make_driver("host")
    g = d.granularity()
    va = d.reserve(8 * g)
    h = mapped(d, va, g)
    d.map(va + 4 * g, g, h)
    d.set_access(va + 4 * g, g)
    ctypes.memmove(va + 100, b"kvvmm", 5)
    assert ctypes.string_at(va + 4 * g + 100, 5) == b"kvvmm"


@host_only
def test_host_memory_belongs_to_the_handle_across_unmap_and_map(make_driver: MakeDriver) -> None:
    d = make_driver("host")
    g = d.granularity()
    va = d.reserve(4 * g)
    h = mapped(d, va, g)
    ctypes.memmove(va + g - 8, b"lastword", 8)
    d.unmap(va, g)
    d.map(va + 3 * g, g, h)
    d.set_access(va + 3 * g, g)
    d.release(h)  # released while mapped: the bytes stay
    assert ctypes.string_at(va + 4 * g - 8, 8) == b"lastword"


def _run_touch(body: str) -> subprocess.CompletedProcess[str]:
    prelude = textwrap.dedent(
        """
        import ctypes
        from kvvmm.driver.host import HostDriver
        d = HostDriver(capacity_bytes=64 << 20)
        g = d.granularity()
        va = d.reserve(4 * g)
        def touch(addr):
            ctypes.c_uint8.from_address(addr).value = 7
            return ctypes.c_uint8.from_address(addr).value
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )


@host_only
@pytest.mark.parametrize(
    "body",
    [
        "touch(va + g)",  # reserved, never mapped
        "h = d.create(g); d.map(va, g, h); touch(va)",  # mapped, no set_access yet
        "h = d.create(g); d.map(va, g, h); d.set_access(va, g); touch(va); d.unmap(va, g); "
        "touch(va)",  # accessible once, then unmapped
    ],
    ids=["reserved-unmapped", "mapped-without-access", "after-unmap"],
)
def test_host_touching_va_with_no_accessible_memory_dies_by_sigsegv(body: str) -> None:
    proc = _run_touch(body + "\nprint('survived')")
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)
    assert "survived" not in proc.stdout


@host_only
def test_host_touching_mapped_accessible_va_in_a_subprocess_works() -> None:
    # The control for the SIGSEGV tests: the same harness survives when memory is there.
    proc = _run_touch(
        "h = d.create(g); d.map(va + g, g, h); d.set_access(va + g, g)\n"
        "assert touch(va + g) == 7 and touch(va + 2 * g - 1) == 7\nprint('survived')"
    )
    assert proc.returncode == 0, proc.stderr
    assert "survived" in proc.stdout

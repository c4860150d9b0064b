"""Drivers under hostile input: nothing a caller types or a peer process does crashes, corrupts or
silently changes a driver's memory.

- every size, address, alignment, handle, fd and device a driver cannot take is refused with a
  typed error before any syscall, on the simulator and the host driver alike, leaving the
  driver's accounting and its open file descriptors as they were;
- an exported host handle is sealed: a peer cannot truncate it (and SIGBUS us), and only
  sealed memfds are imported;
- close() and free() refuse while a reservation is pinned (a tensor can reach it);
- unbacked host VA reads as zeros (a printed tensor does not kill the process), writes fault;
- recommitted host memory never shows an earlier tenant's bytes;
- 10,000 commit/decommit cycles leave RSS, fds and mappings flat.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from drivers import cuda_problem, open_driver_kind

from kvvmm import Arena, ArgumentError, BusyError, DriverError, KvvmmError, SimDriver
from kvvmm.driver import Driver
from kvvmm.driver.base import CUDA_ERROR_INVALID_VALUE, check_call_ints

linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                           reason="the host driver needs Linux")
G = 2 << 20
ROOT = Path(__file__).resolve().parents[2]
KINDS = ("sim", "host") if sys.platform.startswith("linux") else ("sim",)


def _host(**kw: Any) -> Any:
    from kvvmm.driver.host import HostDriver

    return HostDriver(**{"capacity_bytes": 1 << 30, "granularity": G, **kw})


@pytest.fixture(params=KINDS)
def drv(request: pytest.FixtureRequest) -> Iterator[Driver]:
    d: Any = SimDriver("h200") if request.param == "sim" else _host()
    yield d
    d.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


# -- 1. arguments: one table, every call x every kind of bad value -----------------------------

#: Values that are not ints: ArgumentError. (A bool is an int to Python, never to kvvmm.)
NOT_INTS: list[Any] = [True, False, 1.5, float(4 * G), "2097152", None, [G], b"\x00", object(),
                       complex(G, 0)]
#: Ints no driver can take: DriverError(CUDA_ERROR_INVALID_VALUE), as CUDA answers.
BAD_INTS: list[int] = [-1, -G, 1 << 64, (1 << 64) + 4 * G, 1 << 65, -(1 << 64)]

#: Each call with one argument replaced by X; the state it runs against is made by _setup.
CALLS: dict[str, Callable[[Any, dict[str, int], Any], Any]] = {
    "reserve.size": lambda d, s, x: d.reserve(x),
    "reserve.align": lambda d, s, x: d.reserve(G, x),
    "free.va": lambda d, s, x: d.free(x, 8 * G),
    "free.size": lambda d, s, x: d.free(s["va"], x),
    "create.size": lambda d, s, x: d.create(x),
    "release.handle": lambda d, s, x: d.release(x),
    "map.va": lambda d, s, x: d.map(x, G, s["h"]),
    "map.size": lambda d, s, x: d.map(s["va"] + G, x, s["h"]),
    "map.handle": lambda d, s, x: d.map(s["va"] + G, G, x),
    "unmap.va": lambda d, s, x: d.unmap(x, G),
    "unmap.size": lambda d, s, x: d.unmap(s["va"], x),
    "set_access.va": lambda d, s, x: d.set_access(x, G),
    "set_access.size": lambda d, s, x: d.set_access(s["va"], x),
    "set_access.device": lambda d, s, x: d.set_access(s["va"], G, [x]),
    "export_handle.handle": lambda d, s, x: d.export_handle(x),
    "import_handle.fd": lambda d, s, x: d.import_handle(x, G),
}


def _setup(d: Driver) -> dict[str, int]:
    """A reservation of 8G with a mapped, accessible handle at its start and a spare handle."""
    va = d.reserve(8 * G)
    h0 = d.create(G)
    d.map(va, G, h0)
    d.set_access(va, G)
    return {"va": va, "h0": h0, "h": d.create(G)}


def _kinds() -> tuple[str, ...]:
    """The kinds every argument row is compared on: sim and host, and where a GPU is usable
    the CUDA driver on both paths (its C fast path only where it is built)."""
    if cuda_problem():
        return KINDS
    from kvvmm.driver import cuda as cuda_mod

    return (*KINDS, *(("cuda-c",) if cuda_mod._cudafast is not None else ()), "cuda-python")


def _open(kind: str) -> Any:
    if kind == "sim":
        return SimDriver("h200")
    if kind == "host":
        return _host()
    with pytest.MonkeyPatch.context() as mp:  # read once, when the driver is made
        return open_driver_kind(kind, mp)


def _outcome(call: str, kind: str, x: Any) -> tuple[str, str]:
    d: Any = _open(kind)
    try:
        s = _setup(d)
        before, fds = d.stats(), _fds()
        try:
            CALLS[call](d, s, x)
        except ArgumentError as e:  # a DriverArgumentError: both, and INVALID_VALUE
            assert isinstance(e, DriverError) and e.cuda_error == CUDA_ERROR_INVALID_VALUE
            assert repr(x)[:20] in str(e), str(e)
            got = ("ArgumentError", "")
        except DriverError as e:
            got = ("DriverError", e.cuda_error)
        else:
            raise AssertionError(f"{kind}: {call} accepted {x!r}")
        assert d.stats() == before, f"{kind}: {call}({x!r}) changed {before} -> {d.stats()}"
        assert _fds() == fds, f"{kind}: {call}({x!r}) leaked a file descriptor"
        return got
    finally:
        d.close()


@pytest.mark.parametrize("x", NOT_INTS, ids=lambda x: f"{type(x).__name__}-{x!r}"[:24])
@pytest.mark.parametrize("call", list(CALLS))
def test_a_value_that_is_not_an_int_is_an_argument_error_on_every_driver_and_changes_nothing(
    call: str, x: Any
) -> None:
    got = {kind: _outcome(call, kind, x) for kind in _kinds()}
    assert all(g == ("ArgumentError", "") for g in got.values()), got


@pytest.mark.parametrize("x", BAD_INTS, ids=str)
@pytest.mark.parametrize("call", list(CALLS))
def test_an_int_no_driver_can_take_is_invalid_value_on_every_driver_and_changes_nothing(
    call: str, x: int
) -> None:
    got = {kind: _outcome(call, kind, x) for kind in _kinds()}
    assert set(got.values()) == {("DriverError", CUDA_ERROR_INVALID_VALUE)}, got


def test_the_host_reserve_with_a_64_bit_alignment_is_refused_not_a_segfault() -> None:
    code = textwrap.dedent("""
        from kvvmm.driver.host import HostDriver
        from kvvmm import DriverError
        try:
            HostDriver().reserve(2 << 20, align=2**64)
        except DriverError as e:
            print(e.cuda_error)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == CUDA_ERROR_INVALID_VALUE


@pytest.mark.parametrize("kind", KINDS)
def test_an_arena_of_more_than_two_to_the_64_bytes_is_refused(kind: str) -> None:
    d: Any = SimDriver("h200") if kind == "sim" else _host()
    with pytest.raises(KvvmmError):
        Arena(d, reserve_bytes=(1 << 64) + 4 * G)
    assert d.stats().clean


@pytest.mark.parametrize("kind", KINDS)
def test_a_reservation_too_large_for_any_va_is_out_of_memory_on_sim_and_host(kind: str) -> None:
    d: Any = SimDriver("h200") if kind == "sim" else _host()
    for size, align in ((1 << 62, 0), (G, 1 << 63), ((1 << 64) - G, 0)):
        with pytest.raises(DriverError) as e:
            d.reserve(size, align)
        assert e.value.cuda_error == "CUDA_ERROR_OUT_OF_MEMORY"
    assert d.stats().clean


@pytest.mark.parametrize("kind", KINDS)
def test_a_numpy_int_counts_as_its_value(kind: str) -> None:
    np = pytest.importorskip("numpy")
    d: Any = SimDriver("h200") if kind == "sim" else _host()
    va = d.reserve(np.int64(4 * G))
    h = d.create(np.uint64(G))
    d.map(np.int64(va), np.int32(G), np.int64(h))
    d.set_access(va, G)
    d.unmap(va, G)
    d.release(h)
    d.free(va, 4 * G)
    assert d.stats().clean


def test_a_handle_of_true_or_one_point_zero_is_not_handle_one() -> None:
    d = SimDriver("h200")
    va = d.reserve(4 * G)
    h = d.create(G)
    assert h == 1
    for x in (True, 1.0):
        with pytest.raises(ArgumentError):
            d.map(va, G, x)
        with pytest.raises(ArgumentError):
            d.release(x)
    assert d.stats().handles == 1 and d.stats().mappings == 0


def test_the_shared_check_returns_plain_ints_and_names_the_call() -> None:
    assert check_call_ints("map", va=0, size=G) == {"va": 0, "size": G}
    with pytest.raises(ArgumentError, match=r"size=1\.5 .*map\(\) refused"):
        check_call_ints("map", va=0, size=1.5)
    with pytest.raises(DriverError, match="wraps"):
        check_call_ints("map", va=(1 << 64) - G, size=2 * G)
    with pytest.raises(DriverError, match="file descriptor"):
        check_call_ints("import_handle", fd=1 << 31, size=G)


@linux
def test_a_host_create_of_a_float_size_leaks_no_memfd() -> None:
    d = _host()
    fds = _fds()
    with pytest.raises(ArgumentError):
        d.create(4194304.0)
    assert _fds() == fds and d.stats().clean


# -- 3. sealed handles ------------------------------------------------------------------------


@linux
def test_a_peer_cannot_truncate_an_exported_host_handle_and_the_exporter_keeps_reading() -> None:
    d = _host()
    va = d.reserve(4 * G)
    h = d.create(G)
    d.map(va, G, h)
    d.set_access(va, G)
    ctypes.memmove(va + G - 5, b"alive", 5)
    fd = d.export_handle(h)
    os.set_inheritable(fd, True)
    code = textwrap.dedent(f"""
        import os, errno
        for size in (0, 4096, {4 * G}):
            try:
                os.ftruncate({fd}, size)
            except OSError as e:
                assert e.errno == errno.EPERM, e
            else:
                raise SystemExit("truncated to %d" % size)
        print("refused")
    """)
    r = subprocess.run([sys.executable, "-c", code], pass_fds=(fd,), capture_output=True,
                       text=True, timeout=60, check=False)
    os.close(fd)
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stderr + r.stdout
    assert ctypes.string_at(va + G - 5, 5) == b"alive"  # no SIGBUS: the pages are all there
    d.close()


@linux
def test_import_takes_only_a_memfd_sealed_against_resizing() -> None:
    d = _host()
    unsealed = os.memfd_create("x", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, G)
    with tempfile.TemporaryFile() as f:
        f.truncate(G)
        for fd in (unsealed, f.fileno()):
            with pytest.raises(DriverError, match="sealed") as e:
                d.import_handle(fd, G)
            assert e.value.cuda_error == CUDA_ERROR_INVALID_VALUE
            os.fstat(fd)  # still the caller's: not closed
    os.close(unsealed)
    assert d.stats().clean


@linux
def test_import_refuses_the_drivers_own_memfd() -> None:
    d: Any = _host()
    h = d.create(G)
    own = d._fds[h]
    with pytest.raises(DriverError, match="own memfd"):
        d.import_handle(own, G)
    d.release(h)
    assert d.stats().clean


# -- 4. close under live views --------------------------------------------------------------


@linux
def test_close_and_free_refuse_while_a_reservation_is_pinned_and_change_nothing() -> None:
    d: Any = _host()
    va = d.reserve(4 * G)
    h = d.create(G)
    d.map(va, G, h)
    d.set_access(va, G)
    d.pin(va)
    d.pin(va)
    before = d.stats()
    with pytest.raises(BusyError, match="pinned"):
        d.close()
    d.unmap(va, G)
    d.release(h)
    with pytest.raises(BusyError):
        d.free(va, 4 * G)
    assert d.stats().reservations == before.reservations == 1
    assert ctypes.string_at(va, 4) == b"\0\0\0\0"  # still reserved, reads zeros
    d.unpin(va)
    with pytest.raises(BusyError):
        d.close()
    d.unpin(va)
    d.close()
    assert d.stats().clean


@linux
def test_pin_of_an_address_that_is_not_a_reservation_is_invalid_value() -> None:
    d: Any = _host()
    with pytest.raises(DriverError) as e:
        d.pin(0x1000)
    assert e.value.cuda_error == CUDA_ERROR_INVALID_VALUE
    with pytest.raises(ArgumentError):
        d.pin("0x1000")


# -- 5. safe reads of unbacked VA (in a child: a crash must not take pytest with it) ---------


def _child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONFAULTHANDLER": ""}
    env.pop("PYTHONFAULTHANDLER")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env, check=False)


@linux
def test_printing_a_host_tensor_before_its_commit_reads_zeros_and_the_process_lives() -> None:
    r = _child("""
        from kvvmm import Arena
        from kvvmm.driver.host import HostDriver
        d = HostDriver(capacity_bytes=1 << 30)
        a = Arena(d, reserve_bytes=64 << 20)
        off = a.allocate(32 << 20, "kv")
        t = a.tensor(off, (16 << 20,), "bfloat16")
        print(t)
        assert float(t.float().abs().sum()) == 0.0
        a.commit(off, 2 << 20)
        t[:4] = 1.0
        a.decommit(off, 0)
        assert float(t.float().abs().sum()) == 0.0  # decommitted: zeros again, no crash
        print("survived")
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("survived")


@linux
def test_writing_unbacked_host_va_still_faults() -> None:
    r = _child("""
        import ctypes
        from kvvmm.driver.host import HostDriver
        d = HostDriver(capacity_bytes=1 << 30)
        va = d.reserve(4 << 20)
        ctypes.memmove(va, b"x", 1)
        print("wrote")
    """)
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout, r.stderr[-500:])
    assert "wrote" not in r.stdout


# -- 6. recommitted memory is zero ------------------------------------------------------------


@linux
def test_recommitted_host_memory_never_shows_the_earlier_tenants_bytes() -> None:
    d = _host()
    va = d.reserve(8 * G)
    for round_ in range(3):
        hs = []
        for i in range(4):
            h = d.create(G)
            d.map(va + i * G, G, h)
            d.set_access(va + i * G, G)
            hs.append(h)
        assert ctypes.string_at(va, 4 * G).count(0) == 4 * G, f"round {round_}: not zero"
        ctypes.memset(va, 0xAB, 4 * G)
        for i, h in enumerate(hs):
            d.unmap(va + i * G, G)
            d.release(h)
        assert ctypes.string_at(va, 4 * G).count(0) == 4 * G  # unbacked: zeros
    d.free(va, 8 * G)
    assert d.stats().clean


# -- 7. long runs stay flat ------------------------------------------------------------------


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _maps_lines() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@linux
def test_ten_thousand_commit_decommit_cycles_leave_rss_fds_and_mappings_flat() -> None:
    d: Any = _host(granularity=64 << 10)  # 64 KiB handles: the cost is the calls, not memset
    g = d.granularity()
    va = d.reserve(64 * g)

    def cycles(n: int) -> None:
        for i in range(n):
            at = va + (i % 63) * g
            h = d.create(g)
            d.map(at, g, h)
            d.set_access(at, g)
            ctypes.memset(at, 1, 64)
            d.unmap(at, g)
            d.release(h)

    cycles(500)  # warm up allocator caches
    rss, fds, maps = _rss_kib(), _fds(), _maps_lines()
    cycles(10_000)
    assert _fds() == fds
    assert _maps_lines() <= maps + 2
    assert _rss_kib() - rss < 8 * 1024, f"RSS grew {_rss_kib() - rss} KiB"
    d.free(va, 64 * g)
    assert d.stats().clean


def test_fcntl_has_the_seals_the_host_driver_uses() -> None:
    assert fcntl.F_SEAL_SHRINK and fcntl.F_SEAL_GROW and fcntl.F_ADD_SEALS

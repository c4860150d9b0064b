"""Handles between processes: export as a POSIX file descriptor, import elsewhere.

On the host driver the descriptor is the memfd itself: a *spawned* child receives it over a
pipe (SCM_RIGHTS: ``multiprocessing.reduction.send_handle`` / ``recv_handle``), imports it,
maps it into a reservation of its own and sees the parent's bytes; what it writes, the parent
sees. The simulator models the same calls within one node of one process.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
from collections.abc import Callable
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

import pytest

from kvvmm.arena import Arena
from kvvmm.driver import Driver, FaultyDriver, SimDriver, SimNode
from kvvmm.driver.base import CUDA_ERROR_INVALID_VALUE
from kvvmm.errors import ArgumentError, DriverError
from kvvmm.record import Trace, TracingDriver
from kvvmm.replay import replay, replay_arenas
from kvvmm.units import GiB, MiB

MakeDriver = Callable[..., Driver]
G = 2 * MiB
host_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                               reason="the host driver needs Linux (memfd)")
PATTERN = bytes(range(256)) * 16  # 4 KiB


def _host(**options: Any) -> Driver:
    from kvvmm.driver.host import HostDriver

    return HostDriver(capacity_bytes=1 * GiB, **options)


# -- children (module level: a spawned process imports them by name) -----------------------


def _child_reads_and_writes_back(conn: Any, size: int) -> None:
    """Import the fd, map it at a VA of our own, check the parent's bytes, write ours."""
    try:
        fd = recv_handle(conn)
        drv = _host()
        va = drv.reserve(4 * size)
        h = drv.import_handle(fd, size)
        drv.map(va + size, size, h)  # not where the parent mapped it: another reservation
        drv.set_access(va + size, size)
        seen = ctypes.string_at(va + size, len(PATTERN))
        ctypes.memmove(va + size + size - 4096, b"child was here", 14)
        conn.send(("ok", seen == PATTERN, va + size))
        drv.close()  # unmaps and releases (closes the fd): the parent's memory stays
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}", 0))
    finally:
        conn.close()


def _child_adopts_into_an_arena(conn: Any, sizes: list[int]) -> None:
    """Back an allocation of our own arena with the parent's handles; read and write it."""
    try:
        drv = _host()
        arena = Arena(drv, reserve_bytes=64 * MiB, name="child")
        off = arena.allocate(sum(sizes), "kv")
        for size in sizes:
            arena.adopt(off, drv.import_handle(recv_handle(conn), size), size)
        t = arena.tensor(off, (sum(sizes) // 2,), "bfloat16")
        total = float(t.float().sum())
        t[-8:] = 7.0
        snap = arena.snapshot()
        del t
        arena.close()
        conn.send(("ok", total, [m.size_bytes for m in snap.mappings], drv.stats().clean))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}", [], False))
    finally:
        conn.close()


def _spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(child, *args), daemon=True)
    p.start()
    child.close()
    return p, parent


# -- the host driver, across processes ----------------------------------------------------


@host_only
def test_a_spawned_child_maps_the_parents_memfd_and_both_see_each_others_bytes() -> None:
    drv = _host()
    size = 4 * G
    va = drv.reserve(8 * size)
    h = drv.create(size)
    drv.map(va, size, h)
    drv.set_access(va, size)
    ctypes.memmove(va, PATTERN, len(PATTERN))
    fd = drv.export_handle(h)
    p, conn = _spawn(_child_reads_and_writes_back, size)
    send_handle(conn, fd, p.pid)
    os.close(fd)  # the child has its own copy now
    status, same, _child_va = conn.recv()
    p.join(60)
    assert status == "ok", same
    assert same is True, "the child did not see the parent's bytes"
    assert ctypes.string_at(va + size - 4096, 14) == b"child was here"
    assert p.exitcode == 0
    drv.unmap(va, size)
    drv.release(h)
    drv.free(va, 8 * size)
    assert drv.stats().clean


@host_only
def test_a_spawned_child_backs_its_arena_with_the_parents_handles() -> None:
    pytest.importorskip("torch")
    drv = _host()
    arena = Arena(drv, reserve_bytes=256 * MiB, name="parent")
    off = arena.allocate(16 * MiB, "kv")
    arena.commit(off, 4 * MiB)
    arena.commit(off, 10 * MiB)  # two handles: 4 MiB then 6 MiB
    t = arena.tensor(off, (5 * MiB,), "bfloat16")
    t.fill_(1.0)
    fds = arena.export_handles(off)
    assert [s for _, s in fds] == [4 * MiB, 6 * MiB]
    p, conn = _spawn(_child_adopts_into_an_arena, [s for _, s in fds])
    for fd, _ in fds:
        send_handle(conn, fd, p.pid)
        os.close(fd)
    status, total, child_maps, child_clean = conn.recv()
    p.join(60)
    assert status == "ok", total
    assert total == 5 * MiB, "the child summed something else than the parent's ones"
    assert child_maps == [4 * MiB, 6 * MiB] and child_clean
    assert t[-8:].tolist() == [7.0] * 8, "the parent does not see the child's write"
    assert float(t[:-8].float().sum()) == 5 * MiB - 8
    del t
    arena.close()
    assert drv.stats().clean


@host_only
def test_import_checks_the_descriptor_and_its_size(make_driver: MakeDriver) -> None:
    drv = make_driver("host")
    h = drv.create(2 * G)
    fd = drv.export_handle(h)
    before = drv.stats()
    for bad_fd, size, why in [
        (fd, 4 * G, "holds 4194304 bytes, not 8388608"),
        (fd, G + 4096, "granularity"),
        (-1, 2 * G, "not a file descriptor"),
        (987654, 2 * G, "not an open file descriptor"),
    ]:
        with pytest.raises(DriverError) as info:
            drv.import_handle(bad_fd, size)
        assert info.value.cuda_error == CUDA_ERROR_INVALID_VALUE
        assert why in str(info.value), str(info.value)
        assert drv.stats() == before
    r, w = os.pipe()
    with pytest.raises(DriverError, match="not a memfd"):
        drv.import_handle(r, 2 * G)
    os.close(r)
    os.close(w)
    os.fstat(fd)  # a refused descriptor is still the caller's: open
    h2 = drv.import_handle(fd, 2 * G)  # the right size: taken
    s = drv.stats()
    assert (s.handles, s.physical_bytes) == (2, 2 * G), "an import is not counted as memory"
    drv.release(h2)
    with pytest.raises(OSError):
        os.fstat(fd)  # the driver owned it, and closed it on release
    drv.release(h)
    assert drv.stats().clean


@host_only
def test_an_import_in_the_same_process_aliases_the_same_pages(make_driver: MakeDriver) -> None:
    drv = make_driver("host")
    va = drv.reserve(8 * G)
    h = drv.create(2 * G)
    drv.map(va, 2 * G, h)
    drv.set_access(va, 2 * G)
    h2 = drv.import_handle(drv.export_handle(h), 2 * G)
    drv.map(va + 4 * G, 2 * G, h2)
    drv.set_access(va + 4 * G, 2 * G)
    ctypes.memmove(va + 100, b"same pages", 10)
    assert ctypes.string_at(va + 4 * G + 100, 10) == b"same pages"
    drv.release(h)
    drv.unmap(va, 2 * G)
    assert ctypes.string_at(va + 4 * G + 100, 10) == b"same pages", "the import keeps them"


@pytest.mark.parametrize("kind", ["sim", "host"])
def test_export_of_a_released_or_unknown_handle_is_refused(kind: str,
                                                           make_driver: MakeDriver) -> None:
    if kind == "host" and not sys.platform.startswith("linux"):
        pytest.skip("the host driver needs Linux")
    drv = make_driver(kind)
    h = drv.create(2 * G)
    drv.release(h)
    for handle in (h, 12345):
        with pytest.raises(DriverError) as info:
            drv.export_handle(handle)
        assert info.value.cuda_error == CUDA_ERROR_INVALID_VALUE
        assert "not live" in str(info.value)


# -- the simulator ------------------------------------------------------------------------


def test_a_sim_export_is_a_real_descriptor_another_device_of_the_node_imports() -> None:
    node = SimNode(devices=2)
    d0, d1 = node.drivers()
    h = d0.create(4 * G)
    fd = d0.export_handle(h)
    os.fstat(fd)  # a real descriptor: closing or sending it behaves
    h1 = d1.import_handle(fd, 4 * G)
    with pytest.raises(OSError):
        os.fstat(fd)  # taken and closed by the import
    va = d1.reserve(8 * G)
    d1.map(va, 4 * G, h1)
    d1.set_access(va, 4 * G)  # device 1 reaching device 0's memory: a peer path exists
    s0, s1 = d0.stats(), d1.stats()
    assert (s0.handles, s0.physical_bytes) == (1, 4 * G)
    assert (s1.handles, s1.physical_bytes) == (1, 0), "counted by its creator only"
    d1.unmap(va, 4 * G)
    d1.release(h1)
    d1.free(va, 8 * G)
    d0.release(h)
    assert d0.stats().clean and d1.stats().clean


def test_sim_memory_from_a_device_without_a_peer_path_cannot_be_accessed() -> None:
    node = SimNode(devices=2, no_peer=[(0, 1)])
    d0, d1 = node.drivers()
    h1 = d1.import_handle(d0.export_handle(d0.create(2 * G)), 2 * G)
    va = d1.reserve(4 * G)
    d1.map(va, 2 * G, h1)
    with pytest.raises(DriverError, match="cannot access memory on device 0"):
        d1.set_access(va, 2 * G)


def test_sim_imports_check_the_node_and_the_size() -> None:
    a, b = SimDriver(), SimDriver()
    fd = a.export_handle(a.create(2 * G))
    with pytest.raises(DriverError, match="not a handle exported") as info:
        b.import_handle(fd, 2 * G)  # another (lone) driver: another "process"
    assert info.value.cuda_error == CUDA_ERROR_INVALID_VALUE
    with pytest.raises(DriverError, match="4194304 bytes, not 8388608"):
        a.import_handle(fd, 4 * G)
    os.fstat(fd)  # refused: still the caller's
    r, w = os.pipe()
    with pytest.raises(DriverError, match="not a handle exported"):
        a.import_handle(r, 2 * G)
    for x in (r, w):
        os.close(x)
    assert a.stats().handles == 1
    h = a.import_handle(fd, 2 * G)
    assert a.stats().handles == 2 and a.stats().physical_bytes == 2 * G
    a.release(h)


def test_a_closed_sim_export_cannot_be_imported() -> None:
    d = SimDriver()
    fd = d.export_handle(d.create(2 * G))
    os.close(fd)
    with pytest.raises(DriverError, match="not a handle exported"):
        d.import_handle(fd, 2 * G)


@pytest.mark.parametrize("bad", [True, "3", 3.0])
def test_import_of_something_not_a_descriptor_is_refused(bad: object) -> None:
    with pytest.raises(DriverError, match="not a file descriptor"):
        SimDriver().import_handle(bad, 2 * G)  # type: ignore[arg-type]


def test_adopt_backs_the_next_bytes_and_the_arena_owns_the_handle() -> None:
    node = SimNode(devices=2)
    d0, d1 = node.drivers()
    src = Arena(d0, reserve_bytes=64 * MiB, name="src")
    so = src.allocate(16 * MiB, "kv")
    src.commit(so, 4 * MiB)
    src.commit(so, 8 * MiB)
    dst = Arena(d1, reserve_bytes=64 * MiB, name="dst")
    do = dst.allocate(16 * MiB, "kv")
    for fd, size in src.export_handles(so):
        assert dst.adopt(do, d1.import_handle(fd, size), size) == size
    snap = dst.snapshot()
    snap.check()
    assert [m.size_bytes for m in snap.mappings] == [4 * MiB, 4 * MiB]
    assert snap.allocation("kv").backed_bytes == 8 * MiB
    dst.decommit(do, 4 * MiB)  # releases the adopted handle like its own
    dst.close()
    src.close()
    assert d0.stats().clean and d1.stats().clean


@pytest.mark.parametrize(("nbytes", "err"), [
    (G + 4096, "granularity"), (0, "nbytes"), (64 * MiB, "nbytes"),
])
def test_adopt_checks_its_size_before_mapping(nbytes: int, err: str) -> None:
    d = SimDriver()
    arena = Arena(d, reserve_bytes=64 * MiB)
    off = arena.allocate(16 * MiB, "kv")
    h = d.create(2 * G)
    with pytest.raises(ArgumentError, match=err):
        arena.adopt(off, h, nbytes)
    assert d.stats().mappings == 0


def test_a_failed_adopt_is_undone_and_the_handle_stays_the_callers() -> None:
    inner = SimDriver()
    d = FaultyDriver(inner, fail={"set_access": 1})
    arena = Arena(d, reserve_bytes=64 * MiB)
    off = arena.allocate(16 * MiB, "kv")
    h = d.create(2 * G)
    before = arena.snapshot()
    with pytest.raises(DriverError):
        arena.adopt(off, h, 2 * G)
    assert arena.snapshot() == before and inner.stats().mappings == 0
    d.release(h)  # still ours to release
    arena.close()
    assert inner.stats().clean


def test_a_failed_export_closes_the_descriptors_already_made() -> None:
    inner = SimDriver()
    d = FaultyDriver(inner, fail={"export_handle": 2})
    arena = Arena(d, reserve_bytes=64 * MiB)
    off = arena.allocate(16 * MiB, "kv")
    arena.commit(off, 4 * MiB)
    arena.commit(off, 8 * MiB)
    opened = set(os.listdir("/proc/self/fd")) if sys.platform.startswith("linux") else set()
    with pytest.raises(DriverError):
        arena.export_handles(off)
    if opened:
        assert set(os.listdir("/proc/self/fd")) == opened, "a descriptor leaked"
    arena.close()


def test_exports_and_imports_are_traced_and_replay() -> None:
    node = SimNode(devices=2)
    t = TracingDriver(node.driver(0))
    h = t.create(2 * G)
    fd = t.export_handle(h)
    h2 = t.import_handle(fd, 2 * G)
    with pytest.raises(DriverError):
        t.import_handle(fd, 2 * G)  # closed now: refused, and recorded as such
    va = t.reserve(4 * G)
    t.map(va, 2 * G, h2)
    t.set_access(va, 2 * G)
    ops = [(e.op, e.error) for e in t.trace.driver_calls()]
    assert ops[:4] == [("create", None), ("export_handle", None), ("import_handle", None),
                       ("import_handle", CUDA_ERROR_INVALID_VALUE)]
    loaded = Trace.from_json(t.trace.to_json())
    assert replay(loaded, SimDriver()) == []


def test_an_import_from_another_process_replays_as_a_create_of_the_same_size() -> None:
    node = SimNode(devices=2)
    exporter = node.driver(0)  # not traced: it stands for the other process
    t = TracingDriver(node.driver(1))
    arena = Arena(t, reserve_bytes=64 * MiB, name="child", trace=t.trace)
    off = arena.allocate(16 * MiB, "kv")
    fd = exporter.export_handle(exporter.create(4 * MiB))
    arena.adopt(off, t.import_handle(fd, 4 * MiB), 4 * MiB)
    assert [e.op for e in t.trace.driver_calls()][-3:] == ["import_handle", "map", "set_access"]
    assert replay(t.trace, SimDriver()) == []
    (snap,) = replay_arenas(t.trace)
    assert [m.size_bytes for m in snap.mappings] == [4 * MiB]
    assert snap.mappings == arena.snapshot().mappings
    arena.close()

"""Drivers are thread safe. Several arenas on one sim or host driver, used from
several threads at once, leave the driver's book consistent: no KeyError, no "already mapped",
no leaked handle or reservation, every snapshot's conservation check holds. Two threads
releasing one handle are raced on the CUDA driver too (both paths), where a GPU is usable.

A deadlock fails fast: faulthandler dumps every thread's stack and the joins time out.
"""

from __future__ import annotations

import faulthandler
import itertools
import random
import sys
import threading
from typing import Any

import pytest
from drivers import driver_params, open_driver_kind

from kvvmm import Arena, DriverError, SimDriver, SimNode

G = 2 << 20
KINDS = ("sim", "host") if sys.platform.startswith("linux") else ("sim",)
THREADS, ARENAS, OPS = 8, 4, 200


def _driver(kind: str) -> Any:
    if kind == "sim":
        return SimDriver("h200")
    from kvvmm.driver.host import HostDriver

    return HostDriver(capacity_bytes=1 << 30, granularity=G)


def _run(workers: list[threading.Thread], timeout_s: float = 60.0) -> None:
    faulthandler.dump_traceback_later(timeout_s, exit=False)
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout_s)
        assert not any(w.is_alive() for w in workers), "a worker hung (deadlock?)"
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("kind", KINDS)
def test_threads_committing_and_decommitting_several_arenas_on_one_driver_leave_it_clean(
    kind: str,
) -> None:
    d = _driver(kind)
    arenas = [Arena(d, reserve_bytes=32 * G, name=f"a{i}") for i in range(ARENAS)]
    offs = [[a.allocate(8 * G, f"kv{j}") for j in range(2)] for a in arenas]
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(OPS):
                i = rng.randrange(ARENAS)
                a, off = arenas[i], rng.choice(offs[i])
                if rng.random() < 0.6:
                    a.commit(off, rng.randrange(1, 9) * G)
                else:
                    a.decommit(off, rng.randrange(0, 5) * G)
                assert a.snapshot().backed_bytes <= a.reserved_bytes
        except BaseException as e:
            errors.append(e)

    _run([threading.Thread(target=work, args=(s,)) for s in range(THREADS)])
    assert not errors, errors[:3]
    for a in arenas:
        snap = a.snapshot()
        if hasattr(snap, "check"):
            snap.check()
        assert sum(m.size_bytes for m in snap.mappings) == snap.backed_bytes
    assert d.stats().physical_bytes == sum(a.backed_bytes for a in arenas)
    for a in arenas:
        a.close()
    assert d.stats().clean, d.stats()


@pytest.mark.parametrize("kind", KINDS)
def test_threads_making_raw_driver_calls_never_corrupt_the_book(kind: str) -> None:
    d = _driver(kind)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(OPS // 4):
                size = rng.randrange(2, 6) * G
                va = d.reserve(size)
                hs = [d.create(G) for _ in range(2)]
                for k, h in enumerate(hs):
                    d.map(va + k * G, G, h)
                    d.set_access(va + k * G, G)
                early = rng.random() < 0.5
                if early:
                    d.release(hs[0])  # legal while mapped
                d.unmap(va, 2 * G)
                for h in hs[1:] if early else hs:
                    d.release(h)
                d.free(va, size)
        except BaseException as e:
            errors.append(e)

    _run([threading.Thread(target=work, args=(s,)) for s in range(THREADS)])
    assert not errors, errors[:3]
    assert d.stats().clean, d.stats()
    d.close()


@pytest.mark.parametrize("kind", driver_params(("sim", "host", "cuda-c", "cuda-python")))
def test_two_threads_releasing_one_handle_release_it_once(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the CUDA driver too, where a GPU is usable: its C path takes its own lock.
    d = open_driver_kind(kind, monkeypatch)
    for _ in range(50):
        h = d.create(G)
        won: list[int] = []
        barrier = threading.Barrier(2)

        def go(h: int = h, barrier: threading.Barrier = barrier, won: list[int] = won) -> None:
            barrier.wait()
            try:
                d.release(h)
                won.append(1)
            except DriverError:
                pass

        _run([threading.Thread(target=go) for _ in range(2)], 30)
        assert won == [1]
    assert d.stats().clean
    d.close()


def test_the_devices_of_a_sim_node_reserve_from_threads_without_overlap() -> None:
    node = SimNode("h200", devices=4)
    drivers = node.drivers()
    got: list[tuple[int, int]] = []

    def work(i: int) -> None:
        for _ in range(100):
            got.append((drivers[i % 4].reserve(4 * G), 4 * G))

    _run([threading.Thread(target=work, args=(i,)) for i in range(8)])
    got.sort()
    assert all(a + s <= b for (a, s), (b, _) in itertools.pairwise(got))
    assert len(got) == 800

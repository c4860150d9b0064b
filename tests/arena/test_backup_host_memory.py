"""HostBackup's two ways to pin host memory on CUDA, the chunked pinning that overlaps the
copy, and the unpinning off the wake's path.

No GPU here: the CUDA runtime's register/unregister are stood in for by a recorder (the
pinning module reaches them through ``_cudart`` and ``_check_cuda`` only), and ``like`` says
"cuda" the only way HostBackup reads it, by its device type. What is checked is HostBackup's
own part, for any size and chunking: the chunks start on huge-page boundaries and cover
exactly the backup's bytes, each registered once on a worker thread, a chunk's copy is
queued while a later chunk is still being pinned, bytes saved come back, drop unregisters
every chunk once and unmaps (on the thread or not), and a register failing at any chunk
leaves nothing registered, mapped or running.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvvmm.arena import pinned
from kvvmm.arena.backup import HOST_MEMORY, HostBackup, wait_unpinned
from kvvmm.errors import ArgumentError, OutOfRangeError

CUDA_LIKE: Any = SimpleNamespace(device=SimpleNamespace(type="cuda"))
MiB = 1 << 20


class FakeRuntime:
    """cudaHostRegister/Unregister: records, and fails the ``fail_at``-th register
    (1-based)."""

    def __init__(self) -> None:
        self.fail_at = 0
        self.lock = threading.Lock()
        self.calls = 0
        self.registered: dict[int, int] = {}
        self.threads: set[str] = set()
        self.unregistered: list[tuple[int, str]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        with self.lock:
            self.calls += 1
            if self.calls == self.fail_at:
                return 2  # cudaErrorMemoryAllocation
            assert ptr not in self.registered
            self.registered[ptr] = size
            self.threads.add(threading.current_thread().name)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        with self.lock:
            self.unregistered.append((ptr, threading.current_thread().name))
            self.registered.pop(ptr)
        return 0


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)

    def check(err: int) -> None:
        if err != 0:
            raise RuntimeError(f"CUDA error {err}")

    monkeypatch.setattr(pinned, "_check_cuda", check)
    return fake


def _pin_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvvmm-pin")]


@pytest.mark.parametrize("bad", ["pinned", "", None, 3, "TORCH"])
def test_an_unknown_memory_is_refused_naming_the_choices(bad: Any) -> None:
    with pytest.raises(ArgumentError, match="memory") as e:
        HostBackup(bad)
    assert all(m in str(e.value) for m in HOST_MEMORY)


@pytest.mark.parametrize(("name", "bad"), [
    ("free_on_thread", 1), ("free_on_thread", None), ("keep", "yes"), ("keep", 0),
    ("chunk_bytes", 0), ("chunk_bytes", MiB), ("chunk_bytes", 3 * MiB), ("chunk_bytes", True),
    ("chunk_bytes", 2.0 * MiB), ("workers", 0), ("workers", "2"), ("workers", 65)])
def test_bad_options_are_refused_naming_the_option_and_its_limit(name: str, bad: Any) -> None:
    with pytest.raises((ArgumentError, OutOfRangeError), match=name) as e:
        HostBackup(**{name: bad})
    if name == "chunk_bytes":
        assert "multiple of 2 MiB" in str(e.value)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # reset by hand below
@given(nbytes=st.integers(1, 13 * MiB), chunk_mib=st.sampled_from([2, 4, 6]),
       workers=st.integers(1, 4), pos=st.integers(0, 5 * MiB), on_thread=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_an_mmap_backup_registers_its_bytes_chunk_by_chunk_on_worker_threads_and_gives_them_back(
        rt: FakeRuntime, nbytes: int, chunk_mib: int, workers: int, pos: int, on_thread: bool,
        seed: int) -> None:
    rt.registered.clear()
    rt.unregistered.clear()
    rt.threads.clear()
    chunk = chunk_mib * MiB
    b = HostBackup("mmap", free_on_thread=on_thread, chunk_bytes=chunk, workers=workers)
    b.open(nbytes, CUDA_LIKE)
    assert b.nbytes == nbytes
    pos = min(pos, nbytes - 1)
    src = torch.randint(0, 256, (nbytes - pos,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    b.save(pos, src)
    b.flush(torch.device("cpu"))
    back = torch.empty_like(src)
    b.load(pos, back)
    assert torch.equal(back, src)
    got = sorted(rt.registered.items())
    base = got[0][0]
    assert base % (2 * MiB) == 0
    assert got == [(base + s, min(chunk, nbytes - s)) for s in range(0, nbytes, chunk)]
    assert rt.threads and all(n.startswith("kvvmm-pin-") for n in rt.threads)
    ph = b.phases
    assert ph["chunks"] == len(got) and ph["workers"] == min(workers, len(got))
    assert ph["reused"] == 0 and ph["fault_s"] >= 0 and ph["pin_s"] >= 0
    assert ph["ready_s"] > 0
    host = b._host
    assert host is not None
    m = host._map
    assert m is not None
    b.drop()
    assert wait_unpinned(5.0)
    me = threading.current_thread().name
    assert sorted(p for p, _ in rt.unregistered) == [p for p, _ in got]
    assert {t for _, t in rt.unregistered} == {"kvvmm-unpin" if on_thread else me}
    assert not rt.registered and m.closed and not _pin_threads()
    b.drop()  # idempotent
    assert len(rt.unregistered) == len(got)


def test_a_chunks_copy_is_queued_while_a_later_chunk_is_still_being_pinned(
        rt: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real = pinned.HostMapping._fault_in

    def slow_last(self: pinned.HostMapping, start: int, n: int) -> None:
        if start == 6 * MiB:
            assert release.wait(10.0)
        real(self, start, n)

    monkeypatch.setattr(pinned.HostMapping, "_fault_in", slow_last)
    b = HostBackup("mmap", chunk_bytes=2 * MiB, workers=2)
    b.open(8 * MiB, CUDA_LIKE)
    host = b._host
    assert host is not None
    src = torch.arange(8 * MiB, dtype=torch.int64).to(torch.uint8)
    b.save(0, src[:4 * MiB])  # chunks 0 and 1 copied while chunk 3 is not ready
    assert not host._ready[3] and len(rt.registered) < 4
    assert torch.equal(host.buf[:4 * MiB], src[:4 * MiB])
    release.set()
    b.save(4 * MiB, src[4 * MiB:])
    back = torch.empty_like(src)
    b.load(0, back)
    assert torch.equal(back, src) and len(rt.registered) == 4
    assert b.phases["wait_s"] >= 0
    b.drop()
    assert wait_unpinned(5.0) and not rt.registered


@pytest.mark.parametrize("fail_at", [1, 2, 4])
@pytest.mark.parametrize("workers", [1, 3])
def test_a_register_failing_at_any_chunk_surfaces_in_the_copy_and_leaves_nothing_behind(
        rt: FakeRuntime, monkeypatch: pytest.MonkeyPatch, fail_at: int, workers: int) -> None:
    rt.fail_at = fail_at
    maps: list[Any] = []
    real = pinned.mmap.mmap

    def spy(*a: Any, **kw: Any) -> Any:
        maps.append(real(*a, **kw))
        return maps[-1]

    monkeypatch.setattr(pinned.mmap, "mmap", spy)
    b = HostBackup("mmap", chunk_bytes=2 * MiB, workers=workers)
    b.open(8 * MiB, CUDA_LIKE)
    with pytest.raises(RuntimeError, match="CUDA error 2"):
        b.save(0, torch.zeros(8 * MiB, dtype=torch.uint8))
    b.drop()
    assert wait_unpinned(5.0)
    assert not rt.registered and len(maps) == 1 and maps[0].closed
    assert b._host is None and not b._pieces and not _pin_threads()


def test_off_cuda_torch_memory_is_one_plain_cpu_tensor_and_drop_starts_no_thread(
        rt: FakeRuntime) -> None:
    b = HostBackup("torch")
    b.open(3 * MiB, torch.empty(1, dtype=torch.uint8))
    assert [t.device.type for _, t in b._pieces] == ["cpu"] and not rt.registered
    before = threading.active_count()
    b.drop()
    assert threading.active_count() == before and not rt.unregistered


@pytest.mark.parametrize("populate", [True, False])
def test_off_cuda_an_mmap_backup_is_faulted_in_by_its_threads_and_never_registered(
        rt: FakeRuntime, monkeypatch: pytest.MonkeyPatch, populate: bool) -> None:
    # populate=False: the kernel lacks MADV_POPULATE_WRITE; a byte a page is written instead
    monkeypatch.setattr(pinned, "_populate_ok", [populate])
    b = HostBackup("mmap", chunk_bytes=2 * MiB, workers=2)
    b.open(7 * MiB, torch.empty(1, dtype=torch.uint8))
    src = torch.randint(0, 256, (7 * MiB,), dtype=torch.uint8)
    b.save(0, src)
    back = torch.empty_like(src)
    b.load(0, back)
    assert torch.equal(back, src)
    assert b.phases["chunks"] == 4 and b.phases["pin_s"] == 0
    assert not rt.registered
    b.drop()
    assert not rt.unregistered and not _pin_threads()


def test_an_empty_mmap_backup_maps_and_registers_nothing(rt: FakeRuntime) -> None:
    b = HostBackup("mmap")
    b.open(0, CUDA_LIKE)
    assert not rt.registered and b._host is None
    b.drop()
    assert wait_unpinned(1.0)


def test_a_kept_backup_serves_the_next_open_without_pinning_again(rt: FakeRuntime) -> None:
    b = HostBackup("mmap", chunk_bytes=2 * MiB, workers=2, keep=True)
    assert b.reusable
    b.open(6 * MiB, CUDA_LIKE)
    b.save(0, torch.ones(6 * MiB, dtype=torch.uint8))
    first = dict(rt.registered)
    b.open(5 * MiB, CUDA_LIKE)  # smaller: the same memory
    assert b.phases["reused"] == 1 and rt.registered == first and b.nbytes == 5 * MiB
    src = torch.randint(0, 256, (5 * MiB,), dtype=torch.uint8)
    b.save(0, src)
    back = torch.empty_like(src)
    b.load(0, back)
    assert torch.equal(back, src)
    b.open(9 * MiB, CUDA_LIKE)  # larger: the old memory goes, a new one is pinned
    assert b.phases["reused"] == 0
    b.drop()
    assert wait_unpinned(5.0) and not rt.registered
    # every chunk registered went back (the new backup's last chunks may not have been
    # pinned yet when the drop stopped its workers: between 3 + 1 and 3 + 5 in all)
    assert len(rt.unregistered) == rt.calls and 3 + 1 <= rt.calls <= 3 + 5

"""HostBackup's two ways to pin host memory on CUDA, and the unpinning off the wake's path.

No GPU here: the CUDA runtime's register/unregister are stood in for by a recorder (the
module reaches them through ``_cudart`` and ``_check_cuda`` only), and ``like`` says "cuda"
the only way HostBackup reads it, by its device type. What is checked is HostBackup's own
part, for any size: the mapping starts on a huge-page boundary, exactly the backup's bytes
are registered, bytes saved come back, drop unregisters that pointer once and unmaps, on the
thread or not, and a failed register leaves nothing registered or mapped.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvvmm.arena import backup as bk
from kvvmm.arena.backup import HOST_MEMORY, HostBackup, wait_unpinned
from kvvmm.errors import ArgumentError

CUDA_LIKE: Any = SimpleNamespace(device=SimpleNamespace(type="cuda"))


class FakeRuntime:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.unregistered: list[tuple[int, str]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        assert ptr not in self.registered
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append((ptr, threading.current_thread().name))
        self.registered.pop(ptr)
        return 0


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(bk, "_cudart", lambda: fake)

    def check(err: int) -> None:
        if err != 0:
            raise RuntimeError(f"CUDA error {err}")

    monkeypatch.setattr(bk, "_check_cuda", check)
    return fake


@pytest.mark.parametrize("bad", ["pinned", "", None, 3, "TORCH"])
def test_an_unknown_memory_is_refused_naming_the_choices(bad: Any) -> None:
    with pytest.raises(ArgumentError, match="memory") as e:
        HostBackup(bad)
    assert all(m in str(e.value) for m in HOST_MEMORY)


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_free_on_thread_must_be_a_bool(bad: Any) -> None:
    with pytest.raises(ArgumentError, match="free_on_thread"):
        HostBackup(free_on_thread=bad)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # reset by hand below
@given(nbytes=st.integers(1, 9 << 20), pos=st.integers(0, 1 << 20), on_thread=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_an_mmap_backup_registers_exactly_its_bytes_on_a_huge_page_boundary_and_gives_them_back(
        rt: FakeRuntime, nbytes: int, pos: int, on_thread: bool, seed: int) -> None:
    rt.registered.clear()
    rt.unregistered.clear()
    b = HostBackup("mmap", free_on_thread=on_thread)
    b.open(nbytes, CUDA_LIKE)
    assert b.nbytes == nbytes
    [(ptr, size)] = rt.registered.items()
    assert size == nbytes and ptr % (2 << 20) == 0
    pos = min(pos, nbytes - 1)
    src = torch.randint(0, 256, (nbytes - pos,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    b.save(pos, src)
    back = torch.empty_like(src)
    b.load(pos, back)
    assert torch.equal(back, src)
    m = b._map
    assert m is not None
    b.drop()
    assert wait_unpinned(5.0)
    assert rt.unregistered == [(ptr, "kvvmm-unpin" if on_thread else
                                threading.current_thread().name)]
    assert not rt.registered and m.closed
    b.drop()  # idempotent
    assert len(rt.unregistered) == 1


def test_a_failed_register_leaves_nothing_registered_or_mapped(
        rt: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    rt.fail = True
    maps: list[Any] = []
    real = bk.mmap.mmap

    def spy(*a: Any, **kw: Any) -> Any:
        maps.append(real(*a, **kw))
        return maps[-1]

    monkeypatch.setattr(bk.mmap, "mmap", spy)
    b = HostBackup("mmap")
    with pytest.raises(RuntimeError, match="CUDA error 2"):
        b.open(5 << 20, CUDA_LIKE)
    assert not rt.registered and len(maps) == 1 and maps[0].closed
    assert b._map is None and b._registered == 0
    b.drop()
    assert not rt.unregistered


@pytest.mark.parametrize("memory", HOST_MEMORY)
def test_off_cuda_both_memories_are_one_plain_cpu_tensor_and_drop_starts_no_thread(
        rt: FakeRuntime, memory: str) -> None:
    b = HostBackup(memory)
    b.open(3 << 20, torch.empty(1, dtype=torch.uint8))
    assert [t.device.type for _, t in b._pieces] == ["cpu"] and not rt.registered
    before = threading.active_count()
    b.drop()
    assert threading.active_count() == before and not rt.unregistered


def test_an_empty_mmap_backup_maps_and_registers_nothing(rt: FakeRuntime) -> None:
    b = HostBackup("mmap")
    b.open(0, CUDA_LIKE)
    assert not rt.registered and b._map is None
    b.drop()
    assert wait_unpinned(1.0)

"""A sleep's backup is the sleeping arena's alone: one backup keeps one sleep's bytes.

Through every public entry that takes a :class:`~kvvmm.arena.backup.Backup` (``Arena.sleep``,
``KvBufferOwner.sleep``, SGLang's ``KvVmmBufferOwner.pause``) and with each kind of backup
(host memory as a mapping or torch's blocks, a file): a backup another sleep keeps its bytes
in, a spent one (woken from, closed with its arena, dropped) and a drop while a sleep holds
it are refused with a typed error before anything changes; the arena that slept first still
wakes with its own bytes, and a failed sleep leaves the backup free for a retry.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvvmm import Arena, KvBufferOwner, mha_token_major
from kvvmm.arena.backup import Backup, DiskBackup, HostBackup
from kvvmm.driver.base import Driver
from kvvmm.errors import ArgumentError, BackupError, KvvmmError, StateError
from kvvmm.integrations.sglang import KvVmmBufferOwner

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the host driver needs Linux")

ENTRIES = ("arena", "owner", "sglang")
BACKUPS = ("host-mmap", "host-torch", "disk")


class _SglDesc:
    """SGLang's descriptor: four fields."""

    def __init__(self, name: str, shape: tuple[int, ...], row_bytes: int,
                 tokens_per_row: int) -> None:
        self.name, self.shape = name, shape
        self.row_bytes, self.tokens_per_row = row_bytes, tokens_per_row


class Party:
    """One sleeper behind one public entry: its arena, sleep(backup), wake(), close()."""

    def __init__(self, entry: str, driver: Driver, name: str) -> None:
        self.entry = entry
        g = driver.granularity()
        self.obj: Any
        if entry == "arena":
            arena = Arena(driver, reserve_bytes=8 * g, name=name)
            off = arena.allocate(4 * g)
            arena.commit(off, 2 * g)
            self.obj = arena
        elif entry == "owner":
            descs = mha_token_major(layers=1, kv_heads=2, head_dim=64, reserved_tokens=4096,
                                    page_size=16, dtype="bfloat16")
            self.obj = KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16,
                                     reserved_tokens=4096, descs=descs, name=name)
            self.obj.ensure_prefix(2048)
        else:
            descs = [_SglDesc(f"{kv}0", (4096 + 16, 2, 64), 256, 1) for kv in "kv"]
            self.obj = KvVmmBufferOwner(device="cpu", device_id=0, store_dtype=torch.bfloat16,
                                        page_size=16, reserved_num_tokens=4096,
                                        buffer_descs=descs, driver=driver, name=name)
            self.obj.finalize(2048)
        self.arena: Arena = self.obj if entry == "arena" else self.obj.arena

    def sleep(self, backup: Backup) -> None:
        if self.entry == "sglang":
            self.obj.pause(backup=backup)
        else:
            self.obj.sleep(backup)

    def wake(self) -> None:
        if self.entry == "sglang":
            self.obj.resume()
        else:
            self.obj.wake()

    def write(self, value: int) -> None:
        for v in self._views():
            v.fill_(value)

    def holds(self, value: int) -> bool:
        return all(bool((v == value).all()) for v in self._views())

    def _views(self) -> list[torch.Tensor]:
        if self.arena.driver.kind == "sim":
            return []  # no bytes on the simulator
        snap = self.arena.snapshot()
        return [torch.frombuffer((ctypes.c_uint8 * m.size_bytes).from_address(
                snap.base + m.offset), dtype=torch.uint8) for m in snap.mappings]

    def close(self) -> None:
        self.obj.close()


def make_backup(kind: str, tmp: Path, n: int = 0) -> Backup:
    if kind == "disk":
        return DiskBackup(tmp / f"kv-{n}.bin")
    return HostBackup(kind.removeprefix("host-"))


@pytest.fixture(params=["sim", "host"])
def make_party(request: pytest.FixtureRequest,
               make_driver: Callable[..., Driver]) -> Callable[[str, str], Party]:
    drv = make_driver(request.param)
    made: list[Party] = []

    def make(entry: str, name: str) -> Party:
        made.append(Party(entry, drv, name))
        return made[-1]

    return make


@pytest.mark.parametrize("kind", BACKUPS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_backup_another_arenas_sleep_holds_is_refused_and_each_wakes_with_its_own_bytes(
        make_party: Callable[[str, str], Party], tmp_path: Path, entry: str,
        kind: str) -> None:
    a, b = make_party(entry, "a"), make_party(entry, "b")
    a.write(0x11)
    b.write(0x22)
    backup = make_backup(kind, tmp_path)
    a.sleep(backup)
    snap_b, stats = b.arena.snapshot(), b.arena.driver.stats()
    with pytest.raises(ArgumentError, match="arena 'a'"):
        b.sleep(backup)
    assert not b.arena.asleep and b.arena.snapshot() == snap_b
    assert b.arena.driver.stats() == stats and b.holds(0x22)
    assert backup.holder == "arena 'a'"
    a.wake()
    assert a.holds(0x11) and b.holds(0x22)
    a.close()
    b.close()


@pytest.mark.parametrize("end", ["woken", "closed", "dropped"])
@pytest.mark.parametrize("kind", BACKUPS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_spent_backup_is_refused_by_every_later_sleep(
        make_party: Callable[[str, str], Party], tmp_path: Path, entry: str, kind: str,
        end: str) -> None:
    a, b = make_party(entry, "a"), make_party(entry, "b")
    backup = make_backup(kind, tmp_path)
    if end == "dropped":
        backup.drop()
    else:
        a.sleep(backup)
        if end == "woken":
            a.wake()
        else:
            a.close()
    for p in (a, b) if end != "closed" else (b,):
        p.write(0x33)
        snap = p.arena.snapshot()
        with pytest.raises(ArgumentError, match="spent"):
            p.sleep(backup)
        assert not p.arena.asleep and p.arena.snapshot() == snap and p.holds(0x33)
    assert not (tmp_path / "kv-0.bin").exists()
    for p in (a, b):
        p.close()


@pytest.mark.parametrize("kind", BACKUPS)
@pytest.mark.parametrize("entry", ENTRIES)
def test_dropping_a_backup_a_sleep_holds_is_refused_and_the_wake_brings_every_byte_back(
        make_party: Callable[[str, str], Party], tmp_path: Path, entry: str,
        kind: str) -> None:
    a = make_party(entry, "a")
    a.write(0x44)
    backup = make_backup(kind, tmp_path)
    a.sleep(backup)
    for _ in range(2):
        with pytest.raises(StateError, match="arena 'a'"):
            backup.drop()
    assert a.arena.sleep_backup is backup and a.arena.asleep
    a.wake()
    assert a.holds(0x44)
    a.close()


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_arenas_own_sleep_backup_passed_back_to_a_sleep_is_refused(
        make_party: Callable[[str, str], Party], tmp_path: Path, entry: str) -> None:
    a, b = make_party(entry, "a"), make_party(entry, "b")
    a.sleep(HostBackup())
    held = a.arena.sleep_backup
    assert held is not None
    with pytest.raises(KvvmmError):
        a.sleep(held)
    with pytest.raises(ArgumentError, match="arena 'a'"):
        b.sleep(held)
    assert a.arena.asleep and not b.arena.asleep
    a.wake()
    a.close()
    b.close()


class _FailingSave(HostBackup):
    """A host backup whose first save fails (out of host memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = True

    def save(self, pos: int, src: torch.Tensor) -> None:
        if self.fail:
            self.fail = False
            raise RuntimeError("out of host memory")
        super().save(pos, src)


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_failed_sleep_frees_its_backup_for_a_retry_with_the_same_one(
        make_party: Callable[[str, str], Party], entry: str) -> None:
    a = make_party(entry, "a")
    if a.arena.driver.kind == "sim":
        a.close()
        pytest.skip("nothing is saved on the simulator: the save never runs")
    a.write(0x55)
    backup = _FailingSave()
    with pytest.raises(BackupError):
        a.sleep(backup)
    assert not a.arena.asleep and backup.holder is None and a.holds(0x55)
    a.sleep(backup)
    a.write(0)
    a.wake()
    assert a.holds(0x55)
    a.close()


def test_a_wake_reads_only_a_backup_its_own_sleep_holds(
        make_party: Callable[[str, str], Party]) -> None:
    a = make_party("arena", "a")
    a.sleep(HostBackup())
    s = a.arena._sleeping
    assert s is not None
    held, other = s.backup, HostBackup()
    s.backup = other  # a backup no sleep of this arena bound
    snap = a.arena.snapshot()
    with pytest.raises(BackupError, match="not this arena's"):
        a.wake()
    assert a.arena.asleep and a.arena.snapshot() == snap
    s.backup = held
    a.close()


def test_two_threads_sleeping_two_arenas_into_one_backup_leave_it_to_exactly_one(
        make_party: Callable[[str, str], Party]) -> None:
    import threading

    for _ in range(5):
        a, b = make_party("arena", "a"), make_party("arena", "b")
        backup = HostBackup()
        start = threading.Barrier(2)
        errors: list[BaseException] = []

        def sleep(p: Party, backup: Backup, start: threading.Barrier,
                  errors: list[BaseException]) -> None:
            start.wait()
            try:
                p.sleep(backup)
            except ArgumentError as e:
                errors.append(e)

        threads = [threading.Thread(target=sleep, args=(p, backup, start, errors))
                   for p in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(errors) == 1 and [a.arena.asleep, b.arena.asleep].count(True) == 1
        for p in (a, b):
            if p.arena.asleep:
                p.wake()
            p.close()

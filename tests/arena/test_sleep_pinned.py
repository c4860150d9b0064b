"""A sleep through the chunked host backup, on the host driver (real bytes; the "pin" is a
no-op there, the chunking and the threads run): a failure in the middle of the chunked
copy-out undoes itself, a kept backup serves sleep after sleep, and every sleep and wake
says where its time went (``SleepResult.phases``, ``Arena.last_phases``).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvvmm import ArgumentError, BackupError, KvBufferOwner, mha_token_major
from kvvmm.arena import pinned
from kvvmm.arena.backup import HostBackup

MiB = 1 << 20
PAGE = 16


def make_owner(driver: Any) -> KvBufferOwner:
    descs = mha_token_major(layers=2, kv_heads=4, head_dim=64, reserved_tokens=40_000,
                            page_size=PAGE, dtype="bfloat16")
    owner = KvBufferOwner(driver=driver, dtype="bfloat16", page_size=PAGE,
                          reserved_tokens=40_000, descs=descs)
    owner.ensure_prefix(20_000)
    owner.commit_slots([(30_000, 31_024)])
    return owner


def fill(owner: KvBufferOwner, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in owner.tensors:
        v = t[:owner.backed_tokens].view(torch.uint8).view(-1)
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=gen))
        out.append(v.clone())
    return out


def same(owner: KvBufferOwner, want: list[torch.Tensor]) -> bool:
    return all(torch.equal(t[:owner.backed_tokens].view(torch.uint8).view(-1), w)
               for t, w in zip(owner.tensors, want, strict=True))


def _pin_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvvmm-pin")]


@pytest.mark.parametrize("fail_chunk", [0, 3, 7])
def test_a_chunk_failing_in_the_middle_of_the_copy_out_leaves_the_owner_awake_and_nothing_held(
        make_driver: Any, monkeypatch: pytest.MonkeyPatch, fail_chunk: int) -> None:
    drv = make_driver("host")
    owner = make_owner(drv)
    want = fill(owner, seed=fail_chunk)
    snap, held = owner.snapshot(), drv.stats()
    real = pinned.HostMapping._fault_in
    maps: list[Any] = []

    def failing(self: pinned.HostMapping, start: int, n: int) -> None:
        maps.append(self._map)
        if start == fail_chunk * 2 * MiB:
            raise OSError(12, "Cannot allocate memory")
        real(self, start, n)

    monkeypatch.setattr(pinned.HostMapping, "_fault_in", failing)
    backup = HostBackup(chunk_bytes=2 * MiB, workers=3)
    with pytest.raises(BackupError, match="awake, every byte where it was") as info:
        owner.sleep(backup)
    assert isinstance(info.value.__cause__, OSError)
    assert not owner.asleep and owner.snapshot() == snap and drv.stats() == held
    assert same(owner, want)
    assert maps and all(m.closed for m in maps) and not _pin_threads()
    assert backup.holder is None and backup._host is None
    assert owner.arena.last_phases["sleep"]["total_s"] > 0
    monkeypatch.setattr(pinned.HostMapping, "_fault_in", real)
    res = owner.sleep(backup)  # a failed sleep leaves its backup free for a retry
    assert res.backup_bytes == snap.backed_bytes
    owner.wake()
    assert same(owner, want) and owner.snapshot() == snap
    with pytest.raises(ArgumentError, match="spent"):
        owner.sleep(backup)
    owner.close()
    assert drv.stats().clean


def test_a_kept_backup_serves_sleep_after_sleep_and_drop_gives_it_back(
        make_driver: Any) -> None:
    drv = make_driver("host")
    owner, other = make_owner(drv), make_owner(drv)
    backup = HostBackup(chunk_bytes=2 * MiB, workers=2, keep=True)
    for cycle in range(3):
        want = fill(owner, seed=cycle)
        res = owner.sleep(backup)
        assert res.phases["backup.reused"] == (1.0 if cycle else 0.0)
        with pytest.raises(ArgumentError, match="keeps its bytes"):
            other.sleep(backup)  # one sleep's bytes at a time, kept or not
        owner.wake()
        assert same(owner, want)
        assert backup.holder is None and backup._host is not None  # kept
    want = fill(other, seed=9)
    other.sleep(backup)  # any arena may use a kept backup no sleep holds
    other.wake()
    assert same(other, want)
    host = backup._host
    assert host is not None
    backup.drop()
    assert host._map is None and backup._host is None
    with pytest.raises(ArgumentError, match="spent"):
        owner.sleep(backup)
    owner.close()
    other.close()
    assert drv.stats().clean


def test_closing_an_owner_asleep_in_a_kept_backup_drops_it(make_driver: Any) -> None:
    drv = make_driver("host")
    owner = make_owner(drv)
    backup = HostBackup(chunk_bytes=2 * MiB, keep=True)
    owner.sleep(backup)
    owner.close()
    assert backup._host is None and not _pin_threads()
    with pytest.raises(ArgumentError, match="spent"):
        make_owner(drv).sleep(backup)


@pytest.mark.parametrize("backup", [None, "host", "disk"])
def test_every_sleep_and_wake_says_where_its_time_went(
        make_driver: Any, backup: str | None, tmp_path: Any) -> None:
    owner = make_owner(make_driver("host"))
    assert owner.arena.last_phases == {}
    res = owner.sleep(backup, path=tmp_path / "kv.bin" if backup == "disk" else None)
    owner.wake()
    ph = owner.arena.last_phases
    assert ph["sleep"] == res.phases
    steps = {"wait_inflight_s", "sync_s", "give_back_s", "release_s", "total_s"}
    if backup is not None:
        steps |= {"views_s", "open_s", "copy_s", "flush_s"}
    if backup == "host":
        steps |= {f"backup.{k}" for k in ("reused", "open_s", "flush_s", "map_s", "fault_s",
                                          "pin_s", "ready_s", "wait_s", "chunks", "workers")}
    assert set(ph["sleep"]) == steps
    laps = sum(v for k, v in ph["sleep"].items() if not k.startswith("backup.")
               and k != "total_s")
    assert 0 <= laps <= ph["sleep"]["total_s"]
    assert {"back_s", "total_s"} <= set(ph["wake"])
    assert ("copy_s" in ph["wake"]) is (backup is not None)
    if backup == "host":
        assert ph["sleep"]["backup.fault_s"] > 0 and ph["sleep"]["backup.pin_s"] == 0
    owner.close()

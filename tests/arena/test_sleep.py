"""Sleep and wake: every handle given back with the VA kept, and back again.

On the simulator and the host driver: what a sleep gives back, that a wake restores the
snapshot and the owner's bookkeeping exactly, the bytes of each backup (host driver: real
bytes), refusals while asleep, close while asleep, the trace, random sequences of
sleep/wake/grow, and failures of the backup itself at each step (a full disk, out of host
memory) and of the driver at each call of a wake, bytes checked after. The fault matrix
(``tests/driver/test_fault_matrix.py``) runs every driver call of sleep and wake failing too.
"""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvvmm import (
    ArgumentError,
    AsleepError,
    BackupError,
    DriverError,
    Fault,
    FaultyDriver,
    KvBufferOwner,
    SleepRefusedError,
    Trace,
    mha_token_major,
    replay_arenas,
)
from kvvmm.arena.backup import Backup, HostBackup, pow2_pieces
from kvvmm.arena.pool import HandlePool
from kvvmm.driver.base import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY, Driver

PAGE = 16
RESERVED = 36_000
HOLES = (1500, 2100)


def make_owner(driver: Driver, **kw: Any) -> KvBufferOwner:
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=RESERVED,
                            page_size=PAGE, dtype="bfloat16")
    owner = KvBufferOwner(driver=driver, dtype="bfloat16", page_size=PAGE,
                          reserved_tokens=RESERVED, descs=descs, **kw)
    owner.ensure_prefix(9000)
    owner.commit_pages(HOLES)
    owner.commit_slots([(24_000, 25_024)])
    return owner


def fill(owner: KvBufferOwner, seed: int = 0) -> list[torch.Tensor]:
    """Random bytes over every mapping (host driver); returns them, mapping by mapping."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for va, size in _mapped(owner):
        v = _bytes_at(va, size)
        v.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
        out.append(v.clone())
    return out


def _mapped(owner: KvBufferOwner) -> list[tuple[int, int]]:
    snap = owner.arena.snapshot()
    return [(snap.base + m.offset, m.size_bytes) for m in snap.mappings]


def _bytes_at(va: int, size: int) -> torch.Tensor:
    import ctypes

    return torch.frombuffer((ctypes.c_uint8 * size).from_address(va), dtype=torch.uint8)


def same_bytes(owner: KvBufferOwner, want: list[torch.Tensor]) -> bool:
    got = [_bytes_at(va, size) for va, size in _mapped(owner)]
    return len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want,
                                                                          strict=True))


def backups(tmp_path: Path) -> list[tuple[str | None, Path | None]]:
    return [(None, None), ("host", None), ("disk", tmp_path / "kv.bin")]


# -- what a sleep gives back, what a wake restores ----------------------------------------------


@pytest.mark.parametrize("backup", [None, "host", "disk"])
def test_a_sleep_gives_back_every_physical_byte_and_a_wake_restores_the_snapshot_exactly(
        driver: Driver, backup: str | None, tmp_path: Path) -> None:
    owner = make_owner(driver)
    owner.finalize(20_000)
    snap, pages, backed = owner.snapshot(), owner.committed_pages, owner.backed_bytes
    ptrs = [t.data_ptr() for t in owner.tensors]
    path = tmp_path / "kv.bin" if backup == "disk" else None
    res = owner.sleep(backup, path=path)
    assert res.given_bytes == backed and res.backup == backup
    assert res.backup_bytes == (backed if backup else 0)
    st = driver.stats()
    assert (st.handles, st.mappings, st.physical_bytes) == (0, 0, 0)
    assert st.reservations == 1  # the VA stays: tensors keep their pointers
    assert owner.asleep and owner.backed_bytes == 0 and owner.backed_tokens == 0
    asleep = owner.snapshot()
    assert asleep.arena.mappings == () and asleep.arena.asleep_bytes == backed
    assert asleep.arena.asleep_mappings == snap.arena.mappings  # what the wake maps back
    assert (asleep.prefix_tokens, asleep.final_tokens) == (snap.prefix_tokens, snap.final_tokens)
    assert owner.wake() == backed
    assert owner.snapshot() == snap
    assert owner.committed_pages == pages and not owner.asleep
    assert [t.data_ptr() for t in owner.tensors] == ptrs
    if backup == "disk":
        assert not os.path.exists(str(path)), "the wake removes the backup's file"
    owner.ensure_prefix(30_000)  # an awake owner grows as before
    owner.close()
    assert driver.stats().clean


@pytest.mark.parametrize("backup", ["host", "disk"])
def test_a_wake_copies_back_every_byte_of_every_mapping_on_the_host_driver(
        make_driver: Any, backup: str, tmp_path: Path) -> None:
    owner = make_owner(make_driver("host"))
    want = fill(owner)
    owner.sleep(backup, path=tmp_path / "kv.bin" if backup == "disk" else None)
    owner.wake()
    assert same_bytes(owner, want)
    owner.close()


def test_without_a_backup_the_wake_gives_fresh_memory_zeros_on_the_host_driver(
        make_driver: Any) -> None:
    owner = make_owner(make_driver("host"))
    fill(owner)
    owner.sleep()
    owner.wake()
    assert all(not bool(_bytes_at(va, n).any()) for va, n in _mapped(owner))
    owner.close()


def test_reads_during_sleep_are_zeros_on_the_host_driver(make_driver: Any) -> None:
    owner = make_owner(make_driver("host"))
    fill(owner, seed=3)
    owner.sleep("host")
    assert all(not bool(t.any()) for t in owner.tensors)  # the zero page; writes would fault
    owner.wake()
    assert any(bool(t.any()) for t in owner.tensors)
    owner.close()


def test_a_sleep_releases_the_pools_idle_handles_unless_told_to_keep_them(
        make_driver: Any) -> None:
    drv = make_driver("sim")
    pool = HandlePool(drv, threaded=False)
    owner = make_owner(drv, pool=pool)
    owner.shrink(PAGE)  # handles go to the pool (under its cap)
    held = pool.held_bytes
    assert held > 0
    res = owner.sleep(keep_pool=True)
    assert res.pool_bytes == 0 and pool.held_bytes == held
    owner.wake()
    res = owner.sleep()
    assert res.pool_bytes == pool.held_bytes + res.pool_bytes and pool.held_bytes == 0
    assert drv.stats().physical_bytes == 0
    owner.wake()
    owner.close()
    pool.close()
    assert drv.stats().clean


# -- refusals --------------------------------------------------------------------------------


ASLEEP_CALLS = {
    "ensure_prefix": lambda o: o.ensure_prefix(30_000),
    "finalize": lambda o: o.finalize(20_000),
    "shrink": lambda o: o.shrink(PAGE),
    "release_beyond": lambda o: o.release_beyond(PAGE),
    "commit_pages": lambda o: o.commit_pages([3000]),
    "decommit_pages": lambda o: o.decommit_pages(list(HOLES)),
    "commit_slots": lambda o: o.commit_slots([(32_000, 32_016)]),
    "decommit_slots": lambda o: o.decommit_slots([(24_000, 25_024)]),
    "note_pages": lambda o: o.note_pages([1], committed=False),
    "arena.commit": lambda o: o.arena.commit(o.arena.snapshot().allocations[0].offset, 1),
    "arena.decommit_range": lambda o: o.arena.decommit_range(0, 0, 2 << 20),
}


@pytest.mark.parametrize("call", list(ASLEEP_CALLS))
def test_every_change_while_asleep_is_refused_with_asleep_error_saying_wake(
        driver: Driver, call: str) -> None:
    owner = make_owner(driver)
    owner.sleep()
    snap = owner.snapshot()
    with pytest.raises(AsleepError, match=r"wake\(\)"):
        ASLEEP_CALLS[call](owner)
    assert owner.snapshot() == snap and owner.asleep
    owner.wake()
    owner.close()
    assert driver.stats().clean


def test_the_pure_calls_still_answer_while_asleep_and_even_ensure_prefix_0_is_refused(
        driver: Driver) -> None:
    # ensure_prefix(0) would back nothing, but its decode fast path must not tell a
    # sleeping owner from an awake one differently on the sim and on real drivers
    owner = make_owner(driver)
    want = owner.slot_ranges([(0, 64)]), owner.page_ranges([2])
    owner.sleep()
    assert (owner.slot_ranges([(0, 64)]), owner.page_ranges([2])) == want
    with pytest.raises(AsleepError):
        owner.ensure_prefix(0)
    assert owner.backed_tokens == 0
    owner.wake()
    owner.close()


def test_a_second_sleep_and_a_wake_while_awake_are_refused(driver: Driver) -> None:
    owner = make_owner(driver)
    with pytest.raises(SleepRefusedError, match="while awake"):
        owner.wake()
    owner.sleep()
    with pytest.raises(SleepRefusedError, match="while asleep"):
        owner.sleep()
    owner.wake()
    owner.close()


@pytest.mark.parametrize(("kw", "name"), [
    ({"backup": "tape"}, "backup"),
    ({"backup": "disk"}, "path"),
    ({"backup": "host", "path": "/tmp/x"}, "path"),
    ({"backup": None, "path": "/tmp/x"}, "path"),
    ({"keep_pool": 1}, "keep_pool"),
])
def test_bad_sleep_arguments_are_refused_before_anything_changes(
        driver: Driver, kw: dict[str, Any], name: str) -> None:
    owner = make_owner(driver)
    snap = owner.snapshot()
    with pytest.raises(ArgumentError) as info:
        owner.sleep(**kw)
    assert info.value.name == name
    assert owner.snapshot() == snap and not owner.asleep
    owner.close()


def test_a_disk_backup_never_overwrites_an_existing_file(driver: Driver, tmp_path: Path) -> None:
    path = tmp_path / "precious"
    path.write_bytes(b"keep me")
    owner = make_owner(driver)
    with pytest.raises(ArgumentError, match="does not exist yet"):
        owner.sleep("disk", path=path)
    assert path.read_bytes() == b"keep me" and not owner.asleep
    owner.close()


def test_close_while_asleep_gives_everything_back_and_drops_the_backup(
        driver: Driver, tmp_path: Path) -> None:
    owner = make_owner(driver)
    path = tmp_path / "kv.bin"
    owner.sleep("disk", path=path)
    assert path.exists()
    owner.close()
    assert not path.exists() and owner.closed and not owner.asleep
    assert driver.stats().clean


# -- trace ---------------------------------------------------------------------------------


def test_the_trace_records_sleep_and_wake_and_replays_to_the_same_snapshot(
        make_driver: Any) -> None:
    trace = Trace()
    owner = make_owner(make_driver("sim"), trace=trace)
    owner.sleep("host")
    asleep = owner.arena.snapshot()
    owner.wake()
    owner.ensure_prefix(12_000)
    ops = [o.op for o in trace.ops]
    assert "sleep" in ops and ops.index("wake") > ops.index("sleep")
    sleep_op = next(o for o in trace.ops if o.op == "sleep")
    assert sleep_op.args == {"backup": "host", "nbytes": asleep.asleep_bytes}
    (replayed,) = replay_arenas(trace)
    assert replayed.mappings == owner.arena.snapshot().mappings
    owner.close()


# -- random sequences --------------------------------------------------------------------------


def _step(owner: KvBufferOwner, rng: random.Random, tmp: Path, n: int) -> str:
    ps = PAGE
    choice = rng.choice(["grow", "pages", "unpages", "slots", "shrink", "sleep"])
    if choice == "grow":
        owner.ensure_prefix(rng.randrange(PAGE, RESERVED))
    elif choice == "pages":
        owner.commit_pages(rng.sample(range(1, owner.pages), 3))
    elif choice == "unpages" and owner.committed_pages - {0}:
        owner.decommit_pages(rng.sample(sorted(owner.committed_pages - {0}), 1))
    elif choice == "slots":
        a = rng.randrange(1, owner.pages - 70) * ps
        owner.commit_slots([(a, a + 64 * ps)])
    elif choice == "shrink":
        owner.shrink(rng.randrange(PAGE, RESERVED))
    elif choice == "sleep":
        backup = rng.choice([None, "host", "disk"])
        owner.sleep(backup, path=tmp / f"kv{n}.bin" if backup == "disk" else None)
        return f"sleep({backup})"
    return choice


@pytest.mark.parametrize("seed", range(6))
def test_random_sleep_wake_and_grow_sequences_keep_the_bytes_and_the_bookkeeping(
        make_driver: Any, seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    kind = "host" if seed % 2 else "sim"
    drv = make_driver(kind)
    owner = make_owner(drv)
    for n in range(24):
        before = owner.snapshot()
        pages, tokens = owner.committed_pages, owner.backed_tokens
        want = fill(owner, seed=n) if kind == "host" else []
        did = _step(owner, rng, tmp_path, n)
        if owner.asleep:
            assert drv.stats().physical_bytes == 0, did
            owner.wake()
            assert owner.snapshot() == before, did
            assert owner.committed_pages == pages and owner.backed_tokens == tokens, did
            if kind == "host" and did != "sleep(None)":
                assert same_bytes(owner, want), did
        owner.snapshot().arena.check()
    owner.close()
    assert drv.stats().clean


# -- failures of the backup and of a wake's driver calls -------------------------------------------


class FailingBackup(HostBackup):
    """A host backup whose ``step`` fails at its ``nth`` call with ``error``."""

    def __init__(self, step: str, nth: int, error: BaseException) -> None:
        super().__init__()
        self.step, self.nth, self.error, self.seen = step, nth, error, 0

    def _gate(self, step: str) -> None:
        if step == self.step:
            self.seen += 1
            if self.seen == self.nth:
                raise self.error

    def open(self, nbytes: int, like: torch.Tensor) -> None:
        self._gate("open")
        super().open(nbytes, like)

    def save(self, pos: int, src: torch.Tensor) -> None:
        self._gate("save")
        super().save(pos, src)

    def load(self, pos: int, dst: torch.Tensor) -> None:
        self._gate("load")
        super().load(pos, dst)


# Made fresh for each case: a raised error's traceback holds the frames of the copy (and the
# tensor over the arena it was copying), which would keep the arena's close waiting.
ERRORS = {"full-disk": lambda: OSError(errno.ENOSPC, "No space left on device"),
          "no-host-memory": lambda: RuntimeError("CUDA error: out of memory (cudaHostAlloc)")}


@pytest.mark.parametrize("error", list(ERRORS))
@pytest.mark.parametrize(("step", "nth"), [("open", 1), ("save", 1), ("save", 3)])
def test_a_backup_failing_during_sleep_leaves_the_owner_awake_with_every_byte(
        make_driver: Any, step: str, nth: int, error: str) -> None:
    for kind in ("sim", "host"):
        drv = make_driver(kind)
        owner = make_owner(drv)
        want = fill(owner) if kind == "host" else []
        snap, held = owner.snapshot(), drv.stats()
        cause = ERRORS[error]()
        with pytest.raises(BackupError, match="awake") as info:
            owner.sleep(FailingBackup(step, nth, cause))
        assert info.value.__cause__ is cause
        assert not owner.asleep and owner.snapshot() == snap and drv.stats() == held
        if kind == "host":
            assert same_bytes(owner, want)
        owner.ensure_prefix(30_000)
        owner.close()
        assert drv.stats().clean


@pytest.mark.parametrize("nth", [1, 2, 4])
def test_a_backup_failing_during_wake_leaves_the_owner_asleep_with_its_backup_intact(
        make_driver: Any, nth: int) -> None:
    drv = make_driver("host")
    owner = make_owner(drv)
    want = fill(owner)
    awake = owner.snapshot()
    backup = FailingBackup("load", nth, OSError(errno.EIO, "Input/output error"))
    owner.sleep(backup)
    asleep, held = owner.snapshot(), drv.stats()
    with pytest.raises(BackupError, match="asleep, its backup intact"):
        owner.wake()
    assert owner.asleep and owner.snapshot() == asleep and drv.stats() == held
    owner.wake()  # the fault was one-shot: the backup still holds every byte
    assert owner.snapshot() == awake and same_bytes(owner, want)
    owner.close()
    assert drv.stats().clean


@pytest.mark.parametrize("error", [CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_INVALID_VALUE])
def test_a_wake_failing_at_any_driver_call_stays_asleep_and_a_retry_brings_every_byte_back(
        make_driver: Any, error: str) -> None:
    probe = FaultyDriver(make_driver("host"))
    owner = make_owner(probe)
    owner.sleep("host")
    before = len(probe.calls)
    owner.wake()
    calls = probe.calls[before:]
    owner.close()
    assert {"create", "map", "set_access"} <= set(calls)
    for pos in range(1, len(calls) + 1):
        drv = FaultyDriver(make_driver("host"))
        owner = make_owner(drv)
        want = fill(owner, seed=pos)
        awake = owner.snapshot()
        owner.sleep("host")
        asleep, held = owner.snapshot(), drv.stats()
        drv.arm(Fault("*", nth=pos, error=error))
        with pytest.raises(DriverError) as info:
            owner.wake()
        where = f"wake: call {pos}/{len(calls)} ({calls[pos - 1]})"
        assert info.value.call == calls[pos - 1], where
        assert owner.asleep and owner.snapshot() == asleep, where
        assert drv.stats() == held, where
        assert not getattr(info.value, "__notes__", []), where
        drv.disarm()
        owner.wake()
        assert owner.snapshot() == awake and same_bytes(owner, want), where
        owner.close()
        assert drv.stats().clean, where


def test_an_interrupted_sleep_copy_leaves_the_owner_awake(make_driver: Any) -> None:
    drv = make_driver("host")
    owner = make_owner(drv)
    want = fill(owner)
    with pytest.raises(KeyboardInterrupt):
        owner.sleep(FailingBackup("save", 2, KeyboardInterrupt()))
    assert not owner.asleep and same_bytes(owner, want)
    import gc

    gc.collect()  # the interrupt's traceback held a view of the arena
    owner.close()


def test_a_custom_backup_subclass_is_used_as_given(driver: Driver) -> None:
    class Counting(HostBackup):
        saves = 0

        def save(self, pos: int, src: torch.Tensor) -> None:
            type(self).saves += 1
            super().save(pos, src)

    owner = make_owner(driver)
    res = owner.sleep(Counting())
    assert res.backup == "host" and Counting.saves >= 1
    owner.wake()
    owner.close()
    assert isinstance(Counting(), Backup)


def test_the_pinned_backup_is_cut_in_power_of_two_pieces_that_sum_to_its_size() -> None:
    for n in (0, 2 << 20, 6 << 20, (60 << 30) + (6 << 20), 3 << 30):
        pieces = pow2_pieces(n)
        assert sum(pieces) == n
        assert all(p & (p - 1) == 0 and p <= 1 << 30 for p in pieces)


def test_the_lab_draws_a_sleeping_owner_as_asleep_with_what_a_wake_backs(
        make_driver: Any) -> None:
    from kvvmm import KvBufferOwner, mha_token_major
    from kvvmm.viz import describe, va_map

    descs = mha_token_major(layers=1, kv_heads=2, head_dim=64, reserved_tokens=8192,
                            page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=make_driver("sim"), dtype="bfloat16", page_size=16,
                          reserved_tokens=8192, descs=descs)
    owner.ensure_prefix(4096)
    backed = owner.backed_bytes
    owner.sleep()
    snap = owner.snapshot()
    assert snap.arena.asleep_bytes == backed and snap.arena.backed_bytes == 0
    text = describe(snap)
    assert "asleep:" in text and "to wake at the same VA" in text
    title = va_map(snap).layout.title.text
    assert "asleep:" in title and "mapping" in title
    owner.wake()
    assert "asleep" not in va_map(owner.snapshot()).layout.title.text
    owner.close()

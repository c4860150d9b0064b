"""Collective sleep and wake: every rank of a process group sleeps, or none does.

One gloo world of 2 on the host driver (real bytes), spawned once for the module. Each rank
grows its owner collectively (so its memory is a collective's prepared handles: a sleep must
take those too), fills every mapping with random bytes, then runs every case in order:

- a collective sleep and wake with each backup: bytes exact, snapshots exact, memory back;
- refusals and disagreements in prepare (rank 1's path exists, backups differ, asleep
  already): nothing changed on any rank;
- every driver call of rank 1's sleep failing in turn (each unmap, each release), and every
  call of rank 1's wake (each create, map, set access): every rank ends as it began the call,
  awake with every byte, or asleep with its backup, and a retry succeeds.

The world is small (two 1-layer buffers, a few mappings each) so the loops stay fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from kvvmm.arena.backup import HostBackup
from kvvmm.driver import Driver, FaultyDriver, open_driver
from kvvmm.errors import CollectiveError
from kvvmm.layout import mha_token_major
from kvvmm.owner import KvBufferOwner
from kvvmm.owner.distributed import DistributedOwner, spawn
from kvvmm.units import MiB

PS = 16
RESERVED = 16_384
host_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                               reason="the host driver needs Linux")


def _owner(driver: Driver) -> KvBufferOwner:
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=RESERVED,
                            page_size=PS, dtype="bfloat16")
    return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=PS,
                         reserved_tokens=RESERVED, descs=descs)


def _bytes(owner: KvBufferOwner) -> list[Any]:
    """A copy of every mapped byte, mapping by mapping (host driver memory)."""
    import ctypes

    import torch

    snap = owner.arena.snapshot()
    return [torch.frombuffer((ctypes.c_uint8 * m.size_bytes).from_address(snap.base + m.offset),
                             dtype=torch.uint8).clone() for m in snap.mappings]


def _fill(owner: KvBufferOwner, seed: int) -> None:
    import ctypes

    import torch

    gen = torch.Generator().manual_seed(seed)
    snap = owner.arena.snapshot()
    for m in snap.mappings:
        v = torch.frombuffer((ctypes.c_uint8 * m.size_bytes).from_address(snap.base + m.offset),
                             dtype=torch.uint8)
        v.copy_(torch.randint(0, 256, (m.size_bytes,), dtype=torch.uint8, generator=gen))


def _same(a: list[Any], b: list[Any]) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _attempt(fn: Any) -> dict[str, Any]:
    try:
        return {"ok": fn()}
    except CollectiveError as e:
        return {"phase": e.phase, "failed": e.failed_ranks, "rolled_back": e.rolled_back,
                "cause": type(e.__cause__).__name__ if e.__cause__ else None, "text": str(e)}


def _world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    drv = FaultyDriver(open_driver("host", capacity_bytes=512 * MiB))
    owner = _owner(drv)
    do = DistributedOwner(owner, timeout_s=20)
    do.finalize(6000)  # a collective's prepared handles: the sleep must give those back too
    do.commit_pages([700, 900])  # and holes mapped by the collective page commit
    _fill(owner, seed=rank)
    out: dict[str, Any] = {"rank": rank}
    start_snap, start_bytes, free = owner.snapshot(), _bytes(owner), drv.mem_info()[0]

    def awake_as_before() -> bool:
        return (not owner.asleep and owner.snapshot() == start_snap
                and _same(_bytes(owner), start_bytes) and drv.mem_info()[0] == free)

    # 1. Every backup kind, on both ranks: all given back, all restored.
    for kind in (None, "host", "disk"):
        path = str(Path(tmp) / f"r{rank}-{kind}.bin") if kind == "disk" else None
        got = _attempt(lambda k=kind, p=path: do.sleep(k, path=p))
        got["asleep"] = owner.asleep
        got["physical"] = drv.stats().physical_bytes
        got["woke"] = _attempt(do.wake)
        got["snapshot"] = owner.snapshot() == start_snap
        got["bytes"] = _same(_bytes(owner), start_bytes)
        out[f"ok_{kind}"] = got
        if kind is None:
            _fill(owner, seed=rank)  # the wake gave fresh (zero) memory: the pattern again
            start_bytes = _bytes(owner)

    # 2. Refused in prepare: nothing changes anywhere.
    taken = Path(tmp) / f"taken-{rank}.bin"
    taken.write_bytes(b"x")
    cases = {
        "path_exists": lambda: do.sleep("disk", path=str(taken if rank == 1 else
                                                         Path(tmp) / "fine.bin")),
        "backups_differ": lambda: do.sleep("host" if rank == 0 else None),
        "backup_object": lambda: do.sleep(object()),  # type: ignore[arg-type]
        "wake_awake": do.wake,
    }
    for key, call in cases.items():
        got = _attempt(call)
        got["as_before"] = awake_as_before()
        out[key] = got

    # 3. Every driver call of rank 1's sleep failing in turn: every rank awake, every byte.
    out["sleep_faults"] = faults = []
    for call in ("unmap", "release"):
        for nth in range(1, 12):
            if rank == 1:
                drv.arm({call: nth})
            got = _attempt(lambda: do.sleep("host"))
            hit = bool(drv.injected) if rank == 1 else None
            drv.disarm()
            drv.injected.clear()
            if "ok" in got:  # past the last call of that kind: the sleep happened
                got["woke"] = _attempt(do.wake)
            got["as_before"] = awake_as_before()
            faults.append({"call": call, "nth": nth, "hit": hit, **got})
            if "ok" in got:
                break

    # 4. Every driver call of rank 1's wake failing in turn: every rank asleep, then a retry.
    out["wake_faults"] = wfaults = []
    for call in ("create", "map", "set_access"):
        for nth in range(1, 12):
            slept = _attempt(lambda: do.sleep("host"))
            if rank == 1:
                drv.arm({call: nth})
            got = _attempt(do.wake)
            drv.disarm()
            drv.injected.clear()
            got["slept"] = "ok" in slept
            got["asleep_after"] = owner.asleep
            got["physical_after"] = drv.stats().physical_bytes
            if "ok" not in got:
                got["retry"] = _attempt(do.wake)
            got["as_before"] = awake_as_before()
            wfaults.append({"call": call, "nth": nth, **got})
            if "ok" in got:
                break
    # 5. A wake undone sleeps again with the host backup the sleep was given: its chunk,
    # workers and unpinning thread alike; a kept backup itself, its memory reused.
    out["undo_settings"] = settings = []
    for keep in (False, True):
        store = HostBackup(chunk_bytes=4 * MiB, workers=1, free_on_thread=False, keep=keep)
        owner.sleep(store)
        if rank == 1:
            drv.arm({"create": 1})
        got = _attempt(do.wake)
        drv.disarm()
        drv.injected.clear()
        again = owner.arena.sleep_backup
        got["same_object"] = again is store
        got["settings"] = (None if not isinstance(again, HostBackup) else
                           (again.chunk_bytes, again.workers, again.free_on_thread, again.keep))
        got["retry"] = _attempt(do.wake)
        got["as_before"] = awake_as_before()
        if keep:
            store.drop()
        settings.append(got)
    owner.close()
    out["clean"] = drv.stats().clean
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("the host driver needs Linux")
    tmp = tmp_path_factory.mktemp("sleep-dist")
    return spawn(_world, 2, str(tmp), timeout_s=120, group_timeout_s=30)


@host_only
@pytest.mark.parametrize("kind", [None, "host", "disk"])
def test_a_collective_sleep_gives_back_every_rank_s_memory_and_the_wake_restores_it(
        two: Any, kind: str | None) -> None:
    for r in two:
        got = r[f"ok_{kind}"]
        assert "ok" in got and got["asleep"] and got["physical"] == 0, got
        assert got["woke"]["ok"] == got["ok"].given_bytes > 0
        assert got["snapshot"]
        if kind is not None:
            assert got["bytes"], "a backup brings every byte back"
    assert two[0][f"ok_{kind}"]["ok"].given_bytes == two[1][f"ok_{kind}"]["ok"].given_bytes


@host_only
@pytest.mark.parametrize(("case", "failed", "cause"), [
    ("path_exists", (1,), "ArgumentError"),
    ("backup_object", (0, 1), "ArgumentError"),
    ("wake_awake", (0, 1), "SleepRefusedError"),
])
def test_a_refusal_on_any_rank_aborts_the_sleep_on_every_rank_before_anything_changes(
        two: Any, case: str, failed: tuple[int, ...], cause: str) -> None:
    for r in two:
        got = r[case]
        assert got.get("phase") == "prepare" and got["failed"] == failed, got
        assert got["rolled_back"] and got["as_before"], got
        assert got["cause"] == (cause if r["rank"] in failed else None)


@host_only
def test_ranks_asking_for_different_backups_all_abort_before_anything_changes(two: Any) -> None:
    for r in two:
        got = r["backups_differ"]
        assert got["phase"] == "prepare" and got["as_before"], got
        assert "ranks asked for different backups (None and 'host')" in got["text"], got


@host_only
def test_any_driver_call_of_one_rank_s_sleep_failing_leaves_every_rank_awake_with_its_bytes(
        two: Any) -> None:
    for r in two:
        faults = r["sleep_faults"]
        failed = [f for f in faults if "ok" not in f]
        assert len(failed) >= 3, faults  # several unmaps and releases were tried
        for f in failed:
            assert f["phase"] == "sleep" and f["failed"] == (1,), f
            assert f["rolled_back"] and f["as_before"], f
        for f in faults:
            if "ok" in f:
                assert f["woke"].get("ok") and f["as_before"], f
    hits = [f["hit"] for f in two[1]["sleep_faults"] if "ok" not in f]
    assert all(hits), "each aborted sleep was the injected fault's doing"


@host_only
def test_any_driver_call_of_one_rank_s_wake_failing_leaves_every_rank_asleep_then_a_retry_wakes(
        two: Any) -> None:
    for r in two:
        faults = r["wake_faults"]
        failed = [f for f in faults if "ok" not in f]
        assert {f["call"] for f in failed} == {"create", "map", "set_access"}, faults
        for f in failed:
            assert f["slept"] and f["phase"] == "wake" and f["failed"] == (1,), f
            assert f["rolled_back"] and f["asleep_after"] and f["physical_after"] == 0, f
            assert f["retry"].get("ok") and f["as_before"], f


@host_only
def test_every_rank_closes_clean_after_all_of_it(two: Any) -> None:
    assert all(r["clean"] for r in two)


@host_only
def test_a_wake_undone_sleeps_again_with_the_host_backup_settings_the_sleep_was_given(
        two: Any) -> None:
    for out in two:
        plain, kept = out["undo_settings"]
        assert plain["phase"] == "wake" and plain["failed"] == (1,), plain
        assert plain["settings"] == (4 * MiB, 1, False, False), plain
        assert kept["same_object"] and kept["settings"] == (4 * MiB, 1, False, True), kept
        assert "ok" in plain["retry"] and "ok" in kept["retry"]
        assert plain["as_before"] and kept["as_before"]

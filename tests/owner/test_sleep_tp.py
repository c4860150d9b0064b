"""TpOwners.sleep / wake: one transaction over every rank of a process.

A tiny two-layer model at TP 2 and 3, on the simulator (one SimNode) and on host drivers
(real bytes). Every backup round-trips; a refusal on any rank changes nothing anywhere; and
every driver call of any rank's sleep or wake failing in turn (each unmap, release, create,
map, set access, on each rank) leaves every rank as the call found it: awake with every byte
after a failed sleep, asleep with its backup after a failed wake, and a retry then succeeds.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvvmm import ArgumentError, ClosedError, DriverError, FaultyDriver, SleepRefusedError
from kvvmm.driver.host import HostDriver
from kvvmm.layout.models import ModelConfig
from kvvmm.owner.tp import TpOwners
from kvvmm.units import MiB

TINY = ModelConfig(name="tiny", num_layers=2, num_attention_heads=12, num_kv_heads=12,
                   head_dim=64, kv_lora_rank=None, qk_rope_head_dim=None, sliding_window=None,
                   layer_types=None, source="tests")
PS = 16
RESERVED = 16_384
host_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                               reason="the host driver needs Linux")


def grown(tp: TpOwners) -> TpOwners:
    tp.finalize(3000)
    for o in tp.owners:
        o.commit_pages([500, 800])  # holes: separate mappings a wake must bring back
    return tp


def on_host(tp: int) -> tuple[TpOwners, list[FaultyDriver]]:
    drvs = [FaultyDriver(HostDriver(capacity_bytes=256 * MiB, device=i)) for i in range(tp)]
    owners = TpOwners(drvs, model=TINY, dtype="bfloat16", page_size=PS,
                      reserved_tokens=RESERVED)
    return grown(owners), drvs


def mapped_bytes(tp: TpOwners) -> list[torch.Tensor]:
    out = []
    for o in tp.owners:
        snap = o.arena.snapshot()
        for m in snap.mappings:
            raw = (ctypes.c_uint8 * m.size_bytes).from_address(snap.base + m.offset)
            out.append(torch.frombuffer(raw, dtype=torch.uint8))
    return out


_NOISE = torch.randint(0, 256, (2 * MiB,), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(7))


def fill(tp: TpOwners) -> list[torch.Tensor]:
    """Random bytes, different in every mapping (one random block, shifted by its index)."""
    for i, v in enumerate(mapped_bytes(tp)):
        for at in range(0, v.numel(), _NOISE.numel()):
            part = v[at:at + _NOISE.numel()]
            part.copy_(_NOISE[:part.numel()] + (i * 37 + at // _NOISE.numel()) % 251)
    return [v.clone() for v in mapped_bytes(tp)]


def same(tp: TpOwners, want: list[torch.Tensor]) -> bool:
    got = mapped_bytes(tp)
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want,
                                                                          strict=True))


def paths(tmp: Path, n: int, tag: str = "") -> list[Path]:
    return [tmp / f"rank{r}{tag}.bin" for r in range(n)]


@pytest.mark.parametrize("backup", [None, "host", "disk"])
def test_every_rank_sleeps_and_wakes_to_the_same_snapshot_on_the_simulator(
        backup: str | None, tmp_path: Path) -> None:
    with grown(TpOwners.on_sim(TINY, tp=4, reserved_tokens=RESERVED)) as tp:
        before, backed = tp.snapshot(), tp.backed_bytes
        res = tp.sleep(backup, paths=paths(tmp_path, 4) if backup == "disk" else None)
        assert len(res) == 4 and sum(r.given_bytes for r in res) == backed
        assert tp.asleep and tp.backed_bytes == 0
        assert tp.wake() == backed and not tp.asleep
        assert tp.snapshot() == before


@host_only
@pytest.mark.parametrize("backup", ["host", "disk"])
def test_every_rank_gets_every_byte_back_on_host_drivers(backup: str, tmp_path: Path) -> None:
    tp, drvs = on_host(2)
    with tp:
        want = fill(tp)
        tp.sleep(backup, paths=paths(tmp_path, 2) if backup == "disk" else None)
        assert all(d.stats().physical_bytes == 0 for d in drvs)
        tp.wake()
        assert same(tp, want)
    assert all(d.stats().clean for d in drvs)


@pytest.mark.parametrize(("kw", "arg"), [
    ({"backup": "disk"}, "paths"),
    ({"backup": "disk", "paths": ["only-one"]}, "paths"),
    ({"backup": "disk", "paths": ["same", "same", "same"]}, "paths"),
    ({"backup": "host", "paths": ["a", "b", "c"]}, "paths"),
    ({"backup": "tape"}, "backup"),
    ({"backup": 3}, "backup"),
])
def test_bad_sleep_arguments_are_refused_before_any_rank_sleeps(kw: dict[str, Any],
                                                                arg: str) -> None:
    with grown(TpOwners.on_sim(TINY, tp=3, reserved_tokens=RESERVED)) as tp:
        before = tp.snapshot()
        with pytest.raises(ArgumentError) as e:
            tp.sleep(**kw)
        assert e.value.name == arg
        assert tp.snapshot() == before and not any(o.asleep for o in tp.owners)


def test_a_disk_path_that_exists_on_one_rank_refuses_the_sleep_on_every_rank(
        tmp_path: Path) -> None:
    ps = paths(tmp_path, 3)
    ps[2].write_bytes(b"taken")
    with grown(TpOwners.on_sim(TINY, tp=3, reserved_tokens=RESERVED)) as tp:
        before = tp.snapshot()
        with pytest.raises(ArgumentError):
            tp.sleep("disk", paths=ps)
        assert tp.snapshot() == before
        assert not ps[0].exists() and not ps[1].exists()


def test_one_rank_already_asleep_refuses_the_sleep_and_one_awake_refuses_the_wake() -> None:
    with grown(TpOwners.on_sim(TINY, tp=3, reserved_tokens=RESERVED)) as tp:
        before = tp.snapshot()
        with pytest.raises(SleepRefusedError, match="rank 1"):
            tp.owners[1].sleep()
            tp.sleep()
        assert [o.asleep for o in tp.owners] == [False, True, False]
        with pytest.raises(SleepRefusedError, match="rank 0"):
            tp.wake()
        tp.owners[1].wake()
        assert tp.snapshot() == before


def test_sleep_and_wake_after_close_say_closed() -> None:
    tp = TpOwners.on_sim(TINY, tp=2, reserved_tokens=RESERVED)
    tp.close()
    for call in (tp.sleep, tp.wake):
        with pytest.raises(ClosedError):
            call()


def _fault_cases(tp: int) -> list[tuple[int, str, int]]:
    """(rank, call, nth): every rank, each call a sleep or wake makes, its first and a later
    one (a rank maps 12 ranges: the 5th fails in the middle of its buffers)."""
    calls = ("unmap", "release", "create", "map", "set_access")
    return [(r, c, n) for r in range(tp) for c in calls for n in (1, 5)]


@host_only
@pytest.mark.parametrize(("rank", "call", "nth"), _fault_cases(3))
def test_any_driver_call_of_any_rank_failing_undoes_the_whole_sleep_or_wake(
        rank: int, call: str, nth: int) -> None:
    tp, drvs = on_host(3)
    with tp:
        want, before = fill(tp), tp.snapshot()
        free = [d.mem_info()[0] for d in drvs]
        drvs[rank].arm({call: nth})
        try:
            tp.sleep("host")
        except DriverError as e:
            assert drvs[rank].injected, "only the injected fault fails"
            assert f"rank {rank} of 3 failed" in "\n".join(e.__notes__)
            drvs[rank].disarm()
            assert not any(o.asleep for o in tp.owners)
            assert tp.snapshot() == before and same(tp, want)
            assert [d.mem_info()[0] for d in drvs] == free
            return
        assert tp.asleep
        try:
            tp.wake()
        except DriverError as e:
            assert drvs[rank].injected
            assert f"rank {rank} of 3 failed" in "\n".join(e.__notes__)
            drvs[rank].disarm()
            assert tp.asleep and all(d.stats().physical_bytes == 0 for d in drvs)
            tp.wake()  # the retry brings every rank back
        else:
            assert not drvs[rank].injected  # that call is past the last a sleep/wake makes
        assert tp.snapshot() == before and same(tp, want)
    assert all(d.stats().clean for d in drvs)

"""Collective KV resizes on torch.distributed (gloo on 127.0.0.1): every rank or none.

Each world is spawned once (a module fixture: a spawn costs a second or two a world) and runs
its scenarios in order on every rank; the tests then read what each rank saw. A world of 2
(host driver: real bytes) and one of 4 (sim driver) whose last rank exits in the middle of a
resize. A world of 8 ran the 4's scenarios once more (22 s of a 2-core CI run, for eight
spawned torch imports); the 4 covers what it added: a fault on a rank other than the first
or last, and a snapshot gathered on a rank other than 0 (rank 2, before the crash).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from kvvmm.driver import Driver, FaultyDriver, open_driver
from kvvmm.errors import ArgumentError, CollectiveError
from kvvmm.owner import KvBufferOwner
from kvvmm.owner.distributed import DistributedOwner, TpWorkerError, spawn
from kvvmm.owner.tp import tp_descs
from kvvmm.policy import Chunked
from kvvmm.snapshot import OwnerSnapshot, TpSnapshot
from kvvmm.units import MiB

MODEL = "llama-3.1-8b"
PS = 16
host_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                               reason="the host driver needs Linux")


def _owner(driver: Driver, world: int, reserved: int = 8192, **kw: Any) -> KvBufferOwner:
    descs = tp_descs(MODEL, tp=world, reserved_tokens=reserved, page_size=PS, dtype="bfloat16")
    return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=PS, reserved_tokens=reserved,
                         descs=descs, **kw)


def _free(driver: Driver) -> int:
    return driver.mem_info()[0]


def _attempt(fn: Any) -> dict[str, Any]:
    """What a collective call did on this rank: its result, or the CollectiveError's fields."""
    try:
        return {"ok": fn()}
    except CollectiveError as e:
        return {"phase": e.phase, "failed": e.failed_ranks, "rolled_back": e.rolled_back,
                "cause": type(e.__cause__).__name__ if e.__cause__ else None, "text": str(e)}


# -- world of 2, host driver ------------------------------------------------------------------


def _pattern(owner: KvBufferOwner) -> list[Any]:
    return [t[:PS].clone() for t in owner.tensors]


def _world_of_two(rank: int, world: int) -> dict[str, Any]:
    import torch

    # Rank 1 has less memory: the budget is the smaller rank's.
    inner = open_driver("host", capacity_bytes=(1024 if rank == 0 else 768) * MiB)
    drv = FaultyDriver(inner)
    owner = _owner(drv, world)
    for i, t in enumerate(owner.tensors):  # slot 0's page, which a rollback must not touch
        t[:PS] = float(10 * rank + i + 1)
    dist_owner = DistributedOwner(owner, model=MODEL, timeout_s=20)
    out: dict[str, Any] = {"rank": dist_owner.rank, "world": dist_owner.world_size}

    def unchanged(key: str, call: Any, before: OwnerSnapshot, data: list[Any],
                  free: int) -> None:
        out[key] = _attempt(call)
        out[key]["same_snapshot"] = owner.snapshot() == before
        out[key]["same_bytes"] = all(torch.equal(a, b) for a, b in
                                     zip(data, _pattern(owner), strict=True))
        out[key]["same_free"] = _free(drv) == free

    before, data, free = owner.snapshot(), _pattern(owner), _free(drv)
    if rank == 1:
        drv.arm({"create": 2})  # its second create of the prepare
    unchanged("create_fault", lambda: dist_owner.finalize(4096), before, data, free)
    if rank == 1:
        drv.arm({"map": 3})  # two buffers adopted, the third map fails
    unchanged("map_fault", lambda: dist_owner.finalize(4096), before, data, free)
    unchanged("different_n", lambda: dist_owner.finalize(4096 if rank == 0 else 2048),
              before, data, free)
    unchanged("bad_n", lambda: dist_owner.finalize(PS - 1), before, data, free)

    out["budget"] = dist_owner.budget_bytes(64 * MiB)
    out["fit"] = dist_owner.fit_tokens(out["budget"])
    out["finalize"] = _attempt(lambda: dist_owner.finalize(4096))
    out["final_tokens"] = owner.final_tokens
    out["backed_after_finalize"] = owner.backed_bytes
    out["bytes_kept"] = all(torch.equal(a, b) for a, b in zip(data, _pattern(owner), strict=True))
    # The owner's own fast path sees the adopted handles: nothing left to back.
    out["local_prefix_after"] = owner.ensure_prefix(4096)
    out["ensure_prefix"] = _attempt(lambda: dist_owner.ensure_prefix(6000))
    out["prefix_tokens"] = owner.prefix_tokens
    out["shrink"] = _attempt(lambda: dist_owner.shrink(1024))
    out["after_shrink"] = (owner.final_tokens, owner.prefix_tokens, owner.backed_bytes)
    out["snapshot"] = owner.snapshot()
    out["gathered"] = dist_owner.gather_snapshot()
    _pages_of_two(rank, drv, owner, dist_owner, out, unchanged)
    owner.close()
    return out


#: Pages in the middle of the buffers (16 KiB pages, 128 to a 2 MiB granule: granules 2 and
#: 3, past what the shrink to 1024 tokens kept).
PAGES = [300, 301, 420]


def _pages_of_two(rank: int, drv: FaultyDriver, owner: KvBufferOwner,
                  dist_owner: DistributedOwner, out: dict[str, Any], unchanged: Any) -> None:
    """Collective page commits and decommits, after the resizes of the same world."""
    before, data, free = owner.snapshot(), _pattern(owner), _free(drv)

    def no_pages(key: str, call: Any) -> None:
        unchanged(key, call, before, data, free)
        out[key]["committed"] = sorted(owner.committed_pages)

    if rank == 1:
        drv.arm({"create": 2})
    no_pages("pages_create_fault", lambda: dist_owner.commit_pages(PAGES))
    if rank == 1:
        drv.arm({"map": 3})
    no_pages("pages_map_fault", lambda: dist_owner.commit_pages(PAGES))
    no_pages("pages_different", lambda: dist_owner.commit_pages(
        PAGES if rank == 0 else [*PAGES[:-1], PAGES[-1] + 1]))
    no_pages("pages_bad", lambda: dist_owner.commit_pages([owner.pages]))
    got = _attempt(lambda: dist_owner.commit_pages(PAGES))
    got["committed"] = sorted(owner.committed_pages)
    got["free_drop"] = free - _free(drv)
    page = owner.tensors[0][300 * PS:301 * PS]
    page.fill_(5.0)  # the host driver's memory: a write lands, a read sees it
    got["writable"] = float(page.float().sum()) == 5.0 * page.numel()
    del page  # a live view keeps the arena's memory until it goes
    got["same_slot0"] = all(_eq(a, b) for a, b in zip(data, _pattern(owner), strict=True))
    out["pages_commit"] = got
    committed = owner.snapshot()
    out["pages_decommit_different"] = _attempt(lambda: dist_owner.decommit_pages(
        PAGES if rank == 0 else PAGES[:-1]))
    out["pages_decommit_different"]["same_snapshot"] = owner.snapshot() == committed
    if rank == 1:
        drv.arm({"unmap": 1})
    got = _attempt(lambda: dist_owner.decommit_pages(PAGES))
    got["committed"] = sorted(owner.committed_pages)
    got["backed_kept"] = owner.snapshot() == committed
    out["pages_decommit_fault"] = got
    got = _attempt(lambda: dist_owner.decommit_pages(PAGES))  # the failed rank frees its now
    got["committed"] = sorted(owner.committed_pages)
    got["back_to_before"] = owner.snapshot() == before and _free(drv) == free
    out["pages_decommit"] = got


def _eq(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("the host driver needs Linux")
    return spawn(_world_of_two, 2, timeout_s=120, group_timeout_s=30)


@host_only
def test_a_failed_create_on_one_rank_aborts_the_finalize_on_every_rank(two: Any) -> None:
    for r in two:
        got = r["create_fault"]
        assert got["phase"] == "prepare" and got["failed"] == (1,) and got["rolled_back"]
        assert got["cause"] == ("DriverOutOfMemoryError" if r["rank"] == 1 else None)
        assert "rank(s) [1] failed to prepare" in got["text"]


@host_only
@pytest.mark.parametrize("case", ["create_fault", "map_fault", "different_n", "bad_n"])
def test_an_aborted_collective_leaves_bytes_snapshots_and_memory_unchanged_on_every_rank(
        two: Any, case: str) -> None:
    for r in two:
        got = r[case]
        assert "ok" not in got, got
        assert got["same_snapshot"] and got["same_bytes"] and got["same_free"], (r["rank"], got)


@host_only
def test_a_failed_map_on_one_rank_unmaps_what_every_rank_mapped(two: Any) -> None:
    for r in two:
        got = r["map_fault"]
        assert got["phase"] == "map" and got["failed"] == (1,) and got["rolled_back"]
        assert got["cause"] == ("DriverOutOfMemoryError" if r["rank"] == 1 else None)


@host_only
def test_ranks_asking_for_different_token_counts_all_abort(two: Any) -> None:
    for r in two:
        assert r["different_n"]["phase"] == "prepare"
        assert "different token counts, from 2048 to 4096" in r["different_n"]["text"]
        assert r["bad_n"]["failed"] == (0, 1) and r["bad_n"]["cause"] == "ArgumentError"


@host_only
def test_the_collective_finalize_backs_every_rank_alike_and_keeps_slot_zero(two: Any) -> None:
    assert [r["finalize"] for r in two] == [two[0]["finalize"]] * 2
    assert two[0]["finalize"]["ok"] > 0
    assert [r["final_tokens"] for r in two] == [4096, 4096]
    assert two[0]["backed_after_finalize"] == two[1]["backed_after_finalize"]
    assert all(r["bytes_kept"] for r in two)
    assert all(r["local_prefix_after"] == 0 for r in two)  # the owner's mirror was resynced


@host_only
def test_the_budget_is_the_smallest_ranks_and_the_same_on_every_rank(two: Any) -> None:
    budgets = {r["budget"] for r in two}
    assert len(budgets) == 1
    (budget,) = budgets
    assert budget < 768 * MiB  # rank 1's capacity less the headroom, plus what it backs
    assert two[0]["fit"] == two[1]["fit"] >= 4096


@host_only
def test_collective_ensure_prefix_and_shrink_leave_every_rank_alike(two: Any) -> None:
    for r in two:
        assert "ok" in r["ensure_prefix"] and r["prefix_tokens"] == 6000
        assert "ok" in r["shrink"]
    assert two[0]["after_shrink"] == two[1]["after_shrink"]
    assert two[0]["after_shrink"][:2] == (1024, 1024)


@host_only
def test_the_gathered_snapshot_has_every_rank_on_rank_zero_only(two: Any) -> None:
    snap = two[0]["gathered"]
    assert isinstance(snap, TpSnapshot) and two[1]["gathered"] is None
    assert snap.tp == 2 and snap.model == MODEL
    assert snap.owners == (two[0]["snapshot"], two[1]["snapshot"])


@host_only
def test_a_collective_page_commit_backs_the_same_middle_pages_on_every_rank(two: Any) -> None:
    oks = [r["pages_commit"] for r in two]
    for got in oks:
        assert got["ok"] > 0 and got["free_drop"] == got["ok"], got
        assert got["committed"] == PAGES and got["writable"] and got["same_slot0"]
    assert oks[0]["ok"] == oks[1]["ok"]


@host_only
@pytest.mark.parametrize("case", ["pages_create_fault", "pages_map_fault", "pages_different",
                                  "pages_bad"])
def test_an_aborted_page_commit_leaves_bytes_snapshots_memory_and_pages_unchanged(
        two: Any, case: str) -> None:
    for r in two:
        got = r[case]
        assert "ok" not in got and got["rolled_back"], (r["rank"], got)
        assert got["same_snapshot"] and got["same_bytes"] and got["same_free"], (r["rank"], got)
        assert got["committed"] == []


@host_only
def test_a_fault_on_one_rank_during_a_page_commit_names_that_rank_everywhere(two: Any) -> None:
    for r in two:
        create, mapped = r["pages_create_fault"], r["pages_map_fault"]
        assert (create["phase"], create["failed"]) == ("prepare", (1,))
        assert (mapped["phase"], mapped["failed"]) == ("map", (1,))
        assert mapped["cause"] == ("DriverOutOfMemoryError" if r["rank"] == 1 else None)


@host_only
def test_ranks_asking_for_different_pages_all_abort_before_mapping_anything(two: Any) -> None:
    for r in two:
        assert r["pages_different"]["phase"] == "prepare"
        assert "different page sets of 3 pages (their ids differ)" in r["pages_different"]["text"]
        assert r["pages_bad"]["failed"] == (0, 1) and r["pages_bad"]["cause"] == "OutOfRangeError"
        got = r["pages_decommit_different"]
        assert got["phase"] == "prepare" and "from 2 to 3 pages" in got["text"]
        assert got["same_snapshot"]


@host_only
def test_a_failed_page_decommit_on_one_rank_still_forgets_the_pages_on_every_rank(
        two: Any) -> None:
    for r in two:
        got = r["pages_decommit_fault"]
        assert got["phase"] == "confirm" and got["failed"] == (1,), got
        assert got["committed"] == []  # page sets agree across ranks
        # the failed rank keeps its memory (its unmaps undone); the other's decommit stands
        assert got["rolled_back"] == got["backed_kept"] == (r["rank"] == 1)


@host_only
def test_a_collective_page_decommit_gives_every_page_back_on_every_rank(two: Any) -> None:
    r0, r1 = (r["pages_decommit"] for r in two)
    assert r0["ok"] == 0 and r1["ok"] > 0  # rank 0 gave its pages back in the failed round
    assert r0["back_to_before"] and r1["back_to_before"]
    assert r0["committed"] == r1["committed"] == []


# -- a world of 4, sim driver, ending with a crash ----------------------------------------


#: The rank the world of 4 gathers its snapshot on: neither 0 (the world of 2's) nor the last,
#: which crashes later.
GATHER_RANK = 2


class _ExitOnMap(FaultyDriver):
    """A driver whose process ends (``os._exit``) at its ``exit_at``-th map, as a crash."""

    exit_at = 0

    def map(self, va: int, size: int, handle: int) -> None:
        if self.exit_at:
            self.exit_at -= 1
            if not self.exit_at:
                os._exit(17)
        super().map(va, size, handle)


def _world_sim(rank: int, world: int, fail_rank: int, crash: bool) -> dict[str, Any]:
    import time

    drv = _ExitOnMap(open_driver("sim", profile="h200"))
    owner = _owner(drv, world, reserved=16384, policy=Chunked(64 * MiB))
    dist_owner = DistributedOwner(owner, model=MODEL)
    before, free = owner.snapshot(), _free(drv)
    if rank == fail_rank:
        drv.arm({"map": 2})
    out: dict[str, Any] = {"fault": _attempt(lambda: dist_owner.ensure_prefix(12000))}
    out["unchanged"] = owner.snapshot() == before and _free(drv) == free
    out["prefix"] = _attempt(lambda: dist_owner.ensure_prefix(12000))
    out["tokens"] = dist_owner.finalize_to_budget(headroom_bytes=140 * 1024 * MiB)
    out["backed"] = owner.backed_bytes
    out["gathered"] = dist_owner.gather_snapshot(dst=GATHER_RANK)
    owner.close()
    if crash:  # last: the group is broken afterwards
        second = _owner(drv, world)
        crashing = DistributedOwner(second, model=MODEL, timeout_s=10)
        before, free = second.snapshot(), _free(drv)
        if rank == world - 1:
            drv.exit_at = 2  # after agreeing, in the middle of its maps
        t0 = time.monotonic()
        got = _attempt(lambda: crashing.finalize(4096))
        got["seconds"] = time.monotonic() - t0
        got["unchanged"] = second.snapshot() == before and _free(drv) == free
        got["final_tokens"] = second.final_tokens
        out["crash"] = got
        second.close()
    return out


@pytest.fixture(scope="module")
def four_and_the_crash() -> tuple[dict[int, Any], dict[int, str]]:
    with pytest.raises(TpWorkerError) as info:
        spawn(_world_sim, 4, 2, True, timeout_s=120, group_timeout_s=20)
    return info.value.results, info.value.failures


@pytest.fixture(scope="module")
def four(four_and_the_crash: Any) -> list[dict[str, Any]]:
    results, _ = four_and_the_crash
    return [results[r] for r in sorted(results)]


def test_one_ranks_failed_map_rolls_every_rank_of_the_world_back(four: Any) -> None:
    for r in four:
        assert r["fault"]["phase"] == "map" and r["fault"]["failed"] == (2,)
        assert r["fault"]["rolled_back"] and r["unchanged"]
        assert "ok" in r["prefix"]  # and the retry succeeds everywhere


def test_finalize_to_budget_gives_every_rank_the_same_tokens_and_bytes(four: Any) -> None:
    # rank 3 crashed later, so only ranks 0-2 sent results; the snapshot was gathered before
    ranks = four
    assert len(ranks) == 3
    assert len({r["tokens"] for r in ranks}) == 1 and len({r["backed"] for r in ranks}) == 1
    assert 12000 <= ranks[0]["tokens"] <= 16384
    snaps = [r["gathered"] for r in ranks]
    assert [s is None for s in snaps] == [i != GATHER_RANK for i in range(3)]
    got = snaps[GATHER_RANK]
    assert isinstance(got, TpSnapshot) and got.tp == 4
    assert [o.final_tokens for o in got.owners] == [ranks[0]["tokens"]] * 4


def test_a_rank_that_exits_mid_resize_makes_the_others_raise_and_roll_back(
        four_and_the_crash: Any) -> None:
    results, failures = four_and_the_crash
    assert sorted(failures) == [3] and "exit code 17" in failures[3]
    assert sorted(results) == [0, 1, 2]
    for r in results.values():
        got = r["crash"]
        assert got["phase"] == "confirm" and got["rolled_back"] and got["unchanged"], got
        assert "the collective broke" in got["text"] and got["final_tokens"] is None
        assert got["seconds"] < 10  # a dead peer breaks gloo's collective at once


# -- local checks, no process group ------------------------------------------------------------


def test_a_distributed_owner_needs_an_initialised_process_group() -> None:
    owner = _owner(open_driver("sim"), 1)
    with pytest.raises(ArgumentError, match="init_process_group"):
        DistributedOwner(owner)
    owner.close()


def test_spawn_refuses_a_bad_world_size_before_starting_any_process() -> None:
    with pytest.raises(ArgumentError, match="world_size"):
        spawn(_world_sim, 0, 0, False)

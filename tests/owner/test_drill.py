"""kvvmm.owner.drill: notebook 08's TP world, as a package function every rank runs.

Each world is spawned once (a module fixture; a spawn costs a second or two a world): the
notebook's own (two ranks, rank 1's third map fails), one where rank 0's second create
fails (the fault passed through functools.partial, as a torchrun script would not need
to), and a world of one with no fault.
"""

from __future__ import annotations

import functools

import pytest

from kvvmm.driver import Fault
from kvvmm.errors import ArgumentError
from kvvmm.owner.distributed import spawn
from kvvmm.owner.drill import DEFAULT_FAULT, DrillRank, collective_drill
from kvvmm.snapshot import TpSnapshot


@pytest.fixture(scope="module")
def map_fault() -> list[DrillRank]:
    return spawn(collective_drill, 2, 1, timeout_s=120, group_timeout_s=30)


@pytest.fixture(scope="module")
def create_fault() -> list[DrillRank]:
    drill = functools.partial(collective_drill, fault=Fault(call="create", nth=2))
    return spawn(drill, 2, 0, timeout_s=120, group_timeout_s=30)


def test_the_default_fault_is_the_third_map_after_the_ranks_agreed() -> None:
    assert Fault(call="map", nth=3) == DEFAULT_FAULT


def test_one_ranks_failed_map_aborts_the_finalize_on_every_rank_and_changes_nothing(
        map_fault: list[DrillRank]) -> None:
    assert [r.rank for r in map_fault] == [0, 1] and {r.world for r in map_fault} == {2}
    assert all(r.error is not None and "aborted on every rank in map" in r.error
               for r in map_fault)
    assert all(r.unchanged for r in map_fault)
    assert map_fault[0].cause is None  # not rank 0's fault: it only rolled back
    assert map_fault[1].cause is not None and "DriverOutOfMemoryError" in map_fault[1].cause


def test_after_the_fault_every_rank_finalizes_to_the_least_budget_and_the_most_that_fit(
        map_fault: list[DrillRank]) -> None:
    budget = map_fault[0].budget_bytes
    assert budget == min(r.own_budget_bytes for r in map_fault)
    assert {r.budget_bytes for r in map_fault} == {budget}
    assert len({r.tokens for r in map_fault}) == 1 and map_fault[0].tokens > 0
    for r in map_fault:
        assert r.fit_bytes[0] <= budget < r.fit_bytes[1]
        assert r.backed_bytes == r.fit_bytes[0] and r.backend == "gloo"


def test_every_ranks_snapshot_is_gathered_on_rank_zero_only(map_fault: list[DrillRank]) -> None:
    tp = map_fault[0].gathered
    assert isinstance(tp, TpSnapshot) and map_fault[1].gathered is None
    assert tp.tp == 2 and tp.model == "llama-3.1-8b"
    assert [o.final_tokens for o in tp.owners] == [map_fault[0].tokens] * 2
    assert [o.backed_bytes for o in tp.owners] == [r.backed_bytes for r in map_fault]


def test_a_fault_of_another_call_on_another_rank_aborts_every_rank_in_that_phase(
        create_fault: list[DrillRank]) -> None:
    assert all(r.error is not None and "aborted on every rank in prepare" in r.error
               for r in create_fault), [r.error for r in create_fault]
    assert all(r.unchanged for r in create_fault)
    assert create_fault[1].cause is None and create_fault[0].cause is not None


def test_with_no_failing_rank_the_first_finalize_succeeds() -> None:
    (only,) = spawn(collective_drill, 1, None, timeout_s=120, group_timeout_s=30)
    assert only.error is None and only.cause is None
    assert not only.unchanged  # the finalize backed its tokens
    assert only.gathered is not None and only.gathered.tp == 1


@pytest.mark.parametrize("fail_rank", [2, -1, 7])
def test_a_failing_rank_outside_the_world_is_refused_before_any_driver_opens(
        fail_rank: int) -> None:
    with pytest.raises(ArgumentError, match=r"fail_rank.*\[0, 2\)"):
        collective_drill(0, 2, fail_rank)

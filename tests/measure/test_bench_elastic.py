"""``kvvmm bench``'s issue-19 sections (elastic growth, single pages, bandwidth with holes)
run on the sim and host drivers with small sizes: they run, clean up, and give the JSON keys
the H200 run and ``targets`` read."""

from __future__ import annotations

import functools
import json

import pytest

from kvvmm.driver.host import HostDriver
from kvvmm.driver.sim import SimDriver
from kvvmm.measure import bench, timer
from kvvmm.units import GiB, MiB

# 2 buffers of 64 MiB (256 B a token, 128 pages a granule), 8 steps of 1 MiB a buffer
SMALL = bench.Workload(layers=1, kv_heads=2, head_dim=64, page_size=64,
                       reserved_tokens=262_144, step_tokens=4096, grow_to_tokens=32_768)


def _no_sleep(_s: float) -> None:
    pass


def test_elastic_growth_gives_both_variants_settled_and_back_to_back_and_a_sweep() -> None:
    drv = SimDriver("h200")
    res = bench.elastic_growth(drv, SMALL, gap_s=0.001, lookahead_bytes=4 * MiB,
                               sweep=(2 * MiB, 4 * MiB), rounds=2, settle_s=0,
                               sleep=_no_sleep)
    json.dumps(res)
    assert res["assumptions"]["gap_s_between_steps"] == 0.001
    for key in ("without_pool", "with_pool"):
        v = res[key]
        for side in ("settled", "back_to_back"):
            assert len(v[side]["rounds"]) == 2
            for r in v[side]["rounds"]:
                assert r["driver_ms"] == pytest.approx(
                    r["driver_decode_path_ms"] + r["driver_background_ms"], abs=2e-3)
                assert r["overcommit_bytes"] >= 0 and r["pool_errors"] == 0
        assert "back_to_back_over_settled_blocked" in v
    # without a pool nothing runs on another thread; with one the look-ahead does
    assert all(r["driver_calls_background"] == 0
               for r in res["without_pool"]["settled"]["rounds"])
    assert res["with_pool"]["settled"]["rounds"][0]["pool_jobs"] > 0
    assert [r["lookahead_bytes"] for r in res["lookahead_sweep"]] == [2 * MiB, 4 * MiB]
    assert "lookahead_overcommit_bytes" in res["with_pool"]
    assert drv.stats().clean


def test_page_ops_time_owner_pages_and_arena_granules_with_and_without_the_pool() -> None:
    drv = SimDriver("h200")
    res = bench.page_ops(drv, SMALL, pages=4, granules=4)
    json.dumps(res)
    for key in ("without_pool", "with_pool"):
        row = res[key]
        for cycle in (1, 2):
            for op in ("commit", "decommit"):
                assert row[f"owner_{op}_page_cycle{cycle}"]["us_median"] >= 0
                assert row[f"arena_{op}_granule_cycle{cycle}"]["us_median"] >= 0
    # the pool kept the first cycle's handles: the second commit only maps and grants access
    assert res["with_pool"]["owner_commit_page_cycle2"]["driver_calls_per_page"] == 2 * 2
    assert res["without_pool"]["owner_commit_page_cycle2"]["driver_calls_per_page"] == 3 * 2
    assert drv.stats().clean


def test_bandwidth_with_holes_runs_on_real_bytes_and_the_targets_read_every_section() -> None:
    drv = HostDriver(capacity_bytes=GiB)
    try:
        bw = bench.elastic_bandwidth(drv, SMALL, nbytes=8 * MiB, chunk_bytes=4 * MiB,
                                     lookahead_bytes=4 * MiB,
                                     bw_pair=functools.partial(timer.copy_vs_malloc,
                                                               alternations=2, reps=2))
        assert drv.stats().clean
    finally:
        drv.close()
    json.dumps(bw)
    for key in ("owner_with_holes", "ranges_out_of_order", "granules_out_of_order"):
        assert bw[key]["ratio"] > 0
    assert bw["owner_with_holes"]["holes"] > 0
    sim = SimDriver("h200")
    res = {"elastic_growth": bench.elastic_growth(sim, SMALL, gap_s=0, lookahead_bytes=4 * MiB,
                                                  sweep=(), rounds=1, settle_s=0,
                                                  sleep=_no_sleep),
           "page_ops": bench.page_ops(sim, SMALL, pages=2, granules=2),
           "elastic_bandwidth": bw}
    t = bench.elastic_targets(res)
    for key in ("elastic_blocked_ms<=10", "elastic_step_p99_us<=50",
                "elastic_back_to_back<=1.2x_settled", "elastic_bandwidth_ratio>=0.99"):
        assert isinstance(t[key], bool)
    assert t["elastic_lookahead_bytes"] == 4 * MiB and "page_commit_us_median" in t


def test_one_timed_driver_counts_vmm_calls_by_thread_and_records_inside_a_block() -> None:
    # Bench's and calibrate's wrappers became one; each command's use still holds.
    td = timer.TimedDriver(SimDriver("h200"))
    g = td.granularity()
    va = td.reserve(2 * g)
    h = td.create(g)
    td.mem_info()  # not a VMM call: never counted
    assert td.fg_calls == 2 and td.bg_calls == 0 and td.fg_s > 0
    with td.record() as calls:
        td.map(va, g, h)
        td.mem_info()
    assert [(op, size) for op, size, _ in calls] == [("map", g), ("mem_info", 0)]
    assert td.fg_calls == 2  # recorded calls go to the list, not the counters
    td.unmap(va, g)
    with td.record() as calls:
        td.release(h)  # by its handle's size
        td.free(va, 2 * g)
    assert [(op, size) for op, size, _ in calls] == [("release", g), ("free", 2 * g)]
    assert td.fg_calls == 3


def test_rounds_turn_the_order_one_place_each_round() -> None:
    assert [timer.rotated(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]

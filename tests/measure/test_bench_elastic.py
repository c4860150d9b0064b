"""``kvvmm bench``'s issue-19 sections (elastic growth, single pages, bandwidth with holes)
run on the sim and host drivers with small sizes: they run, clean up, and give the JSON keys
the H200 run and ``targets`` read; and ``bench/elastic/bench_elastic.py --churn-growth``'s
kvvmm side on the host driver, whose pattern check must fail a wrong mapping."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvvmm.driver.host import HostDriver
from kvvmm.driver.sim import SimDriver
from kvvmm.measure import bench, timer
from kvvmm.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[2]

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


def _churn_growth(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """bench/elastic/bench_elastic.py --churn-growth on the host driver, small, in its own
    process as a user runs it."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "elastic" / "bench_elastic.py"), "--churn-growth",
         "--driver", "host", "--live", "3", "--ops", "6", "--steps", "40", "--seed", "1",
         "--out", str(tmp_path / "cg.json"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the host driver needs Linux")
def test_churn_and_growth_time_every_op_and_read_every_request_s_pattern_back(
        tmp_path: Path) -> None:
    proc = _churn_growth(tmp_path, "--modes", "thread,inline")
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "cg.json").read_text())
    assert res["work"]["churn_ops"] == 6 and res["work"]["growth_ops"] > 0
    assert res["kvcached"] == {"skipped": "kvcached runs on CUDA only"}
    for mode in ("thread", "inline"):
        run = res["kvvmm"][mode]
        assert run["pages_checked"] > 0
        for pattern, ops in res["ops"].items():
            for op in ops:
                q = run[pattern][op]
                assert q["n"] > 0 and 0 < q["p50_us"] <= q["p99_us"] <= q["max_us"]
            assert run[pattern][ops[-1]]["p50_us"] >= run[pattern][ops[-2]]["p50_us"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the host driver needs Linux")
def test_the_pattern_check_fails_a_run_whose_requests_share_memory(tmp_path: Path) -> None:
    # --wrong-map maps each handle of a size mapped before onto that earlier handle's memory:
    # every call succeeds and the timings would look fine; the read-back must not
    proc = _churn_growth(tmp_path, "--modes", "inline", "--wrong-map")
    assert proc.returncode == 1, proc.stderr
    assert "PatternError" in proc.stderr and "a wrong mapping" in proc.stderr
    assert not (tmp_path / "cg.json").exists()

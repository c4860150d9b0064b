"""bench/elastic/bench_elastic.py's layout-bandwidth section, run on the host driver's real
bytes: every operation it times reads the same values through the interleaved views as through
the per-layer buffers, and its JSON has each ratio (the GPU gives the numbers, not CI)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from kvvmm.driver.host import HostDriver
from kvvmm.units import GiB


def _module(name: str = "bench_elastic", topic: str = "elastic") -> Any:
    """A script of bench/ as a module (bench/ is no package)."""
    path = Path(__file__).resolve().parents[2] / "bench" / topic / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_bandwidth_section_times_every_op_on_every_layout_and_the_views_agree() -> None:
    mod = _module()
    drv = HostDriver(capacity_bytes=4 * GiB)
    res = mod.run_bandwidth(drv, 256, repeats=1)
    ops = ("copy", "sdpa", "gather", "request_copy")
    assert set(res["ops"]) == set(ops)
    for layout in ("interleaved", "token_major", "cudaMalloc"):
        for op in ops:
            assert res[layout][f"{op}_ms"] > 0
    for base in ("token_major", "cudaMalloc"):
        assert set(res[f"interleaved_vs_{base}"]) == set(ops)
        for op in ops:
            assert res[f"interleaved_vs_{base}"][op] == pytest.approx(
                res[base][f"{op}_ms"] / res["interleaved"][f"{op}_ms"], rel=1e-3, abs=1e-3)
    assert res["views_agree"] is True
    assert drv.stats().clean


def test_the_growth_steps_bench_runs_both_layouts_and_reports_the_no_op_beside_its_floor(
) -> None:
    from kvvmm.measure.workload import Workload
    from kvvmm.units import MiB

    mod = _module("bench_growth_steps", "growth")
    small = Workload(layers=2, kv_heads=1, head_dim=128, page_size=16, reserved_tokens=40_000,
                     step_tokens=512, grow_to_tokens=8_192, finalize_tokens=20_000)
    res = mod.run("host", 1, base=small, lookahead_bytes=2 * MiB, gap_s=0.001, settle_s=0)
    assert set(res) == {"token_major", "interleaved"}
    for layout, r in res.items():
        pooled = r["with_pool"]["settled"]
        assert pooled["noop_step_after_gap_us_median"] > 0
        assert pooled["empty_call_after_gap_us_median"] > 0
        assert set(r["targets"]) == {"blocked_ms<=10", "step_p99_us<=50",
                                     "noop_step_after_gap_us<=5"}, layout
        assert r["assumptions"]["gap"] == "time.sleep"
        assert r["with_pool"]["settled"]["rounds"][0]["pool_errors"] == 0


def test_the_growth_steps_bench_refuses_a_kernel_gap_without_cuda(capsys: Any) -> None:
    mod = _module("bench_growth_steps", "growth")
    assert mod.main(["--driver", "host", "--gap", "kernel"]) == 2
    assert "--gap kernel needs --driver cuda" in capsys.readouterr().err

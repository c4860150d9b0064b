"""bench/vllm_overhead's script runs every step without a GPU, with tiny rounds, in its own
process as a user runs it.

On a machine without one, vLLM's CudaVmmDriver is skipped and kvvmm's adapter runs over the
host driver; ``--driver host-pair`` and ``--driver null`` time the adapter against vLLM's calls
passed straight to a host driver / a driver whose calls return at once, so the side-by-side
half (alternation, ratios, the adapter's own µs, the verdict) runs too. No figure is
asserted: it is a benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "vllm_overhead" / "bench_vllm_overhead.py"
CALLS = {"reserve", "create", "map", "set_access", "unmap", "release", "free_reserved"}


def _run(tmp_path: Path, driver: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "sub" / f"{driver}-vllm-overhead.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT), "--driver", driver, "--rounds", "3",
                           "--warmup", "1", "--sizes", "2", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text()), done.stdout


def test_the_script_on_the_host_driver_skips_vllms_driver_and_writes_kvvmms_figures(
        tmp_path: Path) -> None:
    got, stdout = _run(tmp_path, "host")
    assert got["card"] == "host" and got["drivers"] == ["kvvmm"] and "vllm" in got["skipped"]
    assert got["within_target"] is None and got["rounds"] == 3
    assert {"python", "kvvmm", "torch"} <= set(got["versions"]) and got["date"]
    assert list(got["sizes"]) == ["2MiB", "4MiB"]
    for row in got["sizes"].values():
        assert set(row["kvvmm"]) == CALLS and "vllm" not in row
        assert all(v["median_us"] > 0 and v["p99_us"] >= v["median_us"]
                   for v in row["kvvmm"].values())
    assert "skipped vllm" in stdout


@pytest.mark.parametrize("mode", ["host-pair", "null"])
def test_two_drivers_are_timed_alternately_with_ratios_overheads_and_a_verdict(
        tmp_path: Path, mode: str) -> None:
    got, stdout = _run(tmp_path, mode)
    assert got["card"] == mode and got["drivers"] == ["direct", "kvvmm"] and got["skipped"] == {}
    for row in got["sizes"].values():
        assert row["order"] == ["direct", "kvvmm", "kvvmm", "direct"]  # who goes first alternates
        assert set(row["ratio_median"]) == CALLS == set(row["ratio_p99"])
        assert row["ratio_cycle_median"] > 0
        assert set(row["overhead_us"]) == CALLS  # the adapter's own: kvvmm's less direct's
        assert row["overhead_cycle_us"] == pytest.approx(sum(row["overhead_us"].values()),
                                                         abs=1e-2)
    assert "kvvmm / direct" in stdout
    worst = max(row["ratio_cycle_median"] for row in got["sizes"].values())
    assert got["worst_cycle_ratio"] == worst
    assert got["within_target"] == (worst <= got["target_ratio"])

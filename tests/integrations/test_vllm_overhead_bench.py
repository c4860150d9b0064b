"""bench/vllm_overhead's script runs its every step without a GPU, with tiny rounds.

On a machine without one, vLLM's CudaVmmDriver is skipped and kvvmm's adapter runs over the
host driver; with two host adapters given in place of the two CUDA drivers, the side-by-side
half (alternation, ratios, the verdict) runs too. No figure is asserted: it is a benchmark.
"""

from __future__ import annotations

import importlib.util
import json
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import kvvmm
from kvvmm.integrations.vllm import KvvmmVmmDriver

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "vllm_overhead" / "bench_vllm_overhead.py"


@pytest.fixture(scope="module")
def bench() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("kvvmm_bench_vllm_overhead", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_script_on_the_host_driver_skips_vllms_driver_and_writes_kvvmms_figures(
        bench: types.ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "host-vllm-overhead.json"
    assert bench.main(["--driver", "host", "--rounds", "3", "--warmup", "1", "--sizes", "2",
                       "4", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["card"] == "host" and got["drivers"] == ["kvvmm"] and "vllm" in got["skipped"]
    assert got["within_target"] is None and got["rounds"] == 3
    assert {"python", "kvvmm", "torch"} <= set(got["versions"]) and got["date"]
    assert list(got["sizes"]) == ["2MiB", "4MiB"]
    for row in got["sizes"].values():
        assert set(row["kvvmm"]) == set(bench.CALLS) and "vllm" not in row
        assert all(v["median_us"] > 0 and v["p99_us"] >= v["median_us"]
                   for v in row["kvvmm"].values())
    assert "skipped vllm" in capsys.readouterr().out


def test_two_drivers_are_timed_alternately_with_ratios_and_a_verdict(
        bench: types.ModuleType) -> None:
    calls: list[str] = []

    class Counting(KvvmmVmmDriver):
        def __init__(self, driver: Any, name: str) -> None:
            super().__init__(driver)
            self.name = name

        def reserve(self, size: int) -> int:
            calls.append(self.name)
            return super().reserve(size)

    @contextmanager
    def two_hosts(kind: str, device: int) -> Iterator[tuple[dict[str, Any], str, dict[str, str]]]:
        a, b = (kvvmm.open_driver("host", capacity_bytes=64 << 20) for _ in range(2))
        try:
            yield {"vllm": Counting(a, "vllm"), "kvvmm": Counting(b, "kvvmm")}, "two hosts", {}
        finally:
            a.close()
            b.close()

    got = bench.run("host", [2], rounds=4, warmup=0, device=0, opener=two_hosts)
    assert calls == ["vllm", "kvvmm", "kvvmm", "vllm"] * 2  # who goes first alternates
    row = got["sizes"]["2MiB"]
    assert set(row["ratio_median"]) == set(bench.CALLS) == set(row["ratio_p99"])
    assert row["ratio_cycle_median"] > 0
    assert got["worst_cycle_ratio"] == row["ratio_cycle_median"]
    assert got["within_target"] == (row["ratio_cycle_median"] <= 1.1)
    assert "cycle (sum of medians)" in bench.report(got)

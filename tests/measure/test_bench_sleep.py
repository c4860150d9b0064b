"""bench/sleep/bench_sleep.py runs (issue 28, item 4): its logic on the host driver, small.

The H200 run (``bench/device/h200_sleep.sh``) is the measurement; here the same script runs on
32 MiB of host memory in 64 KiB granules, every backup (host, disk, none), and its report
is checked for what the lead reads: bytes given back, bit-exact contents, every target with
the numbers it was judged on, the card, versions and date. The target judging is also run
on a CUDA-shaped result, so a ratio or a comparison the host cannot produce is checked too.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the host driver needs Linux")


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_sleep",
                                                  ROOT / "bench" / "sleep" / "bench_sleep.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_sleep_benchmark_runs_on_the_host_driver_and_reports_every_target(
        tmp_path: Path) -> None:
    bench = _bench()
    out = tmp_path / "r" / "sleep.json"
    assert bench.main(["--driver", "host", "--gib", "0.03125", "--host-granularity-kib", "64",
                       "--reps", "1", "--disk-dir", str(tmp_path), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"card", "date", "versions", "pool", "kvvmm", "targets"} <= set(res)
    assert res["pool"] == {"model": "llama-3.1-70b", "tp": 8, "rank": 0, "gib": 0.03125,
                           "dtype": "bfloat16", "page_size": 16}
    kv = res["kvvmm"]
    assert kv["buffers"] == 160 and set(kv["runs"]) == {"host", "host-mmap", "disk", "none"}
    for mode, runs in kv["runs"].items():
        (rep,) = runs["reps"]
        assert rep["given_bytes"] == rep["physical_bytes"] == rep["woke_bytes"] > 0
        assert rep["given_fraction"] == 1.0
        assert rep.get("bit_exact", True), mode
        assert rep["backup_bytes"] == (0 if mode == "none" else rep["physical_bytes"])
    t = res["targets"]
    assert t["given_back"]["met"] and t["bit_exact"]
    assert t["wake_with_contents"]["h2d_copy_s"] is None  # no PCIe on host memory
    assert t["vs_torch_memory_saver"]["met"] is None
    assert not list(tmp_path.glob("kvvmm-sleep-*.bin")), "the disk backups are removed"


def _runs(wake: float, sleep: float, frac: float = 1.0, **rep: Any) -> dict[str, Any]:
    reps = [{"backup_bytes": 60 << 30, "given_fraction": frac, **rep}]
    return {"wake_s": {"median": wake}, "sleep_s": {"median": sleep},
            "given_fraction_min": frac, "reps": reps}


@pytest.mark.parametrize(("wake_host", "wake_none", "tms_resume", "met"), [
    (1.30, 0.020, 1.5, (True, True, True)),    # 1.30 s <= 1.2 x 1.2 s; faster than tms
    (1.50, 0.080, 1.4, (False, False, False)),  # over both targets, slower than tms
])
def test_the_targets_are_judged_on_the_numbers_the_report_shows(
        wake_host: float, wake_none: float, tms_resume: float,
        met: tuple[bool, bool, bool]) -> None:
    bench = _bench()
    h2d_gbps = (60 << 30) / 1.2 / 1e9  # the copy of those bytes takes 1.2 s
    res = {"pcie": {"h2d_gbps": h2d_gbps},
           "kvvmm": {"runs": {"host": _runs(wake_host, 2.0, bit_exact=True,
                                            graph_same_as_before_sleep=True),
                              "none": _runs(wake_none, 0.05)}},
           "torch_memory_saver": {"runs": {"cpu_backup": _runs(tms_resume, 3.0),
                                           "none": _runs(0.5, 0.5)}}}
    t = bench.targets(res)
    assert t["wake_with_contents"]["h2d_copy_s"] == pytest.approx(1.2)
    assert t["wake_with_contents"]["met"] is met[0]
    assert t["wake_without_contents"]["met"] is met[1]
    assert t["vs_torch_memory_saver"]["host"]["met"] is met[2]
    assert t["graph_after_wake"]["identical"] and t["given_back"]["met"]

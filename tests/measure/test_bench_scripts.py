"""The benchmarks' logic runs on the host driver, small, as a user runs the scripts: each in
its own process through its command line (the GPU run is the measurement; here, that the
script runs and reports what its readers need)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the host driver needs Linux")


def script(path: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``bench/<path>`` with ``args`` from the checkout, as the README says."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_sleep_benchmark_runs_on_the_host_driver_and_reports_every_target(
        tmp_path: Path) -> None:
    out = tmp_path / "r" / "sleep.json"
    proc = script("sleep/bench_sleep.py", "--driver", "host", "--gib", "0.03125",
                  "--host-granularity-kib", "64", "--reps", "1", "--disk-dir", str(tmp_path),
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert {"card", "date", "versions", "pool", "kvvmm", "targets"} <= set(res)
    assert res["pool"] == {"model": "llama-3.1-70b", "tp": 8, "rank": 0, "gib": 0.03125,
                           "dtype": "bfloat16", "page_size": 16}
    kv = res["kvvmm"]
    assert kv["buffers"] == 160 and set(kv["runs"]) == {"host", "host-mmap", "host-mmap-serial",
                                                        "host-keep", "disk", "none"}
    for mode, runs in kv["runs"].items():
        (rep,) = runs["reps"]
        assert rep["given_bytes"] == rep["physical_bytes"] == rep["woke_bytes"] > 0
        assert rep["given_fraction"] == 1.0
        assert rep.get("bit_exact", True), mode
        assert rep["backup_bytes"] == (0 if mode == "none" else rep["physical_bytes"])
        assert rep["phases"]["total_s"] > 0 and rep["wake_phases"]["total_s"] > 0
        if mode.startswith("host-"):  # the mapping's own steps: faulted in on its threads
            assert rep["phases"]["backup.fault_s"] >= 0 and "backup.wait_s" in rep["phases"]
    t = res["targets"]
    assert t["given_back"]["met"] and t["bit_exact"]
    assert t["wake_with_contents"]["h2d_copy_s"] is None  # no PCIe on host memory
    assert t["sleep_with_contents"]["d2h_copy_s"] is None and "host-keep" in t[
        "sleep_with_contents"]["by_memory"]
    assert {"cpus", "thp_enabled"} <= set(res["host"])
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
def test_the_sleep_targets_are_judged_on_the_numbers_the_report_shows(
        tmp_path: Path, wake_host: float, wake_none: float, tms_resume: float,
        met: tuple[bool, bool, bool]) -> None:
    h2d_gbps = (60 << 30) / 1.2 / 1e9  # the copy of those bytes takes 1.2 s
    res = {"pcie": {"h2d_gbps": h2d_gbps},
           "kvvmm": {"runs": {"host": _runs(wake_host, 2.0, bit_exact=True,
                                            graph_same_as_before_sleep=True),
                              "none": _runs(wake_none, 0.05)}},
           "torch_memory_saver": {"runs": {"cpu_backup": _runs(tms_resume, 3.0),
                                           "none": _runs(0.5, 0.5)}}}
    path = tmp_path / "cuda-shaped.json"
    path.write_text(json.dumps(res))
    proc = script("sleep/bench_sleep.py", "--judge", str(path))
    assert proc.returncode == 0, proc.stderr
    t = json.loads(proc.stdout)
    assert t["wake_with_contents"]["h2d_copy_s"] == pytest.approx(1.2)
    assert t["wake_with_contents"]["met"] is met[0]
    assert t["wake_without_contents"]["met"] is met[1]
    assert t["vs_torch_memory_saver"]["host"]["met"] is met[2]
    assert t["graph_after_wake"]["identical"] and t["given_back"]["met"]


def test_the_bandwidth_section_times_every_op_on_every_layout_and_the_views_agree(
        tmp_path: Path) -> None:
    out = tmp_path / "bw.json"
    proc = script("elastic/bench_elastic.py", "--smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
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
    assert res["driver_clean"] is True


def test_the_growth_steps_bench_runs_both_layouts_and_reports_the_no_op_beside_its_floor(
        tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    proc = script("growth/bench_growth_steps.py", "--driver", "host", "--smoke",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert set(res) == {"token_major", "interleaved"}
    for layout, r in res.items():
        pooled = r["with_pool"]["settled"]
        assert pooled["noop_step_after_gap_us_median"] > 0
        assert pooled["empty_call_after_gap_us_median"] > 0
        assert set(r["targets"]) == {"blocked_ms<=10", "step_p99_us<=50",
                                     "noop_step_after_gap_us<=5"}, layout
        assert r["assumptions"]["gap"] == "time.sleep"
        assert r["with_pool"]["settled"]["rounds"][0]["pool_errors"] == 0


def test_the_growth_steps_bench_refuses_a_kernel_gap_without_cuda() -> None:
    proc = script("growth/bench_growth_steps.py", "--driver", "host", "--gap", "kernel")
    assert proc.returncode == 2
    assert "--gap kernel needs --driver cuda" in proc.stderr


def test_every_bench_script_has_its_row_in_the_bench_readme() -> None:
    readme = (ROOT / "bench" / "README.md").read_text()
    scripts = [p.relative_to(ROOT / "bench").as_posix() for p in (ROOT / "bench").rglob("*")
               if p.suffix in (".py", ".sh") and "results" not in p.parts
               and "__pycache__" not in p.parts]
    assert scripts
    missing = [s for s in scripts if f"| `{s}`" not in readme]
    assert not missing, f"bench/README.md has no row for {missing}"


def test_the_device_driver_refuses_a_mode_it_does_not_have_and_each_mode_has_a_row(
        tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device" / "card_check.sh"), "ranges"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "no mode ranges" in proc.stderr
    modes = proc.stderr.split("(", 1)[1].split(")", 1)[0].replace(",", " ").split()
    readme = (ROOT / "bench" / "README.md").read_text()
    assert [m for m in modes if f"| `{m}`" not in readme] == []

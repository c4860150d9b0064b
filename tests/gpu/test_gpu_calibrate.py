"""`kvvmm calibrate --quick` on the GPU writes a complete profile the simulator loads.

Run in a child process (as the other GPU examples): a crash in CUDA must not take the test
session with it, and the child sees the same environment a user's shell does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvvmm.driver.sim import SimDriver
from kvvmm.hardware import get_profile, profile_data, sim_costs
from kvvmm.hardware.schema import COLD_SECTION
from kvvmm.units import MiB

ROOT = Path(__file__).resolve().parents[2]


def test_calibrate_quick_writes_a_complete_profile_that_the_sim_loads_and_charges(
    tmp_path: Path,
) -> None:
    out = tmp_path / "gpu-profile.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "kvvmm", "calibrate", "--quick", "--out",
                           str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    data = json.loads(out.read_text())
    cal = data["calibration"]
    assert cal["complete"] and not cal["errors"], cal["errors"]
    prof = get_profile(out)
    raw = profile_data(prof)
    for op in ("create", "map", "set_access", "unmap", "release", "reserve", "free"):
        assert raw["call_costs"]["points"][op], op
    for section in ("call_costs", "set_access_per_mapping", "unmap_per_mapping",
                    "library_work_us", "library_overhead_us", "post_release_slowdown",
                    "bandwidth"):
        assert raw[section]["source"], section
    costs = sim_costs(prof)
    from kvvmm.measure.operations import WORK_UNITS

    # The library's work is charged per operation (every one measured), nothing per call.
    assert set(costs.work) == set(WORK_UNITS) and costs.per_call_overhead_us == {}
    assert costs.unmap_per_mapping is not None
    assert not any("call costs" in n for n in costs.notes)  # nothing borrowed from the H200
    # The card's first call of each kind after a pause costs more (~80 us for a create on
    # an H200): calibrate measured it, and the sim charges it on a device's first create.
    cold = raw[COLD_SECTION]
    assert cold["source"] and cold["premium_us"]["create"] > 0
    premium = costs.cold.premium_us["create"] if costs.cold is not None else 0.0
    sim = SimDriver(prof)
    sim.create(2 * MiB)
    assert costs.call_us("create", 2 * MiB) == costs.calls("create", 2 * MiB)
    assert sim.clock_us == pytest.approx(costs.calls("create", 2 * MiB) + premium)
    before = sim.clock_us
    sim.create(2 * MiB)  # warm now: the curve's figure alone
    assert sim.clock_us - before == pytest.approx(costs.calls("create", 2 * MiB))
    assert cal["wall_s"] < 180, cal["seconds"]  # --quick: about a minute on an H200

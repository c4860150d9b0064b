"""Every profile says whose call costs it predicts with and where they were measured
(issue 48: `--gpu h100` used the H200's costs and said "measured unknown"; since 2026-12-07
the h100 has costs of its own, measured on an H100, and b200 and gb300 borrow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvvmm.hardware import (
    PROFILES,
    DeviceProfile,
    load_profile,
    profile_data,
    profile_from_data,
    profile_summary,
    provenance,
    provenance_label,
    sim_costs,
)
from kvvmm.hardware.schema import COLD_SECTION
from kvvmm.units import MiB

DATA = Path(__file__).resolve().parents[2] / "kvvmm" / "hardware" / "data"


@pytest.mark.parametrize(("key", "label"), [
    ("h200", "costs: h200, measured on an H200; capacity: h200"),
    ("h200-table", "costs: h200-table, measured on an H200; capacity: h200-table"),
    ("h100", "costs: h100, measured on an H100; capacity: h100"),
    ("b200", "costs: h200, measured on an H200; capacity: b200"),
    ("gb300", "costs: h200, measured on an H200; capacity: gb300"),
])
def test_each_shipped_profile_names_whose_costs_it_uses_and_where_they_were_measured(
        key: str, label: str) -> None:
    assert provenance_label(key) == label
    assert provenance(key).borrowed == (key in ("b200", "gb300"))


@pytest.mark.parametrize("key", sorted(PROFILES))
def test_a_profile_borrows_exactly_when_the_simulator_charges_it_the_h200s_calls(
        key: str) -> None:
    """The label and the cost model read the same rule: no call costs of its own, the
    H200's (sim_costs notes it; the h200 itself lends to no one)."""
    prof = PROFILES[key]
    noted = any(n.startswith("call costs: none measured") for n in sim_costs(prof).notes)
    assert provenance(prof).borrowed == noted
    if provenance(prof).borrowed:  # the very curves the H200 is charged with
        assert sim_costs(prof).calls.curves == sim_costs(PROFILES["h200"]).calls.curves


def test_a_borrowing_profile_dates_its_costs_by_the_lenders_measurement() -> None:
    b200 = profile_summary("b200")
    assert b200["date"] == "not stated"  # the card's own figures carry no date ...
    assert b200["costs_date"] == profile_summary("h200")["date"]  # ... its costs do
    assert b200["costs_measured_on"] == "NVIDIA H200" and b200["borrowed"] is True
    assert b200["label"] == provenance_label("b200")
    assert "unknown" not in json.dumps(b200)


def test_the_h100_predicts_with_its_own_costs_measured_on_an_h100() -> None:
    h100 = profile_summary("h100")
    assert h100["borrowed"] is False and h100["costs"] == h100["capacity"] == "h100"
    assert h100["costs_measured_on"] == "NVIDIA H100 80GB HBM3"
    assert h100["date"] == h100["costs_date"] == "2026-12-07"
    # the simulator charges it the H100's calls, not the H200's (a 2 MiB set_access: 28.9
    # against the H200's 45.1 µs), and notes nothing borrowed
    h100_calls = sim_costs(PROFILES["h100"]).calls
    h200_calls = sim_costs(PROFILES["h200"]).calls
    assert h100_calls("set_access", 2 * MiB) == pytest.approx(28.935)
    assert h100_calls("set_access", 2 * MiB) < 0.7 * h200_calls("set_access", 2 * MiB)
    assert not any("H200" in n for n in sim_costs(PROFILES["h100"]).notes)


RUN = DATA.parents[2] / "bench" / "results" / "h100-calibrated-1207.json"


@pytest.mark.skipif(not RUN.exists(), reason="a checkout's bench/results (not in a wheel)")
def test_the_shipped_h100_is_the_committed_calibration_as_measured() -> None:
    """Every section the simulator reads is the run's own, unchanged (not tuned to a
    target); only the key is the shipped one, and the capacity is the run's cuMemGetInfo."""
    run = json.loads(RUN.read_text(encoding="utf-8"))
    shipped = json.loads((DATA / "h100.json").read_text(encoding="utf-8"))
    assert shipped["key"] == "h100" and run["key"] == "h100-80gb-hbm3"
    assert run["calibration"]["complete"] is True and not run["calibration"]["errors"]
    for k, v in shipped.items():
        if k not in ("key", "note", "calibrated_from"):
            assert v == run[k], k
    # what was not measured on an H100 is not there: no bands, no idle release, no
    # second-call share of the cold premium, no growth bandwidth
    for absent in ("spread", "idle_release"):
        assert absent not in shipped
    assert "second" not in shipped[COLD_SECTION] and "growth" not in shipped["bandwidth"]


def test_a_calibrated_profile_names_the_card_calibrate_recorded(tmp_path: Path) -> None:
    data = dict(profile_data("h200-calibrated"))
    data["key"] = "mycard"
    data["measured_on"] = {**data["measured_on"], "card": "NVIDIA H100 80GB HBM3"}
    path = tmp_path / "mycard.json"
    path.write_text(json.dumps(data))
    assert provenance_label(load_profile(path)) == \
        "costs: mycard, measured on an H100; capacity: mycard"


def test_a_profile_file_without_call_costs_borrows_visibly(tmp_path: Path) -> None:
    path = tmp_path / "my-b200.json"
    shutil.copy(DATA / "b200.json", path)
    assert provenance_label(str(path)) == "costs: h200, measured on an H200; capacity: b200"
    mine = tmp_path / "my-h100.json"  # a copy of a profile with its own costs keeps them
    shutil.copy(DATA / "h100.json", mine)
    assert provenance_label(str(mine)) == "costs: h100, measured on an H100; capacity: h100"


def test_costs_whose_source_names_no_card_say_so() -> None:
    data = dict(profile_data("h200-table"))
    data["key"] = "hand"
    data["call_costs"] = {**data["call_costs"], "source": "typed in from a slide"}
    assert provenance_label(profile_from_data(data)) == \
        "costs: hand, measured on a card not stated; capacity: hand"


def test_a_hand_made_profile_borrows_the_h200s_costs() -> None:
    prof = DeviceProfile("x", "X", 1 << 30, 2 * MiB, "s")
    assert provenance_label(prof) == "costs: h200, measured on an H200; capacity: x"
    assert provenance(prof.at(0.9)).costs == "h200"

"""``kvvmm.measure.level``: the session level fitted from fidelity runs, scored leaving
each session out.

Fixture runs planted at known multiples of the sim's point, in sessions by their dates: runs
minutes apart pool into one session; each session is scored with a level fitted from the
others only, so a session beyond all the others stays outside its band (as the H200's
2026-12-04 did), and one inside their range comes in.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvvmm.measure import fidelity

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fl() -> ModuleType:
    from kvvmm.measure import level

    return level


@pytest.fixture(scope="module")
def small(fl: ModuleType) -> Any:
    from dataclasses import replace

    return replace(fidelity.SMALL, workload_s=0.0, policies=("default",))


def _run(path: Path, date: str, predicted: dict[str, list[float]], scale: float) -> str:
    sc = {name: ({"predicted": v[0], "measured": v[0]} if name.endswith(":calls") else
                 {"predicted_us": v[0], "measured_us": v[0] * scale,
                  "measured_rounds_us": [v[0] * scale] * 3})
          for name, v in predicted.items()}
    path.write_text(json.dumps({"date": date, "scenarios": sc}), encoding="utf-8")
    return str(path)


def test_sessions_pool_runs_minutes_apart_and_each_is_scored_on_the_others_level(
        fl: ModuleType, small: Any, tmp_path: Path) -> None:
    pred = fidelity.predict("h200", small)
    plan = [("a1", "2026-12-01T12:22:00+00:00", 1.0), ("a2", "2026-12-01T12:40:00+00:00", 1.0),
            ("b", "2026-12-02T09:00:00+00:00", 2.5), ("c", "2026-12-03T09:00:00+00:00", 0.4),
            ("d", "2026-12-04T09:00:00+00:00", 2.5)]
    paths = [_run(tmp_path / f"{n}.json", d, pred, x) for n, d, x in plan]
    # the same bytes twice count once
    (tmp_path / "copy.json").write_bytes(Path(paths[0]).read_bytes())
    got = fl.score("h200", [*paths, str(tmp_path / "copy.json")], small,
                   calibrated_at="2026-12-01T12:20:00+00:00")
    assert [r["file"] for r in got["runs"]] == paths
    assert got["sessions"]["2026-12-01T12:22"]["runs"] == ["a1.json", "a2.json"]
    assert got["calibration_session"] == "2026-12-01T12:22"
    runs = got["leave_one_session_out"]["runs"]
    share = {n: (r["before"]["share"], r["after"]["share"]) for n, r in runs.items()}
    assert share["a1.json"] == (1.0, 1.0)  # the point itself: in every band
    # 2.5x the point is past every per-call band; left out, b sees d's 2.5 (and d b's)
    assert share["b.json"] == (0.0, 1.0) and share["d.json"] == (0.0, 1.0)
    # 0.4x is below every session the others saw: left out, it stays outside
    assert share["c.json"] == (0.0, 0.0)
    levels = got["leave_one_session_out"]["levels"]
    for g, row in levels["2026-12-02T09:00"].items():  # fitted without b's 2.5
        assert row["p90"] < 2.5, g
    # b and d in, c out: two of the three sessions other than the calibration's
    assert got["other_sessions_than_calibration"]["after"]["share"] == pytest.approx(2 / 3,
                                                                                   abs=1e-4)
    # the level fitted on every session is the one kvvmm calibrate rebuild writes, and it loads
    lv = got["level_every_session"]
    assert {s["session"] for s in lv["sessions"]} == set(got["sessions"])
    from kvvmm.hardware import profile_from_data
    from kvvmm.hardware.profiles import shipped_data

    data = json.loads(json.dumps(shipped_data()["h200"]))
    data["spread"]["level"] = lv
    profile_from_data(data, where="fitted level")
    for w in got["widths"].values():
        assert w["band_level_width"] >= w["band_width"]
        assert w["within_target_after"] == (w["band_level_width"] <= w["card_spread"] + 0.10)
    chosen = got["sensitivity"]["all_runs"]["as_chosen"]
    assert {k: chosen[k] for k in ("in_band", "share")} == got["overall"]["after"]
    # the composition's width count with the level fitted on every session is the widths'
    assert (chosen["widths_within_target_every_session"]
            == got["widths_within_target"]["after"])
    per_call = got["sensitivity"]["all_runs"]["per_call_band_only"]
    assert per_call["widths_within_target_every_session"] == got["widths_within_target"]["before"]
    comp = got["composition"]
    assert comp["candidates"]["as_chosen"]["in_band_all"] == got["overall"]["after"]["in_band"]
    assert set(comp["candidates"]) >= {"wider_per_side", "level_on_excess"}
    assert isinstance(comp["replaced"], bool)
    json.dumps(got, allow_nan=False)  # strict JSON


def test_with_level_composes_each_scenario_with_its_group_and_no_rows_change_nothing(
        fl: ModuleType) -> None:
    bf = fidelity
    bands = {"growth:exact": [8.0, 10.0, 12.0], "construct": [8.0, 10.0, 12.0],
             "workload:prefix:decode": [1.0, 2.0, 3.0]}
    assert bf.with_level(bands, {}) == bands
    rows = {"growth": {"p10": 0.5, "p50": 1.0, "p90": 1.5}}
    got = bf.with_level(bands, rows)
    assert got["growth:exact"] == [4.0, 10.0, 18.0]
    assert got["construct"] == bands["construct"]
    assert got["workload:prefix:decode"] == bands["workload:prefix:decode"]


def test_the_unstacked_compositions_take_the_wider_side_or_only_what_the_band_misses(
        fl: ModuleType) -> None:
    b = (8.0, 10.0, 12.0)
    # a level inside the per-call band adds nothing; beyond it, the level's end replaces it
    assert fl._wider_per_side(b, (0.9, 1.1)) == (8.0, 12.0)
    assert fl._wider_per_side(b, (0.5, 1.5)) == (5.0, 15.0)
    assert fl._wider_per_side(b, (1.1, 0.9)) == (8.0, 12.0)  # never narrower than the band
    assert fl._widen(b, (0.5, 1.5)) == (4.0, 18.0)  # stacked, for comparison
    # the excess of a ratio beyond its band, as a factor on the end it passed
    assert fl._excess(1.0, b) == 1.0 and fl._excess(1.2, b) == 1.0
    assert fl._excess(1.8, b) == pytest.approx(1.5)
    assert fl._excess(0.4, b) == pytest.approx(0.5)


def test_a_level_fitted_on_excess_leaves_sessions_inside_the_band_at_one(
        fl: ModuleType) -> None:
    bands = {"growth:exact": [8.0, 10.0, 12.0], "growth:default": [8.0, 10.0, 12.0]}
    ratios = {"a": {"growth:exact": 1.1, "growth:default": 1.0},
              "b": {"growth:exact": 1.8, "growth:default": 1.8}}
    session_of = {"a": "s1", "b": "s2"}
    on_ratio = fl._group_levels(ratios, session_of, bands, fl.level_group, None, False)
    on_excess = fl._group_levels(ratios, session_of, bands, fl.level_group, None, True)
    assert on_ratio == {"growth": [pytest.approx(1.05), pytest.approx(1.8)]}
    assert on_excess == {"growth": [1.0, pytest.approx(1.5)]}
    assert fl._group_levels(ratios, session_of, bands, fl.level_group, "s2", True) == {
        "growth": [1.0]}

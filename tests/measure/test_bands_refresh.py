"""``kvvmm calibrate --quick --profile``: a one-minute refresh of a full profile.

On a simulator whose costs are the shipped profile's scaled (each measured figure group by
its own factor), a quick refresh of the shipped profile recovers the scaling: every measured
group, and the groups that follow a measured call, within 2%; the old figures join the
spread's history, so the refreshed profile's bands still carry where the card was.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from kvvmm.driver.sim import SimDriver
from kvvmm.errors import ArgumentError
from kvvmm.hardware import get_profile, load_profile, profile_data, profile_from_data
from kvvmm.hardware.spread import figures_of, scaled
from kvvmm.measure import calibrate
from kvvmm.measure.refresh import FOLLOWS, MEASURED, quick_refresh, refresh_from
from kvvmm.measure.stats import ratios

#: Several scalings of the measured groups: all together (a slower or faster day), each
#: its own way (a driver update that slowed creates only), and far from 1.
SCALINGS: list[dict[str, float]] = [
    dict.fromkeys(MEASURED, 0.7),
    dict.fromkeys(MEASURED, 1.35),
    {"call_costs.create": 1.5, "call_costs.map": 0.8, "call_costs.set_access": 1.2,
     "call_costs.unmap": 0.9, "call_costs.release": 2.0, "call_costs.reserve": 0.5,
     "call_costs.free": 1.5, "first_touch": 0.6, "library_work_us": 1.3},
    {"call_costs.create": 0.5, "call_costs.map": 1.1, "call_costs.set_access": 0.75,
     "call_costs.unmap": 1.6, "call_costs.release": 0.85, "call_costs.reserve": 1.2,
     "call_costs.free": 0.9, "first_touch": 1.8, "library_work_us": 0.7},
]



def _on_sim(d: SimDriver) -> dict[str, Any]:
    """How a refresh tells time on a simulator: its clock, its pause, nothing to settle."""
    return {"clock": lambda: float(d.clock_us), "pause": d.pause, "settle_s": 0.0}

def _old() -> dict[str, Any]:
    return copy.deepcopy(dict(profile_data(get_profile("h200"))))


def _truth(old: dict[str, Any], scaling: dict[str, float]) -> dict[str, Any]:
    full = dict(scaling)
    for follower, leader in FOLLOWS.items():
        full[follower] = scaling[leader]
    return scaled(old, full)


@pytest.mark.parametrize("in_context", [False, True], ids=["tight loop", "in context"])
@pytest.mark.parametrize("scaling", SCALINGS, ids=["all 0.7", "all 1.35", "mixed", "mixed 2"])
def test_a_quick_refresh_recovers_a_scaled_simulator(
        scaling: dict[str, float], in_context: bool) -> None:
    # Within 2%, in context too when first touch is scaled unlike the calls: a growth's calls
    # include the first maps into new regions, as on the card, and the refresh takes out the
    # extra it measured there, as the profile's points are net of the calibration's.
    tol = 0.02
    old = _old()
    truth = _truth(old, scaling)
    d = SimDriver(profile_from_data(truth, where="scaled h200"))
    new = quick_refresh(d, old, **_on_sim(d), reference="points", reps=8,
                        date="2026-12-03T12:00:00+00:00", in_context=in_context)
    from_ = new["refreshed"]["factor_from"]
    assert ("in context" in from_.values()) == in_context
    got = ratios(figures_of(truth), figures_of(new))
    for group in (*MEASURED, *FOLLOWS):
        assert got[group], group
        for r in got[group]:
            assert r == pytest.approx(1.0, rel=tol), (group, r)
    for group, f in scaling.items():
        assert new["refreshed"]["factors"][group] == pytest.approx(f, rel=tol)
    assert d.mem_info()[0] == d.mem_info()[1]  # everything it made is given back


def test_a_refresh_of_an_unchanged_card_nets_its_growth_calls_of_first_touch() -> None:
    # The shipped points are net of the first-touch extra the calibration's growth calls paid
    # (the sim charges it on its own); the refresh's own growth calls pay it too (a 256 MiB
    # set_access 15% over its point on the sim), so it takes the same extra out of them:
    # the sim at the shipped profile, refreshed against itself, reads no change.
    old = _old()
    d = SimDriver(profile_from_data(old, where="h200"))
    new = quick_refresh(d, old, **_on_sim(d), reference="points", reps=5,
                        date="2026-12-03T12:00:00+00:00")
    ref = new["refreshed"]
    touch = ref["first_touch_in_context_us"]
    point = dict((m, u) for m, u in old["call_costs"]["points"]["set_access"])[256.0]
    got = {int(m): u for m, u, _ in ref["raw"]["in_context_us"]["set_access"]}
    assert got[256] > 1.1 * point  # as timed: the extra in it
    assert got[256] - touch["set_access"]["256"] == pytest.approx(point, rel=0.005)
    assert "8" not in touch["set_access"]  # Exact's 1-in-64 fresh steps: trimmed, as the point
    for op in ("map", "set_access"):
        assert ref["factor_from"][f"call_costs.{op}"] == "in context"
        assert ref["factors"][f"call_costs.{op}"] == pytest.approx(1.0, abs=1e-3), op


def test_a_refresh_keeps_the_old_figures_as_history_and_its_spread_covers_them() -> None:
    old = _old()
    truth = _truth(old, dict.fromkeys(MEASURED, 0.75))
    d = SimDriver(profile_from_data(truth, where="faster day"))
    new = quick_refresh(d, old, **_on_sim(d), reference="points", reps=6)
    hist = new["spread"]["history"]
    assert len(hist) == len(old["spread"]["history"]) + 1
    assert hist[-1]["figures"] == figures_of(old)
    assert new["date"] != "" and new["refreshed"]["from_date"] == old["date"]
    # the old (slower) figures are ~1/0.75 of the new: the band's high end reaches them
    create = new["spread"]["figures"]["call_costs.create"]
    assert create["p90"] >= 1.25
    prof = profile_from_data(new, where="refreshed")
    assert prof.at(0.9) != prof
    # The session level was fitted against the old figures, from other sessions than this
    # one: a refresh measures this session's level, so the refreshed profile carries none.
    assert "level" in old["spread"] and "level" not in new["spread"]


def _capacity_only(key: str) -> dict[str, Any]:
    data = copy.deepcopy(dict(profile_data(get_profile(key))))
    assert "call_costs" not in data  # capacity only: the sim charges it the H200's costs
    return data


def _borrowed(new: dict[str, Any], own: dict[str, Any]) -> None:
    """``new`` is ``own`` refreshed from the H200's costs, and says so."""
    ref = new["refreshed"]
    assert ref["costs_from"] == "h200"
    assert ref["sources"] == f"costs: h200, measured; capacity: {own['key']}"
    for k in ("key", "name", "capacity_bytes", "granularity_bytes", "source"):
        assert new[k] == own[k], k
    assert ref["from_date"] == _old()["date"]
    assert new["spread"]["history"][-1]["source"].endswith("(h200)")
    prof = profile_from_data(new, where=f"refreshed {own['key']}")
    assert prof.capacity_bytes == own["capacity_bytes"]


@pytest.mark.parametrize("key", ["b200", "gb300"])
def test_a_profile_of_capacity_only_is_refreshed_from_the_h200s_costs_on_the_sim(
        key: str) -> None:
    # the sim charges a capacity-only profile the H200's costs: refreshed against itself,
    # the H200's figures come back unchanged, under the card's own capacity
    own = _capacity_only(key)
    d = SimDriver(key)
    new = quick_refresh(d, own, **_on_sim(d), reference="points", reps=5, in_context=False,
                        date="2026-12-07T12:00:00+00:00")
    _borrowed(new, own)
    for op in ("create", "map", "set_access", "unmap", "release", "reserve", "free"):
        assert new["refreshed"]["factors"][f"call_costs.{op}"] == pytest.approx(1.0, rel=0.02)
    for r in ratios(figures_of(_old()), figures_of(new))["call_costs.create"]:
        assert r == pytest.approx(1.0, rel=0.02)
    again = refresh_from(own, new["refreshed"]["raw"], date="2026-12-07T12:00:00+00:00")
    assert again["refreshed"]["factors"] == new["refreshed"]["factors"]
    assert d.mem_info()[0] == d.mem_info()[1]


def test_the_shipped_h100_refreshes_its_own_costs_on_the_sim() -> None:
    # the h100 carries costs measured on an H100 and no spread: a refresh rescales its own
    # figures (not the H200's), under its own capacity, and starts the bands' history
    own = copy.deepcopy(dict(profile_data(get_profile("h100"))))
    assert "call_costs" in own and "spread" not in own
    scaling = SCALINGS[2]
    truth = _truth(own, scaling)
    d = SimDriver(profile_from_data(truth, where="scaled h100"))
    new = quick_refresh(d, own, **_on_sim(d), reference="points", reps=6, in_context=False,
                        date="2026-12-08T12:00:00+00:00")
    ref = new["refreshed"]
    assert ref["costs_from"] == "h100" and ref["from_date"] == own["date"]
    for k in ("key", "name", "capacity_bytes", "granularity_bytes"):
        assert new[k] == own[k], k
    for group, f in scaling.items():
        assert ref["factors"][group] == pytest.approx(f, rel=0.02), group
    hist = new["spread"]["history"]
    assert len(hist) == 1 and hist[0]["figures"] == figures_of(own)
    assert profile_from_data(new, where="refreshed h100").capacity_bytes == own["capacity_bytes"]
    assert d.mem_info()[0] == d.mem_info()[1]


def test_a_profile_of_capacity_only_is_refreshed_on_the_host_driver() -> None:
    import time

    from kvvmm.driver.host import HostDriver

    own = _capacity_only("b200")
    d = HostDriver()
    try:
        new = quick_refresh(d, own, clock=lambda: time.perf_counter() * 1e6, settle_s=0.0,
                            sizes_mib=(2, 8), reps=5, regions=2, in_context=False)
    finally:
        d.close()
    _borrowed(new, own)
    assert set(MEASURED) <= set(new["refreshed"]["factors"])
    assert all(f > 0 for f in new["refreshed"]["factors"].values())
    assert new["refreshed"]["raw"]["per_call_us"]["create"].keys() == {"2", "8"}


def test_calibrate_quick_profile_without_a_gpu_says_so_in_one_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # h100: costs of its own but no spread; b200: no call costs of its own; neither refused
    for key in ("h200", "h100", "b200"):
        assert calibrate.main(["--quick", "--profile", key, "--out",
                               str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "GPU" in err
    assert calibrate.main(["--profile", "h200"]) == 2
    assert "--quick" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "kvvmm-hardware-profile"}), encoding="utf-8")
    assert calibrate.main(["--quick", "--profile", str(bad)]) == 2
    assert "bad.json" in capsys.readouterr().err


def test_a_refreshed_profile_written_to_a_file_loads(tmp_path: Path) -> None:
    old = _old()
    d = SimDriver(profile_from_data(_truth(old, dict.fromkeys(MEASURED, 1.1)), where="t"))
    new = quick_refresh(d, old, **_on_sim(d), reference="points", reps=5)
    p = tmp_path / "h200-refreshed.json"
    p.write_text(json.dumps(new), encoding="utf-8")
    assert load_profile(p).key == "h200"


def _card_like(old: dict[str, Any], f: float) -> dict[str, Any]:
    """A simulator whose calls cost the profile's *isolated* figures times ``f``: as a card's
    tight loop does on a day ``f`` times the calibration's (its in-context calls then cost
    the points times ``f``)."""
    truth = copy.deepcopy(old)
    cc = truth["call_costs"]
    cc["points"] = {op: [[m, u * f] for m, u in pts]
                    for op, pts in cc["isolated_points"].items()}
    return truth


@pytest.mark.parametrize("f", [0.6, 1.3])
def test_on_a_card_the_tight_loop_is_compared_with_the_isolated_figures(f: float) -> None:
    # The profile's points are in-context costs (set_access ~1.4x its tight loop on the
    # H200): a refresh that compared its tight loop with them read a day at f as ~0.55 f.
    old = _old()
    assert old["call_costs"]["isolated_points"]
    d = SimDriver(profile_from_data(_card_like(old, f), where="card-like"))
    new = quick_refresh(d, old, **_on_sim(d), reps=6, reference="isolated",
                        in_context=False)  # the sim charges in context what it charges alone
    for op in ("create", "map", "set_access", "unmap", "release"):
        assert new["refreshed"]["factors"][f"call_costs.{op}"] == pytest.approx(f, rel=0.03), op
    got = ratios(figures_of(scaled(old, dict.fromkeys(
        [f"call_costs.{op}" for op in ("create", "map", "set_access", "unmap", "release")],
        f))), figures_of(new))
    for op in ("create", "map", "set_access", "unmap", "release"):
        for r in got[f"call_costs.{op}"]:
            assert r == pytest.approx(1.0, rel=0.03), (op, r)
    # the isolated figures move with the points: the next refresh compares like with like
    assert new["call_costs"]["isolated_points"]["create"][0][1] == pytest.approx(
        old["call_costs"]["isolated_points"]["create"][0][1] * f, rel=0.03)


def test_a_refresh_is_repeatable_from_its_record_without_a_driver() -> None:
    old = _old()
    d = SimDriver(profile_from_data(_truth(old, dict.fromkeys(MEASURED, 0.8)), where="t"))
    new = quick_refresh(d, old, **_on_sim(d), reference="points", reps=5,
                        date="2026-12-03T12:00:00+00:00")
    again = refresh_from(old, new["refreshed"]["raw"], date="2026-12-03T12:00:00+00:00")
    assert again["refreshed"]["factors"] == new["refreshed"]["factors"]
    assert again["call_costs"] == new["call_costs"]
    assert new["refreshed"]["raw"]["library"]["calls_from"] == "timed inside the probe"


def test_an_unknown_reference_is_refused_naming_the_choices() -> None:
    with pytest.raises(ArgumentError, match="isolated"):
        quick_refresh(SimDriver("h200"), _old(), clock=lambda: 0.0, reference="median")

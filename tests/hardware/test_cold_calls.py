"""The first call of each kind after a pause: measured by calibrate, refreshed by --quick,
charged by the sim, checked by the schema (bench/results/h200-cold-calls.json: on an H200 a
pause or other work makes the next create 80-117 us dearer; back to back, nothing)."""

from __future__ import annotations

import copy
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvvmm.driver import SimDriver
from kvvmm.errors import ArgumentError, ProfileError
from kvvmm.hardware import get_profile, profile_data, profile_from_data
from kvvmm.hardware.overhead import sim_costs
from kvvmm.hardware.spread import figures_of, scaled
from kvvmm.measure.calls import COLD_CALLS, cold_premium
from kvvmm.measure.fit import build_profile
from kvvmm.measure.plan import FULL, QUICK, Ctx
from kvvmm.measure.refresh import quick_refresh
from kvvmm.measure.timer import TimedDriver
from kvvmm.units import GiB, MiB

OPS = ("reserve", "create", "map", "set_access", "unmap", "release", "free")
META = {"date": "2026-12-03T12:00:00+00:00", "card": "NVIDIA Test GPU", "key": "testgpu",
        "driver": "580.1", "torch": "2.11", "cuda_bindings": "13.3.1", "kvvmm": "0.3",
        "capacity_bytes": 80 * GiB, "granularity_bytes": 2 * MiB}


def _h200() -> dict[str, Any]:
    return copy.deepcopy(dict(profile_data(get_profile("h200"))))


def _round(d: SimDriver) -> dict[str, float]:
    """One of each call, each call's µs on the sim's clock."""
    out: dict[str, float] = {}

    def timed(op: str, fn: Any) -> Any:
        t0 = d.clock_us
        r = fn()
        out[op] = d.clock_us - t0
        return r

    va = timed("reserve", lambda: d.reserve(4 * GiB))
    h = timed("create", lambda: d.create(2 * MiB))
    timed("map", lambda: d.map(va + GiB, 2 * MiB, h))  # a region of its own: no first touch
    timed("set_access", lambda: d.set_access(va + GiB, 2 * MiB))
    timed("unmap", lambda: d.unmap(va + GiB, 2 * MiB))
    timed("release", lambda: d.release(h))
    timed("free", lambda: d.free(va, 4 * GiB))
    return out


def _warm_costs(data: dict[str, Any]) -> dict[str, float]:
    """A round's costs on a profile without the cold section, after a warm-up round."""
    plain = copy.deepcopy(data)
    plain.pop("cold_calls", None)
    d = SimDriver(profile_from_data(plain))
    _round(d)
    return _round(d)


# -- the sim ---------------------------------------------------------------------------


def test_a_devices_first_call_of_each_kind_costs_its_premium_the_next_its_second_share() -> None:
    data = _h200()
    cold = sim_costs(profile_from_data(data)).cold
    assert cold is not None and set(cold.premium_us) == set(OPS)
    warm = _warm_costs(data)
    d = SimDriver(profile_from_data(data))
    first, second, third = _round(d), _round(d), _round(d)
    for op in OPS:
        share = cold.second.get(op, 0.0)
        assert first[op] == pytest.approx(warm[op] + cold.premium_us[op]), op
        assert second[op] == pytest.approx(warm[op] + share * cold.premium_us[op]), op
        assert third[op] == pytest.approx(warm[op]), op


def test_the_call_after_a_cold_one_pays_the_measured_share_of_what_that_one_paid() -> None:
    """bench/results/h200-startup*.json: request-ranges+deferred's startup, 12 rounds on an
    H200: the second create, map and set_access after a pause cost 0.30-0.40, 0.14-0.27 and
    0.25-0.33 (one 0.65) of the premium more than warm (kvvmm/measure/coldtail.py)."""
    data = _h200()
    sec = data["cold_calls"]["second"]
    assert set(sec) == {"create", "map", "set_access"}
    assert 0.3 <= sec["create"] <= 0.4 and 0.25 <= sec["set_access"] <= 0.33
    assert 0.14 <= sec["map"] <= 0.27
    cold = sim_costs(profile_from_data(data)).cold
    assert cold is not None
    warm = _warm_costs(data)
    for pause_s in (1.0, 5e-3):  # a whole premium, then the share a short pause gives
        d = SimDriver(profile_from_data(data))
        _round(d), _round(d)
        d.pause(pause_s)
        paid = {op: v - warm[op] for op, v in _round(d).items()}
        after = {op: v - warm[op] for op, v in _round(d).items()}
        for op in OPS:
            assert after[op] == pytest.approx(paid[op] * sec.get(op, 0.0)), (op, pause_s)
    # without the figure, the call after a cold one is warm (the model before it)
    del data["cold_calls"]["second"]
    d = SimDriver(profile_from_data(data))
    _round(d)
    assert _round(d) == pytest.approx(warm)


def test_the_shipped_second_shares_are_what_the_committed_startup_probes_give() -> None:
    from kvvmm.measure import coldtail

    got = coldtail.second_shares()
    assert got["second"] == _h200()["cold_calls"]["second"]
    assert all(len(v) == 12 for v in got["rounds"].values())


def _premiums_after(data: dict[str, Any], *pauses_s: float) -> dict[str, float]:
    """µs over warm each call kind pays after a warm round and then these pauses."""
    warm = _warm_costs(data)
    d = SimDriver(profile_from_data(data))
    _round(d), _round(d)  # cold, then the share the call after a cold one pays
    clock = d.clock_us
    for s in pauses_s:
        d.pause(s)
    assert d.clock_us == clock  # a pause is not driver time
    got = _round(d)
    return {op: got[op] - warm[op] for op in OPS}


def test_a_pause_of_the_gap_or_longer_makes_every_kind_pay_its_whole_premium() -> None:
    data = _h200()
    cold = sim_costs(profile_from_data(data)).cold
    assert cold is not None
    gap_s = cold.gap_us / 1e6
    for pause in (gap_s, 3 * gap_s):
        assert _premiums_after(data, pause) == pytest.approx(dict(cold.premium_us))


def test_a_shorter_pause_costs_the_measured_share_rising_with_the_pause_from_none() -> None:
    data = _h200()
    cold = sim_costs(profile_from_data(data)).cold
    assert cold is not None and cold.partial
    gap_s = cold.gap_us / 1e6
    pauses = [0.0, 1e-4, 1e-3, 3e-3, 5e-3, 0.012, 0.02, 0.035, gap_s * 0.999, gap_s]
    paid = [_premiums_after(data, p) for p in pauses]
    for op in OPS:
        row = [p[op] for p in paid]
        assert row[0] == pytest.approx(0.0, abs=1e-9), op  # back to back: warm
        assert all(b >= a - 1e-9 for a, b in itertools.pairwise(row)), (op, row)
        assert row[-1] == pytest.approx(cold.premium_us[op]), op
        for (ms, share) in data["cold_calls"]["partial"].get(op, ()):
            got = _premiums_after(data, ms / 1e3)[op]
            assert got == pytest.approx(share * cold.premium_us[op]), (op, ms)


def test_pauses_add_up_until_a_kind_is_called_and_a_call_warms_only_its_own_kind() -> None:
    data = _h200()
    cold = sim_costs(profile_from_data(data)).cold
    assert cold is not None
    gap_s = cold.gap_us / 1e6
    assert _premiums_after(data, gap_s / 2, gap_s / 2) == pytest.approx(dict(cold.premium_us))
    d = SimDriver(profile_from_data(data))
    _round(d), _round(d)
    d.pause(gap_s)
    h = d.create(2 * MiB)  # create is warm again after the next one (which pays its second
    h1 = d.create(2 * MiB)  # share); every other kind still owes its premium
    t0 = d.clock_us
    h2 = d.create(2 * MiB)
    assert d.clock_us - t0 == pytest.approx(_warm_costs(data)["create"])
    t0 = d.clock_us
    d.release(h)
    assert d.clock_us - t0 == pytest.approx(_warm_costs(data)["release"]
                                            + cold.premium_us["release"])
    d.release(h1)
    d.release(h2)


def test_without_measured_shares_a_pause_shorter_than_the_gap_costs_nothing() -> None:
    data = _h200()
    data["cold_calls"].pop("partial")
    cold = sim_costs(profile_from_data(data)).cold
    assert cold is not None and not cold.partial
    gap_s = cold.gap_us / 1e6
    assert _premiums_after(data, gap_s * 0.9) == pytest.approx(dict.fromkeys(OPS, 0.0))
    assert _premiums_after(data, gap_s) == pytest.approx(dict(cold.premium_us))


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True, "0.1", None])
def test_a_pause_refuses_what_is_not_a_finite_number_of_seconds(bad: object) -> None:
    d = SimDriver("h200")
    with pytest.raises(ArgumentError, match="seconds"):
        d.pause(bad)  # type: ignore[arg-type]


def test_a_profile_without_the_section_charges_no_premium_and_says_so() -> None:
    data = _h200()
    data.pop("cold_calls")
    costs = sim_costs(profile_from_data(data))
    assert costs.cold is None
    assert any("cold calls" in n for n in costs.notes)
    d = SimDriver(profile_from_data(data))
    assert _round(d) == pytest.approx(_round(d))


def test_a_section_measured_but_not_modelled_charges_nothing() -> None:
    data = _h200()
    data["cold_calls"]["modelled"] = False
    d = SimDriver(profile_from_data(data))
    assert sim_costs(d.profile).cold is None
    assert _round(d) == pytest.approx(_round(d))


# -- the schema ------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("premium_us.create", -1.0), ("premium_us.map", "fast"), ("gap_ms", -5.0),
    ("gap_ms", True), ("modelled", "yes"), ("premium_us.create", 1e12),
    ("partial.create", [[1, 1.5]]), ("partial.create", [[-1, 0.5]]), ("partial.map", "half"),
    ("partial.set_access", [[1, True]]), ("partial", [[1, 0.5]]),
    ("second.create", 1.5), ("second.map", -0.1), ("second.set_access", "a third"),
    ("second", [0.3]), ("second.crate", 0.3),
])
def test_the_schema_refuses_a_bad_cold_figure_by_its_path(field: str, value: object) -> None:
    data = _h200()
    sec = data["cold_calls"]
    *parents, last = field.split(".")
    for p in parents:
        sec = sec[p]
    sec[last] = value
    with pytest.raises(ProfileError, match=r"cold_calls\." + field.split(".")[0]):
        profile_from_data(data)


def test_a_premium_for_a_call_the_sim_does_not_make_is_refused_by_name() -> None:
    data = _h200()
    data["cold_calls"]["premium_us"]["crate"] = 10.0
    with pytest.raises(ProfileError, match=r"cold_calls\.premium_us\.crate.*one of reserve"):
        profile_from_data(data)


def test_a_modelled_section_without_premiums_is_refused() -> None:
    data = _h200()
    del data["cold_calls"]["premium_us"]
    with pytest.raises(ProfileError, match="premium_us"):
        profile_from_data(data)


# -- spread, calibrate, refresh -----------------------------------------------------------


def test_the_premiums_are_a_figure_group_bands_scale() -> None:
    data = _h200()
    figs = figures_of(data)
    assert figs["cold_calls"] == data["cold_calls"]["premium_us"]
    assert "cold_calls" in data["spread"]["figures"]
    up = scaled(data, {"cold_calls": 2.0})
    for op, v in data["cold_calls"]["premium_us"].items():
        assert up["cold_calls"]["premium_us"][op] == pytest.approx(2 * v)
    profile_from_data(up)


def test_calibrates_section_times_a_cold_round_against_warm_calls_and_the_profile_keeps_it(
    tmp_path: Path,
) -> None:
    from kvvmm.driver.host import HostDriver

    plan = replace(FULL, cold_rounds=2, cold_gap_s=0.0)
    d = HostDriver()
    try:
        got = cold_premium(Ctx(TimedDriver(d), plan, lambda: None, cuda=False))
    finally:
        d.close()
    assert set(got["premium_us"]) == set(COLD_CALLS) == set(OPS)
    assert all(len(v) == 2 for v in got["first_all_us"].values())
    for op in OPS:
        assert got["premium_us"][op] == pytest.approx(got["first_us"][op] - got["later_us"][op],
                                                      abs=1e-3)
    data = build_profile({"cold_premium": got}, META, plan)
    sec = data["cold_calls"]
    assert sec["gap_ms"] == 0.0 and sec["source"] and sec["measured"]["rounds"] == 2
    assert all(v >= 0 for v in sec["premium_us"].values())  # a negative premium is noise
    path = tmp_path / "card.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    get_profile(path)
    assert QUICK.cold_rounds < FULL.cold_rounds


def test_calibrate_times_the_shorter_pauses_and_the_profile_keeps_rising_shares_of_the_premium(
    tmp_path: Path,
) -> None:
    from kvvmm.driver.host import HostDriver

    plan = replace(FULL, cold_rounds=2, cold_gap_s=0.004, cold_partial_s=(0.002, 0.001, 0.01))
    d = HostDriver()
    try:
        got = cold_premium(Ctx(TimedDriver(d), plan, lambda: None, cuda=False))
    finally:
        d.close()
    assert sorted(got["partial_us"]) == ["1", "2"]  # 10 ms is not shorter than the gap
    assert all(set(v) == set(OPS) for v in got["partial_us"].values())
    # a made-up measurement with a noisy middle pause: the shares stay rising and in [0, 1]
    got["premium_us"] = dict.fromkeys(OPS, 10.0) | {"free": 0.0}
    got["partial_us"] = {"1": dict.fromkeys(OPS, 4.0), "2": dict.fromkeys(OPS, 3.0),
                         "3": dict.fromkeys(OPS, 25.0)}
    sec = build_profile({"cold_premium": got}, META, plan)["cold_calls"]
    assert "free" not in sec["partial"] and sec["partial_source"]
    for op in set(OPS) - {"free"}:
        assert sec["partial"][op] == [[1.0, 0.4], [2.0, 0.4], [3.0, 1.0]], op
    path = tmp_path / "card.json"
    path.write_text(json.dumps(build_profile({"cold_premium": got}, META, plan)), encoding="utf-8")
    get_profile(path)  # the schema takes the shares


def test_the_quick_refresh_measures_the_premiums_on_a_sim_as_the_profile_charges_them(
) -> None:
    old = _h200()
    sim = SimDriver(profile_from_data(old))
    new = quick_refresh(sim, old, clock=lambda: sim.clock_us, pause=sim.pause, settle_s=0.0,
                        reference="points", reps=5, regions=2,
                        in_context=False, date="2026-12-03")
    assert new["refreshed"]["factors"]["cold_calls"] == pytest.approx(1.0, rel=1e-3)
    assert new["refreshed"]["factor_from"]["cold_calls"] == "measured"
    raw = new["refreshed"]["raw"]["cold_calls_us"]
    for op, v in old["cold_calls"]["premium_us"].items():
        assert raw[op] == pytest.approx(v, rel=1e-6), op


def test_a_fresh_owners_startup_on_the_sim_pays_one_premium_per_call_kind() -> None:
    from kvvmm.workload import run_workload
    from kvvmm.workload.requests import Request

    reqs = [Request(arrival_s=0.01 * i, prompt_tokens=200, output_tokens=20) for i in range(8)]
    data = _h200()
    cold = sim_costs(profile_from_data(data)).cold
    assert cold is not None
    r = run_workload(reqs, ["xl-page-elastic"], record=True).results[0]
    assert r.trace is not None
    startup = [e for e in r.trace.events][:4]
    assert [e.op for e in startup] == ["reserve", "create", "map", "set_access"]
    premium = sum(cold.premium_us[e.op] for e in startup)
    assert r.startup_driver_s * 1e6 == pytest.approx(sum(e.sim_us for e in startup))
    assert r.startup_driver_s * 1e6 > premium


def test_the_quick_refresh_waits_with_the_pause_it_is_given_on_any_driver() -> None:
    # a simulator behind a wrapper is no SimDriver: the refresh cannot tell, and must not ask
    from kvvmm.driver.faults import FaultyDriver

    old = _h200()
    sim = SimDriver(profile_from_data(old))
    paused: list[float] = []

    def pause(seconds: float) -> None:
        paused.append(seconds)
        sim.pause(seconds)

    new = quick_refresh(FaultyDriver(sim), old, clock=lambda: sim.clock_us, pause=pause,
                        settle_s=0.0, reference="points", reps=5, regions=2,
                        in_context=False, date="2026-12-03")
    assert paused and all(s == old["cold_calls"]["gap_ms"] / 1e3 for s in paused)
    assert new["refreshed"]["factors"]["cold_calls"] == pytest.approx(1.0, rel=1e-3)

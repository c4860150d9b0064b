"""Fidelity as ranges: spreads in profiles, bands from them, and where they show.

A profile may carry each cost figure's spread (``spread``: p10/p50/p90 per figure group over
rounds and calibrations kept, and those calibrations' figures); the schema refuses a bad one
by file and field, a hand-built :class:`DeviceProfile` meets the schema too, and
every band the sim reports is ordered ``low <= mid <= high``.
"""

from __future__ import annotations

import copy
import io
import json
import math
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvvmm import cli
from kvvmm.errors import ArgumentError, ProfileError
from kvvmm.hardware import DeviceProfile, get_profile, load_profile, profile_data, profile_from_data
from kvvmm.hardware.profiles import shipped_data
from kvvmm.hardware.spread import GROUPS, figures_of, scaled
from kvvmm.measure.stats import quantiles, ratios, spread_section
from kvvmm.policy import Chunked, Exact
from kvvmm.units import MiB
from kvvmm.workload.bands import Band, band_notes, band_profiles, growth_bands

SMALL_GROWTH = {"model": "llama-3.1-8b", "layers": 2, "tokens": 4096, "step_tokens": 512}


def _h200() -> dict[str, Any]:
    return copy.deepcopy(dict(shipped_data()["h200"]))


def _write(tmp_path: Path, data: object, text: str | None = None) -> Path:
    p = tmp_path / "card.json"
    p.write_text(json.dumps(data) if text is None else text, encoding="utf-8")
    return p


# -- the schema ----------------------------------------------------------------------------


def test_the_shipped_h200_profile_carries_a_spread_for_every_figure_group_it_has() -> None:
    data = _h200()
    have = set(figures_of(data))
    spread = data["spread"]["figures"]
    assert have - {"library_overhead_us"} <= set(spread), have - set(spread)
    for row in spread.values():
        assert 0 < row["p10"] <= row["p50"] <= row["p90"]
        assert row["samples"] >= 2


def test_a_profile_without_a_spread_is_a_point_and_says_so() -> None:
    h100 = get_profile("h100")
    assert h100.at(0.1) is h100 and h100.at(0.9) is h100
    lo, mid, hi = band_profiles(h100)
    assert lo is mid is hi
    assert any("no spread" in n for n in band_notes(h100))


def test_a_profile_with_a_spread_loads_from_a_file_and_at_moves_its_figures(
        tmp_path: Path) -> None:
    prof = load_profile(_write(tmp_path, _h200()))
    low, high = prof.at(0.1), prof.at(0.9)
    assert low != prof != high
    create = figures_of(profile_data(prof))["call_costs.create"]
    lo_create = figures_of(profile_data(low))["call_costs.create"]
    f = profile_data(prof)["spread"]["figures"]["call_costs.create"]["p10"]
    for k, v in create.items():
        assert lo_create[k] == pytest.approx(v * f, rel=1e-3, abs=1e-3)


BAD_SPREADS: list[tuple[str, tuple[str | int, ...], object, str]] = [
    ("negative", ("figures", "call_costs.create", "p10"), -0.5, "p10"),
    ("zero", ("figures", "call_costs.create", "p90"), 0, "p90"),
    ("a string", ("figures", "call_costs.map", "p50"), "1.0", "p50"),
    ("a bool", ("figures", "call_costs.map", "p50"), True, "p50"),
    ("p10 above p90", ("figures", "call_costs.set_access", "p10"), 2.0, "p10"),
    ("unknown group", ("figures", "call_costs.teleport"), {"p10": 1, "p50": 1, "p90": 1},
     "teleport"),
    ("no p50", ("figures", "first_touch"), {"p10": 0.9, "p90": 1.1}, "p50"),
    ("history not a list", ("history",), {"a": 1}, "history"),
    ("history entry without figures", ("history",), [{"date": "x"}], "figures"),
    ("history value not finite", ("history",),
     [{"figures": {"call_costs.create": {"2": 1e400}}}], "create"),
    ("history size label", ("history",),
     [{"figures": {"call_costs.create": {"two": 14.0}}}], "two"),
    ("history unknown group", ("history",), [{"figures": {"warp": {"2": 1.0}}}], "warp"),
]


@pytest.mark.parametrize(("what", "path", "value", "field"), BAD_SPREADS,
                         ids=[b[0] for b in BAD_SPREADS])
def test_a_bad_spread_is_refused_naming_the_file_and_the_field(
        tmp_path: Path, what: str, path: tuple[str | int, ...], value: object,
        field: str) -> None:
    data = _h200()
    node: Any = data["spread"]
    for seg in path[:-1]:
        node = node[seg]
    node[path[-1]] = value
    f = _write(tmp_path, data).with_name("card.json")
    with pytest.raises(ProfileError) as e:
        load_profile(f)
    assert "card.json" in str(e.value) and field in str(e.value), str(e.value)
    assert e.value.field.startswith("spread")


def test_a_nan_spread_in_the_file_text_is_refused_by_field(tmp_path: Path) -> None:
    data = _h200()
    data["spread"]["figures"]["call_costs.create"]["p10"] = 0.123456
    text = json.dumps(data).replace('"p10": 0.123456', '"p10": NaN', 1)
    assert "NaN" in text
    with pytest.raises(ProfileError) as e:
        load_profile(_write(tmp_path, None, text))
    assert "spread.figures" in e.value.field and "p10" in e.value.field


# -- a profile built by hand (it bypassed the schema) ----------------------------

BAD_FIELDS: list[tuple[str, dict[str, Any]]] = [
    ("granularity_bytes", {"granularity_bytes": 3 * MiB}),
    ("granularity_bytes", {"granularity_bytes": 1 * MiB}),
    ("granularity_bytes", {"granularity_bytes": 4 * MiB, "capacity_bytes": 2 * MiB}),
    ("capacity_bytes", {"capacity_bytes": 0}),
    ("capacity_bytes", {"capacity_bytes": True}),
    ("capacity_bytes", {"capacity_bytes": float("nan")}),
    ("capacity_bytes", {"capacity_bytes": "80GB"}),
    ("key", {"key": ""}),
    ("name", {"name": None}),
    ("source", {"source": 3}),
    ("date", {"date": 20261201}),
    ("path", {"path": None}),
]


@pytest.mark.parametrize(("field", "change"), BAD_FIELDS,
                         ids=[f"{f}={v!r}" for f, c in BAD_FIELDS for v in [next(iter(
                             c.values()))]])
def test_a_hand_built_profile_meets_the_schema_on_construction(
        field: str, change: dict[str, Any]) -> None:
    args: dict[str, Any] = {"key": "mine", "name": "My GPU", "capacity_bytes": 80 << 30,
                            "granularity_bytes": 2 * MiB, "source": "by hand"} | change
    with pytest.raises(ProfileError) as e:
        DeviceProfile(**args)
    assert e.value.field == field, str(e.value)
    assert "DeviceProfile" in str(e.value)


def test_a_hand_built_profile_with_a_shipped_key_keeps_its_own_fields_at_every_quantile(
        ) -> None:
    mine = DeviceProfile("h200", "small H200", 8 << 30, 2 * MiB, "by hand", "2026-12-03")
    for q in (0.1, 0.9):
        p = mine.at(q)
        assert (p.name, p.capacity_bytes, p.date) == ("small H200", 8 << 30, "2026-12-03")


def test_a_good_hand_built_profile_works_and_is_a_point() -> None:
    p = DeviceProfile("mine", "My GPU", 80 << 30, 2 * MiB, "by hand", "2026-12-03")
    assert p.at(0.5) is p
    with pytest.raises(ArgumentError):
        p.at(1.5)
    with pytest.raises(ArgumentError):
        p.at(float("nan"))


# -- quantiles and ratios -------------------------------------------------------------------


@given(st.lists(st.floats(0.01, 100), min_size=1, max_size=40))
def test_quantiles_are_ordered_and_inside_the_samples(xs: list[float]) -> None:
    q = quantiles(xs)
    assert min(xs) - 1e-3 <= q["p10"] <= q["p50"] <= q["p90"] <= max(xs) + 1e-3


@given(st.dictionaries(st.sampled_from(GROUPS), st.floats(0.2, 5), min_size=1))
def test_scaling_a_profile_gives_those_ratios_back(factors: dict[str, float]) -> None:
    base = _h200()
    got = ratios(figures_of(base), figures_of(scaled(base, factors)))
    for g, f in factors.items():
        for r in got.get(g, []):
            assert r == pytest.approx(f, rel=2e-2, abs=1e-3)


def test_a_spread_from_history_holds_the_calibrations_kept() -> None:
    base = _h200()
    hist = [{"date": "d1", "source": "s", "figures": figures_of(scaled(base, {
        g: 0.7 for g in GROUPS}))},
            {"date": "d2", "source": "s", "figures": figures_of(scaled(base, {
                g: 1.3 for g in GROUPS}))}]
    sec = spread_section(base, history=hist, source="test")
    create = sec["figures"]["call_costs.create"]
    assert create["p10"] < 1.0 < create["p90"]
    assert len(sec["history"]) == 2
    profile_from_data(base | {"spread": sec}, where="test")  # meets the schema


# -- bands are ordered, whatever the spread -------------------------------------------------

_factor = st.floats(0.3, 3.0)


@st.composite
def _spreads(draw: st.DrawFn) -> dict[str, Any]:
    figs = {}
    for g in draw(st.sets(st.sampled_from(GROUPS[:11]), min_size=1)):
        a, b, c = sorted(draw(st.lists(_factor, min_size=3, max_size=3)))
        figs[g] = {"p10": a, "p50": b, "p90": c, "samples": 3}
    return {"unit": "", "source": "hypothesis", "figures": figs, "history": []}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_spreads())
def test_every_growth_band_is_ordered_low_mid_high_over_random_spreads(
        spread: dict[str, Any]) -> None:
    prof = profile_from_data(_h200() | {"spread": spread}, where="random spread")
    bands = growth_bands([Exact(), Chunked(8 * MiB)], profile=prof, **SMALL_GROWTH)
    for b in bands:
        assert b.low <= b.mid <= b.high
        assert all(math.isfinite(x) and x >= 0 for x in (b.low, b.mid, b.high))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(0.3, 1.0), st.floats(1.0, 3.0))
def test_the_sim_is_monotone_in_its_costs_so_the_band_is_not_made_ordered_by_sorting(
        low: float, high: float) -> None:
    data = _h200()
    data.pop("library_overhead_us", None)  # a fitted residual may be negative
    data["spread"] = {"figures": {g: {"p10": low, "p50": 1.0, "p90": high}
                                  for g in GROUPS[:11]}}
    prof = profile_from_data(data, where="monotone")
    from kvvmm.driver.sim import SimDriver
    from kvvmm.growth import decode_growth

    def us(p: DeviceProfile) -> float:
        return decode_growth([Exact()], driver=lambda: SimDriver(p), **SMALL_GROWTH)[0].sim_us

    assert us(prof.at(0.1)) <= us(prof) + 1e-6 <= us(prof.at(0.9)) + 2e-6


def test_band_of_orders_its_ends_around_the_point() -> None:
    assert Band.of(5.0, 3.0, 1.0) == Band(1.0, 3.0, 5.0)
    b = Band.of(2.0, 4.0, 8.0)
    assert b.contains(4.0) and not b.contains(9.0) and b.width == pytest.approx(1.5)


# -- where bands show -----------------------------------------------------------------------


def test_kvvmm_replay_prints_a_band_table_of_at_most_100_columns_and_json_bands() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli.main(["replay", "generated", "--seconds", "8", "--strategy", "prefix",
                         "--strategy", "request-ranges+deferred", "--json"]) == 0
    got = json.loads(out.getvalue())
    assert got["band"]["quantiles"] == [0.1, 0.9]
    for row in got["results"]:
        for k, (lo, mid, hi) in row["bands"].items():
            assert lo <= mid <= hi, k
        assert row["bands"]["decode_driver_ms"][1] == pytest.approx(row["decode_driver_ms"],
                                                                    abs=1e-3)
    from kvvmm.viz.bands import format_workload_bands
    from kvvmm.workload.bands import band_notes as notes
    from kvvmm.workload.bands import workload_bands
    from kvvmm.workload.generator import generate

    bands = workload_bands(generate(seed=0, duration_s=8.0),
                           ["request-ranges+deferred", "page-elastic+pool"])
    text = format_workload_bands(bands, notes("h200"))
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "request-ranges+deferred" in text


def test_the_growth_lab_shows_each_policys_band_in_its_table_and_a_figure() -> None:
    from kvvmm.lab import GrowthLab

    lab = GrowthLab(layers=2, tokens=4096, step_tokens=512)
    assert lab.run(), lab.error_text
    assert len(lab.bands) == len(lab.results)
    for r, b in zip(lab.results, lab.bands, strict=True):
        assert b.low <= b.mid == r.sim_us <= b.high
    assert "band (p10-p90)" in lab.table.value
    (trace,) = lab.band_figure.data
    assert list(trace.error_y.array) == pytest.approx([(b.high - b.mid) / 1e3
                                                       for b in lab.bands])
    assert "kvvmm calibrate --quick --profile h200" in lab.profile_age.value


def test_the_workload_lab_draws_the_decode_band_as_error_bars() -> None:
    from kvvmm.lab import WorkloadLab

    lab = WorkloadLab(seconds=8.0, strategies=("prefix", "page-elastic"))
    assert lab.run(), lab.error_text
    assert set(lab.bands) == {"prefix", "page-elastic"}
    points = [t for t in lab.figure.data if getattr(t, "mode", None) == "markers+text"]
    bars = {t.name: t.error_x for t in points if t.meta["trade"] == "decode"}
    # the first-token panel's points carry no decode band
    assert all(t.error_x.array is None for t in points if t.meta["trade"] != "decode")
    for name, figs in lab.bands.items():
        b = figs["decode_driver_ms"]
        assert bars[name].array[0] == pytest.approx(b.high - b.mid)
    assert "band (p10-p90)" in lab.table.value


def test_the_profile_age_line_says_how_old_and_names_the_quick_refresh() -> None:
    import datetime

    from kvvmm.viz.bands import profile_age_line

    line = profile_age_line("h200", today=datetime.date(2026, 12, 3))
    assert "measured 2026-12-01, 2 days ago" in line
    assert "kvvmm calibrate --quick --profile h200" in line
    # a profile with no costs of its own is as old as the costs it borrows (issue 48)
    borrowed = profile_age_line(DeviceProfile("x", "X", 1 << 30, 2 * MiB, "s"),
                                today=datetime.date(2026, 12, 3))
    assert "costs measured 2026-12-01, 2 days ago (costs: h200, measured on an H200; " \
           "capacity: x)" in borrowed
    undated = {k: v for k, v in profile_data("h200").items() if k != "date"}
    assert "unknown date" in profile_age_line(profile_from_data(undated))

"""The session level: how far the card's whole level moved between sessions.

A profile's ``spread.level`` holds, per scenario group, p10/p50/p90 over sessions of each
session's *measured / the sim's point*. Four classes of behaviour:

- composing: a band widened by a level row keeps ``low <= mid <= high``, never narrows, and
  moves each end by exactly the row's factor where that factor passes 1;
- an absent section changes nothing: the cost figures, the per-call bands and the notes of a
  profile without ``spread.level`` are those of today, and ``level=False`` gives them too;
- the shipped level is the quantiles of the sessions it lists (kept as measured: the fit
  from the GPU runs is retired, docs/FIDELITY.md);
- the schema: a malformed level is one :class:`ProfileError` naming the field and the value.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvvmm.errors import ProfileError
from kvvmm.hardware import get_profile, load_profile, profile_data, profile_from_data
from kvvmm.hardware import schema as schema_mod
from kvvmm.hardware.profiles import shipped_data
from kvvmm.hardware.spread import (
    LEVEL_GROUPS,
    WORKLOAD_LEVEL,
    compose_level,
    figures_of,
    level_notes,
    level_of,
)
from kvvmm.measure.stats import quantiles
from kvvmm.policy import Chunked, Exact
from kvvmm.units import MiB
from kvvmm.workload.bands import Band, band_notes, growth_bands, workload_bands

SMALL_GROWTH = {"model": "llama-3.1-8b", "layers": 2, "tokens": 4096, "step_tokens": 512}


def _h200() -> dict[str, Any]:
    return copy.deepcopy(dict(shipped_data()["h200"]))


def _without_level() -> dict[str, Any]:
    data = _h200()
    data["spread"].pop("level", None)
    return data


def _row(p10: float, p50: float, p90: float) -> dict[str, float]:
    return {"p10": p10, "p50": p50, "p90": p90}


# -- composing -----------------------------------------------------------------------------

_pos = st.floats(0.01, 100.0)
_fac = st.floats(0.2, 5.0)


@given(st.lists(_pos, min_size=3, max_size=3), st.lists(_fac, min_size=3, max_size=3))
def test_a_level_widens_a_band_never_narrows_it_and_keeps_it_ordered(
        ends: list[float], factors: list[float]) -> None:
    lo, mid, hi = sorted(ends)
    p10, p50, p90 = sorted(factors)
    got = compose_level(lo, mid, hi, _row(p10, p50, p90))
    assert got[0] <= lo and got[2] >= hi and got[1] == mid
    assert got[0] <= got[1] <= got[2]
    assert got[0] == pytest.approx(lo * min(p10, 1.0))
    assert got[2] == pytest.approx(hi * max(p90, 1.0))
    b = Band(lo, mid, hi).with_level(_row(p10, p50, p90))
    assert (b.low, b.mid, b.high) == got


def test_no_row_is_the_band_as_it_is() -> None:
    b = Band(1.0, 2.0, 3.0)
    assert b.with_level(None) is b and b.with_level({}) is b
    assert compose_level(1.0, 2.0, 3.0, None) == (1.0, 2.0, 3.0)


def test_a_level_above_one_moves_only_the_high_end_and_below_one_only_the_low_end() -> None:
    assert compose_level(8.0, 10.0, 12.0, _row(1.1, 1.2, 1.5)) == (8.0, 10.0, 18.0)
    assert compose_level(8.0, 10.0, 12.0, _row(0.5, 0.7, 0.9)) == (4.0, 10.0, 12.0)


def test_growth_bands_with_the_shipped_level_are_the_per_call_bands_widened_by_growth() -> None:
    policies = [Exact(), Chunked(8 * MiB)]
    plain = growth_bands(policies, profile="h200", level=False, **SMALL_GROWTH)
    wide = growth_bands(policies, profile="h200", **SMALL_GROWTH)
    row = level_of(_h200())["growth"]
    for p, w in zip(plain, wide, strict=True):
        assert w == p.with_level(row)
        assert w.low <= p.low <= p.mid == w.mid <= p.high <= w.high


def test_workload_bands_widen_startup_and_decode_only() -> None:
    from kvvmm.workload.generator import generate

    wl = generate(seed=0, duration_s=8.0)
    plain = workload_bands(wl, ["prefix"], level=False)
    wide = workload_bands(wl, ["prefix"])
    rows = level_of(_h200())
    for fig, b in plain["prefix"].items():
        group = WORKLOAD_LEVEL.get(fig)
        assert wide["prefix"][fig] == b.with_level(rows[group] if group else None), fig
    assert set(WORKLOAD_LEVEL.values()) <= set(LEVEL_GROUPS)


# -- an absent section changes nothing ------------------------------------------------------


def test_a_profile_without_a_level_has_the_same_costs_bands_and_notes_as_today(
        tmp_path: Path) -> None:
    bare = _without_level()
    f = tmp_path / "bare.json"
    f.write_text(json.dumps(bare), encoding="utf-8")
    prof, shipped = load_profile(f), get_profile("h200")
    assert level_of(profile_data(prof)) == {}
    for q in (0.1, 0.5, 0.9):  # the level is not a cost figure: no quantile moves by it
        assert figures_of(profile_data(prof.at(q))) == figures_of(profile_data(shipped.at(q)))
    policies = [Exact(), Chunked(8 * MiB)]
    mine = growth_bands(policies, profile=prof, **SMALL_GROWTH)
    assert mine == growth_bands(policies, profile=prof, level=False, **SMALL_GROWTH)
    assert mine == growth_bands(policies, profile=shipped, level=False, **SMALL_GROWTH)
    assert band_notes(prof) == band_notes(prof, level=False) == band_notes(shipped,
                                                                           level=False)
    assert level_notes(bare) == ["no session level measured: the band is the per-call "
                                 "spread only"]


def test_profiles_without_any_spread_stay_points_with_or_without_the_level_switch() -> None:
    h100 = get_profile("h100")
    policies = [Exact()]
    a = growth_bands(policies, profile=h100, **SMALL_GROWTH)
    b = growth_bands(policies, profile=h100, level=False, **SMALL_GROWTH)
    assert a == b and a[0].low == a[0].mid == a[0].high
    assert band_notes(h100) == band_notes(h100, level=False)


def test_the_shipped_notes_name_the_level_in_lines_a_table_can_show() -> None:
    notes = band_notes("h200")
    assert any("session level" in n for n in notes)
    assert max(len(n) for n in notes) <= 100


# -- the shipped level --------------------------------------------------------------------


def test_the_shipped_level_is_the_quantiles_of_the_sessions_it_lists() -> None:
    lv = _h200()["spread"]["level"]
    sessions = lv["sessions"]
    assert len(sessions) >= 2 and all(s["runs"] for s in sessions)
    for g, row in lv["groups"].items():
        want = quantiles([s["factors"][g] for s in sessions if g in s["factors"]])
        assert {q: row[q] for q in ("p10", "p50", "p90")} == want, g
        assert row["sessions"] == sum(g in s["factors"] for s in sessions)


def test_the_schema_and_the_band_lookup_name_the_same_groups() -> None:
    assert schema_mod.LEVEL_GROUPS == LEVEL_GROUPS


# -- the schema refuses a malformed level ----------------------------------------------------

BAD_LEVELS: list[tuple[str, tuple[str | int, ...], object, str]] = [
    ("negative", ("groups", "growth", "p10"), -0.5, "-0.5"),
    ("zero", ("groups", "growth", "p90"), 0, "p90"),
    ("a string", ("groups", "close", "p50"), "1.0", "'1.0'"),
    ("a bool", ("groups", "close", "p50"), True, "true"),
    ("p10 above p90", ("groups", "decode", "p10"), 2.0, "2.0"),
    ("no p90", ("groups", "startup"), {"p10": 0.9, "p50": 1.0}, "p90"),
    ("unknown group", ("groups", "teleport"), {"p10": 1, "p50": 1, "p90": 1}, "teleport"),
    ("sessions count not an integer", ("groups", "growth", "sessions"), 2.5, "2.5"),
    ("groups not an object", ("groups",), [1, 2], "groups"),
    ("sessions not a list", ("sessions",), {"a": 1}, "sessions"),
    ("session without factors", ("sessions",), [{"session": "x"}], "factors"),
    ("session factor zero", ("sessions",), [{"factors": {"growth": 0.0}}], "growth"),
    ("session factor a string", ("sessions",), [{"factors": {"growth": "fast"}}], "fast"),
    ("session unknown group", ("sessions",), [{"factors": {"warp": 1.0}}], "warp"),
]


@pytest.mark.parametrize(("what", "path", "value", "shown"), BAD_LEVELS,
                         ids=[b[0] for b in BAD_LEVELS])
def test_a_malformed_level_is_one_profile_error_naming_the_field_and_the_value(
        tmp_path: Path, what: str, path: tuple[str | int, ...], value: object,
        shown: str) -> None:
    data = _h200()
    node: Any = data["spread"]["level"]
    for seg in path[:-1]:
        node = node[seg]
    node[path[-1]] = value
    f = tmp_path / "card.json"
    f.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ProfileError) as e:
        load_profile(f)
    msg = str(e.value)
    assert e.value.field.startswith("spread.level"), msg
    assert "card.json" in msg and shown in msg, msg
    with pytest.raises(ProfileError):  # data built in Python meets the same schema
        profile_from_data(data, where="by hand")


def test_a_nan_level_in_the_file_text_is_refused_by_field(tmp_path: Path) -> None:
    data = _h200()
    data["spread"]["level"]["groups"]["growth"]["p90"] = 0.123456
    text = json.dumps(data).replace('"p90": 0.123456', '"p90": NaN', 1)
    f = tmp_path / "card.json"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(ProfileError) as e:
        load_profile(f)
    assert e.value.field == "spread.level.groups.growth.p90", str(e.value)

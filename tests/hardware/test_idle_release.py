"""The first create after an idle pause that follows a large release: charged by the sim by the
GiB released, checked by the schema, banded by the spread (bench/results/h200-construct.json:
on an H200 the first create after an owner grown to 61 GiB closed and 2 s passed cost 14-22 ms
more; with 1.6 GiB released, nothing)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from kvvmm.driver import SimDriver
from kvvmm.errors import ProfileError
from kvvmm.hardware import get_profile, profile_data, profile_from_data
from kvvmm.hardware.overhead import sim_costs
from kvvmm.hardware.spread import figures_of
from kvvmm.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[2]
H200 = sim_costs(get_profile("h200")).idle


def _release(d: SimDriver, gib: int) -> None:
    """Back ``gib`` GiB in 2 GiB handles, then release them all (a grown owner's close)."""
    hs = [d.create(2 * GiB) for _ in range(gib // 2)]
    for h in hs:
        d.release(h)


def _create_us(d: SimDriver) -> float:
    t0 = d.clock_us
    d.release(d.create(2 * MiB))
    return d.clock_us - t0


def _warm(d: SimDriver) -> float:
    _create_us(d)  # cold
    _create_us(d)  # the call after a cold one pays its share of the cold premium too
    return _create_us(d)


def test_the_shipped_h200_profile_models_it() -> None:
    assert H200 is not None
    assert 100 < H200.create_us_per_gib < 400 and H200.pause_us == 0.25e6
    assert H200.min_released_bytes == 10 * GiB


@pytest.mark.parametrize("gib", [16, 64])
def test_the_first_create_after_an_idle_pause_pays_per_gib_released_and_only_it(
        gib: int) -> None:
    assert H200 is not None
    d = SimDriver("h200")
    warm = _warm(d)
    _release(d, gib)
    d.pause(1.5)
    assert d._cost.idle_premium_us == pytest.approx(H200.create_us_per_gib * gib)
    first = _create_us(d)
    # the pause made every call kind cold too: a create's and a release's premium more
    cold = sim_costs(get_profile("h200")).cold
    assert cold is not None
    cold_us = cold.premium_us["create"] + cold.premium_us["release"]
    assert first - warm == pytest.approx(H200.create_us_per_gib * gib + cold_us, rel=1e-3)
    # the next create pays no idle premium: only the cold call's tail
    tail = cold.second.get("create", 0.0) * cold.premium_us["create"]
    assert _create_us(d) == pytest.approx(warm + tail, rel=0.05)


def test_a_short_pause_a_small_release_or_a_fresh_device_pays_nothing() -> None:
    short = SimDriver("h200")
    warm = _warm(short)
    _release(short, 64)
    short.pause(0.1)  # cold (>= 50 ms), not idle (< 0.25 s)
    assert short._cost.idle_premium_us == 0.0
    assert _create_us(short) < warm + 1_000
    small = SimDriver("h200")
    _warm(small)
    _release(small, 8)  # under min_released_gib
    small.pause(5.0)
    assert small._cost.idle_premium_us == 0.0
    fresh = SimDriver("h200")
    fresh.pause(5.0)  # nothing released on this device
    assert fresh._cost.idle_premium_us == 0.0


def test_a_create_between_the_release_and_the_pause_clears_what_was_released() -> None:
    d = SimDriver("h200")
    _warm(d)
    _release(d, 64)
    _create_us(d)  # the release is behind a create now
    d.pause(2.0)
    assert d._cost.idle_premium_us == 0.0


def test_a_profile_without_the_section_charges_nothing_after_an_idle_pause() -> None:
    data = copy.deepcopy(dict(profile_data(get_profile("h200"))))
    del data["idle_release"]
    prof = profile_from_data(data, where="h200 without idle_release")
    assert sim_costs(prof).idle is None
    d = SimDriver(prof)
    warm = _warm(d)
    _release(d, 64)
    d.pause(2.0)
    assert _create_us(d) < warm + 1_000


def _with(**idle: Any) -> dict[str, Any]:
    data = copy.deepcopy(dict(profile_data(get_profile("h200"))))
    data["idle_release"] = {**data["idle_release"], **idle}
    return data


@pytest.mark.parametrize(("field", "value"), [
    ("create_us_per_gib", -1.0), ("create_us_per_gib", float("nan")),
    ("create_us_per_gib", "fast"), ("pause_s", -0.5), ("min_released_gib", -1),
    ("modelled", "yes"),
])
def test_a_bad_figure_is_refused_naming_its_path(field: str, value: Any) -> None:
    with pytest.raises(ProfileError, match=f"idle_release.{field}"):
        profile_from_data(_with(**{field: value}), where="bad idle_release")


def test_a_modelled_section_without_its_figure_is_refused() -> None:
    data = _with()
    del data["idle_release"]["create_us_per_gib"]
    with pytest.raises(ProfileError, match="create_us_per_gib"):
        profile_from_data(data, where="no figure")


def test_the_band_moves_the_premium_with_its_spread() -> None:
    prof = get_profile("h200")
    assert figures_of(profile_data(prof))["idle_release"] == {
        "create_us_per_gib": H200.create_us_per_gib if H200 else 0.0}
    spread = profile_data(prof)["spread"]["figures"]["idle_release"]
    lo, hi = sim_costs(prof.at(0.1)).idle, sim_costs(prof.at(0.9)).idle
    assert lo is not None and hi is not None and H200 is not None
    assert lo.create_us_per_gib == pytest.approx(H200.create_us_per_gib * spread["p10"], rel=1e-3)
    assert hi.create_us_per_gib == pytest.approx(H200.create_us_per_gib * spread["p90"], rel=1e-3)

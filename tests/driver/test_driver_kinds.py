"""One list of driver kinds, and every place that offers a kind offers that list."""

from __future__ import annotations

import sys

import pytest

import kvvmm
from kvvmm.driver import (
    DRIVER_ENV,
    DRIVER_KINDS,
    SimDriver,
    driver_for,
    get_profile,
    notebook_driver_kind,
    open_driver,
)
from kvvmm.errors import ArgumentError, DriverUnavailableError
from kvvmm.units import MiB

host_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                               reason="the host driver needs Linux")


def test_the_list_is_the_three_drivers_from_the_one_that_runs_anywhere_to_the_card() -> None:
    assert DRIVER_KINDS == ("sim", "host", "cuda")
    assert kvvmm.DRIVER_KINDS is DRIVER_KINDS and "DRIVER_KINDS" in kvvmm.__all__


@pytest.mark.parametrize("kind", [k for k in DRIVER_KINDS if k != "cuda"])
def test_each_kind_opens_a_driver_that_reports_that_kind(kind: str) -> None:
    if kind == "host" and not sys.platform.startswith("linux"):
        pytest.skip("the host driver needs Linux")
    drv = open_driver(kind)
    try:
        assert drv.kind == kind
    finally:
        drv.close()


def test_cuda_is_a_known_kind_even_where_no_gpu_is_usable() -> None:
    # An unknown kind would be an ArgumentError; a known one the machine lacks is unavailable.
    try:
        drv = open_driver("cuda")
    except DriverUnavailableError as e:
        assert "CUDA" in str(e)
    else:
        assert drv.kind == "cuda"
        drv.close()


def test_an_unknown_kind_is_refused_with_the_list_and_auto() -> None:
    with pytest.raises(ArgumentError, match=r"one of \['auto', 'sim', 'host', 'cuda'\]"):
        open_driver("gpu")


def test_the_cli_offers_auto_and_the_list_for_the_lab_and_the_list_for_replay() -> None:
    from kvvmm.cli import _parser

    sub = next(a for a in _parser()._actions if a.dest == "cmd")
    choices = sub.choices  # type: ignore[attr-defined]
    lab = next(a for a in choices["lab"]._actions if a.dest == "driver")
    replay = next(a for a in choices["replay"]._actions if a.dest == "driver")
    assert list(lab.choices) == ["auto", *DRIVER_KINDS]
    assert tuple(replay.choices) == DRIVER_KINDS


def test_every_panel_offers_the_list_as_its_driver_choices() -> None:
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from kvvmm.lab import ArenaLab, GrowthLab, LayoutExplorer

    for panel in (ArenaLab(), GrowthLab(), LayoutExplorer()):
        assert tuple(panel.driver.options) == DRIVER_KINDS


# -- driver_for: one opener for "a driver of this kind, the sim simulating this profile" ------


def test_driver_for_gives_the_sim_the_profile_and_the_device() -> None:
    drv = driver_for("sim", profile="b200", device=3)
    assert drv.kind == "sim" and drv.device == 3
    assert drv.profile.key == "b200"  # type: ignore[attr-defined]
    assert drv.mem_info()[1] == get_profile("b200").capacity_bytes


def test_driver_for_defaults_to_the_h200_the_sim_defaults_to() -> None:
    assert driver_for("sim").profile.key == "h200"  # type: ignore[attr-defined]
    assert driver_for("sim").profile == SimDriver().profile


def test_driver_for_takes_a_profile_object_as_well_as_a_key() -> None:
    prof = get_profile("h100")
    assert driver_for("sim", profile=prof).mem_info()[1] == prof.capacity_bytes


@host_only
def test_driver_for_opens_a_real_driver_as_it_is_whatever_the_profile() -> None:
    small = driver_for("host", profile="b200", device=1, capacity_bytes=64 * MiB)
    try:
        assert small.kind == "host" and small.device == 1
        assert small.mem_info()[1] == 64 * MiB  # the host's options, not the B200's capacity
    finally:
        small.close()


@host_only
def test_open_driver_still_refuses_a_profile_for_a_real_driver() -> None:
    with pytest.raises(TypeError, match="profile"):
        open_driver("host", profile="h200")


def test_driver_for_checks_the_profile_for_every_kind() -> None:
    for kind in ("sim", "host", "auto"):
        with pytest.raises(ArgumentError, match="h900"):
            driver_for(kind, profile="h900")


def test_driver_for_refuses_an_unknown_kind_as_open_driver_does() -> None:
    with pytest.raises(ArgumentError, match=r"one of \['auto', 'sim', 'host', 'cuda'\]"):
        driver_for("gpu")


# -- notebook_driver_kind: the driver a notebook runs on ----------------------------------------


def test_a_notebook_runs_on_the_sim_without_the_variable_or_with_it_empty() -> None:
    assert notebook_driver_kind(environ={}) == "sim"
    assert notebook_driver_kind(environ={DRIVER_ENV: ""}) == "sim"


@pytest.mark.parametrize("kind", ["auto", *DRIVER_KINDS])
def test_a_notebook_runs_on_the_kind_the_lab_set(kind: str) -> None:
    assert notebook_driver_kind(environ={DRIVER_ENV: kind}) == kind


def test_a_notebook_about_real_memory_turns_the_sim_into_auto_and_keeps_the_rest() -> None:
    assert notebook_driver_kind(real_memory=True, environ={}) == "auto"
    assert notebook_driver_kind(real_memory=True, environ={DRIVER_ENV: "sim"}) == "auto"
    for kind in ("auto", "host", "cuda"):
        assert notebook_driver_kind(real_memory=True, environ={DRIVER_ENV: kind}) == kind


def test_a_bad_value_of_the_variable_is_refused_by_name_with_what_it_may_hold() -> None:
    with pytest.raises(ArgumentError, match=r"KVVMM_DRIVER='gpu'.*'auto', 'sim', 'host', 'cuda'"):
        notebook_driver_kind(environ={DRIVER_ENV: "gpu"})


def test_the_variable_is_read_when_asked_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DRIVER_ENV, "host")
    assert notebook_driver_kind() == "host"
    monkeypatch.delenv(DRIVER_ENV)
    assert notebook_driver_kind() == "sim"


def test_the_lab_sets_the_variable_the_notebooks_read() -> None:
    from kvvmm.cli import lab

    assert lab.DRIVER_ENV is DRIVER_ENV == "KVVMM_DRIVER"
    assert kvvmm.notebook_driver_kind is notebook_driver_kind

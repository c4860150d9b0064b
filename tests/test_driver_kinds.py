"""One list of driver kinds, and every place that offers a kind offers that list (issue 23.5)."""

from __future__ import annotations

import sys

import pytest

import kvvmm
from kvvmm.driver import DRIVER_KINDS, open_driver
from kvvmm.errors import ArgumentError, DriverUnavailableError


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

"""The interleaved bandwidth curve is fitted to the owner's measured growth runs (with the
plain curve the lab predicted the default policy at 0.97x; the H200 measured 0.99x)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvvmm.errors import ArgumentError
from kvvmm.hardware import H200_BANDWIDTH
from kvvmm.hardware.bandwidth import (
    BANDWIDTH_TARGET,
    GrowthPoint,
    fit_growth_bandwidth,
    growth_fit,
    predicted_ratio,
)
from kvvmm.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[2]


def _collect_script():  # type: ignore[no-untyped-def]
    from kvvmm.measure import growth_bandwidth

    return growth_bandwidth


def test_the_h200_profile_ships_every_committed_growth_run_by_policy() -> None:
    collected = json.loads((ROOT / "bench" / "results" / "h200-growth-bandwidth.json")
                           .read_text(encoding="utf-8"))
    shipped = {p.label: p for p in H200_BANDWIDTH.growth}
    assert set(shipped) == set(collected["runs"])
    for label, runs in collected["runs"].items():
        assert shipped[label].ratios == tuple(r["ratio"] for r in runs), label
    assert len(shipped["Chunked(128.0 MiB)"].ratios) >= 10  # several runs: a spread


def test_the_fit_reproduces_every_policys_measured_ratio_within_its_runs_spread() -> None:
    fit = growth_fit()
    assert fit is not None
    for p in fit.points:
        band = fit.band(p.copied)
        assert p.low <= band.mid <= p.high, (p.label, band, p.ratios)
        # within the runs' spread of the median too: half the spread, at least 0.005
        assert abs(band.mid - p.median) <= max(0.005, (p.high - p.low) / 2), p.label
        assert band.low <= band.mid <= band.high


def test_the_fitted_curve_copies_faster_over_larger_handles() -> None:
    fit = growth_fit()
    assert fit is not None
    ratios = [1 / u for u in fit.mid.ys]
    assert ratios == sorted(ratios) and len(ratios) >= 4


def test_the_fit_and_the_runs_agree_on_which_policies_keep_the_target() -> None:
    fit = growth_fit()
    assert fit is not None
    for p in H200_BANDWIDTH.growth:
        assert (fit.band(p.copied).mid >= BANDWIDTH_TARGET) == (p.median >= BANDWIDTH_TARGET), \
            p.label


def test_the_shipped_layouts_are_what_the_bench_growth_gives_on_the_sim() -> None:
    script = _collect_script()
    data = json.loads((ROOT / "kvvmm" / "hardware" / "data" / "h200.json")
                      .read_text(encoding="utf-8"))
    section = data["bandwidth"]["growth"]
    collected = json.loads((ROOT / "bench" / "results" / "h200-growth-bandwidth.json")
                           .read_text(encoding="utf-8"))
    from kvvmm.policy import Chunked, Exact

    for policy in (Exact(), Chunked(128 * MiB)):  # one per shape: the script does them all
        assert section["points"][str(policy)]["copied_mib"] == script.copied_mib(
            policy, collected["workload"])


def test_interleaved_small_handles_predict_below_the_target_with_a_band() -> None:
    band = predicted_ratio([8 * MiB] * 16, interleaved=True)
    assert band.low <= band.mid <= band.high < BANDWIDTH_TARGET
    plain = predicted_ratio([64 * MiB] * 16)  # one buffer's handles: the table's curve
    assert plain.low <= plain.mid <= plain.high
    with pytest.raises(ArgumentError):
        predicted_ratio([])


def test_a_fit_refuses_points_that_leave_a_size_unpinned() -> None:
    with pytest.raises(ArgumentError):
        fit_growth_bandwidth([])
    one = GrowthPoint("x", ((2 * MiB, GiB),), (0.8, 0.9))
    fit = fit_growth_bandwidth([one])
    assert fit.band(one.copied).mid == pytest.approx(0.85, abs=0.01)


# -- the lab's answer on the workload the H200 measured ----------------------------------

MEASURED_GROWTH = {"model": "llama-3.1-8b", "page_size": 64, "tokens": 500_000,
                   "step_tokens": 4096, "reserved_tokens": 2_000_000}


def _measured_policies():  # type: ignore[no-untyped-def]
    from kvvmm.policy import Chunked, Exact, Geometric, default_policy

    return [default_policy(), Exact(), Chunked(64 * MiB), Chunked(128 * MiB),
            Chunked(256 * MiB), Geometric(2.0, 256 * MiB)]


def test_the_lab_names_the_policy_the_runs_name_on_the_measured_workload() -> None:
    from kvvmm.growth import decode_growth, least_over_commit
    from kvvmm.viz import format_growth

    results = decode_growth(_measured_policies(), **MEASURED_GROWTH)
    assert results[0].buffers == 64  # the bench's 64 buffers of 2 KiB per token
    runs = {p.label: p for p in H200_BANDWIDTH.growth}
    for r in results:  # each prediction lies within that policy's runs
        assert runs[r.policy].low <= r.predicted_ratio.mid <= runs[r.policy].high, r.policy
    by_runs = min((r for r in results if runs[r.policy].median >= BANDWIDTH_TARGET),
                  key=lambda r: r.max_over_commit_bytes)
    answer = least_over_commit(results)
    assert answer is not None and answer.policy == by_runs.policy
    assert f"with the least over-commit: {answer.policy}" in format_growth(results)
    # The design document gives the same answer (the two had disagreed).
    docs = " ".join((ROOT / "docs" / "MEASUREMENTS.md").read_text(encoding="utf-8").split())
    assert f"keeps >= 0.99x with the least over-commit: `{answer.policy}`" in docs


def test_least_over_commit_is_none_when_no_policy_keeps_the_target() -> None:
    from kvvmm.growth import decode_growth, least_over_commit
    from kvvmm.policy import Exact

    results = decode_growth([Exact()], layers=2, tokens=4096, step_tokens=256)
    assert least_over_commit(results) is None
    assert least_over_commit(results, target=0.5) is results[0]

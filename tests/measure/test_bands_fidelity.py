"""The fidelity benchmark's bands: ``in_band`` per scenario, and ``--score``.

``python -m kvvmm.measure.fidelity --score`` scores a profile's bands against measured runs of other
sessions and days. On fixture runs whose medians are known to lie inside (the point itself)
or outside (ten times it) every band, the score says so per scenario, per run and overall.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fidelity() -> ModuleType:
    from kvvmm.measure import fidelity as mod

    return mod


@pytest.fixture(scope="module")
def small(fidelity: ModuleType) -> Any:
    from dataclasses import replace

    return replace(fidelity.SMALL, workload_s=0.0, policies=("default",))


def _run(path: Path, predicted: dict[str, list[float]], scale: float) -> Path:
    sc = {name: ({"predicted": v[0], "measured": v[0]} if name.endswith(":calls") else
                 {"predicted_us": v[0], "measured_us": v[0] * scale,
                  "measured_rounds_us": [v[0] * scale] * 3})
          for name, v in predicted.items()}
    path.write_text(json.dumps({"date": "fixture", "scenarios": sc}), encoding="utf-8")
    return path


def test_score_puts_each_run_in_or_out_of_every_band_and_counts_the_share(
        fidelity: ModuleType, small: Any, tmp_path: Path) -> None:
    pred = fidelity.predict("h200", small)
    inside = _run(tmp_path / "inside.json", pred, 1.0)
    outside = _run(tmp_path / "outside.json", pred, 10.0)
    got = fidelity.score("h200", [str(inside), str(outside)], small)
    assert got["runs"]["inside.json"]["in_band_share"] == 1.0
    assert got["runs"]["outside.json"]["in_band_share"] == 0.0
    assert got["in_band_share"] == 0.5 and got["target_share"] == 0.9
    for name, row in got["runs"]["inside.json"]["scenarios"].items():
        lo, mid, hi = row["band_us"]
        assert lo <= mid <= hi and row["in_band"], name
    for row in got["widths"].values():
        # the card's spread: (p90 - p10) / p50 over both runs' rounds, 3 at x1 and 3 at x10
        assert row["card_spread"] == pytest.approx(9 / 5.5, rel=1e-3)
        assert row["rounds"] == 6 and 0 < row["band_width"] < 1
        assert row["within_target"] == (row["band_width"] <= row["card_spread"] + 0.10)
    json.dumps(got, allow_nan=False)  # strict JSON


def test_compare_adds_the_band_and_in_band_and_summarize_counts_them(
        fidelity: ModuleType, small: Any) -> None:
    pred = fidelity.predict("h200", small)
    bands = fidelity.predict_bands("h200", small, pred)
    meas = {k: [v[0] * (1.0 if i % 2 else 3.0)] for i, (k, v) in enumerate(pred.items())}
    res: dict[str, Any] = {"scenarios": fidelity.compare(pred, meas, bands)}
    fidelity.summarize(res)
    timed = {k: v for k, v in res["scenarios"].items() if v.get("ratio") is not None}
    assert timed and all("in_band" in v and "band_us" in v for v in timed.values())
    n_in = sum(v["in_band"] for v in timed.values())
    assert res["in_band_count"] == f"{n_in} of {len(timed)} timed"
    assert set(res["outside_band"]) == {k for k, v in timed.items() if not v["in_band"]}

"""Every output of `kvvmm plan` and `kvvmm replay` names whose call costs it predicts with
(issue 48, item 3): an h200 or h100 profile its own, a b200 or gb300 profile the H200's,
visibly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvvmm import cli
from kvvmm.hardware import provenance_label

#: profile -> the label every output must carry
LABELS = {"h200": "costs: h200, measured on an H200; capacity: h200",
          "h100": "costs: h100, measured on an H100; capacity: h100",
          "b200": "costs: h200, measured on an H200; capacity: b200",
          "gb300": "costs: h200, measured on an H200; capacity: gb300"}
#: the card each profile's costs were measured on, as the calibration recorded it
MEASURED_ON = {"h200": "NVIDIA H200", "h100": "NVIDIA H100 80GB HBM3",
               "b200": "NVIDIA H200", "gb300": "NVIDIA H200"}
REPLAY = ["replay", "generated", "--seconds", "10", "--model", "llama-3.1-8b", "--tp", "1",
          "--strategy", "prefix", "--no-bands"]


@pytest.mark.parametrize("gpu", sorted(LABELS))
def test_plan_text_and_json_name_the_costs_and_capacity(
        gpu: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert provenance_label(gpu) == LABELS[gpu]
    assert cli.main(["plan", "--model", "llama-3.1-8b", "--gpu", gpu]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"profile: {gpu} (") and first.endswith(LABELS[gpu])
    assert "unknown" not in first  # issue 48: "measured unknown"
    assert cli.main(["plan", "--model", "llama-3.1-8b", "--gpu", gpu, "--json"]) == 0
    used = json.loads(capsys.readouterr().out)["profile"]
    assert used["label"] == LABELS[gpu] and used["borrowed"] == (gpu in ("b200", "gb300"))


@pytest.mark.parametrize("gpu", sorted(LABELS))
def test_replay_text_json_and_figure_name_the_costs_and_capacity(
        gpu: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.html"
    assert cli.main([*REPLAY, "--gpu", gpu, "-o", str(out)]) == 0
    text = capsys.readouterr().out
    first, lead = text.splitlines()[0], " ".join(text.split("memory on one rank")[0].split())
    assert first.endswith(LABELS[gpu])
    assert f"simulated with {LABELS[gpu]}" in lead  # the report's own lead, as the lab shows
    assert "first token p50" in text and "put off" in text  # item 4: what requests waited
    assert LABELS[gpu] in out.read_text()  # the figure's title
    assert cli.main([*REPLAY, "--gpu", gpu, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["costs"] == data["profile"]["label"] == LABELS[gpu]
    assert data["profile"]["costs_measured_on"] == MEASURED_ON[gpu]
    (row,) = data["results"]
    assert {"first_token_p50_ms", "first_token_p99_ms", "first_token_max_ms",
            "admissions_put_off", "latency_p99_s"} <= row.keys()


def test_replay_tenants_json_and_figure_name_the_costs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["replay", "--tenants", "llama-3.1-8b:generated", "--budget", "2GiB", "--seconds",
            "5", "--gpu", "b200"]
    assert cli.main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"]["label"] == LABELS["b200"]
    out = tmp_path / "t.html"
    assert cli.main([*args, "-o", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(LABELS["b200"])
    assert LABELS["b200"] in out.read_text()

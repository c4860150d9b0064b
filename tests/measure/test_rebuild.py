"""``kvvmm calibrate rebuild``: the shipped H200 profile is what the committed results rebuild,
``--check`` says when it is not, and the results are found in the checkout or where named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvvmm.cli import main as cli_main
from kvvmm.errors import ArgumentError
from kvvmm.measure import coldtail, rebuild, results
from kvvmm.measure.results import results_dir, shipped_profile_path


def test_the_shipped_profile_is_what_the_committed_results_rebuild(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert rebuild.main(["--check"]) == 0, capsys.readouterr().out


def _copy_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  change: dict[str, Any]) -> Path:
    data = json.loads(shipped_profile_path().read_text(encoding="utf-8"))
    data.update(change)
    target = tmp_path / "h200.json"
    target.write_text(rebuild.dump(data), encoding="utf-8")
    monkeypatch.setattr(rebuild, "shipped_profile_path", lambda key="h200": target)
    # the rebuild itself is checked above; here only what the command does with its answer
    monkeypatch.setattr(rebuild, "rebuild",
                        lambda shipped, res, collected=None: {**shipped, "note": "rebuilt"})
    return target


def test_check_exits_1_and_names_the_file_when_the_shipped_profile_drifted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    target = _copy_shipped(tmp_path, monkeypatch, {"note": "typed by hand"})
    before = target.read_bytes()
    assert rebuild.main(["--check"]) == 1
    assert str(target) in capsys.readouterr().out
    assert target.read_bytes() == before  # --check writes nothing


def test_rebuild_writes_the_drifted_file_and_then_is_up_to_date(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _copy_shipped(tmp_path, monkeypatch, {"note": "typed by hand"})
    assert rebuild.main([]) == 0
    assert json.loads(target.read_text(encoding="utf-8"))["note"] == "rebuilt"
    assert rebuild.main(["--check"]) == 0


def test_results_are_the_checkouts_or_the_folder_named_and_nothing_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert results_dir() == Path(rebuild.__file__).resolve().parents[2] / "bench" / "results"
    assert results_dir(tmp_path) == tmp_path
    with pytest.raises(ArgumentError, match="folder of committed results"):
        results_dir(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArgumentError):
        results_dir(tmp_path / "file")
    # an installed package (no bench/results beside it) is refused, not searched around
    monkeypatch.setattr(results, "checkout_root", lambda: tmp_path)
    monkeypatch.chdir(Path(rebuild.__file__).resolve().parents[2])
    with pytest.raises(ArgumentError, match="--results"):
        results_dir()


def test_a_results_folder_that_is_not_there_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert rebuild.main(["--check", "--results", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "kvvmm calibrate rebuild" in err


def test_rebuild_is_a_calibrate_subcommand_that_needs_no_gpu(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["calibrate", "rebuild", "--help"])
    assert e.value.code == 0
    assert "--check" in capsys.readouterr().out


def test_new_second_shares_replace_the_old_ones_in_the_sections_order() -> None:
    section = {"unit": "u", "partial_source": "p", "second": {"create": 0.9},
               "second_source": "old", "modelled": True}
    got = coldtail.with_second(section, {"create": 0.3})
    assert list(got) == ["unit", "partial_source", "second", "second_source", "modelled"]
    assert got["second"] == {"create": 0.3} and got["second_source"] == coldtail.SOURCE
    assert section["second"] == {"create": 0.9}  # the input is left as it was

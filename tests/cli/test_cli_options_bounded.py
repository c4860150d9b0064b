"""``kvvmm replay``, ``kvvmm lab`` and the shared one-line error: every option read and bounded
before any work, and the file named after a run the one written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvvmm import cli
from kvvmm.cli import common
from kvvmm.cli import replay as replay_cli


class _Reached(BaseException):
    """A workload was about to be made: the options were all taken."""


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any workload made or replayed ends the command at once (nothing slow ever runs)."""
    def reached(*args: Any, **kwargs: Any) -> Any:
        raise _Reached

    for name in ("generate", "load_workload", "run_workload", "compare_tenants"):
        monkeypatch.setattr(replay_cli, name, reached)


def _replay(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str, str]:
    try:
        rc: int | str = cli.main(["replay", *argv])
    except _Reached:
        rc = "reached"
    except SystemExit as e:
        rc = int(e.code or 0)
    err = capsys.readouterr().err
    return rc, err


def _tenants(n: int, model: str = "llama-3.1-8b") -> str:
    return ",".join([f"{model}:generated"] * n)


@pytest.mark.parametrize("n", [17, 1000, 100_000])
def test_more_tenants_than_the_limit_are_refused_before_any_workload(
        n: int, no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _replay(["--tenants", _tenants(n), "--budget", "2GiB"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert f"{n} items" in err and str(replay_cli.MAX_TENANTS) in err


def test_as_many_tenants_as_the_limit_are_taken(no_work: None,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc, _ = _replay(["--tenants", _tenants(replay_cli.MAX_TENANTS), "--budget", "16GiB"], capsys)
    assert rc == "reached"


@pytest.mark.parametrize("offset", ["1e300", "inf", "nan", "-1", "604801", "1e6", "9" * 400,
                                    "0x10", "", "soon"])
def test_a_tenant_offset_outside_a_week_is_refused_before_any_workload(
        offset: str, no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _replay(["--tenants", f"llama-3.1-8b:generated@{offset}", "--budget", "2GiB"],
                      capsys)
    assert rc == 2 and err.count("\n") == 1 and "offset" in err and "604800" in err


@pytest.mark.parametrize("offset", ["0", "7.5", "604800"])
def test_a_tenant_offset_within_a_week_is_taken(
        offset: str, no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _ = _replay(["--tenants", f"llama-3.1-8b:generated@{offset}", "--budget", "2GiB"],
                    capsys)
    assert rc == "reached"


@pytest.mark.parametrize(("budget", "says"), [
    ("1", "room for 3 pages"),  # no tenant fits
    ("30MiB", "room for 3 pages"),  # the 70b fits alone, not in a sixteenth of it
    ("1PiB", "memory"),  # past the card
    ("200GB", "memory"),
])
def test_a_budget_the_comparison_would_refuse_is_refused_before_any_workload(
        budget: str, says: str, no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    tenants = _tenants(15) + ",llama-3.1-70b:generated"
    rc, err = _replay(["--tenants", tenants, "--budget", budget], capsys)
    assert rc == 2 and err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("demand", ["1GiB@1e300", "1GiB@nan", "1GiB@-1", "1GiB@604801",
                                    "0@5", "1.5B@5", "1GiB", "@", "72057594037927937@1"])
def test_a_demand_out_of_its_bounds_is_refused_before_any_workload(
        demand: str, no_work: None, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _replay(["--tenants", _tenants(1), "--budget", "2GiB", "--demand", demand],
                      capsys)
    assert rc == 2 and err.count("\n") == 1 and "BYTES@SECONDS" in err


@pytest.mark.parametrize("argv", [
    ["generated", "-o", "report.txt"],
    ["generated", "-o", "no-such-folder/report.html"],
    ["generated", "-o", "."],
    ["generated", "--json", "-o", "report.txt"],  # refused, not ignored
    ["--tenants", "llama-3.1-8b:generated", "--budget", "1GiB", "-o", "r.csv"],
    ["generated", "--model", "llama-9"],
    ["generated", "--gpu", "h900"],
    ["--tenants", "llama-3.1-8b:nosuch.csv", "--budget", "1GiB"],
    ["--tenants", "llama-3.1-8b:generated,llama-9:generated", "--budget", "1GiB"],
])
def test_the_output_card_model_and_traces_are_checked_before_any_workload(
        argv: list[str], no_work: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rc, err = _replay(argv, capsys)
    assert rc == 2 and err.count("\n") == 1


@pytest.mark.parametrize("tenants", [False, True])
def test_the_report_named_after_a_run_is_the_file_written(
        tenants: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    argv = (["--tenants", "llama-3.1-8b:generated", "--budget", "256MiB"] if tenants else
            ["generated", "--strategy", "static", "--model", "llama-3.1-8b", "--tp", "1",
             "--no-bands"])
    assert cli.main(["replay", *argv, "--seconds", "2", "-o", "report"]) == 0
    wrote = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote")]
    assert wrote == ["wrote report.html"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


# -- lab --------------------------------------------------------------------------------


@pytest.mark.parametrize("port", ["-1", "0", "65536", "99999", "nan", "1e3", "8888.0", "9" * 400,
                                  "", "\x1b[31m"])
def test_lab_refuses_a_port_that_is_not_one_in_one_line(
        port: str, capsys: pytest.CaptureFixture[str]) -> None:
    launched: list[object] = []
    with pytest.raises(SystemExit) as e:
        cli.main(["lab", f"--port={port}"], launch=lambda a, env: launched.append(a) or 0,
                 gpu_probe=lambda: False)
    err = capsys.readouterr().err
    assert e.value.code == 2 and not launched
    assert err.count("\n") == 1 and "65535" in err and "\x1b" not in err


@pytest.mark.parametrize("port", ["1", "8888", "65535"])
def test_lab_takes_any_tcp_port(port: str, tmp_path: Path) -> None:
    nb = tmp_path / "notebooks"
    nb.mkdir()
    (nb / "01_tour.ipynb").write_text("{}", encoding="utf-8")
    launched: list[list[str]] = []
    assert cli.main(["lab", "--port", port, "--notebooks", str(nb)],
                    launch=lambda a, env: launched.append(list(a)) or 0,
                    gpu_probe=lambda: False) == 0
    assert f"--ServerApp.port={port}" in launched[0]


# -- the one line -----------------------------------------------------------------------


def test_an_error_line_escapes_what_a_terminal_would_act_on_and_is_cut(
        capsys: pytest.CaptureFixture[str]) -> None:
    common._err("map", "bad \x1b[31mred\x1b[0m\nsecond line\r\u202eevil\x00" + "x" * 5000)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "\r" not in err
    assert "\u202e" not in err and "\x00" not in err
    assert "\\x1b[31mred" in err and "\\u202e" in err and len(err) < 600

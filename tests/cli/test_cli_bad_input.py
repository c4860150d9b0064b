"""Every option of every ``kvvmm`` command, fed hostile values, and every help page.

The options are read from the argparse parsers themselves, so an option added later is
covered without touching this file. The rule checked: a bad value is exit code 2 and one line
on stderr, with no traceback and no raw terminal escape, within a bound; a value the command
documents as taken (a new file name for ``-o``, anything after ``kvvmm lab --``) may succeed,
and then nothing it prints is raw either.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import kvvmm
from kvvmm import cli
from kvvmm.budget import Ledger
from kvvmm.cli import budget as budget_cli
from kvvmm.cli import replay as replay_cli
from kvvmm.units import MAX_BYTES, MiB

#: What each option is fed. ``@...`` are files made per test (see ``_files``).
HOSTILE = {
    "400 digits": "9" * 400,
    "1e300": "1e300",
    "-1": "-1",
    "nan": "nan",
    "inf": "inf",
    "empty": "",
    "terminal escape": "\x1b[31m",
    "very long": "x" * 5000,
    "missing file": "@missing",
    "directory": "@directory",
    "garbage JSON": "@garbage",
}

#: A file name that exists nowhere yet is a valid place to write: these kinds of value.
_NEW_FILE_NAMES = {"400 digits", "1e300", "-1", "nan", "inf", "terminal escape", "missing file"}

#: (command, option's dest) -> the kinds of hostile value it documents as taken.
ACCEPTS: dict[tuple[str, str], set[str]] = {
    ("lab", "jupyter_args"): set(HOSTILE),  # handed to JupyterLab as they are
    ("map", "output"): _NEW_FILE_NAMES,  # a new file (no suffix: .html is added)
    ("replay", "output"): _NEW_FILE_NAMES,
    ("budget init", "ledger"): _NEW_FILE_NAMES,  # init creates the ledger there
    # a key of letters, digits, '-', '_', '.': init creates its ledger
    ("budget init", "key"): {"1e300", "-1", "nan", "inf"},
}

#: Every hostile case ends within this many seconds (a guard against a runaway, set far
#: above what any case takes, not a measure of speed).
_BOUND_S = 60


class _Reached(BaseException):
    """The command got past every check to its work (a BaseException: no handler in the
    command mistakes it for a refusal)."""


class _RanTooLong(BaseException):
    pass


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
              ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command's words and parser, read from argparse."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _takes_a_value(action: argparse.Action) -> bool:
    return action.nargs != 0 and not isinstance(action, (argparse._SubParsersAction,
                                                         argparse._HelpAction))


def _cases() -> list[tuple[str, str, str]]:
    """(command words, option string or positional dest, hostile kind) for every option."""
    out = []
    for path, parser in _commands(cli._parser()):
        for action in parser._actions:
            if not _takes_a_value(action):
                continue
            opt = action.option_strings[-1] if action.option_strings else action.dest
            out += [(" ".join(path), opt, kind) for kind in HOSTILE]
    return out


CASES = _cases()


def _files(tmp: Path) -> dict[str, str]:
    (tmp / "directory").mkdir()
    (tmp / "garbage.json").write_text('{"a": [1, 2,, "\x00', encoding="utf-8")
    return {"@missing": str(tmp / "nowhere" / "missing.json"),
            "@directory": str(tmp / "directory"), "@garbage": str(tmp / "garbage.json")}


def _trace(path: Path) -> str:
    drv = kvvmm.TracingDriver(kvvmm.SimDriver("h200"))
    arena = kvvmm.Arena(drv, reserve_bytes=64 * MiB, name="scratch", trace=drv.trace)
    arena.commit(arena.allocate(8 * MiB), 4 * MiB)
    drv.trace.save(path)
    return str(path)


def _baseline(command: str, opt: str, tmp: Path) -> list[str]:
    """A valid command line for ``command`` that ``opt`` is then added to (or replaces)."""
    if command == "lab":
        nb = tmp / "notebooks"
        nb.mkdir(exist_ok=True)
        (nb / "01_tour.ipynb").write_text("{}", encoding="utf-8")
        return ["lab", "--notebooks", str(nb), "--no-browser"]
    if command == "map":
        return ["map", _trace(tmp / "run.json"), "-o", str(tmp / "map.html")]
    if command == "replay":
        if opt.lstrip("-").replace("-", "_") in _tenant_options():
            return ["replay", "--tenants", "llama-3.1-8b:generated", "--budget", "256MiB",
                    "--seconds", "1", "--json"]
        return ["replay", "generated", "--seconds", "1", "--strategy", "static", "--model",
                "llama-3.1-8b", "--tp", "1", "--no-bands", "--json"]
    if command.startswith("budget "):
        ledger = tmp / "ledger"
        if not ledger.exists():
            Ledger(ledger, budget_bytes=1 << 30).close()
        where = [] if opt == "--key" else ["--ledger", str(ledger)]
        action = command.split()[1]
        if action == "set":
            return ["budget", "set", "engine-a", "1GiB", *where]
        if action == "init":
            return ["budget", "init", "1GiB", *where]
        return ["budget", "show", *where]
    return command.split()


#: Where each positional stands in its command's baseline.
_POSITIONAL_AT = {("map", "trace"): 1, ("replay", "trace"): 1, ("budget set", "tenant"): 2,
                  ("budget set", "bytes"): 3, ("budget init", "bytes"): 2}


def _with(argv: list[str], command: str, opt: str, value: str) -> list[str]:
    """``argv`` with ``opt`` set to ``value`` (a positional replaced where it stands)."""
    if opt.startswith("-"):
        out = list(argv)
        for name in ("-o", "--output") if opt == "--output" else (opt,):
            while name in out:  # the baseline's own value for it goes
                i = out.index(name)
                del out[i:i + 2]
        return [*out, f"{opt}={value}"]  # "=": a value such as -1 stays a value
    if opt == "cmd":
        return [value]
    if opt == "jupyter_args":
        return [*argv, "--", value]
    at = _POSITIONAL_AT.get((command, opt))
    if at is None:
        raise AssertionError(f"no place known for {command} {opt}: add it to _POSITIONAL_AT")
    return [*argv[:at], value, *argv[at + 1:]]


def _tenant_options() -> set[str]:
    replay = dict(_commands(cli._parser()))[("replay",)]
    return {a.dest for g in replay._action_groups if g.title == "tenants"
            for a in g._group_actions}


def _run(argv: list[str], launch: Callable[..., int]) -> int:
    def too_long(signum: int, frame: FrameType | None) -> None:
        raise _RanTooLong(f"{argv[:3]} ran past {_BOUND_S} s")

    old = signal.signal(signal.SIGALRM, too_long)
    signal.setitimer(signal.ITIMER_REAL, _BOUND_S)
    try:
        return cli.main(argv, launch=launch, gpu_probe=lambda: False)
    except SystemExit as e:  # argparse's refusal
        return int(e.code or 0)
    except _Reached:
        return 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize(("command", "opt", "kind"), CASES,
                         ids=[f"{c}|{o}|{k}" for c, o, k in CASES])
def test_a_hostile_value_of_any_option_is_one_line_and_exit_2(
        command: str, opt: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # whatever a taken value writes lands here
    real_default = budget_cli.default_path
    monkeypatch.setattr(budget_cli, "default_path",
                        lambda key="gpu0": real_default(key, folder=tmp_path))

    def reached(*args: Any, **kwargs: Any) -> Any:
        raise _Reached

    monkeypatch.setattr(replay_cli, "run_workload", reached)
    monkeypatch.setattr(replay_cli, "compare_tenants", reached)
    value = _files(tmp_path).get(HOSTILE[kind], HOSTILE[kind])
    argv = _with(_baseline(command, opt, tmp_path), command, opt, value)
    capsys.readouterr()
    rc = _run(argv, launch=lambda argv, env: 0)
    out, err = capsys.readouterr()
    dest = opt.lstrip("-").replace("-", "_")
    taken = kind in ACCEPTS.get((command, dest), set())
    assert "Traceback" not in err and "\x1b" not in out + err, err
    if taken and rc == 0:
        return
    assert rc == 2, f"{argv!r:.300} exited {rc}: {err!r:.300}"
    assert err.endswith("\n") and err.count("\n") == 1 and len(err) < 1200, err[:1200]


def _all_commands() -> list[tuple[str, ...]]:
    return [path for path, _ in _commands(cli._parser())]


@pytest.mark.parametrize("columns", [None, "200", "60"])
@pytest.mark.parametrize("path", _all_commands(), ids=lambda p: " ".join(p) or "kvvmm")
def test_every_help_line_fits_in_100_columns(
        path: tuple[str, ...], columns: str | None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    try:
        cli.main([*path, "--help"], gpu_probe=lambda: False)
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    long = [line for line in out.splitlines() if len(line) >= 100]
    assert not long, long


# -- sizes: one exact parser behind every size option ------------------------------------


def _size_options() -> list[tuple[str, list[str]]]:
    """Every option that takes a size, as the command line to give it ``{}``."""
    return [("plan --budget-bytes", ["plan", "--budget-bytes", "{}"]),
            ("plan --free-bytes", ["plan", "--free-bytes", "{}"]),
            ("plan --headroom-bytes", ["plan", "--headroom-bytes", "{}"]),
            ("budget set BYTES", ["budget", "set", "engine-a", "{}", "--ledger", "L"]),
            ("budget init BYTES", ["budget", "init", "{}", "--ledger", "L"]),
            ("replay --budget", ["replay", "--tenants", "llama-3.1-8b:generated", "--budget",
                                 "{}", "--seconds", "1", "--json"]),
            ("replay --demand", ["replay", "--tenants", "llama-3.1-8b:generated", "--budget",
                                 "1GiB", "--demand", "{}@1", "--seconds", "1", "--json"])]


def test_every_size_option_is_found_by_the_enumeration() -> None:
    """A new option with "bytes" in its name joins _size_options (else it is not checked)."""
    named = {f"{' '.join(p)} {a.option_strings[-1] if a.option_strings else 'BYTES'}"
             for p, parser in _commands(cli._parser()) for a in parser._actions
             if "bytes" in a.dest or a.metavar in ("BYTES", "BYTES@S")}
    listed = {name for name, _ in _size_options()}
    assert named <= listed, named - listed


@pytest.mark.parametrize(("name", "argv"), _size_options(), ids=[n for n, _ in _size_options()])
@pytest.mark.parametrize("text", [str(MAX_BYTES + 1), "9" * 400, "1e300", "1.5B", "-1", "nan"])
def test_every_size_option_refuses_what_is_not_an_exact_size_within_the_limit(
        name: str, argv: list[str], text: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    Ledger(tmp_path / "L", budget_bytes=1 << 30).close()
    line = [str(tmp_path / "L") if a == "L" else a.replace("{}", text) for a in argv]
    rc = _run(line, launch=lambda argv, env: 0)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    if text == str(MAX_BYTES + 1):  # named with the limit, never rounded down to it
        assert str(MAX_BYTES) in err and text in err

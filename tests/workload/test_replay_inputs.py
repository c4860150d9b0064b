"""Hostile inputs to the workload lab (hardening round 2, classes 2, 3 and 8): every input
error of `kvvmm replay` is one bounded line and exit 2, never a traceback; idle gaps of any
length cost one step of the serving model, not one per sampled second; durations are finite
and bounded before anything is drawn; JSON output is strict."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import pytest

from kvvmm.cli.replay import add_replay_parser, replay_command
from kvvmm.errors import ArgumentError, OutOfRangeError, WorkloadFormatError
from kvvmm.workload import Request, Workload, generate, load_workload, run_workload
from kvvmm.workload.generator import MAX_REQUESTS

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def replay(*argv: str) -> int:
    ap = argparse.ArgumentParser(prog="kvvmm")
    sub = ap.add_subparsers(dest="cmd")
    add_replay_parser(sub)
    return replay_command(ap.parse_args(["replay", *argv]))


def _write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


# -- class 2 and 8: one bounded line, exit 2, whatever failed inside -----------------------

BAD_TRACES = {
    "mixed naive and zoned times": ("t.csv", HEADER + "2023-11-16 18:15:46.1,10,5\n"
                                    "2023-11-16 18:15:47.1+00:00,10,5\n"),
    "a field over csv's 128 KiB limit": ("t.csv", HEADER + '"' + "9" * 200_000 + '",10,5\n'),
    "a header of 10**5 columns": ("t.csv", ",".join(f"c{i}" for i in range(100_000)) + "\n"),
    "deeply nested JSON": ("t.jsonl", "[" * 100_000 + "]" * 100_000 + "\n"),
    "NaN arrival": ("t.jsonl", '{"arrival_s": NaN, "prompt_tokens": 5, "output_tokens": 5}\n'),
    "Infinity tokens": ("t.jsonl", '{"arrival_s": 0, "prompt_tokens": Infinity, '
                                   '"output_tokens": 5}\n'),
    "an int of 10**5 digits": ("t.csv", HEADER + "2023-11-16 18:15:46.1," + "7" * 100_000
                               + ",5\n"),
    "a huge object": ("t.jsonl", json.dumps(list(range(50_000))) + "\n"),
    "bytes that are not UTF-8": ("t.csv", HEADER),
}


@pytest.mark.parametrize("case", list(BAD_TRACES))
def test_a_bad_trace_is_one_bounded_line_and_exit_2(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name, text = BAD_TRACES[case]
    path = _write(tmp_path, name, text)
    if case == "bytes that are not UTF-8":
        Path(path).write_bytes(HEADER.encode() + b"\xff\xfe,1,2\n")
    assert replay(path, "--strategy", "static", "--json") == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("kvvmm replay: ") and err.count("\n") == 1, err[:300]
    assert len(err) < 700 and "Traceback" not in err
    assert captured.out == ""


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "inf", "1e12"])
def test_replay_refuses_a_duration_that_is_not_finite_positive_and_bounded(
        seconds: str, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    assert replay("generated", "--seconds", seconds, "--strategy", "static", "--json") == 2
    assert time.monotonic() - t0 < 5  # refused before drawing anything
    err = capsys.readouterr().err
    assert "duration_s" in err and err.count("\n") == 1


def test_replay_json_is_strict_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert replay("generated", "--seconds", "3", "--strategy", "static", "--json") == 0
    out = capsys.readouterr().out
    json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))


def test_a_loader_message_quotes_a_huge_value_in_part(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.jsonl", json.dumps({"arrival_s": "x" * 100_000,
                                                   "prompt_tokens": 1, "output_tokens": 1})
                  + "\n")
    with pytest.raises(WorkloadFormatError) as e:
        load_workload(path)
    assert len(str(e.value)) < 400 and "100,002 characters" in str(e.value)


# -- class 3: time and memory bounded by the work, not by the clock ------------------------


def test_an_idle_gap_of_any_length_costs_one_step_of_the_model() -> None:
    wl = Workload((Request(0.0, 100, 10), Request(1e12, 100, 10)), "two requests, far apart")
    t0 = time.monotonic()
    (r,) = run_workload(wl, ["prefix"], model="qwen2.5-7b", tp=1, pool_tokens=8192).results
    assert time.monotonic() - t0 < 10
    assert r.serving.completed == 2 and r.serving.end_s > 1e12
    assert len(r.timeline.t_s) < 100  # samples over the work, not over 10**12 seconds
    # the gap is sampled once, as it starts, and that state holds through it: the
    # time-weighted mean is the gap's (what stays in use while idle)
    t, used = r.timeline.t_s, r.timeline.used_bytes
    idle = next(u for a, u in zip(t, used, strict=True) if 0 < a < 1e12)
    assert idle < max(used)
    assert r.mean_used_bytes == pytest.approx(idle, rel=1e-9)


def test_an_idle_gap_leaves_the_means_as_sampling_through_it_would() -> None:
    reqs = (Request(0.0, 2000, 50), Request(30.0, 2000, 50), Request(90.0, 500, 20))
    wl = Workload(reqs, "gaps")
    (r,) = run_workload(wl, ["prefix"], model="qwen2.5-7b", tp=1, pool_tokens=16384).results
    t, used = r.timeline.t_s, r.timeline.used_bytes
    # step function: each sample holds until the next; recompute the mean by hand
    area = sum(u * (b - a) for u, a, b in zip(used, t, t[1:], strict=False))
    assert r.mean_used_bytes == pytest.approx(area / (t[-1] - t[0]), rel=1e-6)


@pytest.mark.parametrize("bad", [0, -5.0, math.nan, math.inf, True, "60"], ids=repr)
def test_generate_refuses_a_duration_that_is_not_finite_and_positive(bad: object) -> None:
    with pytest.raises(ArgumentError, match="duration_s"):
        generate(duration_s=bad)  # type: ignore[arg-type]


def test_generate_refuses_to_draw_more_than_its_bound() -> None:
    with pytest.raises(OutOfRangeError, match="duration_s"):
        generate(duration_s=1e12)
    with pytest.raises(ArgumentError, match="requests"):
        generate(requests=MAX_REQUESTS + 1)


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, True], ids=repr)
def test_first_refuses_a_duration_that_is_not_finite_and_positive(bad: object) -> None:
    with pytest.raises(WorkloadFormatError, match="seconds"):
        generate(duration_s=10.0).first(bad)  # type: ignore[arg-type]

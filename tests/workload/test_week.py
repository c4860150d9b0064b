"""A week of traffic in bounded memory (issue 48, item 2): the generator as a stream, the
serving loop reading it one request ahead, and a run's per-step and per-request state kept
in bounded summaries."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from kvvmm import cli
from kvvmm.errors import ArgumentError
from kvvmm.record import TracingDriver
from kvvmm.workload import (
    RequestStream,
    ServingConfig,
    ServingModel,
    StepTimeModel,
    generate,
    generate_stream,
    run_workload,
    save_jsonl,
)
from kvvmm.workload import run as run_mod
from kvvmm.workload import tally as tally_mod
from kvvmm.workload.generator import MAX_STREAM_S
from kvvmm.workload.serving import ServingHooks
from kvvmm.workload.tally import RELATIVE_ERROR, Tally

POOL = 4096 * 16  # pool tokens: small enough to preempt and stall now and then


@pytest.mark.parametrize("kw", [{"seed": 0, "duration_s": 300.0},
                                {"seed": 7, "duration_s": 900.0, "rate_scale": 3.0},
                                {"seed": 2, "duration_s": 120.0, "prefixes": 3,
                                 "prefix_tokens": 500}])
def test_a_stream_gives_the_generators_requests_for_the_same_seed_and_span(kw: dict) -> None:
    held = generate(**kw)
    stream = generate_stream(**kw)
    assert isinstance(stream, RequestStream) and stream.count is None
    assert tuple(stream) == held.requests  # the same requests, in the same order
    assert tuple(stream) == held.requests  # and again: each reading draws them afresh
    assert stream.source == held.source and stream.span_s == kw["duration_s"]


def test_a_stream_is_drawn_as_it_is_read_not_held() -> None:
    week = generate_stream(seed=1, duration_s=7 * 86400.0, rate_scale=8.07)
    first = list(itertools.islice(week, 5))  # a 27 M-request week: only 5 are drawn
    assert first == list(generate(seed=1, duration_s=first[-1].arrival_s + 1e-3,
                                  rate_scale=8.07).requests)[:5]


def test_a_stream_past_a_year_is_refused_and_a_held_workload_keeps_its_limit() -> None:
    with pytest.raises(ArgumentError, match="duration_s"):
        generate_stream(duration_s=MAX_STREAM_S * 2)
    with pytest.raises(ArgumentError, match="2,000,000 requests"):
        generate(duration_s=7 * 86400.0)  # 3.3 M held: refused; streamed: fine
    generate_stream(duration_s=7 * 86400.0)


def test_a_tally_is_exact_nearest_rank_below_its_limit() -> None:
    rng = random.Random(3)
    values = [rng.lognormvariate(-6, 2) for _ in range(5000)]
    t = Tally(values)
    s = sorted(values)
    assert t.exact and t.values() == tuple(values) and len(t) == 5000
    for q in (1, 50, 90, 99, 99.9, 100):
        rank = max(1, -(-int(q * len(s)) // 100))
        assert t.quantile(q) == s[rank - 1]
    assert t.max == s[-1] and t.min == s[0] and Tally().quantile(99) == 0.0


def test_a_tally_past_its_limit_stays_the_same_size_and_within_its_stated_error() -> None:
    rng = random.Random(5)
    t = Tally(exact_limit=1000, sample_size=200)
    values: list[float] = []
    sizes = []
    for n in (10_000, 100_000):
        while len(values) < n:
            v = rng.lognormvariate(-7, 2.5)  # stalls: microseconds to seconds
            values.append(v)
            t.append(v)
        sizes.append(t.summary_size())
    assert not t.exact and t.count == 100_000
    # the buckets span the values' range (one per 1 %), the sample is fixed: not the count
    span = math.log(t.max / t.min) / math.log((1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR))
    assert all(size <= 200 + span + 2 for size in sizes) and sizes[1] < 5000
    assert len(t.sample()) == 200
    s = sorted(values)
    for q in (1, 10, 50, 90, 99, 99.9):
        rank = max(1, -(-int(q * len(s)) // 100))
        assert t.quantile(q) == pytest.approx(s[rank - 1], rel=RELATIVE_ERROR)
    assert (t.min, t.max, t.count) == (s[0], s[-1], len(s))
    assert t.total == pytest.approx(sum(values))
    with pytest.raises(ArgumentError, match="quantile"):
        t.values()


class _Quiet:
    kv_bandwidth_factor = 1.0

    def update(self, allocated: list[int], freed: list[int], high_water: int, step: int,
               now_s: float) -> float:
        return 1e-5 if allocated else 0.0

    def sample(self, *a: object) -> None:
        pass


def test_the_serving_loop_serves_a_stream_as_it_serves_the_workload() -> None:
    hooks: ServingHooks = _Quiet()
    sm = StepTimeModel.for_model("llama-3.1-8b", "h200")
    model = ServingModel(ServingConfig(), sm, pool_pages=4096)
    held = model.run(generate(seed=4, duration_s=600.0), hooks)
    streamed = model.run(generate_stream(seed=4, duration_s=600.0), hooks)
    assert held == streamed and streamed.requests == len(generate(seed=4, duration_s=600.0))
    assert streamed.stall_steps == held.stall_steps and streamed.first_token.exact


def test_a_replay_of_a_stream_is_the_replay_of_the_held_workload() -> None:
    names = ["request-ranges+deferred", "prefix"]
    kw = {"model": "llama-3.1-8b", "tp": 1, "pool_tokens": POOL}
    held = run_workload(generate(seed=2, duration_s=240.0), names, **kw)
    streamed = run_workload(generate_stream(seed=2, duration_s=240.0), names, **kw)
    assert streamed.setup == held.setup
    for a, b in zip(held.results, streamed.results, strict=True):
        row_a, row_b = a.summary(), b.summary()
        row_a.pop("wall_s"), row_b.pop("wall_s")
        assert row_a == row_b and a.timeline == b.timeline and a.serving == b.serving


def test_a_long_runs_summaries_timeline_and_trace_stay_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the limits shrunk, a short run is a long one: the tallies fold, the timeline
    thins, the traced calls are dropped once counted; the means and peaks stay exact and
    the percentiles within the tally's stated error."""
    kw = {"model": "llama-3.1-8b", "tp": 1, "pool_tokens": POOL}
    wl = generate_stream(seed=6, duration_s=300.0, rate_scale=2.0)
    exact = run_workload(wl, ["request-ranges+deferred"], **kw).results[0]
    tracers: list[TracingDriver] = []

    class _Kept(TracingDriver):
        def __init__(self, *a: object, **k: object) -> None:
            super().__init__(*a, **k)  # type: ignore[arg-type]
            tracers.append(self)

    monkeypatch.setattr(tally_mod, "EXACT_LIMIT", 100)
    monkeypatch.setattr(tally_mod, "SAMPLE_SIZE", 50)
    monkeypatch.setattr(run_mod, "TIMELINE_CAP", 64)
    monkeypatch.setattr(run_mod, "TracingDriver", _Kept)
    long = run_workload(wl, ["request-ranges+deferred"], **kw).results[0]
    s = long.serving
    assert s.requests > 1000 and not s.first_token.exact and not s.latency.exact
    assert s.first_token.summary_size() < 5000 and len(s.first_token.sample()) == 50
    assert len(long.timeline) < 64 < len(exact.timeline) and long.timeline.kept_every > 1
    assert long.timeline.t_s[-1] == exact.timeline.t_s[-1]  # the end is always kept
    # the calls were counted, then dropped: only the owner's close is left in the trace
    assert long.driver_calls == exact.driver_calls > 1000
    assert len(tracers[0].trace.events) < 200 and long.trace is None
    a, b = exact.summary(), long.summary()
    for k in ("mean_backed_bytes", "mean_used_bytes", "peak_backed_bytes", "mean_pool_bytes",
              "mean_elastic_bytes", "stalled_steps", "max_stall_us", "first_token_max_ms",
              "completed", "steps", "driver_calls", "decode_driver_ms"):
        assert a[k] == b[k], k
    for k in ("first_token_p50_ms", "first_token_p99_ms", "latency_p50_s", "latency_p99_s"):
        assert b[k] == pytest.approx(a[k], rel=RELATIVE_ERROR, abs=1e-3), k


def test_kvvmm_replay_generated_takes_days_and_a_rate_scale_and_streams_them(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["replay", "generated", "--days", "0.0005", "--rate-scale", "2", "--strategy",
            "static", "--model", "llama-3.1-8b", "--tp", "1", "--no-bands", "--json"]
    assert cli.main(args) == 0
    got = json.loads(capsys.readouterr().out)
    held = generate(seed=0, duration_s=43.2, rate_scale=2.0)
    assert got["requests"] == len(held) and got["workload"] == held.source
    assert got["results"][0]["completed"] == len(held)
    trace = generate(seed=0, duration_s=10.0)
    path = str(tmp_path / "t.jsonl")
    save_jsonl(trace.requests, path)
    assert cli.main(["replay", path, "--rate-scale", "2", "--json"]) == 2
    assert "--rate-scale is for the 'generated' trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one length, not two
        cli.main(["replay", "generated", "--days", "1", "--seconds", "60"])

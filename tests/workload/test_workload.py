"""The workload lab: loaders, the fitted generator, the serving model, strategies."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from serving_support import QuietHooks

from kvvmm.driver.sim import SimDriver
from kvvmm.errors import ArgumentError, WorkloadFormatError
from kvvmm.replay import replay, replay_arenas
from kvvmm.workload import (
    AZURE_CONV_TRACE,
    STRATEGIES,
    PageElastic,
    PrefixGrowth,
    Request,
    RunOptions,
    ServingConfig,
    SlotAllocator,
    Strategy,
    Workload,
    azure_conv_fit,
    find_trace,
    fit_workload,
    generate,
    load_azure_csv,
    load_jsonl,
    load_workload,
    run_workload,
    save_jsonl,
)

TRACE = (Path(__file__).resolve().parents[3] / "shared" / "data" / "azure-llm-inference-2023"
         / "AzureLLMInferenceTrace_conv.csv")
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason=f"{TRACE} not here")

# A pool small enough to preempt under the fitted traffic: qwen2.5-7b at TP 1 (56 buffers of
# 1 KiB per token), 8192 tokens: 8 MiB per buffer, four granules (slot 0's covers 2048 tokens).
SMALL = {"model": "qwen2.5-7b", "tp": 1, "pool_tokens": 8192}


def small_workload(seed: int = 3, seconds: float = 20.0) -> Workload:
    return generate(seed=seed, duration_s=seconds, rate_scale=2.0)


# -- loaders --------------------------------------------------------------------------------


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_an_azure_csv_loads_with_arrivals_in_seconds_from_the_first_row(tmp_path: Path) -> None:
    p = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    wl = load_azure_csv(p)
    assert wl.requests[0] == Request(0.0, 374, 44)
    assert wl.requests[1].arrival_s == pytest.approx(4.314579)
    assert load_workload(p) == wl


@pytest.mark.parametrize(("row", "field", "text"), [
    ("2023-11-16 18:15:50.99,x,109", "ContextTokens", "row 3"),
    ("2023-11-16 18:15:50.99,396,0", "GeneratedTokens", "row 3"),
    ("yesterday,396,10", "TIMESTAMP", "row 3"),
    ("2023-11-16 18:15:40.00,396,10", "TIMESTAMP", "row 3"),
    ("2023-11-16 18:15:50.99,396", "GeneratedTokens", "row 3"),
])
def test_a_bad_csv_row_is_refused_naming_its_row_and_field(tmp_path: Path, row: str, field: str,
                                                           text: str) -> None:
    p = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              f"2023-11-16 18:15:46.6805900,374,44\n{row}\n")
    with pytest.raises(WorkloadFormatError, match=f"{text}.*{field}|{field}.*{text}"):
        load_azure_csv(p)


def test_a_csv_with_another_header_is_refused_on_row_1(tmp_path: Path) -> None:
    p = write(tmp_path, "t.csv", "time,prompt,output\n1,2,3\n")
    with pytest.raises(WorkloadFormatError, match=r"row 1.*TIMESTAMP"):
        load_azure_csv(p)


def test_jsonl_round_trips_with_prefix_ids(tmp_path: Path) -> None:
    reqs = [Request(0.0, 10, 5, "sys"), Request(0.5, 20, 1)]
    save_jsonl(reqs, tmp_path / "w.jsonl")
    assert load_jsonl(tmp_path / "w.jsonl").requests == tuple(reqs)


@pytest.mark.parametrize(("line", "field"), [
    ('{"arrival_s": 1, "prompt_tokens": 0, "output_tokens": 3}', "prompt_tokens"),
    ('{"arrival_s": -1, "prompt_tokens": 2, "output_tokens": 3}', "arrival_s"),
    ('{"arrival_s": 1, "prompt_tokens": 2}', "output_tokens"),
    ('{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 3, "prefix_id": 7}', "prefix_id"),
    ('{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 3, "extra": 1}', "extra"),
    ('{"arrival_s": 1, "prompt_tokens": true, "output_tokens": 3}', "prompt_tokens"),
    ("[1, 2, 3]", "JSON object"),
    ("{nope", "not JSON"),
])
def test_a_bad_jsonl_row_is_refused_naming_its_row_and_field(tmp_path: Path, line: str,
                                                             field: str) -> None:
    p = write(tmp_path, "w.jsonl",
              '{"arrival_s": 0, "prompt_tokens": 2, "output_tokens": 3}\n\n' + line + "\n")
    with pytest.raises(WorkloadFormatError, match=f"row 3.*{field}"):
        load_jsonl(p)


def test_an_unknown_trace_suffix_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkloadFormatError, match="unknown format"):
        load_workload(write(tmp_path, "t.parquet", ""))


def test_find_trace_returns_a_path_a_user_names_and_refuses_one_that_is_not_a_file(
        tmp_path: Path) -> None:
    p = write(tmp_path, "mine.jsonl", "")
    assert find_trace(p) == p and find_trace(str(p)) == p
    with pytest.raises(WorkloadFormatError, match="not a file"):
        find_trace(tmp_path / "absent.csv")


def test_find_trace_looks_next_to_the_repository_root_and_finds_nothing_elsewhere(
        tmp_path: Path) -> None:
    # Notebook 06 runs the real trace when ../shared holds it.
    repo = tmp_path / "clone"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("", encoding="utf-8")
    assert find_trace(start=repo / "notebooks") is None  # no copy next to the clone
    copy = tmp_path / AZURE_CONV_TRACE
    copy.parent.mkdir(parents=True)
    copy.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n", encoding="utf-8")
    assert find_trace(start=repo / "notebooks") == copy
    assert find_trace("", start=repo) == copy  # an empty path is no path
    assert find_trace(start=tmp_path) is None  # not inside a repository


@needs_trace
def test_find_trace_finds_the_shared_copy_from_this_checkout() -> None:
    assert find_trace(start=Path(__file__).parent) == TRACE


# -- the fitted generator ---------------------------------------------------------------------


def test_the_same_seed_gives_the_same_workload_and_another_seed_another() -> None:
    a, b, c = (generate(seed=s, duration_s=60.0) for s in (1, 1, 2))
    assert a == b and a.requests != c.requests


def test_the_shipped_fit_states_the_conversation_trace_statistics() -> None:
    s = azure_conv_fit().summary()
    assert (s["context_median"], s["context_p99"], s["context_max"]) == (1020, 4142, 14050)
    assert (s["output_median"], s["output_max"]) == (129, 1000)
    assert s["rate_per_s"] == pytest.approx(5.53, abs=0.01)
    assert "Splitwise" in azure_conv_fit().source and "CC-BY 4.0" in azure_conv_fit().source


def test_a_generated_hour_matches_the_fit_it_was_drawn_from() -> None:
    got = fit_workload(generate(seed=7)).summary()
    assert got["rate_per_s"] == pytest.approx(5.53, rel=0.03)
    assert got["context_median"] == pytest.approx(1020, rel=0.03)
    assert got["context_p99"] == pytest.approx(4142, rel=0.05)
    assert got["output_median"] == pytest.approx(129, rel=0.05)
    assert got["output_max"] <= 1000 and got["context_max"] <= 14050


@needs_trace
def test_the_shipped_fit_is_what_fitting_the_real_trace_gives() -> None:
    real = fit_workload(load_azure_csv(TRACE), name="azure-conv-2023")
    shipped = azure_conv_fit()
    assert real.requests == 19366 == shipped.requests
    assert real.context_percentiles == shipped.context_percentiles
    assert real.output_percentiles == shipped.output_percentiles
    assert real.rate_profile == shipped.rate_profile


def test_generator_arguments_are_checked() -> None:
    with pytest.raises(ArgumentError, match="rate_scale"):
        generate(rate_scale=0)
    with pytest.raises(ArgumentError, match="requests"):
        generate(requests=0)


def test_a_bool_is_not_a_rate_scale_or_a_hysteresis() -> None:
    # Both took True as 1 (the only number checks that did not refuse bool).
    with pytest.raises(ArgumentError, match=r"^rate_scale=True is invalid: must be a number in "
                                            r"\(0, 1e6\]$"):
        generate(rate_scale=True)
    with pytest.raises(ArgumentError, match=r"^hysteresis=True is invalid: must be a number > 0$"):
        PrefixGrowth(hysteresis=True)
    assert PrefixGrowth(hysteresis=2).hysteresis == 2.0


def test_requests_stops_after_that_many_and_prefixes_are_named() -> None:
    wl = generate(seed=0, requests=50, prefixes=3, prefix_tokens=100)
    assert len(wl) == 50
    assert {r.prefix_id for r in wl.requests} <= {"p0", "p1", "p2"}
    assert min(r.prompt_tokens for r in wl.requests) >= 100


# -- the slot allocator and the serving model -------------------------------------------------


def test_lowest_free_first_reuses_the_lowest_page_and_lifo_the_last_freed() -> None:
    for order, want in (("lowest", 2), ("lifo", 4)):
        a = SlotAllocator(10, order)
        got: list[int] = []
        a.alloc(5, got)
        assert got == [1, 2, 3, 4, 5] and a.high_water == 6
        a.release([2, 4])
        again: list[int] = []
        a.alloc(1, again)
        assert again == [want]
    a = SlotAllocator(10, "lowest")
    pages: list[int] = []
    a.alloc(3, pages)
    a.release([3, 2])
    assert a.high_water == 2 and a.free == 8


def test_every_request_completes_or_is_rejected_and_the_pool_preempts_when_full() -> None:
    wl = Workload((*small_workload().requests, Request(30.0, 9000, 10)), "with one too big")
    (r,) = run_workload(wl, ["prefix"], **SMALL).results  # type: ignore[arg-type]
    s = r.serving
    assert s.completed + s.rejected == s.requests == len(wl)
    too_big = sum(-(-(q.prompt_tokens + q.output_tokens) // 16) > 8192 // 16 - 1
                  for q in wl.requests)
    assert s.rejected == too_big >= 1  # 9010 tokens never fit 8192 (page 0 is slot 0's)
    assert s.preemptions > 0
    assert s.peak_used_pages <= 8192 // 16 - 1
    assert r.used_over_backed == 0 and r.conservation_errors == 0


def test_max_running_bounds_the_batch() -> None:
    (r,) = run_workload(small_workload(), ["static"], config=ServingConfig(max_running=3),
                        **SMALL).results  # type: ignore[arg-type]
    assert r.serving.peak_running <= 3
    assert r.serving.completed + r.serving.rejected == r.serving.requests


class _SlowToMap(SlotAllocator):
    """An allocator whose memory for a request is ready ``lag_s`` after the engine first asks
    (prepare): what a backing thread mapping it would give."""

    def __init__(self, pages: int, lag_s: float) -> None:
        super().__init__(pages)
        self.lag_s = lag_s
        self.asked: dict[int, float] = {}
        self.admitted: dict[int, float] = {}
        self.unprepared: list[int] = []

    def prepare(self, rid: int, n: int) -> bool:
        first = self.asked.setdefault(rid, self.now_s)
        return self.now_s >= first + self.lag_s

    def ready_s(self, rid: int) -> float:
        return self.asked[rid] + self.lag_s

    def unprepare(self, rid: int) -> None:
        self.unprepared.append(rid)
        self.asked.pop(rid, None)

    def alloc_for(self, rid: int, n: int, out: list[int]) -> None:
        self.admitted.setdefault(rid, self.now_s)
        self.asked.pop(rid, None)  # a preempted request asks again
        super().alloc_for(rid, n, out)


@pytest.mark.parametrize("lag_s", [0.0, 0.0004, 0.03, 2.0])
def test_an_admission_whose_memory_is_not_ready_waits_for_a_later_boundary_not_the_step(
        lag_s: float) -> None:
    """prepare() False: the head request stays queued (its memory on the way), the step does
    not wait, and it is admitted at the first boundary at or after its memory is ready, even
    with nothing running (the engine then idles until it is) or after the last arrival."""
    from kvvmm.workload.serving import ServingModel, StepTimeModel

    wl = small_workload(seed=5, seconds=10)
    cfg = ServingConfig()
    sm = StepTimeModel.for_model("qwen2.5-7b", "h200", tp=1)
    alloc = _SlowToMap(8192 // 16, lag_s)

    stats = ServingModel(cfg, sm, pool_pages=8192 // 16, allocator=alloc).run(wl, QuietHooks())
    assert stats.completed + stats.rejected == stats.requests == len(wl)
    assert stats.stall_steps == ()
    assert len(alloc.admitted) == stats.completed  # each waited out its lag
    for rid, at in alloc.admitted.items():
        arrival = wl.requests[rid].arrival_s
        assert at >= arrival + lag_s - 1e-9, (rid, at, arrival)
    assert alloc.unprepared == []


def test_a_request_that_times_out_while_its_memory_maps_gives_it_back() -> None:
    from kvvmm.workload.serving import ServingModel, StepTimeModel

    wl = Workload((Request(0.0, 100, 5),), "one request")
    alloc = _SlowToMap(64, lag_s=5.0)

    sm = StepTimeModel.for_model("qwen2.5-7b", "h200", tp=1)
    stats = ServingModel(ServingConfig(max_wait_s=1.0), sm, pool_pages=64,
                         allocator=alloc).run(wl, QuietHooks())
    assert stats.timed_out == 1 and stats.completed == 0
    assert alloc.unprepared == [0]


# -- strategies and invariants ----------------------------------------------------------------


@pytest.mark.parametrize("order", ["lowest", "lifo"])
def test_every_strategy_keeps_used_within_backed_and_conserves_bytes(order: str) -> None:
    cmp = run_workload(small_workload(), STRATEGIES, config=ServingConfig(slot_order=order),
                       record=True, **SMALL)  # type: ignore[arg-type]
    for r in cmp.results:
        assert r.used_over_backed == 0, r.strategy
        assert r.conservation_errors == 0, r.strategy
        assert all(u <= b for u, b in zip(r.timeline.used_bytes, r.timeline.backed_bytes,
                                          strict=True)), r.strategy
        assert r.serving.completed + r.serving.rejected == r.serving.requests
        snap = r.final_snapshot
        assert snap is not None and snap.backed_bytes + snap.unbacked_bytes == r.reserved_bytes
        assert r.trace is not None
        assert replay(r.trace, SimDriver("h200")) == [], r.strategy
        (got,) = replay_arenas(r.trace)
        assert got.mappings == snap.mappings and got.allocations == snap.allocations


@pytest.mark.parametrize("name", ["prefix+shrink", "page-elastic", "page-elastic+pool"])
def test_the_same_seed_gives_the_same_results(name: str) -> None:
    a, b = (run_workload(small_workload(seed=5), [name], **SMALL)  # type: ignore[arg-type]
            for _ in range(2))
    ra, rb = a.results[0], b.results[0]
    assert ra.timeline == rb.timeline and ra.serving == rb.serving
    assert ra.summary() | {"wall_s": 0} == rb.summary() | {"wall_s": 0}


def test_page_elastic_backs_exactly_the_granules_in_use_and_less_than_prefix_growth() -> None:
    cmp = run_workload(small_workload(), ["prefix", "page-elastic"], record=True,
                       **SMALL)  # type: ignore[arg-type]
    prefix, elastic = cmp.results
    # lowest-free-first: a page is never shared across a granule edge here, so what the
    # strategy backs is what the runner's arithmetic says page-elastic needs at best
    assert elastic.timeline.backed_bytes == elastic.timeline.elastic_bytes
    assert elastic.mean_backed_bytes < prefix.mean_backed_bytes
    assert elastic.decode_driver_calls > prefix.decode_driver_calls
    assert elastic.peak_pool_bytes == 0
    assert elastic.trace is not None
    assert {op.op for op in elastic.trace.ops} >= {"commit_range", "decommit_range"}


def test_the_pool_turns_decommit_then_commit_into_maps_and_shows_what_it_holds() -> None:
    cmp = run_workload(small_workload(), ["page-elastic", "page-elastic+pool"], record=True,
                       **SMALL)  # type: ignore[arg-type]
    bare, pooled = cmp.results
    assert pooled.timeline.backed_bytes == bare.timeline.backed_bytes  # the same backing
    assert pooled.trace is not None and bare.trace is not None
    creates = [sum(e.op == "create" for e in r.trace.events) for r in (bare, pooled)]
    assert creates[1] < creates[0]
    assert pooled.decode_driver_s < bare.decode_driver_s
    assert max(pooled.timeline.pool_held_bytes) == pooled.peak_pool_bytes > 0
    cap = 4 * (2 << 20) * 56  # the default: 4 granules per buffer
    assert pooled.peak_pool_bytes <= cap


def test_page_elastic_arguments_are_checked() -> None:
    with pytest.raises(ArgumentError, match="retain_bytes"):
        PageElastic(retain_bytes=-1, pool=True)
    with pytest.raises(ArgumentError, match="retain_bytes"):
        PageElastic(retain_bytes=2 << 20)  # a cap without a pool
    assert PageElastic(pool=True).name == "page-elastic+pool"


def test_a_shrink_waits_for_the_pool_to_stay_low_for_hold_s_seconds() -> None:
    # A burst, then a large request every 2 s (the pool empties between them), then a quiet
    # spell and one small request: without a hold every gap gives the tail back and the next
    # request regrows it; with a 5 s hold only the quiet spell does.
    wl = Workload((*generate(seed=2, duration_s=10.0, rate_scale=3).requests,
                   *(Request(200.0 + 2 * i, 3000, 5) for i in range(10)),
                   Request(260.0, 100, 5)), "a burst, a large request every 2 s, a small one")
    churn, held = (run_workload(wl, [PrefixGrowth(shrink=True, hold_s=h)],  # type: ignore[arg-type]
                                **SMALL).results[0] for h in (0.0, 5.0))
    assert held.decode_driver_calls < churn.decode_driver_calls
    assert held.timeline.backed_bytes[-1] < max(held.timeline.backed_bytes)  # it still shrinks
    with pytest.raises(ArgumentError, match="hold_s"):
        PrefixGrowth(shrink=True, hold_s=-1)


def test_static_backs_everything_and_prefix_growth_backs_less() -> None:
    cmp = run_workload(generate(seed=1, duration_s=10.0), ["static", "prefix"],
                       model="llama-3.1-70b", gpu="h200", tp=8)
    static, prefix = cmp.results
    assert static.peak_backed_bytes >= 100 * 2**30
    assert prefix.peak_backed_bytes < static.peak_backed_bytes / 10
    assert static.decode_driver_s == 0.0 and prefix.stalled_steps >= 1


def test_prefix_growth_with_shrink_gives_memory_back_when_the_pool_empties() -> None:
    wl = Workload((*generate(seed=2, duration_s=10.0, rate_scale=3).requests,
                   Request(200.0, 100, 5)), "a burst, then one small request")
    cmp = run_workload(wl, ["prefix", "prefix+shrink"], **SMALL)  # type: ignore[arg-type]
    grow, shrink = cmp.results
    assert shrink.timeline.backed_bytes[-1] < grow.timeline.backed_bytes[-1]


def test_a_strategy_written_in_a_few_lines_runs_like_the_shipped_ones() -> None:
    class Exactly(Strategy):
        name = "mine"

        def update(self, allocated: list[int], freed: list[int], high_water: int) -> None:
            if high_water > self.covered_pages:
                self.grow_to(high_water)

    cmp = run_workload(small_workload(), [Exactly(), PrefixGrowth()], **SMALL)  # type: ignore[arg-type]
    mine = cmp.result("mine")
    assert mine.used_over_backed == 0 and mine.serving.completed > 0
    with pytest.raises(ArgumentError, match="strategy"):
        cmp.result("nope")


def test_a_strategy_that_backs_too_little_is_caught() -> None:
    class Lazy(Strategy):
        name = "lazy"

        def update(self, allocated: list[int], freed: list[int], high_water: int) -> None:
            pass

    (r,) = run_workload(small_workload(), [Lazy()], **SMALL).results  # type: ignore[arg-type]
    assert r.used_over_backed > 0


def test_strategies_run_on_the_host_driver_with_real_memory() -> None:
    cmp = run_workload(small_workload(seconds=5.0), ["finalize", "prefix+shrink"], driver="host",
                       touch=True, model="qwen2.5-7b", tp=1, pool_tokens=4096)
    for r in cmp.results:
        assert r.driver == "host" and r.used_over_backed == 0
        assert r.serving.completed + r.serving.rejected == r.serving.requests


def test_unknown_strategies_and_tiny_pools_are_refused() -> None:
    with pytest.raises(ArgumentError, match="strategy"):
        run_workload(small_workload(), ["elastic"], **SMALL)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="pool_tokens"):
        run_workload(small_workload(), ["static"], model="llama-3.1-8b", pool_tokens=16)


def test_the_options_record_refuses_an_unknown_option_and_a_bad_flag_by_name() -> None:
    with pytest.raises(ArgumentError) as e:
        run_workload(small_workload(), ["static"], pool_token=4096)
    assert e.value.name == "option" and e.value.value == "pool_token"
    with pytest.raises(ArgumentError, match="touch"):
        RunOptions(touch=1)  # type: ignore[arg-type]


def test_keywords_change_the_options_record_run_workload_is_given() -> None:
    wl = small_workload(seconds=3.0)
    base = RunOptions(model="qwen2.5-7b", tp=1, pool_tokens=4096)
    a = run_workload(wl, ["prefix"], options=base, pool_tokens=8192).results[0]
    b = run_workload(wl, ["prefix"], model="qwen2.5-7b", tp=1, pool_tokens=8192).results[0]
    assert a.summary() | {"wall_s": 0} == b.summary() | {"wall_s": 0}
    assert a.reserved_bytes > run_workload(wl, ["prefix"], options=base).results[0].reserved_bytes


@needs_trace
def test_ten_minutes_of_the_real_trace_replay_with_every_request_completed() -> None:
    wl = load_azure_csv(TRACE).first(600)
    (r,) = run_workload(wl, ["prefix"]).results
    assert r.serving.completed == len(wl) and r.serving.rejected == 0
    assert r.used_over_backed == 0
    assert json.loads(json.dumps(r.summary()))["strategy"] == "prefix"


# -- the CLI --------------------------------------------------------------------------------


def replay_cli(*argv: str) -> int:
    import argparse

    from kvvmm.cli.replay import add_replay_parser, replay_command

    ap = argparse.ArgumentParser(prog="kvvmm")
    add_replay_parser(ap.add_subparsers(dest="cmd"))
    return replay_command(ap.parse_args(["replay", *argv]))


def test_kvvmm_replay_prints_json_for_scripts(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    save_jsonl(small_workload(seconds=5.0).requests, tmp_path / "w.jsonl")
    assert replay_cli(str(tmp_path / "w.jsonl"), "--model", "qwen2.5-7b", "--tp", "1",
                      "--pool-tokens", "8192", "--strategy", "prefix", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["results"][0]["strategy"] == "prefix" and out["model"] == "qwen2.5-7b"


def test_kvvmm_replay_in_real_time_charges_the_cold_premium_an_engine_would_pay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_jsonl(small_workload(seconds=8.0).requests, tmp_path / "w.jsonl")
    got = {}
    for extra in ((), ("--real-time",)):
        assert replay_cli(str(tmp_path / "w.jsonl"), "--model", "qwen2.5-7b", "--tp", "1",
                          "--pool-tokens", "8192", "--strategy", "request-ranges", "--json",
                          *extra) == 0
        (r,) = json.loads(capsys.readouterr().out)["results"]
        got[extra] = r
    warm, real = got[()], got[("--real-time",)]
    assert real["driver_calls"] == warm["driver_calls"]
    assert real["decode_driver_ms"] > warm["decode_driver_ms"]
    direct = run_workload(small_workload(seconds=8.0), ["request-ranges"], model="qwen2.5-7b",
                          tp=1, pool_tokens=8192, pause_scale=1.0).results[0].summary()
    assert real["decode_driver_ms"] == direct["decode_driver_ms"]


def test_kvvmm_replay_writes_an_html_report(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.html"
    assert replay_cli("generated", "--seconds", "5", "--strategy", "static", "-o", str(out)) == 0
    assert out.stat().st_size > 1000 and "peak backed" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [("missing.csv",), ("generated", "--model", "nope"),
                                  ("generated", "--tp", "3")])
def test_kvvmm_replay_exits_2_with_one_line_on_bad_input(
        argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_cli(*argv, "--seconds", "2", "--json") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvvmm replay: ") and "\n" not in err


# -- figures --------------------------------------------------------------------------------


def test_the_tradeoff_chart_puts_each_strategy_at_its_held_memory_and_decode_driver_time(
        ) -> None:
    from kvvmm.viz.workload import held_over_used, tradeoff_figure, workload_figure

    cmp = run_workload(small_workload(), ["static", "prefix", "page-elastic+pool",
                                          "request-ranges+deferred"])
    fig = tradeoff_figure(cmp)
    assert [t.name for t in fig.data] == [r.strategy for r in cmp.results]
    for t, r in zip(fig.data, cmp.results, strict=True):
        assert t.y[0] == pytest.approx((r.mean_backed_bytes + r.mean_pool_bytes)
                                       / r.mean_used_bytes)
        assert t.y[0] == held_over_used(r)
        ms = r.decode_driver_s * 1e3
        assert t.x[0] == (ms if ms > 0 else 1e-3)  # none: the axis's left edge, hover says 0
        assert t.customdata[0][0] == ms
    assert fig.layout.xaxis.type == "log"
    pooled = cmp.result("page-elastic+pool")
    assert held_over_used(pooled) > pooled.mean_backed_bytes / pooled.mean_used_bytes
    combined = workload_figure(cmp)  # memory over time, stalls and the tradeoff in one figure
    assert {t.name for t in combined.data} >= {t.name for t in fig.data}
    assert len(tradeoff_figure(None).data) == 0 and workload_figure(None).layout.meta


def test_held_over_used_is_infinite_when_nothing_was_used() -> None:
    from kvvmm.viz.workload import held_over_used

    (r,) = run_workload(small_workload(), ["static"]).results
    assert held_over_used(dataclasses.replace(r, mean_used_bytes=0.0)) == float("inf")


def test_stalls_are_reported_as_a_share_of_steps_and_percentiles_over_stalled_steps() -> None:
    from kvvmm.viz.workload import format_workload, stall_figure

    cmp = run_workload(small_workload(), ["page-elastic", "static"])
    el, st = cmp.result("page-elastic"), cmp.result("static")
    stalls = sorted(el.serving.stall_steps)
    assert el.stalled_steps == len(stalls) > 0
    assert el.stalled_share == pytest.approx(len(stalls) / el.serving.steps)
    assert el.stalled_p50_s == stalls[(len(stalls) + 1) // 2 - 1]  # nearest rank
    assert 0 < el.stalled_p50_s <= el.stalled_p99_s <= el.max_stall_s
    assert el.stalled_p99_s >= el.p99_stall_s  # over stalled steps, not over every step
    assert (st.stalled_share, st.stalled_p50_s, st.stalled_p99_s) == (0.0, 0.0, 0.0)
    row = el.summary()
    assert row["stalled_share"] == round(el.stalled_share, 6)
    assert row["stalled_p99_us"] == round(el.stalled_p99_s * 1e6, 3)
    text = format_workload(cmp)
    assert "stalled steps" in text and "p99 if stalled" in text and "p99 step" in text
    assert f"({el.stalled_share:.2%})" in text
    assert stall_figure(cmp).data[0].name.endswith(f"({el.stalled_share:.1%})")


# -- the sim's cold calls between steps -----------------------------------------------------


PAUSE_STRATEGIES = ("prefix", "page-elastic", "request-ranges", "request-ranges+deferred")


def _driver_ms(wl: Workload, name: str, scale: float | None) -> tuple[float, int]:
    (r,) = run_workload(wl, [name], model="qwen2.5-7b", tp=1, pool_tokens=8192,
                        pause_scale=scale).results
    return (r.decode_driver_s + r.background_driver_s) * 1e3, r.driver_calls


@pytest.mark.parametrize("name", PAUSE_STRATEGIES)
def test_the_sims_calls_cost_more_the_more_host_time_passes_between_them(name: str) -> None:
    wl = small_workload(seconds=8.0)
    base, calls = _driver_ms(wl, name, None)
    assert _driver_ms(wl, name, 0.0) == (base, calls)  # no time passes: as without pauses
    got = [_driver_ms(wl, name, s) for s in (1e-3, 1e-2, 0.1, 1.0, 10.0)]
    assert all(c == calls for _, c in got)  # the same calls, only their costs move
    costs = [base] + [ms for ms, _ in got]
    assert costs == sorted(costs), costs
    if name != "prefix":  # its calls come in bursts at startup and growth; the others'
        assert costs[-2] > base  # one per admission or page, which real time makes cold


def test_real_drivers_take_a_pause_scale_and_make_the_same_calls() -> None:
    wl = small_workload(seconds=3.0)
    a, b = (run_workload(wl, ["request-ranges"], model="qwen2.5-7b", tp=1, pool_tokens=4096,
                         driver="host", pause_scale=s).results[0] for s in (None, 1.0))
    assert a.driver_calls == b.driver_calls and a.serving.steps == b.serving.steps


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, "1.0"])
def test_a_bad_pause_scale_is_refused_by_name(bad: object) -> None:
    with pytest.raises(ArgumentError, match="pause_scale"):
        run_workload(small_workload(seconds=1.0), ["prefix"], model="qwen2.5-7b", tp=1,
                     pool_tokens=4096, pause_scale=bad)  # type: ignore[arg-type]

"""The replay's fast paths give the figures the plain ones gave, and report as they go."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from serving_support import QuietHooks

from kvvmm.errors import ArgumentError
from kvvmm.hardware import predicted_bandwidth_tb_s
from kvvmm.hardware.bandwidth import predicted_mix_tb_s
from kvvmm.workload import STRATEGIES, generate, run_workload
from kvvmm.workload import run as run_module
from kvvmm.workload.bands import workload_bands

GOLDEN = Path(__file__).parent / "data" / "replay_golden.json"


def test_every_figure_of_a_replay_and_its_bands_is_what_the_plain_replay_gave() -> None:
    """Recorded from the replay before its fast paths (a snapshot of every mapping at each
    backing change, dict counts, a scan per boundary): every summary figure and every band,
    to the bit, every strategy, real-time cold calls included."""
    want = json.loads(GOLDEN.read_text())
    wl = generate(seed=5, duration_s=8.0, rate_scale=4.0)
    assert len(wl) == want["requests"]
    names = [str(was["strategy"]) for was in want["results"]]
    cmp = run_workload(wl, names, pause_scale=1.0)
    bands = workload_bands(wl, names, mid=cmp, pause_scale=1.0, workers=1)
    assert len(cmp.results) == len(want["results"])
    for row, was in zip(cmp.summary(), want["results"], strict=True):
        r = dict(row)
        r["bands"] = {k: [b.low, b.mid, b.high] for k, b in bands[str(r["strategy"])].items()}
        r = json.loads(json.dumps(r))
        assert {k: r[k] for k in was} == was  # figures added since are checked elsewhere


def test_the_mappings_kept_from_the_driver_calls_are_the_arenas_at_every_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes in the order a snapshot lists them, counts, the pool's idle bytes and the
    bandwidth factor, checked against a snapshot after every account of every strategy."""
    seen = Counter[str]()
    plain = run_module._Hooks.account

    def account(self: run_module._Hooks) -> float:
        cost = plain(self)
        snap = self.owner.arena.snapshot()
        sizes = [m.size_bytes for m in snap.mappings]
        assert self.mappings.mix() == list(Counter(sizes).items())
        assert self.mappings.mapped_bytes == snap.backed_bytes
        assert self.pool_held == snap.pool_bytes
        want = predicted_bandwidth_tb_s(sizes, interleaved=len(self.owner.descs) > 1) \
            / run_module._PLAIN_TB_S if sizes else 1.0
        assert self.kv_bandwidth_factor == want
        seen[self.strategy.name] += 1
        return cost

    monkeypatch.setattr(run_module._Hooks, "account", account)
    cmp = run_workload(generate(seed=2, duration_s=6.0, rate_scale=4.0), list(STRATEGIES),
                       model="qwen2.5-7b", tp=1, pool_tokens=8192)
    assert set(seen) == set(STRATEGIES)
    assert all(r.conservation_errors == 0 for r in cmp.results)
    assert any(r.serving.preemptions for r in cmp.results)  # a pool that filled


@pytest.mark.parametrize("sizes", [[2 << 20], [4096, 2 << 20, 4096, 8 << 20, 2 << 20],
                                   [8 << 20, 4096, 4096, 64 << 20, 8 << 20]])
@pytest.mark.parametrize("interleaved", [False, True])
def test_a_mix_of_handle_counts_predicts_what_the_list_of_sizes_does_to_the_bit(
        sizes: list[int], interleaved: bool) -> None:
    mix = list(Counter(sizes).items())
    assert predicted_mix_tb_s(mix, interleaved=interleaved) == \
        predicted_bandwidth_tb_s(sizes, interleaved=interleaved)
    assert predicted_mix_tb_s([]) == 0.0


@pytest.mark.parametrize("bad", [[(0, 1)], [(4096, 0)], [(4096, -2)], [(4096, 1.5)],
                                 [(True, 1)], [(4096, True)], [("4096", 1)]])
def test_a_mix_with_a_size_or_count_that_is_not_a_positive_int_is_refused(bad: list) -> None:
    with pytest.raises(ArgumentError):
        predicted_mix_tb_s(bad)


def test_a_replay_reports_its_serving_seconds_up_to_every_strategys_span() -> None:
    wl = generate(seed=1, duration_s=20.0, rate_scale=2.0)
    calls: list[tuple[float, float]] = []
    names = ["static", "page-elastic"]
    quiet = run_workload(wl, names)
    cmp = run_workload(wl, names, progress=lambda d, t: calls.append((d, t)))
    span = wl.requests[-1].arrival_s
    assert calls and all(t == pytest.approx(2 * span) for _, t in calls)
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == pytest.approx(2 * span)
    assert span in [pytest.approx(d) for d in done]  # the first strategy's end
    assert [r.summary() | {"wall_s": 0} for r in cmp.results] == \
        [r.summary() | {"wall_s": 0} for r in quiet.results]


def test_bands_report_their_runs_and_give_the_same_bands_in_a_second_process() -> None:
    wl = generate(seed=4, duration_s=6.0, rate_scale=2.0)
    names = ["prefix", "request-ranges+deferred"]
    mid = run_workload(wl, names)
    calls: list[tuple[float, float]] = []
    here = workload_bands(wl, names, mid=mid, workers=1,
                          progress=lambda d, t: calls.append((d, t)))
    span = wl.requests[-1].arrival_s
    assert calls[-1][0] == pytest.approx(calls[-1][1]) == pytest.approx(2 * 2 * span)
    assert workload_bands(wl, names, mid=mid, workers=2) == here


@pytest.mark.parametrize("bad", [0, 3, True, 1.0, "2"])
def test_a_band_worker_count_other_than_1_2_or_none_is_refused(bad: object) -> None:
    with pytest.raises(ArgumentError, match="workers"):
        workload_bands(generate(seed=4, duration_s=1.0), ["static"],
                       workers=bad)  # type: ignore[arg-type]


def test_the_first_token_comes_at_the_end_of_the_prefill_step_and_a_queued_one_waits_too(
        ) -> None:
    from kvvmm.workload import Request, ServingConfig, Workload
    from kvvmm.workload.serving import ServingModel, StepTimeModel

    sm = StepTimeModel(weights_bytes=10**9, kv_bytes_per_token=10**5, hbm_bytes_per_s=10**12,
                       overhead_s=1e-3, prefill_s_per_token=1e-5)
    cfg = ServingConfig(max_running=1)  # the second request queues behind the first
    reqs = (Request(0.0, 100, 3), Request(0.0005, 50, 2))
    stats = ServingModel(cfg, sm, pool_pages=64).run(Workload(reqs, "test"), QuietHooks())
    base, kv, pre = 1e-3 + 1e-3, 1e-7, 1e-5
    step1 = base + kv * 100 + pre * 100  # prefill of 100 tokens, its KV read
    one_done = step1 + (base + kv * 101) + (base + kv * 102)  # 3 tokens: three steps
    step2 = base + kv * 50 + pre * 50
    assert stats.first_token_s == pytest.approx((step1, one_done + step2 - 0.0005))
    assert stats.latency_s == pytest.approx((one_done, one_done + step2 + base + kv * 51
                                             - 0.0005))


def test_put_off_admissions_are_counted_and_their_wait_is_in_the_first_token() -> None:
    from kvvmm.workload.strategies import RequestRanges

    wl = generate(seed=5, duration_s=20.0, rate_scale=3.0)  # no bounded wait: all put off
    cmp = run_workload(wl, ["request-ranges",
                            lambda: RequestRanges(deferred=True, admit_wait_s=0.0)])
    plain, deferred = (r.summary() for r in cmp.results)
    assert plain["admissions_put_off"] == 0
    assert deferred["admissions_put_off"] == cmp.results[1].ranges["deferred_admits"] > 0
    for r in cmp.results:
        s = r.serving
        assert len(s.first_token_s) == s.completed == len(s.latency_s)  # all were served
        assert min(s.first_token_s) > 0 and min(s.latency_s) >= min(s.first_token_s)
        row = r.summary()
        assert 0 < row["first_token_p50_ms"] <= row["first_token_p99_ms"] \
            <= row["first_token_max_ms"]
        assert row["latency_p50_s"] <= row["latency_p99_s"]


def test_a_strategy_with_no_call_after_its_start_gets_the_band_a_full_run_would_give(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its p10 and p90 come from its start alone (a run of no requests), the rest from
    serving again: the same bands, to the bit, as serving every strategy at each quantile."""
    from kvvmm.workload import bands as bands_module
    from kvvmm.workload.bands import Band

    wl = generate(seed=5, duration_s=8.0, rate_scale=4.0)
    names = ["static", "finalize", "page-elastic"]
    cmp = run_workload(wl, names)
    started = bands_module._startup_only(cmp, names)
    assert started == ["static", "finalize"]  # page-elastic maps pages as they come
    served: list[tuple[int, list[str]]] = []
    flat_run = bands_module._flat_run

    def spy(workload, names, *a, **kw):  # type: ignore[no-untyped-def]
        served.append((len(workload), list(names)))
        return flat_run(workload, names, *a, **kw)

    monkeypatch.setattr(bands_module, "_flat_run", spy)
    got = workload_bands(wl, names, mid=cmp, workers=1, level=False)
    assert sorted(served) == [(0, started), (0, started), (len(wl), ["page-elastic"]),
                              (len(wl), ["page-elastic"])]
    lo, hi = (flat_run(wl, names, "h200", q, {}) for q in (0.1, 0.9))
    mid = bands_module._flat(cmp)
    for key, m in mid.items():
        strategy, fig = key.split("|", 1)
        assert got[strategy][fig] == Band.of(lo[key], m, hi[key]), key


def test_a_run_priced_at_the_band_quantiles_gives_the_same_figures_and_bands_a_rerun_gives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``band_prices``: the point figures unchanged; the bands of a strategy with no call
    after its start and of the prefix ones to the bit; page-elastic's within a percent or
    two (the same calls at each quantile: a re-run's stalls move the boundaries a little);
    only the range strategy (a backing thread) is served again."""
    from kvvmm.workload import bands as bands_module

    wl = generate(seed=5, duration_s=8.0, rate_scale=4.0)
    names = ["static", "prefix", "page-elastic", "request-ranges+deferred"]
    plain = run_workload(wl, names)
    priced = run_workload(wl, names, band_prices=True)
    assert [r.summary() | {"wall_s": 0} for r in priced.results] == \
        [r.summary() | {"wall_s": 0} for r in plain.results]
    assert [bool(r.band_times) for r in priced.results] == [True, True, True, False]
    rerun = workload_bands(wl, names, mid=plain, workers=1)
    served: list[list[str]] = []
    flat_run = bands_module._flat_run

    def spy(workload, names, *a, **kw):  # type: ignore[no-untyped-def]
        served.append(list(names))
        return flat_run(workload, names, *a, **kw)

    monkeypatch.setattr(bands_module, "_flat_run", spy)
    one = workload_bands(wl, names, mid=priced, workers=1)
    assert served == [["request-ranges+deferred"]] * 2
    for name in ("static", "prefix", "request-ranges+deferred"):
        assert one[name] == rerun[name], name
    for fig, band in rerun["page-elastic"].items():
        got = one["page-elastic"][fig]
        assert got.mid == band.mid
        assert got.low == pytest.approx(band.low, rel=0.02), fig
        assert got.high == pytest.approx(band.high, rel=0.02), fig


def test_bands_with_no_run_given_price_the_run_they_make() -> None:
    wl = generate(seed=4, duration_s=6.0, rate_scale=2.0)
    names = ["prefix", "page-elastic"]
    assert workload_bands(wl, names, workers=1) == \
        workload_bands(wl, names, mid=run_workload(wl, names, band_prices=True), workers=1)


def test_quantile_prices_wrap_only_the_sim() -> None:
    from kvvmm.driver.host import HostDriver
    from kvvmm.workload.bands import QuantilePrices

    with pytest.raises(ArgumentError, match="SimDriver"):
        QuantilePrices(HostDriver())

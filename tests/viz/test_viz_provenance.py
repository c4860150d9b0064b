"""Every chart and table of a prediction names whose call costs it uses (issue 48 item 3),
and the trade-off puts memory held against first-token delay beside decode stall (item 4)."""

from __future__ import annotations

import pytest

import kvvmm
from kvvmm.arena import Arena
from kvvmm.driver import SimDriver
from kvvmm.errors import ArgumentError
from kvvmm.growth import decode_growth
from kvvmm.hardware import provenance_label
from kvvmm.units import MiB
from kvvmm.viz import describe_stats, format_growth, growth_figure, timeline
from kvvmm.viz.bands import add_decode_bands
from kvvmm.viz.workload import (
    first_token_figure,
    stall_figure,
    tradeoff_figure,
    workload_figure,
    workload_report,
)
from kvvmm.workload import WorkloadComparison, generate, run_workload
from kvvmm.workload.bands import Band

B200 = "costs: h200, measured on an H200; capacity: b200"  # borrows the H200's costs
H100 = "costs: h100, measured on an H100; capacity: h100"  # its own, measured on an H100
H200 = "costs: h200, measured on an H200; capacity: h200"


@pytest.fixture(scope="module")
def cmp_b200() -> WorkloadComparison:
    return run_workload(generate(seed=0, duration_s=10.0), ["prefix", "request-ranges+deferred"],
                        model="llama-3.1-8b", tp=1, gpu="b200")


def _title(fig: object) -> str:
    return str(fig.layout.title.text)  # type: ignore[attr-defined]


def test_every_workload_figure_and_the_report_name_the_borrowed_costs(
        cmp_b200: WorkloadComparison) -> None:
    assert provenance_label("b200") == B200
    for fig in (stall_figure(cmp_b200), first_token_figure(cmp_b200), tradeoff_figure(cmp_b200),
                tradeoff_figure(cmp_b200, against="first-token"),
                workload_figure(cmp_b200)):
        assert B200 in _title(fig) and fig.layout.meta["costs"] == f"simulated with {B200}"
    assert f"simulated with {B200}" in workload_report(cmp_b200).lead
    assert B200 in workload_report(cmp_b200).html()


def test_a_figure_keeps_its_costs_line_under_a_title_set_later(
        cmp_b200: WorkloadComparison) -> None:
    fig = workload_figure(cmp_b200)
    fig.update_layout(title_text=f"kvvmm replay: x<br>{fig.layout.title.text}")  # as replay does
    assert B200 in _title(fig)


def test_the_first_token_panel_puts_each_strategy_at_its_p99_first_token(
        cmp_b200: WorkloadComparison) -> None:
    fig = tradeoff_figure(cmp_b200, against="first-token")
    assert fig.layout.xaxis.type == "log" and fig.layout.meta["against"] == "first-token"
    for t in fig.data:
        r = cmp_b200.result(t.name)
        p99 = r.wait_summary()["first_token_p99_ms"]
        assert p99 > 0 and t.x[0] == pytest.approx(p99)
        assert f"{r.wait_summary()['admissions_put_off']:,} admissions put off" in t.hovertext[0]
    boxes = first_token_figure(cmp_b200).data
    assert [len(b.y) for b in boxes] == [r.serving.completed for r in cmp_b200.results]


def test_decode_bands_go_on_the_decode_panel_only(cmp_b200: WorkloadComparison) -> None:
    band = {"decode_driver_ms": Band(1.0, 2.0, 3.0)}
    fig = add_decode_bands(workload_figure(cmp_b200), cmp_b200,
                           {r.strategy: band for r in cmp_b200.results})
    points = [t for t in fig.data if getattr(t, "mode", None) == "markers+text"]
    assert {t.meta["trade"] for t in points if t.error_x.array is not None} == {"decode"}
    assert any(t.meta["trade"] == "first-token" for t in points)


def test_the_trade_off_refuses_an_unknown_axis(cmp_b200: WorkloadComparison) -> None:
    with pytest.raises(ArgumentError, match="against"):
        tradeoff_figure(cmp_b200, against="latency")


def test_the_report_has_a_table_of_what_requests_waited(cmp_b200: WorkloadComparison) -> None:
    rep = workload_report(cmp_b200)
    waits = next(t for t in rep.tables if t.title.startswith("what requests waited"))
    assert waits.header[:6] == ("strategy", "first token p50", "p99", "max", "added p99 / max",
                                "put off")
    for row, r in zip(waits.rows, cmp_b200.results, strict=True):
        w = r.wait_summary()
        assert row[0] == r.strategy and row[5] == f"{w['admissions_put_off']:,}"
        assert row[4].startswith(f"{w['first_token_added_p99_ms']:,.1f} / ")
        assert row[2] == f"{w['first_token_p99_ms']:,.1f} ms"


def test_simulated_timelines_growth_and_stats_name_the_profile_and_its_costs() -> None:
    for key, label in (("b200", B200), ("h100", H100)):
        drv = kvvmm.TracingDriver(SimDriver(key))
        arena = Arena(drv, reserve_bytes=64 * MiB)
        arena.commit(arena.allocate(32 * MiB), 8 * MiB)
        assert label in _title(timeline(drv.trace))  # from the profile the trace recorded
        assert label in describe_stats(drv.stats(), profile=key)
    results = decode_growth([kvvmm.Exact()], profile="h200", model="llama-3.1-8b",
                            tokens=4096, step_tokens=1024)
    assert H200 in format_growth(results, profile="h200")
    assert H200 in _title(growth_figure(results, profile="h200"))

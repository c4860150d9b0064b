"""kvvmm.lab panels, driven without a browser: clicks and trait assignments, as a user would.

Each test sets widget values and clicks buttons through the ipywidgets API, then checks the
arena, the figure's data and the error area (ipywidgets' own tests work the same way).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import ipywidgets as widgets
import plotly.graph_objects as go

import kvvmm
from kvvmm.driver import Fault, FaultyDriver, SimDriver
from kvvmm.growth import decode_growth, growth_cost
from kvvmm.lab import ArenaLab, BudgetLab, GrowthLab, LayoutExplorer, WorkloadLab
from kvvmm.policy import default_policy
from kvvmm.snapshot import OwnerSnapshot
from kvvmm.units import MiB
from kvvmm.viz import VA_MAP_TRACES, format_growth


def _backed_bars(lab: Any) -> list[tuple[int, int]]:
    """(offset, size) in bytes of the figure's backed bars."""
    fig = lab.figure
    unit = fig.layout.meta["unit_bytes"]
    bars = fig.data[0]
    return [(round(b * unit), round(x * unit)) for b, x in zip(bars.base, bars.x, strict=True)]


def _reserve(lab: ArenaLab, mib: int = 64) -> None:
    lab.reserve_mib.value = mib
    lab.reserve_button.click()
    assert lab.error_text == ""


# -- ArenaLab ----------------------------------------------------------------------------


def test_reserve_allocate_commit_change_the_arena_and_the_figure() -> None:
    lab = ArenaLab()
    _reserve(lab)
    assert lab.arena is not None and lab.arena.reserved_bytes == 64 * MiB
    lab.alloc_mib.value = 10
    lab.alloc_name.value = "kv"
    lab.allocate_button.click()
    assert lab.target.value == "kv" and lab.commit_mib.max == 10
    lab.commit_mib.value = 6
    lab.commit_button.click()
    assert lab.error_text == ""
    snap = lab.arena.snapshot()
    assert snap.allocation("kv").backed_bytes == 6 * MiB
    assert _backed_bars(lab) == [(0, 6 * MiB)]
    assert tuple(t.name for t in lab.figure.data) == VA_MAP_TRACES
    assert "backed   6.0 MiB in 1 handle " in lab.summary.value
    assert "create(size=6.0 MiB)" in lab.log_text()


def test_decommit_gives_back_whole_mappings_and_the_figure_follows() -> None:
    lab = ArenaLab()
    _reserve(lab)
    lab.allocate_button.click()  # 16 MiB, default name
    for mib in (4, 8):
        lab.commit_mib.value = mib
        lab.commit_button.click()
    assert _backed_bars(lab) == [(0, 4 * MiB), (4 * MiB, 4 * MiB)]
    lab.commit_mib.value = 2
    lab.decommit_button.click()  # keeps the first handle: it straddles 2 MiB
    assert lab.error_text == ""
    assert _backed_bars(lab) == [(0, 4 * MiB)]


def test_bad_reserve_size_shows_an_error_and_changes_nothing() -> None:
    lab = ArenaLab()
    lab.reserve_mib.value = -5
    lab.reserve_button.click()
    assert "reserve_bytes=" in lab.error_text and "must be" in lab.error_text
    assert "reserve_bytes" in lab.error.value
    assert lab.arena is None and lab.snapshot() is None
    assert len(lab.figure.data[0].x) == 0


def test_allocating_past_the_reservation_shows_an_error_and_changes_nothing() -> None:
    lab = ArenaLab()
    _reserve(lab, 32)
    before = lab.arena.snapshot()  # type: ignore[union-attr]
    figure_before = lab.figure.to_json()
    lab.alloc_mib.value = 1000
    lab.allocate_button.click()
    assert lab.error_text.startswith("ReservationExhaustedError")
    assert lab.arena.snapshot() == before  # type: ignore[union-attr]
    assert lab.figure.to_json() == figure_before
    lab.alloc_mib.value = 8
    lab.allocate_button.click()
    assert lab.error_text == "" and lab.error.value == ""  # a success clears the error


def test_reserving_twice_asks_to_close_first() -> None:
    lab = ArenaLab()
    _reserve(lab)
    arena = lab.arena
    lab.reserve_button.click()
    assert "Close" in lab.error_text and lab.arena is arena
    assert isinstance(lab.last_error, kvvmm.StateError)  # a kvvmm error, still a RuntimeError
    assert lab.error_text == "StateError: an arena is open: press Close before reserving another"


def test_a_driver_or_profile_the_lab_does_not_offer_is_an_argument_error_naming_the_choices(
) -> None:
    with pytest.raises(kvvmm.ArgumentError, match=r"^driver='cpu' is invalid: must be one of "
                                                  r"\["):
        ArenaLab("cpu")
    with pytest.raises(kvvmm.ArgumentError, match=r"^profile='h900' is invalid: must be one of "
                                                  r"\['b200', "):
        ArenaLab(profile="h900")


def test_decode_growth_refuses_a_step_below_one_token_with_an_argument_error() -> None:
    with pytest.raises(kvvmm.ArgumentError,
                       match=r"^step_tokens=0 is invalid: must be an int >= 1$"):
        decode_growth([default_policy()], layers=1, tokens=1024, step_tokens=0)
    with pytest.raises(kvvmm.ArgumentError,
                       match=r"^layers=True is invalid: must be an int >= 1 or None$"):
        decode_growth([default_policy()], layers=True, tokens=1024, step_tokens=256)


def test_reserve_kv_then_finalize_backs_each_buffers_final_span() -> None:
    lab = ArenaLab(layers=2, reserved_tokens=8192)
    lab.reserve_kv_button.click()
    assert lab.owner is not None and lab.tokens.max == 8192
    lab.tokens.value = 4096
    lab.finalize_button.click()
    assert lab.error_text == ""
    snap = lab.snapshot()
    assert isinstance(snap, OwnerSnapshot) and snap.final_tokens == 4096
    final = {t.name: t for t in lab.figure.data}["final"]
    unit = lab.figure.layout.meta["unit_bytes"]
    assert [round(x * unit) for x in final.x] == [b.offset + (b.final_bytes or 0)
                                                  for b in snap.buffers]
    assert len(_backed_bars(lab)) == snap.handles


def test_finalize_below_one_page_shows_an_error_and_changes_nothing() -> None:
    lab = ArenaLab(layers=2, reserved_tokens=8192)
    lab.reserve_kv_button.click()
    before = lab.snapshot()
    lab.tokens.value = 8
    lab.finalize_button.click()
    assert lab.error_text == "ArgumentError: n=8 is invalid: must be >= page_size (16)"
    assert lab.snapshot() == before


def test_ensure_prefix_and_shrink_follow_the_token_slider() -> None:
    lab = ArenaLab(layers=1, reserved_tokens=65536)
    lab.policy.value = kvvmm.Exact()
    lab.reserve_kv_button.click()
    lab.tokens.value = 8192
    lab.prefix_button.click()
    assert lab.owner is not None and lab.owner.backed_bytes == 2 * 16 * MiB
    lab.tokens.value = 1024  # keeps 2 MiB + 32 KiB: the [2, 16) MiB handle straddles it
    lab.shrink_button.click()
    assert lab.error_text == "" and lab.owner.backed_bytes == 2 * 16 * MiB
    lab.tokens.value = 512  # keeps 1 MiB + 32 KiB: the second handle goes
    lab.shrink_button.click()
    assert lab.error_text == "" and lab.owner.backed_bytes == 2 * 2 * MiB


def test_owner_buttons_without_kv_buffers_say_what_to_press() -> None:
    lab = ArenaLab()
    _reserve(lab)
    lab.finalize_button.click()
    assert "Reserve KV" in lab.error_text and isinstance(lab.last_error, kvvmm.StateError)


def test_close_gives_everything_back_and_keeps_the_last_map() -> None:
    lab = ArenaLab(layers=2, reserved_tokens=4096)
    lab.reserve_kv_button.click()
    drv = lab.driver_object
    assert drv is not None
    lab.close_button.click()
    assert lab.error_text == "" and lab.owner is None
    assert drv.stats().clean
    snap = lab.snapshot()
    assert snap is not None and (snap.arena if isinstance(snap, OwnerSnapshot) else snap).closed
    lab.reserve_kv_button.click()  # a fresh one after close
    assert lab.error_text == "" and lab.owner is not None


def test_a_failing_driver_call_shows_in_the_panel_and_changes_nothing() -> None:
    faulty = FaultyDriver(SimDriver("h200"))
    lab = ArenaLab(driver=faulty, layers=2, reserved_tokens=8192)
    assert lab.driver.disabled and lab.driver.value == "sim"
    lab.reserve_kv_button.click()
    before = lab.snapshot()
    bars = _backed_bars(lab)
    faulty.arm(Fault(call="set_access", nth=2, error="CUDA_ERROR_UNKNOWN"))
    lab.tokens.value = 4096
    lab.finalize_button.click()
    assert lab.error_text.startswith("DriverError: set_access(")
    assert "CUDA_ERROR_UNKNOWN" in lab.error.value
    assert lab.snapshot() == before and _backed_bars(lab) == bars
    assert "FAILED CUDA_ERROR_UNKNOWN" in lab.log.value  # the failed call and its undo
    faulty.disarm()
    lab.finalize_button.click()
    assert lab.error_text == ""


def test_an_unavailable_driver_shows_an_error_and_changes_nothing() -> None:
    lab = ArenaLab()
    lab.driver.value = "cuda"
    lab.reserve_button.click()
    if lab.error_text == "":  # a machine with a GPU: it simply worked
        lab.close_button.click()
        return
    assert "DriverUnavailableError" in lab.error_text and lab.arena is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the host driver is Linux-only")
def test_the_arena_lab_works_on_the_host_driver() -> None:
    lab = ArenaLab(driver="host", layers=1, reserved_tokens=2048)
    lab.reserve_kv_button.click()
    assert lab.error_text == ""
    lab.tokens.value = 1024
    lab.finalize_button.click()
    assert lab.error_text == "" and lab.owner is not None
    assert lab.owner.arena.driver.kind == "host"
    lab.close_button.click()
    assert lab.error_text == ""


def test_a_panel_is_a_widget_with_a_mimebundle() -> None:
    lab = ArenaLab()
    assert isinstance(lab.widget, widgets.VBox)
    bundle = lab._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_the_map_is_a_plotly_bundle_in_an_output_widget_with_no_widget_model_of_its_own() -> None:
    # A FigureWidget (an anywidget) left blank panels when its model was slow to reach
    # the page; the figure travels in the Output's own trait instead.
    lab = ArenaLab()
    assert isinstance(lab.plot, widgets.Output) and isinstance(lab.figure, go.Figure)
    _reserve(lab)
    lab.allocate_button.click()
    lab.commit_mib.value = 4
    lab.commit_button.click()
    assert _backed_bars(lab) == [(0, 4 * MiB)]
    (out,) = lab.plot.outputs
    spec = out["data"]["application/vnd.plotly.v1+json"]
    assert [t["name"] for t in spec["data"]] == list(VA_MAP_TRACES)
    assert spec["layout"]["title"]["text"] == lab.figure.layout.title.text
    assert spec["config"] == {"responsive": True} and "width" not in spec["layout"]


# -- LayoutExplorer ----------------------------------------------------------------------


def test_the_layout_explorer_plans_on_construction_and_on_every_change() -> None:
    ex = LayoutExplorer(model="llama-3.1-8b", gpu="h200")
    assert ex.error_text == "" and ex.plan.tokens > 0
    assert "64 buffers of shape" in ex.text and "VA to reserve" in ex.text
    tokens_tp1 = ex.plan.tokens
    ex.tp.value = 2
    assert ex.error_text == "" and ex.plan.tp == 2 and ex.plan.tokens > tokens_tp1
    assert ex.figure.layout.meta["kvvmm"] == "va_map"
    assert len(ex.figure.layout.meta["rows"]) == 64  # one per buffer, however drawn


def test_the_layout_explorer_shows_bad_input_and_keeps_the_last_plan() -> None:
    ex = LayoutExplorer()
    p, text = ex.plan, ex.report.value
    ex.tp.value = 3
    assert "tp=3" in ex.error_text and ex.plan is p and ex.report.value == text
    ex.page_size.value = 0
    assert "page_size" in ex.error_text and ex.plan is p
    ex.page_size.value = 16
    ex.tp.value = 1
    assert ex.error_text == "" and ex.plan is not p


def test_a_refused_change_marks_the_layout_explorers_plan_stale() -> None:
    # An error over a plan of other inputs must say the plan is stale.
    ex = LayoutExplorer()
    assert not ex.stale and ex.error.value == ""
    ex.tp.value = 3
    assert ex.stale and "stale: the last change failed: " in ex.error.value
    ex.tp.value = 1
    assert not ex.stale and ex.error.value == ""


def test_the_arena_labs_errors_are_never_stale_because_nothing_changed() -> None:
    lab = ArenaLab(layers=1, reserved_tokens=4096)
    lab.reserve_kv_button.click()
    lab.tokens.value = 8
    lab.finalize_button.click()
    assert lab.last_error is not None and not lab.stale and "stale" not in lab.error.value


def test_the_arena_lab_shows_the_chosen_policys_over_commit() -> None:
    lab = ArenaLab(layers=2, reserved_tokens=8192)
    assert str(default_policy()) in lab.policy_cost.value
    assert "over-commit (backed - needed): at worst" in lab.policy_cost.value
    lab.policy.value = kvvmm.Exact()
    assert "Exact() on 4 buffers" in lab.policy_cost.value
    lab.layers.value = 0  # refused by the layout: the readout says why, nothing raises
    assert "layers" in lab.policy_cost.value


def test_panels_lay_controls_out_to_wrap_and_figures_to_fill_the_cell() -> None:
    # At 1280 px LayoutExplorer's driver dropdown was off-screen.
    for panel in (ArenaLab(), LayoutExplorer(), GrowthLab()):
        rows = [c for c in panel.widget.children if isinstance(c, widgets.Box)
                and c.layout.flex_flow == "row wrap"]
        assert rows, type(panel).__name__
        assert panel.figure.layout.width is None and panel.figure.layout.autosize


def test_no_panel_holds_an_anywidget_or_a_figurewidget() -> None:
    # Every widget is one of ipywidgets' own (no anywidget model to wait for), whether or
    # not anywidget is installed.
    for panel in (ArenaLab(), LayoutExplorer(), GrowthLab(), BudgetLab(), WorkloadLab()):
        try:
            stack = [panel.widget]
            while stack:
                w = stack.pop()
                assert type(w).__module__.startswith("ipywidgets."), (type(panel).__name__, w)
                stack.extend(getattr(w, "children", ()))
        finally:
            getattr(panel, "close", lambda: None)()


def test_the_layout_explorer_takes_an_explicit_budget() -> None:
    ex = LayoutExplorer(model="qwen2.5-7b")
    ex.budget_gib.value = 10.0
    assert ex.error_text == "" and ex.plan.budget_bytes == 10 * 1024 * MiB
    ex.budget_gib.value = -1.0
    assert "budget" in ex.error_text and ex.plan.budget_bytes == 10 * 1024 * MiB
    assert ex.error_text == "ArgumentError: budget GiB=-1.0 is invalid: must be >= 0 (0: automatic)"


def test_the_layout_explorer_previews_a_hybrid_models_full_pool() -> None:
    ex = LayoutExplorer(model="gpt-oss-120b", tp=2)  # its weights fit an H200 from TP 2
    assert ex.error_text == "" and len(ex.plan.pools) == 2
    assert "full pool buffers" in ex.text


# -- GrowthLab ---------------------------------------------------------------------------


def test_decode_growth_counts_handles_and_calls_per_policy() -> None:
    results = decode_growth([kvvmm.Exact(), kvvmm.Chunked(64 * MiB)], layers=2,
                            tokens=8192, step_tokens=512)
    exact, chunked = results
    # 4 buffers, 2 KiB per token: 16 MiB each at the end; Exact: 2 MiB handles.
    assert exact.handles == 4 * 8 and exact.driver_calls == 3 * 4 * 7
    assert exact.backed_bytes == exact.needed_bytes == 4 * 16 * MiB
    # Chunked: one extension from the slot-0 page to the whole 18 MiB allocation.
    assert chunked.handles == 4 * 2 and chunked.max_handle_bytes == 16 * MiB
    assert chunked.backed_bytes == 4 * 18 * MiB
    assert exact.predicted_tb_s < chunked.predicted_tb_s
    assert exact.tokens[-1] == 8192 and len(exact.backed_by_step) == 16
    text = format_growth(results)
    assert text.splitlines()[0].startswith("4 buffers grown to 8,192 tokens in 16 steps on sim")
    assert "Exact()" in text and "Chunked(64.0 MiB)" in text


def test_the_growth_lab_runs_the_default_and_three_policies_and_draws_them() -> None:
    lab = GrowthLab(layers=1, tokens=4096, step_tokens=256)
    assert lab.run() and lab.error_text == ""
    default = str(default_policy())
    assert [r.policy for r in lab.results] == [default, "Exact()", "Chunked(64.0 MiB)",
                                               "Geometric(2, 256.0 MiB)"]
    names = [t.name for t in lab.figure.data]
    assert names[:5] == ["needed", default, "Exact()", "Chunked(64.0 MiB)",
                         "Geometric(2, 256.0 MiB)"]
    assert "Exact()" in lab.table.value


def test_the_growth_lab_shows_progress_and_disables_run_while_it_runs() -> None:
    # A 70B run took ~15 s with no sign of life.
    lab = GrowthLab(layers=1, tokens=4096, step_tokens=256)
    seen: list[tuple[bool, int, str]] = []
    lab.progress.observe(lambda ch: seen.append(
        (lab.run_button.disabled, ch["new"], lab.progress.layout.visibility)), names="value")
    assert lab.run()
    steps = 4096 // 256
    assert seen and all(disabled and vis == "visible" for disabled, _, vis in seen), seen
    assert seen[-1][1] == lab.progress.max == 4 * steps
    assert not lab.run_button.disabled and lab.progress.layout.visibility == "hidden"
    lab.step_tokens.value = 0
    assert not lab.run() and not lab.run_button.disabled  # re-enabled after a failure too


def test_the_growth_lab_shows_each_policys_over_commit_next_to_it() -> None:
    # The default's cost, where the policy is chosen, before any Run.
    lab = GrowthLab(layers=4, tokens=32768, step_tokens=256)
    assert "at worst" in lab.default_cost.value  # whatever the default is now
    assert "at worst 12.0 MiB" in lab.exact_cost.value
    lab.chunk_mib.value = 0  # refused: its own line says so, the others stand
    assert "min_bytes=0" in lab.chunked_cost.value and "at worst" in lab.exact_cost.value
    lab.chunk_mib.value = 16
    assert lab.run()
    costs = lab.cost_texts()
    for r, text in zip(lab.results, costs, strict=True):
        from kvvmm.units import fmt_bytes
        assert f"at worst {fmt_bytes(r.max_over_commit_bytes)} while growing" in text, (r, text)


def test_a_failed_run_marks_the_growth_labs_results_stale() -> None:
    lab = GrowthLab(layers=1, tokens=4096)
    lab.chunk_mib.value = 0
    assert not lab.run() and not lab.stale  # nothing shown yet: only the error
    assert not lab.error.value.count("stale")
    lab.chunk_mib.value = 64
    assert lab.run() and not lab.stale and lab.error.value == ""
    lab.chunk_mib.value = 0
    assert not lab.run() and lab.stale
    assert "stale: the last change failed: ArgumentError: min_bytes=0" in lab.error.value


def test_the_growth_lab_shows_bad_input_and_keeps_its_results() -> None:
    lab = GrowthLab(layers=1, tokens=4096)
    lab.run_button.click()
    results = lab.results
    lab.chunk_mib.value = 0
    lab.run_button.click()
    assert "min_bytes=0" in lab.error_text and lab.results is results
    lab.chunk_mib.value = 64
    lab.geo_factor.value = 0.5
    assert not lab.run() and "factor" in lab.error_text
    lab.geo_factor.value = 2.0
    lab.step_tokens.value = 0
    assert not lab.run() and "step_tokens" in lab.error_text and lab.results is results


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the host driver is Linux-only")
def test_the_growth_lab_works_on_the_host_driver() -> None:
    lab = GrowthLab(driver="host", layers=1, tokens=2048, step_tokens=512)
    assert lab.run(), lab.error_text
    assert all(r.driver == "host" and r.sim_us == 0 for r in lab.results)


def test_decode_growth_counts_the_driver_calls_a_trace_would_record() -> None:
    # The count comes from the handles added (no TracingDriver: it cost a third of a run).
    traced: list[kvvmm.TracingDriver] = []

    def factory() -> kvvmm.Driver:
        traced.append(kvvmm.TracingDriver(SimDriver("h200")))
        return traced[-1]

    policies = [kvvmm.Exact(), kvvmm.Chunked(8 * MiB), kvvmm.Geometric(2.0, 64 * MiB)]
    results = decode_growth(policies, driver=factory, layers=2, tokens=8192, step_tokens=512)
    for r, drv in zip(results, traced, strict=True):
        ops = [e.op for e in drv.trace.driver_calls()]
        slot0 = 3 * len(r.handle_bytes) - r.driver_calls  # construction's create/map/access
        grown = ops[slot0:slot0 + r.driver_calls]
        assert len(grown) == r.driver_calls and set(grown) == {"create", "map", "set_access"}


def test_growth_cost_predicts_what_decode_growth_measures_on_a_real_owner() -> None:
    from kvvmm.layout.model_buffers import full_pool_descs

    descs = full_pool_descs("llama-3.1-8b", layout="token_major", reserved_tokens=16384,
                            page_size=16, dtype="bfloat16", tp=1)[:8]
    policies = [default_policy(), kvvmm.Exact(), kvvmm.Geometric(2.0, 256 * MiB)]
    measured = decode_growth(policies, layers=4, tokens=16384, step_tokens=256)
    for policy, r in zip(policies, measured, strict=True):
        c = growth_cost(policy, descs, page_size=16, itemsize=2, tokens=16384,
                        granularity_bytes=2 * MiB, step_tokens=256)
        assert (c.backed_bytes, c.needed_bytes, c.max_over_commit_bytes) == (
            r.backed_bytes, r.needed_bytes, r.max_over_commit_bytes), policy


def test_the_workload_lab_runs_a_trace_file_it_is_given_and_the_generator_without(
        tmp_path: Path) -> None:
    # WorkloadLab could take a trace file and nothing said so.
    from kvvmm.lab import WorkloadLab
    from kvvmm.workload import generate, save_jsonl

    trace = tmp_path / "t.jsonl"
    save_jsonl(generate(seed=5, duration_s=8.0).requests, trace)
    lab = WorkloadLab(seconds=8.0, strategies=("static", "prefix"), trace=str(trace))
    assert lab.source.value == str(trace)
    assert lab.run(), lab.error_text
    assert lab.comparison is not None and str(trace) in lab.comparison.setup.workload
    lab.source.value = ""
    assert lab.run() and lab.comparison is not None
    assert "generat" in lab.comparison.setup.workload


def test_the_workload_labs_real_time_box_charges_the_cold_premium_an_engine_would_pay() -> None:
    from kvvmm.lab import WorkloadLab
    from kvvmm.workload import run_workload

    lab = WorkloadLab(seconds=6.0, strategies=("request-ranges",))
    assert lab.real_time.value is False
    assert lab.run(), lab.error_text
    assert lab.comparison is not None
    warm = lab.comparison.results[0]
    warm_band = lab.bands["request-ranges"]["decode_driver_ms"]
    assert "calls as warm as back to back" in lab.table.value
    lab.real_time.value = True
    assert lab.run(), lab.error_text
    real = lab.comparison.results[0]
    assert "calls in real time" in lab.table.value  # the report says which it ran
    assert real.driver_calls == warm.driver_calls
    assert real.decode_driver_s > warm.decode_driver_s
    direct = run_workload(lab.workload(), ["request-ranges"], model=lab.model.value,
                          gpu=lab.gpu.value, tp=lab.tp.value, pause_scale=1.0).results[0]
    assert real.decode_driver_s == direct.decode_driver_s
    band = lab.bands["request-ranges"]["decode_driver_ms"]  # the bands are made alike
    assert band.low > warm_band.low and band.high > warm_band.high

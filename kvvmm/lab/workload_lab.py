"""WorkloadLab: memory strategies side by side on a serving workload (a trace or generated)."""

from __future__ import annotations

from collections.abc import Callable

import ipywidgets as widgets

from kvvmm.driver import PROFILES
from kvvmm.lab._panel import _controls, _field, _Panel, _pre, _profile_age, _run_controls, _running
from kvvmm.layout import list_models
from kvvmm.viz.bands import add_decode_bands, format_workload_bands
from kvvmm.viz.workload import workload_figure, workload_report
from kvvmm.workload import (
    SLOT_ORDERS,
    STRATEGIES,
    RunOptions,
    ServingConfig,
    Workload,
    WorkloadComparison,
    generate,
    load_workload,
    run_workload,
)
from kvvmm.workload.bands import Band, band_notes, workload_bands

__all__ = ["WorkloadLab"]


class WorkloadLab(_Panel):
    """Memory strategies side by side on one workload (:func:`~kvvmm.workload.run_workload`).

    Pick the model, GPU profile and TP, the workload (the generator fitted to Azure's
    conversation trace, with a seed and a traffic scale, or a trace file: Azure CSV or
    JSONL), how many seconds of it, the slot order, and the strategies; press **Run**. Each
    strategy drives a fresh owner on the sim driver; the table gives peak and mean backed
    bytes, waste, stalls and driver calls, the figure memory over time and step stalls.
    Every timed figure carries its band (:mod:`kvvmm.workload.bands`: the sim at the
    profile's p10 and p90 costs): a second table, and error bars on the decode driver time
    in the memory-against-stall panel; a line says how old the profile is and how to
    refresh it on a GPU.

    The **trace** field takes a file's path (an Azure CSV such as Azure's conversation
    trace, or JSONL; :func:`~kvvmm.workload.find_trace` finds the copy next to a checkout);
    left empty, the generator runs. Either way the first ``seconds`` of it run.

    Args:
        model, gpu, tp, seconds, strategies: initial control values.
        trace: the trace field's initial value ("": the generator).
    """

    _stale_on_error = True

    def __init__(self, *, model: str = "llama-3.1-70b", gpu: str = "h200", tp: int = 8,
                 seconds: float = 120.0,
                 strategies: tuple[str, ...] = ("static", "prefix", "prefix+shrink"),
                 trace: str = "") -> None:
        self.model = widgets.Dropdown(options=list_models(), value=model, description="model",
                                      **_field())
        self.gpu = widgets.Dropdown(options=sorted(PROFILES), value=gpu, description="GPU",
                                    **_field())
        self.tp = widgets.IntText(value=tp, description="TP", **_field("110px"))
        self.source = widgets.Text(value=trace, placeholder="generator (or a .csv/.jsonl path)",
                                   description="trace", **_field("340px"))
        self.seed = widgets.IntText(value=0, description="seed", **_field("120px"))
        self.rate = widgets.FloatText(value=1.0, description="traffic x", **_field("150px"))
        self.seconds = widgets.FloatText(value=seconds, description="seconds",
                                         **_field("160px"))
        self.order = widgets.Dropdown(options=list(SLOT_ORDERS), value="lowest",
                                      description="slots", **_field())
        self.strategies = widgets.SelectMultiple(options=list(STRATEGIES), value=strategies,
                                                 description="strategies", rows=4)
        #: on: the sim charges each call the cold premium an engine serving the trace as it
        #: came would pay (``run_workload(pause_scale=1.0)``); off: as warm as back to back
        self.real_time = widgets.Checkbox(value=False, description="calls in real time",
                                          indent=False, **_field("150px"))
        #: the progress bar: the replay's serving seconds, over each stage of a run
        self.run_button, self.progress = _run_controls()
        self.stage = widgets.HTML(value="")
        self.table = widgets.HTML(value=_pre("press Run"))
        self.comparison: WorkloadComparison | None = None
        #: per strategy, each timed figure's band (:func:`~kvvmm.workload.bands.workload_bands`)
        self.bands: dict[str, dict[str, Band]] = {}
        self.profile_age = _profile_age(self.gpu)
        super().__init__(workload_figure(None))
        self.run_button.on_click(lambda _: self.run())
        self.widget = widgets.VBox([
            _controls(self.model, self.gpu, self.tp),
            self.profile_age,
            _controls(self.source, self.seed, self.rate, self.seconds),
            _controls(self.order, self.strategies, self.real_time, self.run_button,
                      self.progress, self.stage),
            self.error, self.table, self.plot,
        ], layout={"width": "100%"})
        self._add_dom_classes("workload-lab")

    def workload(self) -> Workload:
        """The workload the controls describe (the first ``seconds`` of it)."""
        path = self.source.value.strip()
        if path:
            return load_workload(path).first(self.seconds.value)
        return generate(seed=self.seed.value, duration_s=self.seconds.value,
                        rate_scale=self.rate.value)

    def run(self) -> bool:
        """Run every chosen strategy; True if it worked (else the error shows)."""
        try:
            with _running(self.run_button, self.progress):
                return self._run(self._run_all)
        finally:
            self.stage.value = ""

    def _reporter(self, stage: str) -> Callable[[float, float], None]:
        """A progress callback for one stage of a run (the strategies, then their bands)."""
        self.stage.value = stage
        self.progress.value = 0

        def report(done: float, total: float) -> None:
            # At most ~100 updates a stage: each is a comm message to the page.
            value = int(100 * done / total) if total > 0 else 100
            if value != self.progress.value:
                self.progress.max, self.progress.value = 100, value

        return report

    def _run_all(self) -> None:
        wl, names = self.workload(), list(self.strategies.value)
        opts = RunOptions(model=self.model.value, gpu=self.gpu.value, tp=self.tp.value,
                          config=ServingConfig(slot_order=self.order.value),
                          pause_scale=1.0 if self.real_time.value else None,
                          band_prices=True)  # the bands priced in this pass (sim calls)
        cmp = run_workload(wl, names, options=opts, progress=self._reporter("strategies"))
        bands = workload_bands(wl, names, gpu=self.gpu.value, mid=cmp, options=opts,
                               progress=self._reporter("bands (p10, p90)"))
        self.comparison, self.bands = cmp, bands
        # HTML tables, one per kind of figure, each fitting the cell's width.
        self.table.value = (workload_report(cmp).html()
                            + _pre(format_workload_bands(bands, band_notes(self.gpu.value))))
        self._show(add_decode_bands(workload_figure(cmp), cmp, bands))

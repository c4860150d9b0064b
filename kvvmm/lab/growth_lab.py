"""GrowthLab: growth policies side by side on a decode-growth workload."""

from __future__ import annotations

import os
from collections.abc import Callable

import ipywidgets as widgets

from kvvmm.driver import DRIVER_KINDS, PROFILES, get_profile
from kvvmm.dtypes import dtype_itemsize
from kvvmm.growth import GrowthResult, decode_growth, growth_cost
from kvvmm.hardware import profile_label
from kvvmm.lab._panel import (
    DTYPES,
    _controls,
    _cost_line,
    _draw,
    _field,
    _line,
    _Panel,
    _plot_output,
    _pre,
    _profile_age,
    _run_controls,
    _running,
)
from kvvmm.layout import list_models
from kvvmm.layout.model_buffers import full_pool_descs
from kvvmm.policy import Chunked, Exact, Geometric, GrowthPolicy, default_policy
from kvvmm.units import MiB
from kvvmm.viz import growth_figure, growth_report
from kvvmm.viz.bands import format_growth_bands, growth_band_figure
from kvvmm.workload.bands import Band, band_notes, growth_bands

__all__ = ["GrowthLab"]


class GrowthLab(_Panel):
    """Growth policies side by side on a decode-growth workload (:func:`decode_growth`).

    Press **Run**: each policy (the owner's default, ``Exact()``, ``Chunked(chunk MiB)``,
    ``Geometric(factor, max MiB)``) grows a fresh owner on the chosen driver, with a
    progress bar while it runs. Next to each policy, its over-commit (backed - needed) on
    this workload, worked out as the controls change (:func:`~kvvmm.growth.growth_cost`).
    The table shows handles, driver calls, over-commit and the copy bandwidth predicted
    from the handle sizes (``kvvmm.hardware.predicted_ratio``: the H200 curve fitted to the
    owner's measured growth runs, with their band), whether each policy keeps the 0.99x
    target, and which one keeps it with the least over-commit; the figure shows backed bytes
    per step against what the tokens need, and the predicted bandwidth against the target
    line.
    Both name the profile the sim's driver times come from (card, date). On a GPU the same
    growth also runs on the sim with that profile, and both show the measured driver time
    next to the predicted one (:attr:`predicted`).
    Every simulated time carries its band (:mod:`kvvmm.workload.bands`: the sim at the
    profile's p10 and p90 costs), in a table under the first and a figure with error bars
    under the main one; a line says how old the profile is and how to refresh it on a GPU.
    A run that fails leaves the last results showing, marked stale.

    Args:
        driver, profile, model, layers, tokens, step_tokens: initial control values
            (``layers=0`` means all the model's layers). ``profile`` is a shipped key or
            the path of a calibrated profile (``kvvmm calibrate --out``), which joins the
            choices.
    """

    _stale_on_error = True

    def __init__(self, driver: str = "sim", profile: str = "h200", *,
                 model: str = "llama-3.1-8b", layers: int = 4, tokens: int = 32768,
                 step_tokens: int = 256) -> None:
        self.driver = widgets.Dropdown(options=list(DRIVER_KINDS), value=driver,
                                       description="driver", **_field())
        choices = [(k, k) for k in sorted(PROFILES)]
        if profile not in PROFILES:  # a calibrated profile's path: shown by its file name
            choices.append((os.path.basename(profile), profile))
            get_profile(profile)  # refused here, not at the first Run
        self.profile = widgets.Dropdown(options=choices, value=profile,
                                        description="profile", **_field())
        self.model = widgets.Dropdown(options=list_models(), value=model, description="model",
                                      **_field())
        self.layers = widgets.IntText(value=layers, description="layers (0: all)",
                                      **_field("160px"))
        self.dtype = widgets.Dropdown(options=list(DTYPES), value="bfloat16",
                                      description="dtype", **_field())
        self.page_size = widgets.IntText(value=16, description="page", **_field("120px"))
        self.tokens = widgets.IntText(value=tokens, description="tokens", **_field("170px"))
        self.step_tokens = widgets.IntText(value=step_tokens, description="step tokens",
                                           **_field("160px"))
        self.chunk_mib = widgets.IntText(value=64, description="Chunked MiB",
                                         **_field("170px"))
        self.geo_factor = widgets.FloatText(value=2.0, description="Geometric factor",
                                            **_field("190px"))
        self.geo_max_mib = widgets.IntText(value=256, description="max MiB",
                                           **_field("150px"))
        # One "over-commit" readout per policy, next to the control that sets it.
        self.default_cost = widgets.HTML(value="")
        self.exact_cost = widgets.HTML(value="")
        self.chunked_cost = widgets.HTML(value="")
        self.geometric_cost = widgets.HTML(value="")
        self.run_button, self.progress = _run_controls()
        self.table = widgets.HTML(value=_pre("press Run"))
        self.results: list[GrowthResult] = []
        #: Each policy's simulated growth time as a band (the sim's results, or on a GPU the
        #: prediction's), in the order of :attr:`results`.
        self.bands: list[Band] = []
        self.profile_age = _profile_age(self.profile)
        #: The figure of :attr:`bands`, drawn in :attr:`band_plot`.
        self.band_figure = growth_band_figure([], [])
        self.band_plot = _plot_output()
        _draw(self.band_plot, self.band_figure)
        #: On a GPU: the same growth on the sim with the chosen profile (else None).
        self.predicted: list[GrowthResult] | None = None
        super().__init__(growth_figure([]))
        self.run_button.on_click(lambda _: self.run())
        for c in (self.model, self.layers, self.dtype, self.page_size, self.tokens,
                  self.step_tokens, self.chunk_mib, self.geo_factor, self.geo_max_mib,
                  self.profile):
            c.observe(lambda _: self._show_costs(), names="value")
        label = widgets.HTML
        self.widget = widgets.VBox([
            _controls(self.driver, self.profile, self.model, self.layers),
            self.profile_age,
            _controls(self.dtype, self.page_size, self.tokens, self.step_tokens),
            _controls(label(_pre(f"default {default_policy()}")), self.default_cost),
            _controls(label(_pre("Exact()")), self.exact_cost),
            _controls(self.chunk_mib, self.chunked_cost),
            _controls(self.geo_factor, self.geo_max_mib, self.geometric_cost),
            _controls(self.run_button, self.progress),
            self.error, self.table, self.plot, self.band_plot,
        ], layout={"width": "100%"})
        self._add_dom_classes("growth-lab")
        self._show_costs()

    def policies(self) -> list[GrowthPolicy]:
        """The owner's default and the three policies as the controls set them.

        Raises:
            ArgumentError: a chunk, factor or cap the policies refuse.
        """
        return [make() for make in self._makers()]

    def _makers(self) -> list[Callable[[], GrowthPolicy]]:
        return [default_policy, Exact, lambda: Chunked(self.chunk_mib.value * MiB),
                lambda: Geometric(self.geo_factor.value, self.geo_max_mib.value * MiB)]

    def run(self) -> bool:
        """Run the workload under each policy; True if it worked (else the error shows)."""
        with _running(self.run_button, self.progress):
            return self._run(self._run_all)

    def _on_progress(self, done: int, total: int) -> None:
        # About 100 updates a run: each is a comm message to the page.
        if done == total or done % max(1, total // 100) == 0:
            self.progress.max, self.progress.value = total, done

    def _layers(self) -> int | None:
        return None if self.layers.value == 0 else self.layers.value

    def _run_all(self) -> None:
        def grow(driver: str, progress: Callable[[int, int], None] | None) -> list[GrowthResult]:
            return decode_growth(
                self.policies(), driver=driver, profile=self.profile.value,
                model=self.model.value, layers=self._layers(), dtype=self.dtype.value,
                page_size=self.page_size.value, tokens=self.tokens.value,
                step_tokens=self.step_tokens.value, progress=progress)

        results = grow(self.driver.value, self._on_progress)
        # Measured next to predicted: on a GPU, the same growth on the sim (cheap: no memory).
        predicted = grow("sim", None) if results and results[0].driver == "cuda" else None
        prof = self.profile.value
        sim = predicted if predicted is not None else (
            results if results and results[0].driver == "sim" else None)
        bands = [] if sim is None else growth_bands(
            self.policies(), profile=prof, mid=sim, model=self.model.value,
            layers=self._layers(), dtype=self.dtype.value, page_size=self.page_size.value,
            tokens=self.tokens.value, step_tokens=self.step_tokens.value)
        self.results, self.predicted, self.bands = results, predicted, bands
        # HTML tables, not a <pre>: they fit the cell's width (kvvmm.viz._common.Table).
        report = growth_report(results, profile=prof, predicted=predicted).html()
        if sim is not None:
            report += _pre(format_growth_bands(sim, bands, band_notes(prof)))
        self.table.value = report
        self._show(growth_figure(results, profile=prof, predicted=predicted))
        self.band_figure = growth_band_figure(sim or [], bands, label=profile_label(prof))
        _draw(self.band_plot, self.band_figure)

    def cost_texts(self) -> list[str]:
        """Each policy's over-commit on the workload the controls describe, one a line.

        A policy whose control holds a refused value gets that error as its line.
        """
        from kvvmm.growth import first_layers  # the buffers decode_growth grows

        try:
            descs = first_layers(full_pool_descs(
                self.model.value, layout="token_major", reserved_tokens=self.tokens.value,
                page_size=self.page_size.value, dtype=self.dtype.value, tp=1),
                self._layers())
            itemsize = dtype_itemsize(self.dtype.value)
        except Exception as e:  # a half-typed workload: every line says why
            return [f"over-commit: - ({type(e).__name__}: {e})"] * len(self._makers())
        out = []
        for make in self._makers():
            try:
                c = growth_cost(make(), descs, page_size=self.page_size.value,
                                itemsize=itemsize, tokens=self.tokens.value,
                                granularity_bytes=get_profile(
                                    self.profile.value).granularity_bytes,
                                step_tokens=self.step_tokens.value)
            except Exception as e:  # this policy's value is refused; the others stand
                out.append(f"over-commit: - ({type(e).__name__}: {e})")
                continue
            out.append(_cost_line(c))
        return out

    def _show_costs(self) -> None:
        outs = (self.default_cost, self.exact_cost, self.chunked_cost, self.geometric_cost)
        for out, text in zip(outs, self.cost_texts(), strict=True):
            out.value = _line(text)  # wraps at the cell's edge instead of being cut


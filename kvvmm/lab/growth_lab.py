"""GrowthLab: growth policies side by side on a decode-growth workload."""

from __future__ import annotations

import ipywidgets as widgets

from kvvmm.driver import PROFILES
from kvvmm.growth import GrowthResult, decode_growth
from kvvmm.lab._panel import DRIVERS, DTYPES, _Panel, _pre
from kvvmm.layout import (
    list_models,
)
from kvvmm.policy import Chunked, Exact, Geometric, GrowthPolicy
from kvvmm.units import MiB
from kvvmm.viz import format_growth, growth_figure

__all__ = ["GrowthLab"]


class GrowthLab(_Panel):
    """Growth policies side by side on a decode-growth workload (:func:`decode_growth`).

    Press **Run**: each policy (``Exact()``, ``Chunked(chunk MiB)``, ``Geometric(factor,
    max MiB)``) grows a fresh owner on the chosen driver. The table shows handles, driver
    calls, over-commit and the copy bandwidth predicted from the handle sizes (the H200
    table, ``kvvmm.viz.H200_BANDWIDTH``); the figure shows backed bytes per step against
    what the tokens need, and the predicted bandwidth.

    Args:
        driver, profile, model, layers, tokens, step_tokens: initial control values
            (``layers=0`` means all the model's layers).
    """

    def __init__(self, driver: str = "sim", profile: str = "h200", *,
                 model: str = "llama-3.1-8b", layers: int = 4, tokens: int = 32768,
                 step_tokens: int = 256) -> None:
        style = {"description_width": "initial"}
        small = widgets.Layout(width="190px")
        self.driver = widgets.Dropdown(options=list(DRIVERS), value=driver,
                                       description="driver", layout=small)
        self.profile = widgets.Dropdown(options=sorted(PROFILES), value=profile,
                                        description="profile", layout=small)
        self.model = widgets.Dropdown(options=list_models(), value=model, description="model",
                                      layout=widgets.Layout(width="260px"))
        self.layers = widgets.IntText(value=layers, description="layers (0: all)",
                                      style=style, layout=small)
        self.dtype = widgets.Dropdown(options=list(DTYPES), value="bfloat16",
                                      description="dtype", layout=small)
        self.page_size = widgets.IntText(value=16, description="page", layout=small)
        self.tokens = widgets.IntText(value=tokens, description="tokens", layout=small)
        self.step_tokens = widgets.IntText(value=step_tokens, description="step tokens",
                                           style=style, layout=small)
        self.chunk_mib = widgets.IntText(value=64, description="Chunked MiB", style=style,
                                         layout=small)
        self.geo_factor = widgets.FloatText(value=2.0, description="Geometric factor",
                                            style=style, layout=small)
        self.geo_max_mib = widgets.IntText(value=256, description="Geometric max MiB",
                                           style=style, layout=widgets.Layout(width="220px"))
        self.run_button = widgets.Button(description="Run", button_style="primary")
        self.table = widgets.HTML(value=_pre("press Run"))
        self.results: list[GrowthResult] = []
        super().__init__(growth_figure([]))
        self.run_button.on_click(lambda _: self.run())
        self.widget = widgets.VBox([
            widgets.HBox([self.driver, self.profile, self.model, self.layers]),
            widgets.HBox([self.dtype, self.page_size, self.tokens, self.step_tokens]),
            widgets.HBox([self.chunk_mib, self.geo_factor, self.geo_max_mib,
                          self.run_button]),
            self.error, self.table, self.plot,
        ])
        self._add_dom_classes("growth-lab")

    def policies(self) -> list[GrowthPolicy]:
        """The three policies as the controls set them (raises on bad values)."""
        return [Exact(), Chunked(self.chunk_mib.value * MiB),
                Geometric(self.geo_factor.value, self.geo_max_mib.value * MiB)]

    def run(self) -> bool:
        """Run the workload under each policy; True if it worked (else the error shows)."""
        return self._run(self._run_all)

    def _run_all(self) -> None:
        layers = self.layers.value
        results = decode_growth(
            self.policies(), driver=self.driver.value, profile=self.profile.value,
            model=self.model.value, layers=None if layers == 0 else layers,
            dtype=self.dtype.value, page_size=self.page_size.value, tokens=self.tokens.value,
            step_tokens=self.step_tokens.value)
        self.results = results
        self.table.value = _pre(format_growth(results))
        self._show(growth_figure(results))

"""LayoutExplorer: a model's KV cache planned on a GPU, and its finalized layout's VA map."""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from kvvmm.checks import number_arg
from kvvmm.driver import DRIVER_KINDS, PROFILES
from kvvmm.dtypes import dtype_itemsize
from kvvmm.lab._panel import (
    DTYPES,
    _controls,
    _empty_snapshot,
    _field,
    _open,
    _Panel,
    _pre,
)
from kvvmm.layout import (
    LAYOUTS,
    list_models,
)
from kvvmm.layout.model_buffers import full_pool_descs
from kvvmm.owner import KvBufferOwner
from kvvmm.units import GiB
from kvvmm.viz import describe_descs, va_map

__all__ = ["LayoutExplorer"]


class LayoutExplorer(_Panel):
    """Plan a model's KV cache on a GPU and see its layout.

    A change that fails (a TP that does not split the heads) leaves the last plan showing,
    with the error above it saying that plan is stale.

    Changing any control re-plans with :func:`kvvmm.plan.plan` (budget: the explicit
    ``budget GiB``, or the device's capacity less 4 GiB of headroom when it is 0) and shows
    the plan's report, the buffers, and the VA map of the full-attention pool built on the
    chosen driver. On ``sim`` (a simulator of the chosen GPU) the map is finalized at the
    planned capacity; on ``host`` or ``cuda`` it only reserves the VA and backs slot 0,
    because finalizing would back the whole budget.

    Args:
        model, gpu, dtype, page_size, tp, layout, driver: initial control values.
    """

    _stale_on_error = True

    def __init__(self, model: str = "llama-3.1-8b", gpu: str = "h200", *,
                 dtype: str = "bfloat16", page_size: int = 16, tp: int = 1,
                 layout: str = "token_major", driver: str = "sim") -> None:
        self.model = widgets.Dropdown(options=list_models(), value=model, description="model",
                                      **_field())
        self.layout = widgets.Dropdown(options=list(LAYOUTS), value=layout,
                                       description="layout", **_field())
        self.dtype = widgets.Dropdown(options=list(DTYPES), value=dtype, description="dtype",
                                      **_field())
        self.page_size = widgets.IntText(value=page_size, description="page",
                                         **_field("120px"))
        self.tp = widgets.IntText(value=tp, description="TP", **_field("110px"))
        self.gpu = widgets.Dropdown(options=sorted(PROFILES), value=gpu, description="GPU",
                                    **_field())
        self.budget_gib = widgets.FloatText(value=0.0, description="budget GiB (0: auto)",
                                            **_field("230px"))
        self.reserved_tokens = widgets.IntText(value=0,
                                               description="reserved tokens (0: planned)",
                                               **_field("270px"))
        self.driver = widgets.Dropdown(options=list(DRIVER_KINDS), value=driver,
                                       description="driver", **_field())
        self.report = widgets.HTML(value="")
        self.plan: Any = None
        self.text = ""
        super().__init__(va_map(_empty_snapshot(gpu)))
        self._controls = [self.model, self.layout, self.dtype, self.page_size, self.tp,
                          self.gpu, self.budget_gib, self.reserved_tokens, self.driver]
        for c in self._controls:
            c.observe(lambda _: self.update(), names="value")
        self.widget = widgets.VBox([
            _controls(self.model, self.gpu, self.dtype, self.layout, self.driver),
            _controls(self.page_size, self.tp, self.budget_gib, self.reserved_tokens),
            self.error, self.report, self.plot,
        ], layout={"width": "100%"})
        self._add_dom_classes("layout-explorer")
        self.update()

    def update(self) -> bool:
        """Re-plan from the controls; True if it worked (else the error shows)."""
        return self._run(self._update)

    def _update(self) -> None:
        from kvvmm.layout import PlanOptions, plan
        from kvvmm.viz import format_plan

        budget = number_arg("budget GiB", self.budget_gib.value, lo=0,
                            limit=">= 0 (0: automatic)")
        o = PlanOptions(dtype=self.dtype.value, page_size=self.page_size.value, tp=self.tp.value,
                        layout=self.layout.value, budget_bytes=int(budget * GiB) or None,
                        reserved_tokens=self.reserved_tokens.value or None)
        p = plan(gpu=self.gpu.value, model=self.model.value, options=o)
        full = p.pools[0]
        descs = full_pool_descs(self.model.value, layout=o.layout, page_size=o.page_size,
                                reserved_tokens=full.reserved_tokens, dtype=o.dtype, tp=o.tp)
        kind = self.driver.value
        drv = _open(kind, self.gpu.value)
        owner = KvBufferOwner(driver=drv, dtype=o.dtype, page_size=o.page_size,
                              reserved_tokens=full.reserved_tokens, descs=descs,
                              name=f"{self.model.value} ({full.name} pool)")
        try:
            if kind == "sim":
                owner.finalize(full.tokens)
            snap = owner.snapshot()
        finally:
            owner.close()
        itemsize = dtype_itemsize(o.dtype)
        text = "\n".join([
            format_plan(p), "",
            f"{full.name} pool buffers:", describe_descs(descs, itemsize),
        ])
        self.plan, self.text = p, text
        self.report.value = _pre(text)
        self._show(va_map(snap))

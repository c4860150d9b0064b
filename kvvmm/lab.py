"""Widget panels for JupyterLab: thin wiring from ipywidgets controls to the library.

- :class:`ArenaLab`: pick a driver and device profile, reserve an arena (or a KV owner),
  allocate, commit, decommit, ensure a prefix, finalize, shrink, close; the VA map updates
  live and a log lists the driver calls each step made.
- :class:`LayoutExplorer`: model, layout, dtype, page size, TP degree and GPU -> the plan
  (:func:`kvvmm.plan.plan`): buffers, VA to reserve, capacity in tokens, granularity waste,
  and the finalized layout's VA map.
- :class:`GrowthLab`: growth policies side by side on a decode-growth workload
  (:func:`decode_growth`): handles, driver calls, over-commit, predicted bandwidth.

Every panel keeps its controls as attributes (``lab.reserve_button.click()``,
``lab.tokens.value = 512``), its top-level box as ``widget``, and displays itself. Each
action runs in one handler: library errors (bad input, a failed driver call) are shown in
the panel's ``error`` area and change nothing, because the library changes nothing when it
raises. The figure is a plotly ``FigureWidget`` updated inside ``batch_update()`` when
anywidget is installed (plotly needs it for FigureWidget); otherwise a plain figure shown in
an ``Output`` widget, redrawn on each change.
"""

from __future__ import annotations

import copy
import html
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from kvvmm.arena import Arena, ArenaSnapshot
from kvvmm.driver import PROFILES, Driver, open_driver
from kvvmm.layout import (
    LAYOUTS,
    KvBufferDesc,
    dtype_itemsize,
    hybrid_swa_descs,
    list_models,
    load_model,
    mha_token_major,
    model_descs,
)
from kvvmm.owner import KvBufferOwner, OwnerSnapshot
from kvvmm.policy import Chunked, Exact, Geometric, GrowthPolicy, default_policy
from kvvmm.trace import Trace, TracingDriver
from kvvmm.units import GiB, MiB, fmt_bytes
from kvvmm.viz import H200_BANDWIDTH, _table, describe, predicted_bandwidth_tb_s, va_map

__all__ = [
    "ArenaLab",
    "GrowthLab",
    "GrowthResult",
    "LayoutExplorer",
    "decode_growth",
    "format_growth",
]

DRIVERS = ("sim", "host", "cuda")
DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float32")


# -- shared plumbing ---------------------------------------------------------------------


def _open(kind: str, profile: str) -> Driver:
    """A fresh driver: the sim one with the profile, host or cuda as they are."""
    if kind == "sim":
        return open_driver("sim", profile=profile)
    return open_driver(kind)


def _figure_view(fig: go.Figure) -> tuple[Any, Any]:
    """(figure to update, widget to show): a FigureWidget, or a Figure in an Output."""
    try:
        fw = go.FigureWidget(fig)
    except ImportError:  # plotly's FigureWidget needs anywidget
        out = widgets.Output(layout={"min_height": "260px"})
        return go.Figure(fig), out
    return fw, fw


def _sync(target: Any, new: go.Figure) -> None:
    """Make ``target``'s traces and layout those of ``new``, in one batch when possible."""
    same = len(target.data) == len(new.data) and all(
        a.type == b.type for a, b in zip(target.data, new.data, strict=True))
    if not same:
        target.data = ()
        target.add_traces(list(new.data))
    with target.batch_update():
        if same:
            for t, n in zip(target.data, new.data, strict=True):
                props = n.to_plotly_json()
                props.pop("type", None)
                props.pop("uid", None)
                t.update(props, overwrite=True)
        target.layout.update(new.layout.to_plotly_json(), overwrite=True)


def _ipython_display(obj: object) -> None:
    import IPython.display

    show: Any = IPython.display.display  # untyped
    show(obj)


class _Panel:
    """What every panel shares: an error area, the figure, display support."""

    widget: widgets.Widget

    def __init__(self, fig: go.Figure) -> None:
        self.error = widgets.HTML(value="")
        self.last_error: BaseException | None = None
        self.figure, self.plot = _figure_view(fig)
        if isinstance(self.plot, widgets.Output):
            self._show(fig)

    @property
    def error_text(self) -> str:
        """The error shown now, as plain text ("" when the last action succeeded)."""
        if self.last_error is None:
            return ""
        e = self.last_error
        return "\n".join([f"{type(e).__name__}: {e}", *getattr(e, "__notes__", [])])

    def _run(self, action: Callable[[], object]) -> bool:
        """Run one action; show its error in the panel instead of raising. True if it ran."""
        try:
            action()
        except Exception as e:  # a lab shows every failure; the library changed nothing
            self.last_error = e
            self.error.value = (
                '<pre style="color:#c92a2a;white-space:pre-wrap;margin:0">'
                + html.escape(self.error_text) + "</pre>")
            self._after_error()
            return False
        self.last_error = None
        self.error.value = ""
        return True

    def _after_error(self) -> None:
        """Show what a failed action did (its calls and their undo); the state is unchanged."""

    def _show(self, fig: go.Figure) -> None:
        _sync(self.figure, fig)
        if isinstance(self.plot, widgets.Output):
            # Set the Output's outputs trait (synced over the widget's comm) rather than
            # display() into it: a display message goes to whichever cell runs, and would
            # land in that cell's outputs wherever no frontend routes it (nbval, nbclient).
            spec = json.loads(self.figure.to_json())
            spec["config"] = {"responsive": True}
            self.plot.outputs = ({
                "output_type": "display_data", "metadata": {},
                "data": {"application/vnd.plotly.v1+json": spec,
                         "text/plain": f"<plotly figure: {len(self.figure.data)} traces>"},
            },)

    def _add_dom_classes(self, panel: str) -> None:
        """CSS classes as stable hooks for the browser test (tests/test_browser.py).

        The panel's box gets ``kvvmm-<panel>``, each control, the error area and the plot
        ``kvvmm-<attribute>`` (``reserve_kv_button`` -> ``kvvmm-reserve-kv-button``), so a
        test finds them by name rather than by position or label.
        """
        self.widget.add_class(f"kvvmm-{panel}")
        for name, value in vars(self).items():
            if name not in ("widget", "figure") and isinstance(value, widgets.DOMWidget):
                value.add_class(f"kvvmm-{name.replace('_', '-')}")

    def _resend_figure(self) -> None:
        """Send the FigureWidget's whole figure again, for the views about to be made.

        A new view draws what the front end holds in ``_widget_data``, a copy patched by
        every update since the widget was made. ``batch_update()`` over traces with different
        properties leaves ``marker: undefined`` in that copy (plotly's restyle pads the
        traces lacking a property with undefined), and plotly.js then fails to draw: the
        panel showed no figure when it was changed before being displayed (LayoutExplorer
        always is). plotly's own FigureWidget resends both when it is displayed; a panel
        displays its box instead, so it does the same here.
        """
        fw = self.figure
        if hasattr(fw, "_widget_data"):  # a FigureWidget, not the Output fallback's Figure
            fw._widget_layout = copy.deepcopy(fw._layout_obj._props)
            fw._widget_data = copy.deepcopy(fw._data)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        self._resend_figure()
        return self.widget._repr_mimebundle_(**kwargs)

    def display(self) -> None:
        """Show the panel in the notebook (same as leaving it as a cell's last value)."""
        _ipython_display(self)


def _pre(text: str) -> str:
    return f'<pre style="margin:0;font-size:12px">{html.escape(text)}</pre>'


def _policy_options() -> list[tuple[str, GrowthPolicy]]:
    # The owner's default first, so the panel starts where the library does.
    ps: list[GrowthPolicy] = [default_policy(), Chunked(64 * MiB), Exact(),
                              Geometric(2.0, 256 * MiB)]
    return [(str(p), p) for p in ps]


# -- ArenaLab ----------------------------------------------------------------------------


class ArenaLab(_Panel):
    """An arena (or a KV owner) to drive by hand, with its live VA map and driver-call log.

    Two ways in: **Reserve** makes a bare :class:`~kvvmm.arena.Arena` of ``reserve_mib``
    to ``allocate`` / ``commit`` / ``decommit`` by hand; **Reserve KV** makes a
    :class:`~kvvmm.owner.KvBufferOwner` (``layers`` K and V buffers, 8 KV heads of 128,
    bf16) to ``ensure_prefix`` / ``finalize`` / ``shrink`` by tokens. **Close** gives
    everything back. Every driver call goes through a :class:`~kvvmm.trace.TracingDriver`;
    ``trace`` holds them and ``log`` shows the last ones.

    Args:
        driver: ``"sim"``, ``"host"`` or ``"cuda"``, or a driver object to use as it is
            (a :class:`~kvvmm.driver.FaultyDriver`, say); the dropdown is then disabled.
        profile: the sim driver's device profile.
        reserve_mib, layers, reserved_tokens, page_size: initial control values.
    """

    def __init__(self, driver: str | Driver = "sim", profile: str = "h200", *,
                 reserve_mib: int = 64, layers: int = 2, reserved_tokens: int = 4096,
                 page_size: int = 16) -> None:
        self._given: Driver | None = None if isinstance(driver, str) else driver
        kind = driver if isinstance(driver, str) else driver.kind
        if kind not in DRIVERS:
            raise ValueError(f"Unsupported driver: {kind!r} (one of {list(DRIVERS)})")
        if profile not in PROFILES:
            raise ValueError(f"Unsupported profile: {profile!r} (one of {sorted(PROFILES)})")
        self.arena: Arena | None = None
        self.owner: KvBufferOwner | None = None
        self.trace = Trace()
        self._driver: Driver | None = None
        self._last: ArenaSnapshot | OwnerSnapshot | None = None
        style = {"description_width": "initial"}
        small = widgets.Layout(width="170px")
        self.driver = widgets.Dropdown(options=list(DRIVERS), value=kind, description="driver",
                                       disabled=self._given is not None, layout=small)
        self.profile = widgets.Dropdown(options=sorted(PROFILES), value=profile,
                                        description="profile", layout=small)
        # Bare arena.
        self.reserve_mib = widgets.IntText(value=reserve_mib, description="reserve MiB",
                                           style=style, layout=small)
        self.reserve_button = widgets.Button(description="Reserve", button_style="primary")
        self.alloc_mib = widgets.IntText(value=16, description="allocate MiB", style=style,
                                         layout=small)
        self.alloc_name = widgets.Text(value="", placeholder="name (optional)",
                                       layout=widgets.Layout(width="140px"))
        self.allocate_button = widgets.Button(description="Allocate")
        self.target = widgets.Dropdown(options=[], description="allocation", style=style,
                                       layout=widgets.Layout(width="220px"))
        self.commit_mib = widgets.IntSlider(value=0, min=0, max=0, step=2,
                                            description="MiB", continuous_update=False)
        self.commit_button = widgets.Button(description="Commit")
        self.decommit_button = widgets.Button(description="Decommit to")
        # KV owner.
        self.layers = widgets.IntText(value=layers, description="layers", layout=small)
        self.reserved_tokens = widgets.IntText(value=reserved_tokens,
                                               description="reserved tokens", style=style,
                                               layout=widgets.Layout(width="210px"))
        self.page_size = widgets.IntText(value=page_size, description="page", layout=small)
        self.policy = widgets.Dropdown(options=_policy_options(), description="policy",
                                       layout=widgets.Layout(width="260px"))
        self.reserve_kv_button = widgets.Button(description="Reserve KV",
                                                button_style="primary")
        self.tokens = widgets.IntSlider(value=0, min=0, max=reserved_tokens,
                                        description="tokens", continuous_update=False)
        self.prefix_button = widgets.Button(description="Ensure prefix")
        self.finalize_button = widgets.Button(description="Finalize")
        self.shrink_button = widgets.Button(description="Shrink")
        self.close_button = widgets.Button(description="Close", button_style="warning")
        self.summary = widgets.HTML(value=_pre("nothing reserved yet"))
        self.log = widgets.HTML(value=_pre("no driver calls yet"),
                                layout={"max_height": "180px", "overflow": "auto"})
        super().__init__(va_map(_empty_snapshot(profile)))

        self.reserve_button.on_click(lambda _: self._run(self._reserve))
        self.reserve_kv_button.on_click(lambda _: self._run(self._reserve_kv))
        self.allocate_button.on_click(lambda _: self._run(self._allocate))
        self.commit_button.on_click(lambda _: self._run(self._commit))
        self.decommit_button.on_click(lambda _: self._run(self._decommit))
        self.prefix_button.on_click(lambda _: self._run(self._ensure_prefix))
        self.finalize_button.on_click(lambda _: self._run(self._finalize))
        self.shrink_button.on_click(lambda _: self._run(self._shrink))
        self.close_button.on_click(lambda _: self._run(self._close))
        self.target.observe(lambda _: self._fit_commit_slider(), names="value")

        box = widgets.VBox
        row = widgets.HBox
        self.widget = box([
            row([self.driver, self.profile, self.close_button]),
            row([self.reserve_mib, self.reserve_button, self.alloc_mib, self.alloc_name,
                 self.allocate_button]),
            row([self.target, self.commit_mib, self.commit_button, self.decommit_button]),
            row([self.layers, self.reserved_tokens, self.page_size, self.policy,
                 self.reserve_kv_button]),
            row([self.tokens, self.prefix_button, self.finalize_button, self.shrink_button]),
            self.error, self.plot, self.summary, self.log,
        ])
        self._add_dom_classes("arena-lab")

    # -- state -----------------------------------------------------------------------

    def snapshot(self) -> ArenaSnapshot | OwnerSnapshot | None:
        """The owner's or arena's snapshot now (the last one after close), None before."""
        if self.owner is not None:
            return self.owner.snapshot()
        if self.arena is not None:
            return self.arena.snapshot()
        return self._last

    @property
    def driver_object(self) -> Driver | None:
        """The (tracing) driver the current arena runs on."""
        return self._driver

    def log_text(self, last: int = 12) -> str:
        """The last ``last`` driver calls, one a line (simulated cost on the sim driver)."""
        calls = self.trace.driver_calls()
        lines = [f"{len(calls)} driver calls"]
        for e in calls[-last:]:
            args = ", ".join(
                f"{k}={v:#x}" if k == "va" else f"{k}={fmt_bytes(v)}" if k == "size"
                else f"{k}={v}" for k, v in e.args.items())
            res = "" if e.result is None else (
                f" -> {e.result:#x}" if e.op == "reserve" else f" -> {e.result}")
            cost = f"{e.sim_us:.1f} µs sim" if e.sim_us else ""
            err = f"  FAILED {e.error}" if e.error else ""
            lines.append(f"#{e.seq} {e.op}({args}){res}  {cost}{err}".rstrip())
        return "\n".join(lines)

    def _after_error(self) -> None:
        self.log.value = _pre(self.log_text())

    def _refresh(self) -> None:
        snap = self.snapshot()
        names = [] if snap is None else [
            a.name for a in (snap.arena if isinstance(snap, OwnerSnapshot) else snap).allocations]
        current = self.target.value
        self.target.options = names
        if current in names:
            self.target.value = current
        self._fit_commit_slider()
        if self.owner is not None:
            self.tokens.max = self.owner.reserved_tokens
        self.summary.value = _pre("nothing reserved yet" if snap is None else describe(snap))
        self.log.value = _pre(self.log_text())
        self._show(va_map(snap if snap is not None else _empty_snapshot(self.profile.value)))

    def _fit_commit_slider(self) -> None:
        a = self._open_arena(required=False)
        if a is None or self.target.value is None:
            self.commit_mib.max = 0
            return
        snap = a.snapshot()
        alloc = snap.allocation(self.target.value)
        self.commit_mib.step = max(1, snap.granularity // MiB)
        self.commit_mib.max = alloc.size_bytes // MiB
        self.commit_mib.value = min(self.commit_mib.max, -(-alloc.backed_bytes // MiB))

    def _open_arena(self, required: bool = True) -> Arena | None:
        a = self.owner.arena if self.owner is not None else self.arena
        if a is None or a.closed:
            if required:
                raise RuntimeError("no open arena: press Reserve or Reserve KV first")
            return None
        return a

    def _offset(self) -> int:
        a = self._open_arena()
        assert a is not None
        if self.target.value is None:
            raise RuntimeError("no allocation chosen: allocate one first")
        return a.snapshot().allocation(self.target.value).offset

    def _new_driver(self) -> TracingDriver:
        if self._open_arena(required=False) is not None:
            raise RuntimeError("an arena is open: press Close before reserving another")
        inner = self._given if self._given is not None else _open(self.driver.value,
                                                                   self.profile.value)
        return TracingDriver(inner, Trace())

    # -- actions ---------------------------------------------------------------------

    def _reserve(self) -> None:
        drv = self._new_driver()
        arena = Arena(drv, reserve_bytes=self.reserve_mib.value * MiB, name="arena")
        self._driver, self.trace, self.arena, self.owner = drv, drv.trace, arena, None
        self._refresh()

    def _reserve_kv(self) -> None:
        drv = self._new_driver()
        descs = mha_token_major(layers=self.layers.value, kv_heads=8, head_dim=128,
                                reserved_tokens=self.reserved_tokens.value,
                                page_size=self.page_size.value, dtype="bfloat16")
        owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=self.page_size.value,
                              reserved_tokens=self.reserved_tokens.value, descs=descs,
                              policy=self.policy.value)
        self._driver, self.trace, self.owner, self.arena = drv, drv.trace, owner, owner.arena
        self.tokens.max = owner.reserved_tokens
        self._refresh()

    def _allocate(self) -> None:
        a = self._open_arena()
        assert a is not None
        name = self.alloc_name.value.strip() or None
        a.allocate(self.alloc_mib.value * MiB, name)
        self._refresh()
        self.target.value = a.snapshot().allocations[-1].name

    def _commit(self) -> None:
        a = self._open_arena()
        assert a is not None
        a.commit(self._offset(), self.commit_mib.value * MiB)
        self._refresh()

    def _decommit(self) -> None:
        a = self._open_arena()
        assert a is not None
        a.decommit(self._offset(), self.commit_mib.value * MiB)
        self._refresh()

    def _kv(self) -> KvBufferOwner:
        if self.owner is None or self.owner.closed:
            raise RuntimeError("this needs KV buffers: press Reserve KV first")
        return self.owner

    def _ensure_prefix(self) -> None:
        self._kv().ensure_prefix(self.tokens.value)
        self._refresh()

    def _finalize(self) -> None:
        self._kv().finalize(self.tokens.value)
        self._refresh()

    def _shrink(self) -> None:
        self._kv().shrink(self.tokens.value)
        self._refresh()

    def _close(self) -> None:
        if self.owner is not None:
            self.owner.close()
        elif self.arena is not None:
            self.arena.close()
        self._last = self.snapshot()
        self.owner = self.arena = None
        self._refresh()


def _empty_snapshot(profile: str) -> ArenaSnapshot:
    """What the map shows before anything is reserved: an empty 64 MiB reservation."""
    p = PROFILES[profile]
    return ArenaSnapshot(name="(nothing reserved)", driver="-", device_name=p.name,
                         granularity=p.granularity_bytes, base=0, reserved_bytes=64 * MiB,
                         cursor_bytes=0, allocations=(), mappings=(), backed_bytes=0,
                         closed=False)


# -- LayoutExplorer ----------------------------------------------------------------------


def _pool_descs(model: str, *, layout: str, reserved_tokens: int, page_size: int,
                dtype: str, tp: int) -> list[KvBufferDesc]:
    """The full-attention pool's buffers (hybrid sliding-window models: their full pool)."""
    m = load_model(model)
    if m.is_hybrid_swa:
        return hybrid_swa_descs(m, reserved_tokens=reserved_tokens, page_size=page_size,
                                dtype=dtype, tp=tp, layout=layout)[0]
    return model_descs(m, layout=layout, reserved_tokens=reserved_tokens,
                       page_size=page_size, dtype=dtype, tp=tp)


def describe_descs(descs: Sequence[KvBufferDesc], itemsize: int) -> str:
    """One line per distinct buffer shape: how many, shape, bytes per row and per buffer."""
    groups: dict[tuple[tuple[int, ...], int, int], int] = {}
    for d in descs:
        key = (d.shape, d.row_bytes, d.tokens_per_row)
        groups[key] = groups.get(key, 0) + 1
    lines = []
    for (shape, row, per_row), n in groups.items():
        span = itemsize
        for dim in shape:
            span *= dim
        unit = "token" if per_row == 1 else f"{per_row}-token page"
        lines.append(f"{n} buffers of shape {shape}: {fmt_bytes(row)} per {unit}, "
                     f"{fmt_bytes(span)} each")
    return "\n".join(lines)


class LayoutExplorer(_Panel):
    """Plan a model's KV cache on a GPU and see its layout.

    Changing any control re-plans with :func:`kvvmm.plan.plan` (budget: the explicit
    ``budget GiB``, or the device's capacity less 4 GiB of headroom when it is 0) and shows
    the plan's report, the buffers, and the VA map of the full-attention pool built on the
    chosen driver. On ``sim`` (a simulator of the chosen GPU) the map is finalized at the
    planned capacity; on ``host`` or ``cuda`` it only reserves the VA and backs slot 0,
    because finalizing would back the whole budget.

    Args:
        model, gpu, dtype, page_size, tp, layout, driver: initial control values.
    """

    def __init__(self, model: str = "llama-3.1-8b", gpu: str = "h200", *,
                 dtype: str = "bfloat16", page_size: int = 16, tp: int = 1,
                 layout: str = "token_major", driver: str = "sim") -> None:
        style = {"description_width": "initial"}
        small = widgets.Layout(width="190px")
        self.model = widgets.Dropdown(options=list_models(), value=model, description="model",
                                      layout=widgets.Layout(width="260px"))
        self.layout = widgets.Dropdown(options=list(LAYOUTS), value=layout,
                                       description="layout", layout=small)
        self.dtype = widgets.Dropdown(options=list(DTYPES), value=dtype, description="dtype",
                                      layout=small)
        self.page_size = widgets.IntText(value=page_size, description="page", layout=small)
        self.tp = widgets.IntText(value=tp, description="TP", layout=small)
        self.gpu = widgets.Dropdown(options=sorted(PROFILES), value=gpu, description="GPU",
                                    layout=small)
        self.budget_gib = widgets.FloatText(value=0.0, description="budget GiB (0: auto)",
                                            style=style, layout=widgets.Layout(width="220px"))
        self.reserved_tokens = widgets.IntText(value=0,
                                               description="reserved tokens (0: planned)",
                                               style=style, layout=widgets.Layout(width="260px"))
        self.driver = widgets.Dropdown(options=list(DRIVERS), value=driver,
                                       description="driver", layout=small)
        self.report = widgets.HTML(value="")
        self.plan: Any = None
        self.text = ""
        super().__init__(va_map(_empty_snapshot(gpu)))
        self._controls = [self.model, self.layout, self.dtype, self.page_size, self.tp,
                          self.gpu, self.budget_gib, self.reserved_tokens, self.driver]
        for c in self._controls:
            c.observe(lambda _: self.update(), names="value")
        self.widget = widgets.VBox([
            widgets.HBox([self.model, self.gpu, self.dtype, self.layout]),
            widgets.HBox([self.page_size, self.tp, self.budget_gib, self.reserved_tokens,
                          self.driver]),
            self.error, self.report, self.plot,
        ])
        self._add_dom_classes("layout-explorer")
        self.update()

    def update(self) -> bool:
        """Re-plan from the controls; True if it worked (else the error shows)."""
        return self._run(self._update)

    def _update(self) -> None:
        from kvvmm.plan import format_plan, plan

        budget = self.budget_gib.value
        if budget < 0:
            raise ValueError(f"budget GiB={budget!r} is invalid: must be >= 0 (0: automatic)")
        rt = self.reserved_tokens.value
        p = plan(gpu=self.gpu.value, model=self.model.value, dtype=self.dtype.value,
                 page_size=self.page_size.value, tp=self.tp.value, layout=self.layout.value,
                 budget_bytes=int(budget * GiB) if budget else None,
                 reserved_tokens=rt if rt else None)
        full = p.pools[0]
        descs = _pool_descs(self.model.value, layout=self.layout.value,
                            reserved_tokens=full.reserved_tokens, page_size=self.page_size.value,
                            dtype=self.dtype.value, tp=self.tp.value)
        kind = self.driver.value
        drv = _open(kind, self.gpu.value)
        owner = KvBufferOwner(driver=drv, dtype=self.dtype.value, page_size=self.page_size.value,
                              reserved_tokens=full.reserved_tokens, descs=descs,
                              name=f"{self.model.value} ({full.name} pool)")
        try:
            if kind == "sim":
                owner.finalize(full.tokens)
            snap = owner.snapshot()
        finally:
            owner.close()
        itemsize = dtype_itemsize(self.dtype.value)
        text = "\n".join([
            format_plan(p), "",
            f"{full.name} pool buffers:", describe_descs(descs, itemsize),
        ])
        self.plan, self.text = p, text
        self.report.value = _pre(text)
        self._show(va_map(snap))


# -- GrowthLab ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GrowthResult:
    """One growth policy's run of a decode-growth workload on one driver."""

    policy: str  #: ``str(policy)``
    driver: str  #: driver kind the owner ran on
    buffers: int  #: KV buffers that grew together
    handles: int  #: handles backing the buffers at the end (slot-0 pages included)
    driver_calls: int  #: create/map/set_access calls during growth
    min_handle_bytes: int
    max_handle_bytes: int
    handle_bytes: tuple[int, ...]  #: every handle's size at the end, in VA order
    backed_bytes: int  #: backed at the end
    needed_bytes: int  #: what the prefix spans needed at the end
    max_over_commit_bytes: int  #: largest ``backed - needed`` seen after any step
    predicted_tb_s: float  #: copy bandwidth predicted from the handle sizes (H200 table)
    sim_us: float  #: simulated driver time of the growth (0 on real drivers)
    wall_s: float  #: wall time of the growth steps
    tokens: tuple[int, ...]  #: token count after each step
    backed_by_step: tuple[int, ...]  #: backed bytes after each step
    needed_by_step: tuple[int, ...]  #: needed bytes after each step

    @property
    def over_commit_bytes(self) -> int:
        """Backed beyond what the final prefix needs."""
        return self.backed_bytes - self.needed_bytes


def _first_layers(descs: list[KvBufferDesc], layers: int | None) -> list[KvBufferDesc]:
    if layers is None:
        return descs
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers={layers!r} is invalid: must be an int >= 1 or None")
    keep = [d for d in descs if int(re.sub(r"^\D+", "", d.name) or 0) < layers]
    return keep or descs


def decode_growth(
    policies: Sequence[GrowthPolicy],
    *,
    driver: str | Callable[[], Driver] = "sim",
    profile: str = "h200",
    model: str = "llama-3.1-8b",
    layers: int | None = None,
    dtype: str = "bfloat16",
    page_size: int = 16,
    tp: int = 1,
    tokens: int = 32768,
    step_tokens: int = 256,
) -> list[GrowthResult]:
    """Grow a model's KV buffers by decode steps under each policy, on a real owner each.

    For each policy a fresh driver (``driver``: a kind, or a factory returning a driver)
    gets a :class:`~kvvmm.owner.KvBufferOwner` of ``tokens`` reserved tokens, which then
    runs ``ensure_prefix(step_tokens)``, ``ensure_prefix(2 * step_tokens)``, ... up to
    ``tokens``; the owner is closed after. Driver calls are counted through a
    :class:`~kvvmm.trace.TracingDriver`.

    Args:
        policies: growth policies to compare.
        driver: ``"sim"``, ``"host"``, ``"cuda"``, or a zero-argument driver factory.
        profile: sim device profile.
        model: a shipped model key (hybrid models grow their full-attention pool).
        layers: use only the first ``layers`` layers (None: all), to keep runs small.
        dtype, page_size, tp: the layout.
        tokens: tokens to grow to, > 0.
        step_tokens: tokens per decode step, > 0.
    Returns:
        One :class:`GrowthResult` per policy, in order.
    Raises:
        ArgumentError and friends: bad layout arguments; DriverError: a failed driver call.
    """
    if isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or step_tokens < 1:
        raise ValueError(f"step_tokens={step_tokens!r} is invalid: must be an int >= 1")
    descs = _first_layers(_pool_descs(model, layout="token_major", reserved_tokens=tokens,
                                      page_size=page_size, dtype=dtype, tp=tp), layers)
    steps = [*range(step_tokens, tokens, step_tokens), tokens]
    out = []
    for policy in policies:
        inner = driver() if callable(driver) else _open(driver, profile)
        drv = TracingDriver(inner, Trace())
        owner = KvBufferOwner(driver=drv, dtype=dtype, page_size=page_size,
                              reserved_tokens=tokens, descs=descs, policy=policy)
        try:
            before = len(drv.trace.events)
            backed, needed = [], []
            t0 = time.perf_counter()
            for n in steps:
                owner.ensure_prefix(n)
                backed.append(owner.backed_bytes)
                needed.append(sum(d.prefix_span_bytes(n, page_size) for d in descs))
            wall = time.perf_counter() - t0
            snap = owner.snapshot()
            grow = [e for e in drv.trace.events[before:] if not e.op.startswith("arena.")]
        finally:
            owner.close()
        sizes = [m.size_bytes for m in snap.arena.mappings]
        out.append(GrowthResult(
            policy=str(policy), driver=inner.kind, buffers=len(descs), handles=len(sizes),
            driver_calls=len(grow), min_handle_bytes=min(sizes), max_handle_bytes=max(sizes),
            handle_bytes=tuple(sizes),
            backed_bytes=snap.backed_bytes, needed_bytes=needed[-1],
            max_over_commit_bytes=max(b - n for b, n in zip(backed, needed, strict=True)),
            predicted_tb_s=predicted_bandwidth_tb_s(sizes, interleaved=len(descs) > 1),
            sim_us=sum(e.sim_us for e in grow), wall_s=wall, tokens=tuple(steps),
            backed_by_step=tuple(backed), needed_by_step=tuple(needed),
        ))
    return out


def format_growth(results: Sequence[GrowthResult]) -> str:
    """A table of :func:`decode_growth` results (no wall times: the text is deterministic)."""
    ref = H200_BANDWIDTH.reference_tb_s("plain") or 1.0
    rows = [[r.policy, f"{r.handles:,}", f"{r.driver_calls:,}", fmt_bytes(r.min_handle_bytes),
             fmt_bytes(r.max_handle_bytes), fmt_bytes(r.backed_bytes),
             fmt_bytes(r.max_over_commit_bytes), f"{r.predicted_tb_s:.2f}",
             f"{r.predicted_tb_s / ref:.2f}x",
             f"{r.sim_us / 1000:.1f} ms" if r.sim_us else "-"] for r in results]
    head = ["policy", "handles", "calls", "smallest", "largest", "backed", "max over",
            "TB/s", "vs malloc", "driver time"]
    if not results:
        return "no results"
    r0 = results[0]
    lines = [f"{r0.buffers} buffers grown to {r0.tokens[-1]:,} tokens in {len(r0.tokens)} "
             f"steps on {r0.driver}; needed at the end {fmt_bytes(r0.needed_bytes)}"]
    return "\n".join(lines + _table(head, rows))


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
        super().__init__(_growth_figure([]))
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
        self._show(_growth_figure(results))


def _growth_figure(results: Sequence[GrowthResult]) -> go.Figure:
    """Backed vs needed bytes per step (left) and predicted bandwidth (right)."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, column_widths=[0.68, 0.32],
                        subplot_titles=("backed while decoding", "predicted copy bandwidth"))
    if results:
        r0 = results[0]
        fig.add_trace(go.Scatter(name="needed", x=list(r0.tokens),
                                 y=[n / MiB for n in r0.needed_by_step], mode="lines",
                                 line={"color": "#495057", "dash": "dot"}), row=1, col=1)
    for r in results:
        fig.add_trace(go.Scatter(name=r.policy, x=list(r.tokens),
                                 y=[b / MiB for b in r.backed_by_step], mode="lines",
                                 line={"shape": "hv"}), row=1, col=1)
    fig.add_trace(go.Bar(name="TB/s", x=[r.policy for r in results],
                         y=[r.predicted_tb_s for r in results], showlegend=False,
                         text=[f"{r.predicted_tb_s:.2f}" for r in results],
                         marker={"color": "#2f9e44"}), row=1, col=2)
    ref = H200_BANDWIDTH.reference_tb_s("plain")
    if ref is not None:
        fig.add_trace(go.Scatter(name=f"cudaMalloc {ref:.2f} TB/s",
                                 x=[r.policy for r in results] or [""],
                                 y=[ref] * max(1, len(results)), mode="lines",
                                 line={"dash": "dash", "color": "#e8590c"}), row=1, col=2)
    fig.update_xaxes(title_text="tokens", row=1, col=1)
    fig.update_yaxes(title_text="MiB", row=1, col=1)
    fig.update_yaxes(title_text="TB/s (H200 table)", range=[3.0, 4.4], row=1, col=2)
    fig.update_layout(height=380, margin={"l": 10, "r": 10, "t": 50, "b": 40},
                      plot_bgcolor="white", meta={"kvvmm": "growth"})
    return fig

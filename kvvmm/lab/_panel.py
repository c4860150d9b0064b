"""What every panel shares: the figure view, error display, and how a panel shows itself."""

from __future__ import annotations

import copy
import html
import json
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from kvvmm.driver import PROFILES, Driver, driver_for
from kvvmm.growth import GrowthCost
from kvvmm.policy import Chunked, Exact, Geometric, GrowthPolicy, default_policy
from kvvmm.snapshot import ArenaSnapshot
from kvvmm.units import MiB, fmt_bytes

DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float32")


def _open(kind: str, profile: str) -> Driver:
    return driver_for(kind, profile=profile)


def _figure_view(fig: go.Figure) -> tuple[Any, Any]:
    """(figure to update, widget to show): a FigureWidget, or a Figure in an Output."""
    try:
        fw = go.FigureWidget(fig)
    except ImportError:  # plotly's FigureWidget needs anywidget
        out = widgets.Output(layout={"min_height": "260px", "width": "100%"})
        return go.Figure(fig), out
    # plotly.js's responsive mode: each view gets a resize handler (``_FIT_ESM`` calls it).
    fw._config = {**fw._config, "responsive": True}
    return fw, fw


#: The front end of ``_fit_widget``: a ResizeObserver on every plotly graph in its panel.
#:
#: plotly's FigureWidget (an anywidget) draws before its view is in the page, where it
#: measures no width and falls back to plotly's default 700 px; it never measures again (its
#: resize hooks are Lumino messages, which anywidget views do not get). So the figure stayed
#: 700 px wide in a 850-1500 px cell, with ``autosize`` on and no width set. Observing the
#: graph's own box catches every case where it gets its real width: first attached, a cell
#: scrolled into view (JupyterLab skips the layout of off-screen cells), a window or sidebar
#: resize. It then runs plotly.js's responsive handler (``config.responsive``: relayout with
#: ``autosize``, which measures the box; the height the figure sets stays), or, where that
#: is missing, fires the window resize event that handler listens to.
_FIT_ESM = """
const seen = new WeakSet();
function fit(gd) {
  const w = gd.getBoundingClientRect().width;
  const full = gd._fullLayout;
  if (!full || w < 2 || (gd.layout && gd.layout.width) || Math.abs(full.width - w) <= 1) return;
  if (gd._responsiveChartHandler) gd._responsiveChartHandler();
  else window.dispatchEvent(new Event('resize'));
}
export default {
  render({ el }) {
    el.style.display = 'none';
    let stop = false, root = null, frames = 0;
    const sizes = new ResizeObserver((entries) => entries.forEach((e) => fit(e.target)));
    const watch = () => root.querySelectorAll('.js-plotly-plot').forEach((gd) => {
      if (!seen.has(gd)) { seen.add(gd); sizes.observe(gd); }
      fit(gd);
    });
    const added = new MutationObserver(watch);
    const start = () => {  // the view is put into the page after render returns
      if (stop) return;
      root = el.isConnected && el.closest('.kvvmm-panel');
      if (!root) { if (frames++ < 600) requestAnimationFrame(start); return; }
      added.observe(root, { childList: true, subtree: true });
      watch();
    };
    requestAnimationFrame(start);
    return () => { stop = true; sizes.disconnect(); added.disconnect(); };
  },
};
"""


def _fit_widget() -> widgets.Widget | None:
    """An invisible widget that makes its panel's figures fill their cell; None without
    anywidget (the Output fallback's figure is plotly's mime renderer, which resizes)."""
    try:
        import anywidget
    except ImportError:
        return None
    global _FitFigures
    if _FitFigures is None:
        _FitFigures = type("FitFigures", (anywidget.AnyWidget,), {"_esm": _FIT_ESM})
    widget: widgets.Widget = _FitFigures()
    return widget


_FitFigures: Any = None


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


def _show_on(figure: Any, plot: Any, fig: go.Figure) -> None:
    """Show ``fig`` in a (figure, plot) pair of :func:`_figure_view`."""
    # No fixed width: the figure follows its cell (the FigureWidget resizes on resize).
    fig.update_layout(width=None, autosize=True)
    _sync(figure, fig)
    if isinstance(plot, widgets.Output):
        # Set the Output's outputs trait (synced over the widget's comm) rather than
        # display() into it: a display message goes to whichever cell runs, and would
        # land in that cell's outputs wherever no frontend routes it (nbval, nbclient).
        spec = json.loads(figure.to_json())
        spec["config"] = {"responsive": True}
        plot.outputs = ({
            "output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": spec,
                     "text/plain": f"<plotly figure: {len(figure.data)} traces>"},
        },)


class _Panel:
    """What every panel shares: an error area, the figure, display support."""

    widget: widgets.Widget
    #: Whether a failed action leaves a result that no longer matches the controls (a
    #: plan, a growth run): then the error says the result shown is stale. ArenaLab's map
    #: is never stale: a failed call changes nothing, so the map still shows the arena.
    _stale_on_error = False
    #: Figures shown beside the main one (attributes holding a ``_figure_view`` figure),
    #: resent with it before a view is made.
    _extra_figures: tuple[str, ...] = ()

    def __init__(self, fig: go.Figure) -> None:
        self.error = widgets.HTML(value="", layout={"width": "100%"})
        self.last_error: BaseException | None = None
        #: True once an action has put a result on screen: a later failure leaves that
        #: result showing, and the error then says it is stale.
        self._has_result = False
        self.figure, self.plot = _figure_view(fig)
        self._show(fig, result=False)

    @property
    def stale(self) -> bool:
        """True when the last action failed over an earlier result (still shown)."""
        return self._stale_on_error and self.last_error is not None and self._has_result

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
            # Over an earlier result, say that what is shown is not what was asked for.
            lead = "stale: the last change failed: " if self.stale else ""
            self.error.value = (
                '<pre style="color:#c92a2a;white-space:pre-wrap;margin:0">'
                + html.escape(lead + self.error_text) + "</pre>")
            self._after_error()
            return False
        self.last_error = None
        self.error.value = ""
        return True

    def _after_error(self) -> None:
        """Show what a failed action did (its calls and their undo); the state is unchanged."""

    def _show(self, fig: go.Figure, *, result: bool = True) -> None:
        _show_on(self.figure, self.plot, fig)
        self._has_result = self._has_result or result

    def _add_dom_classes(self, panel: str) -> None:
        """CSS classes as stable hooks for the browser test (tests/repo/test_browser.py).

        The panel's box gets ``kvvmm-<panel>``, each control, the error area and the plot
        ``kvvmm-<attribute>`` (``reserve_kv_button`` -> ``kvvmm-reserve-kv-button``), so a
        test finds them by name rather than by position or label. The box also gets
        ``kvvmm-panel`` and, last, the invisible widget that fits its figure to the cell.
        """
        self.widget.add_class(f"kvvmm-{panel}")
        self.widget.add_class("kvvmm-panel")  # where _FIT_ESM looks for figures
        fit = _fit_widget()
        if fit is not None:
            self.widget.children = (*self.widget.children, fit)
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
        for fw in (self.figure, *(getattr(self, n) for n in self._extra_figures)):
            if hasattr(fw, "_widget_data"):  # a FigureWidget, not the Output's Figure
                fw._widget_layout = copy.deepcopy(fw._layout_obj._props)
                fw._widget_data = copy.deepcopy(fw._data)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        self._resend_figure()
        return self.widget._repr_mimebundle_(**kwargs)

    def display(self) -> None:
        """Show the panel in the notebook (same as leaving it as a cell's last value)."""
        _ipython_display(self)


def _controls(*children: widgets.Widget) -> widgets.Box:
    """A row of controls that wraps onto the next line when the cell is narrow."""
    return widgets.Box(list(children), layout=widgets.Layout(
        display="flex", flex_flow="row wrap", align_items="center", width="100%",
        grid_gap="4px 12px"))


def _field(width: str = "auto") -> dict[str, Any]:
    """Keyword arguments for a labelled control whose label and value are never cut."""
    return {"style": {"description_width": "initial"},
            "layout": widgets.Layout(width=width, min_width="max-content")}


def _cost_line(c: GrowthCost) -> str:
    """One policy's over-commit, at worst while growing and at the end."""
    share = c.over_commit_bytes / max(1, c.needed_bytes)
    return (f"over-commit (backed - needed): at worst {fmt_bytes(c.max_over_commit_bytes)} "
            f"while growing; {fmt_bytes(c.over_commit_bytes)} at {c.tokens:,} tokens "
            f"({share:.0%} of the {fmt_bytes(c.needed_bytes)} needed)")


def _pre(text: str) -> str:
    # A table wider than the cell scrolls rather than wraps (wrapped columns read as rows).
    return ('<pre style="margin:0;font-size:12px;white-space:pre;overflow-x:auto">'
            f'{html.escape(text)}</pre>')


def _line(text: str) -> str:
    """A sentence in the table's font that wraps at the cell's edge instead of being cut."""
    return ('<pre style="margin:0;font-size:12px;white-space:pre-wrap">'
            f'{html.escape(text)}</pre>')


def _policy_options() -> list[tuple[str, GrowthPolicy]]:
    # The owner's default first, so the panel starts where the library does.
    ps: list[GrowthPolicy] = [default_policy(), Chunked(64 * MiB), Exact(),
                              Geometric(2.0, 256 * MiB)]
    return [(str(p), p) for p in ps]


def _empty_snapshot(profile: str) -> ArenaSnapshot:
    """What the map shows before anything is reserved: an empty 64 MiB reservation."""
    p = PROFILES[profile]
    return ArenaSnapshot(name="(nothing reserved)", driver="-", device_name=p.name,
                         granularity=p.granularity_bytes, base=0, reserved_bytes=64 * MiB,
                         cursor_bytes=0, allocations=(), mappings=(), backed_bytes=0,
                         closed=False)

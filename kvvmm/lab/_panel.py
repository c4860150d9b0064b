"""What every panel shares: the figure view, error display, and how a panel shows itself."""

from __future__ import annotations

import contextlib
import html
import json
from collections.abc import Callable, Iterator
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from kvvmm.driver import PROFILES, Driver, driver_for
from kvvmm.growth import GrowthCost
from kvvmm.policy import Chunked, Exact, Geometric, GrowthPolicy, default_policy
from kvvmm.snapshot import ArenaSnapshot
from kvvmm.units import MiB, fmt_bytes
from kvvmm.viz.bands import profile_age_line

DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float32")


def _open(kind: str, profile: str) -> Driver:
    return driver_for(kind, profile=profile)


def _plot_output() -> widgets.Output:
    """The widget a panel's figure is drawn in (see :func:`_draw`)."""
    # No width: the panel's column stretches it to fit inside its margins.
    return widgets.Output(layout={"min_height": "260px"})


def _draw(plot: widgets.Output, fig: go.Figure) -> None:
    """Draw ``fig`` in ``plot``, replacing what it showed.

    The figure travels as plotly's mime bundle in the Output's ``outputs`` trait, so the
    front end draws it with plotly's mime renderer the moment the trait arrives: no widget
    model of its own to wait for (a FigureWidget is an anywidget, whose view gives up when
    its model is slow to come), and no copy in the page that later updates patch. The
    trait is set rather than ``display()``-ed into: a display message goes to whichever
    cell runs, and lands in that cell's outputs where no front end routes it (nbval).
    """
    # No fixed width: the figure follows its cell, and plotly.js relayouts on resize.
    fig.update_layout(width=None, autosize=True)
    spec = json.loads(fig.to_json())
    spec["config"] = {"responsive": True}
    plot.outputs = ({
        "output_type": "display_data", "metadata": {},
        "data": {"application/vnd.plotly.v1+json": spec,
                 "text/plain": f"<plotly figure: {len(fig.data)} traces>"},
    },)


class _Panel:
    """What every panel shares: an error area, the figure, display support."""

    widget: widgets.Widget
    #: Whether a failed action leaves a result that no longer matches the controls (a
    #: plan, a growth run): then the error says the result shown is stale. ArenaLab's map
    #: is never stale: a failed call changes nothing, so the map still shows the arena.
    _stale_on_error = False

    def __init__(self, fig: go.Figure) -> None:
        self.error = widgets.HTML(value="", layout={"width": "100%"})
        self.last_error: BaseException | None = None
        #: True once an action has put a result on screen: a later failure leaves that
        #: result showing, and the error then says it is stale.
        self._has_result = False
        #: The figure shown now (a plain plotly Figure), drawn in :attr:`plot`.
        self.figure = fig
        self.plot = _plot_output()
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
        self.figure = fig
        _draw(self.plot, fig)
        self._has_result = self._has_result or result

    def _add_dom_classes(self, panel: str) -> None:
        """CSS classes as stable hooks for the browser test (tests/repo/test_browser.py).

        The panel's box gets ``kvvmm-<panel>``; each control, the error area and the plot
        ``kvvmm-<attribute>`` (``reserve_kv_button`` -> ``kvvmm-reserve-kv-button``), so a
        test finds them by name rather than by position or label.
        """
        self.widget.add_class(f"kvvmm-{panel}")
        for name, value in vars(self).items():
            if name != "widget" and isinstance(value, widgets.DOMWidget):
                value.add_class(f"kvvmm-{name.replace('_', '-')}")

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def display(self) -> None:
        """Show the panel in the notebook (same as leaving it as a cell's last value)."""
        import IPython.display

        show: Any = IPython.display.display  # untyped
        show(self)


def _controls(*children: widgets.Widget) -> widgets.Box:
    """A row of controls that wraps onto the next line when the cell is narrow."""
    return widgets.Box(list(children), layout=widgets.Layout(
        display="flex", flex_flow="row wrap", align_items="center", width="100%",
        grid_gap="4px 12px"))


def _field(width: str = "auto") -> dict[str, Any]:
    """Keyword arguments for a labelled control whose label and value are never cut."""
    return {"style": {"description_width": "initial"},
            "layout": widgets.Layout(width=width, min_width="max-content")}


def _run_controls() -> tuple[widgets.Button, widgets.IntProgress]:
    """A Run button and the progress bar shown while its run lasts (:func:`_running`)."""
    return (widgets.Button(description="Run", button_style="primary"),
            widgets.IntProgress(value=0, min=0, max=1,
                                layout=widgets.Layout(width="240px", visibility="hidden")))


@contextlib.contextmanager
def _running(button: widgets.Button, progress: widgets.IntProgress) -> Iterator[None]:
    """While a run lasts: its button disabled, its progress bar shown from 0."""
    button.disabled = True
    progress.value, progress.layout.visibility = 0, "visible"
    try:
        yield
    finally:
        button.disabled = False
        progress.layout.visibility = "hidden"


def _profile_age(profile: widgets.Dropdown) -> widgets.HTML:
    """A line saying how old the profile ``profile`` names is; it follows the dropdown."""
    age = widgets.HTML(value=_line(profile_age_line(profile.value)))
    profile.observe(lambda _: setattr(age, "value", _line(profile_age_line(profile.value))),
                    names="value")
    return age


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

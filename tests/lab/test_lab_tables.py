"""Tables fit where they are read: 100 columns in a terminal, a notebook cell at 1280 px.

At a 1280 px window every row of notebook 06's 18-column results table
wrapped onto two lines, GrowthLab cut "driver time" to "driv", and ``kvvmm replay``'s table
was ~230 characters wide. Every table a command prints must fit :data:`TERMINAL_COLUMNS`;
every table a panel shows is an HTML table whose headers are whole (they wrap at spaces,
never cut) and whose width fits :data:`~kvvmm.viz._common.FIT_PX`, the narrowest cell a
1280 px window gives; text a panel shows in a ``<pre>`` fits 100 columns too.
"""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Any

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import ipywidgets as widgets
from hypothesis import given, settings
from hypothesis import strategies as st

from kvvmm.cli import main
from kvvmm.layout import list_models
from kvvmm.viz._common import FIT_PX, TERMINAL_COLUMNS, Report, Table, _fitted_table
from kvvmm.workload import STRATEGIES, generate, run_workload

# Not blank: a row of blank cells prints as an empty line, which the block split below reads
# as the gap between two blocks (found by hypothesis in CI).
cell = st.text(alphabet="abc xyz0123456789.,%()", min_size=1, max_size=14).filter(str.strip)


@settings(max_examples=60, deadline=None)
@given(header=st.lists(cell, min_size=1, max_size=20), data=st.data(),
       width=st.integers(min_value=30, max_value=120))
def test_a_table_wider_than_the_width_splits_into_blocks_that_each_repeat_the_names(
        header: list[str], data: Any, width: int) -> None:
    rows = data.draw(st.lists(st.lists(cell, min_size=len(header), max_size=len(header)),
                              max_size=5))
    lines = _fitted_table(header, rows, width)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    narrow = len(header) == 1 or widths[0] + 2 + max(widths[1:]) <= width
    if narrow:  # every block fits when the name column and any one column do
        assert all(len(line) <= width for line in lines), lines
    blocks = "\n".join(lines).split("\n\n")
    for block in blocks:  # each block: a header line and one line per row, names first
        got = block.split("\n")
        assert len(got) == 1 + len(rows)
        assert got[0].startswith(header[0].ljust(widths[0]).rstrip())
        for line, r in zip(got[1:], rows, strict=True):
            assert line.startswith(r[0].ljust(widths[0]).rstrip())
    shown = " ".join(lines)
    assert all(h.strip() in shown for h in header)  # no column is dropped
    if max(map(len, _fitted_table(header, rows, None))) <= width:
        assert len(blocks) == 1  # one that fits is left whole


def test_kvvmm_replay_prints_every_strategy_in_lines_of_at_most_100_columns(
        capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    out = tmp_path / "r.html"
    assert main(["replay", "generated", "--seconds", "20", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    wide = [line for line in text.splitlines() if len(line) > TERMINAL_COLUMNS]
    assert not wide, wide
    for name in STRATEGIES:  # every strategy has its row in each of the three tables (and bands)
        assert sum(line.split("  ")[0].strip() == name for line in text.splitlines()) >= 3
    for column in ("peak backed", "mean backed", "decode driver", "stalled steps",
                   "p99 if stalled", "p99 step", "calls", "preempted"):
        assert column in text


@pytest.mark.parametrize("model", list_models())
def test_kvvmm_plan_prints_lines_of_at_most_100_columns_for_every_shipped_model(
        model: str, capsys: pytest.CaptureFixture[str]) -> None:
    for tp in ("1", "8"):
        code = main(["plan", "--model", model, "--gpu", "h200", "--tp", tp])
        out, err = capsys.readouterr()
        wide = [line for line in out.splitlines() if len(line) > TERMINAL_COLUMNS]
        assert not wide, (model, tp, wide)
        # a plan that cannot be made says why in one line (errors are one line, any width)
        assert code == 0 or len(err.strip().splitlines()) == 1


class _Tables(HTMLParser):
    """Every table's header cells, its rows, and the style of every header and cell."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict[str, Any]] = []
        self.pres: list[str] = []
        self._cell: list[str] | None = None
        self._pre: list[str] | None = None
        self._pre_style = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        style = dict(attrs).get("style") or ""
        if tag == "table":
            self.tables.append({"header": [], "rows": [], "styles": []})
        elif tag == "tr" and self.tables:
            self.tables[-1]["rows"].append([])
        elif tag in ("th", "td"):
            self._cell = []
            self.tables[-1]["styles"].append(style)
        elif tag == "pre":
            self._pre, self._pre_style = [], style

    def handle_endtag(self, tag: str) -> None:
        if tag in ("th", "td") and self._cell is not None:
            text = "".join(self._cell)
            t = self.tables[-1]
            (t["header"] if tag == "th" else t["rows"][-1]).append(text)
            self._cell = None
        elif tag == "pre" and self._pre is not None:
            if "pre-wrap" not in self._pre_style:  # a <pre> that wraps needs no width
                self.pres.append("".join(self._pre))
            self._pre = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._pre is not None:
            self._pre.append(data)


def _html_of(w: widgets.Widget) -> list[str]:
    out = [w.value] if isinstance(w, widgets.HTML) else []
    for child in getattr(w, "children", ()):
        out += _html_of(child)
    return out


def _check_panel(panel: Any, *, tables: int) -> list[dict[str, Any]]:
    parsed = _Tables()
    for value in _html_of(panel.widget):
        parsed.feed(value)
    assert len(parsed.tables) >= tables, "the panel's results are not HTML tables"
    for t in parsed.tables:
        rows = [r for r in t["rows"] if r]
        table = Table("", tuple(t["header"]), tuple(tuple(r) for r in rows))
        assert table.html_px() <= FIT_PX, (t["header"], table.html_px())
        for style in t["styles"]:  # nothing hides or cuts a header or a cell
            assert "overflow:hidden" not in style.replace(" ", "")
            assert "text-overflow" not in style and "width:" not in style
        heads = [s for s, _ in zip(t["styles"], t["header"], strict=False)]
        assert all("white-space:normal" in s for s in heads)  # a header wraps, whole
    for text in parsed.pres:
        wide = [line for line in text.splitlines() if len(line) > TERMINAL_COLUMNS]
        assert not wide, wide
    return parsed.tables


def test_the_workload_lab_shows_every_strategy_in_html_tables_that_fit_a_1280px_cell() -> None:
    from kvvmm.lab import WorkloadLab

    lab = WorkloadLab(seconds=20.0, strategies=tuple(STRATEGIES))
    assert lab.run(), lab.error_text
    tables = _check_panel(lab, tables=3)
    names = {r[0] for t in tables for r in t["rows"] if r}
    assert names == set(STRATEGIES)
    headers = [h for t in tables for h in t["header"]]
    assert "decode driver" in headers and "p99 if stalled" in headers


@pytest.mark.parametrize("driver_kw", [{}, {"layers": 0, "tokens": 8192, "step_tokens": 4096}])
def test_the_growth_lab_shows_its_results_in_html_tables_with_whole_headers(
        driver_kw: dict[str, int]) -> None:
    from kvvmm.lab import GrowthLab

    lab = GrowthLab(**{"layers": 2, "tokens": 4096, "step_tokens": 512, **driver_kw})
    assert lab.run(), lab.error_text
    tables = _check_panel(lab, tables=2)
    assert "driver time" in tables[0]["header"]  # the panel once read "driv"


@pytest.mark.parametrize("model,tp", [("llama-3.1-70b", 8), ("deepseek-v3", 8),
                                      ("gemma-3-27b", 1), ("llama-3.1-8b", 1)])
def test_the_layout_explorer_and_arena_lab_show_text_of_at_most_100_columns(
        model: str, tp: int) -> None:
    from kvvmm.lab import ArenaLab, LayoutExplorer

    ex = LayoutExplorer(model=model, tp=tp)
    assert ex.last_error is None, ex.error_text
    _check_panel(ex, tables=0)
    lab = ArenaLab()
    lab.reserve_kv_button.click()
    lab.tokens.value = 3000
    lab.finalize_button.click()
    assert lab.last_error is None, lab.error_text
    _check_panel(lab, tables=0)


def test_a_report_prints_as_text_and_shows_as_html_in_a_notebook() -> None:
    cmp = run_workload(generate(seed=0, duration_s=10.0), ["static", "prefix"])
    from kvvmm.viz.workload import format_workload, workload_report

    rep = workload_report(cmp)
    assert isinstance(rep, Report) and str(rep) == format_workload(cmp) == rep.text()
    assert rep._repr_html_().count("<table") == len(rep.tables) == 4  # + what requests waited
    assert all(len(line) <= TERMINAL_COLUMNS for line in rep.text().splitlines())


def test_a_report_with_a_range_strategy_adds_its_allocators_table_with_one_row_each() -> None:
    from kvvmm.viz.workload import workload_report

    cmp = run_workload(generate(seed=0, duration_s=10.0),
                       ["prefix", "request-ranges", "request-ranges+deferred"],
                       model="llama-3.1-8b", tp=1, pause_scale=1.0)
    rep = workload_report(cmp)
    assert len(rep.tables) == 5
    ranges = rep.tables[4]
    assert [row[0] for row in ranges.rows] == ["request-ranges", "request-ranges+deferred"]
    for row, r in zip(ranges.rows, cmp.results[1:], strict=True):
        assert row[1] == f"{r.ranges['deferred_admits']:,} of {r.ranges['admits']:,}"
    assert ranges.rows[0][1].startswith("0 of")  # inline commits: nothing is put off ...
    assert ranges.rows[0][5] == "inline"  # ... nor waited for: the step makes the calls
    r = cmp.results[2].ranges
    assert ranges.rows[1][4] == f"{r['waited_admits']:,} ({r['admit_waited_ms']:.1f} ms)"
    assert ranges.rows[1][5] == f"{r['stalled_admits']:,} / {r['stalled_grows']:,}"
    assert all(len(line) <= TERMINAL_COLUMNS for line in rep.text().splitlines())


# -- figures: one colour per strategy, lines that coincide both visible --


def test_every_strategy_has_a_colour_of_its_own_and_coinciding_pairs_differ_in_dash() -> None:
    from kvvmm.viz._common import STRATEGY_STYLES, strategy_style

    assert set(STRATEGY_STYLES) == set(STRATEGIES)
    colors = [strategy_style(n).color for n in STRATEGIES]
    assert len(set(colors)) == len(colors)
    # finalize backs what static backs, the pool strategy the pages page-elastic backs, and
    # prefix+shrink is prefix growth until it shrinks: the second is thinner, dashed, on top
    for under, over in (("static", "finalize"), ("page-elastic", "page-elastic+pool"),
                        ("prefix", "prefix+shrink")):
        a, b = strategy_style(under), strategy_style(over)
        assert a.dash == "solid" != b.dash and b.width < a.width and b.layer > a.layer
    own = strategy_style("headroom")  # a reader's own: a colour none of the shipped take
    assert own == strategy_style("headroom") and own.color not in colors


def test_each_figure_draws_a_strategy_in_its_colour_and_dashed_lines_over_solid_ones() -> None:
    from kvvmm.viz._common import strategy_style
    from kvvmm.viz.workload import (
        stall_figure,
        tradeoff_figure,
        workload_figure,
        workload_memory_figure,
    )

    names = ["page-elastic+pool", "finalize", "static", "page-elastic", "prefix"]
    cmp = run_workload(generate(seed=0, duration_s=10.0), names)
    mem = [t for t in workload_memory_figure(cmp).data if t.name.startswith("backed: ")]
    drawn = [t.name.removeprefix("backed: ") for t in mem]
    for t, name in zip(mem, drawn, strict=True):
        sty = strategy_style(name)
        assert (t.line.color, t.line.dash, t.line.width) == (sty.color, sty.dash, sty.width)
    for under, over in (("static", "finalize"), ("page-elastic", "page-elastic+pool")):
        assert drawn.index(under) < drawn.index(over)  # the dashed line on top
    # the legend keeps the order the strategies were asked for
    assert [n for _, n in sorted(zip((t.legendrank for t in mem), drawn, strict=True))] == names
    for t in stall_figure(cmp).data:
        assert t.marker.color == strategy_style(t.name.rsplit(" (", 1)[0]).color
    trade = tradeoff_figure(cmp).data
    for t in trade:
        assert (t.marker.color, t.marker.symbol) == (strategy_style(t.name).color,
                                                     strategy_style(t.name).symbol)
    # static and finalize sit on one point: their labels go on opposite sides of it
    st, fi = (next(t for t in trade if t.name == n) for n in ("static", "finalize"))
    if (st.x[0], st.y[0]) == pytest.approx((fi.x[0], fi.y[0]), rel=0.1):
        assert st.textposition.split()[0] != fi.textposition.split()[0]
    combined = workload_figure(cmp)  # what kvvmm replay --png draws: the same styles
    for t in combined.data:
        name = (t.name or "").removeprefix("backed: ").rsplit(" (", 1)[0]
        if name in names:
            color = t.line.color if t.type == "scatter" and t.mode == "lines" else t.marker.color
            assert color == strategy_style(name).color, t.name

"""The lab as a person uses it: JupyterLab in headless Chromium, driven through Playwright.

nbval proves the notebooks' outputs; it cannot see a panel that never renders (a missing
front-end extension, a widget whose view fails). This test starts JupyterLab on the working
folder ``kvvmm.cli.workspace`` makes in a git checkout of the notebooks (private Jupyter
directories, news and autosave off, ``KVVMM_DRIVER=sim``; saving must leave ``git status``
clean),
opens ``01_tour.ipynb`` in the system's Chromium, runs all cells, and then uses the
ArenaLab panel with clicks and typing: Reserve, Allocate, Commit, Reserve KV, Finalize, and
a token count below one page, whose error must appear in the panel. ``02_layouts.ipynb``
gives the LayoutExplorer, whose model, GPU and layout preset are changed from the page.
``06_workloads.ipynb`` runs on Azure's real trace when the checkout has it next door
(``KVVMM_TRACE``, cut to ``KVVMM_TRACE_MINUTES``, 10 unless set, to bound the test), on the
generated slice otherwise, and must say which it ran.
Any JavaScript error in the page fails the test. Screenshots of each step and the server's
log go to ``test-artifacts/browser/``.

Panels are found by the CSS classes ``kvvmm.lab`` gives them (``kvvmm-arena-lab``,
``kvvmm-error``, ``kvvmm-finalize-button``, ...). Skipped without Playwright or Chromium,
except under ``CI=true``, where that fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from browser_support import (
    ARTIFACTS,
    CHROMIUM_ARGS,
    ConsoleErrors,
    LabServer,
    NotebookTab,
    browser_tools,
    screenshot_on_exit,
)

from kvvmm.cli.workspace import prepare_workspace
from kvvmm.units import MiB, fmt_bytes
from kvvmm.workload import find_trace

pytestmark = [pytest.mark.browser, pytest.mark.heavy]

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
#: Azure's trace next to this checkout, if there: the server's copy of the notebooks lies in a
#: temporary folder, so notebook 06 is told where it is.
TRACE = find_trace(start=NOTEBOOKS)
TRACE_MINUTES = os.environ.get("KVVMM_TRACE_MINUTES", "10")

#: Bounds for waits on a slow (2-core) machine; every wait ends as soon as its state holds.
OPEN_MS = 60_000  # JupyterLab's first load, a notebook's kernel start
RUN_ALL_MS = 120_000  # a notebook's Run All
#: 06 on ten minutes of the real trace takes about 40 s on 2 cores; the whole hour about 3 min.
RUN_ALL_06_MS = RUN_ALL_MS if TRACE is None or TRACE_MINUTES else 600_000
STEP_MS = 20_000  # one click's round trip: comm message, kernel handler, figure redraw

#: The figure inside a panel, as plotly.js holds it: title, legend, backed bars and bytes.
FIGURE_JS = """
(el) => {
  const gd = el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot');
  if (!gd || !gd._fullData || !gd._fullLayout) return null;
  const unit = (gd._fullLayout.meta || {}).unit_bytes || 1;
  const backed = gd._fullData.find(t => t.name === 'backed');
  const xs = backed && backed.x ? Array.from(backed.x) : [];
  const bars = gd.querySelectorAll('.barlayer .trace.bars');
  return {
    title: (gd.querySelector('.gtitle') || {}).textContent || '',
    legend: Array.from(gd.querySelectorAll('.legendtext')).map(t => t.textContent),
    backed_bars: xs.length,
    backed_bytes: Math.round(xs.reduce((a, b) => a + b, 0) * unit),
    drawn_backed_bars: bars.length ? bars[0].querySelectorAll('.point').length : 0,
  };
}
"""


# -- fixtures ----------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git repository holding the tracked notebooks and .gitignore, committed: a checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path_factory.mktemp("checkout")
    (repo / "notebooks").mkdir()
    for nb in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"):
        shutil.copy(nb, repo / "notebooks" / nb.name)
    shutil.copy(NOTEBOOKS.parent / ".gitignore", repo / ".gitignore")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "notebooks")
    return repo


@pytest.fixture(scope="module")
def lab_server(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """JupyterLab on the checkout's working folder, as `kvvmm lab` opens it."""
    browser_tools()  # skip (fail in CI) before starting anything
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    root = prepare_workspace(checkout / "notebooks")
    env = {"KVVMM_DRIVER": "sim"}
    if TRACE is not None:
        env |= {"KVVMM_TRACE": str(TRACE), "KVVMM_TRACE_MINUTES": TRACE_MINUTES}
    server = LabServer(root, tmp_path_factory.mktemp("jupyter"), env=env)
    try:
        server.start()
    except RuntimeError as e:
        server.stop()
        pytest.fail(str(e), pytrace=False)
    try:
        yield server
    finally:
        server.stop()
        shutil.copy(server.log_path, ARTIFACTS / "jupyterlab.log")


@pytest.fixture(scope="module")
def browser(lab_server: LabServer) -> Iterator[Any]:
    """The system's Chromium, headless, through Playwright (never a downloaded browser)."""
    sync_playwright, chromium = browser_tools()
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, args=list(CHROMIUM_ARGS))
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, lab_server: LabServer,
         request: pytest.FixtureRequest) -> Iterator[tuple[Any, ConsoleErrors]]:
    """A fresh JupyterLab page; the test fails on any JavaScript error it logged.

    Each test gets its own workspace (``?reset``: nothing restored from an earlier page)
    and its kernels are shut down after it.
    """
    # The laptop size the lab must fit; element screenshots still show a
    # whole panel, taller than the window or not.
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    errors = ConsoleErrors(pg)
    # Only the local server may be reached: anything else (news, fonts, CDNs) is refused
    # and reported, rather than left to time out on a machine with no network.
    outside: list[str] = []

    def refuse(route: Any) -> None:
        outside.append(route.request.url)
        route.abort()

    context.route(lambda url: not url.startswith(lab_server.url), refuse)
    workspace = re.sub(r"\W+", "-", request.node.name)
    pg.goto(f"{lab_server.url}/lab/workspaces/{workspace}?reset&token={lab_server.token}",
            timeout=OPEN_MS)
    try:
        yield pg, errors
    finally:
        context.close()
        lab_server.shutdown_kernels()
    assert not outside, "the page asked for addresses other than the local server:\n" + (
        "\n".join(outside))
    errors.check("while the test ran")


# -- helpers -----------------------------------------------------------------------------


def _expect(locator: Any, what: str) -> Any:
    from playwright.sync_api import expect

    return expect(locator, message=what)


def _figure(panel: Any) -> dict[str, Any]:
    state = panel.locator(".kvvmm-plot").evaluate(FIGURE_JS)
    assert state is not None, "the panel's plot holds no plotly figure"
    return dict(state)


def _wait_slider_max(panel: Any, css_class: str, maximum: int, why: str) -> None:
    """Wait until the slider's range ends at ``maximum`` (the front end has the kernel's max)."""
    handle = panel.locator(f".{css_class} [role=slider]")
    _expect(handle, f"{css_class} goes up to {maximum} after {why}").to_have_attribute(
        "aria-valuemax", re.compile(rf"^{maximum}(\.0+)?$"), timeout=STEP_MS)


def _set_slider(panel: Any, css_class: str, value: int) -> None:
    """Type ``value`` into a slider's readout and press Enter, as a person would."""
    readout = panel.locator(f".{css_class} .widget-readout")
    readout.fill(str(value))
    readout.press("Enter")
    _expect(readout, f"{css_class} shows {value}").to_have_text(str(value), timeout=STEP_MS)


def _click(panel: Any, css_class: str) -> None:
    panel.locator(f".{css_class}").click()


def _wait_title(panel: Any, text: str, why: str) -> dict[str, Any]:
    """Wait for the figure's title to contain ``text``; the figure then."""
    title = panel.locator(".kvvmm-plot .gtitle")
    _expect(title, f"VA map title after {why}").to_contain_text(text, timeout=STEP_MS)
    return _figure(panel)


def _shot(panel: Any, name: str) -> None:
    panel.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def _no_error(panel: Any, why: str) -> None:
    _expect(panel.locator(".kvvmm-error"), f"no error after {why}").to_have_text(
        "", timeout=STEP_MS)


# -- the tests ---------------------------------------------------------------------------


def test_arena_lab_renders_and_its_buttons_change_the_va_map(
        page: tuple[Any, ConsoleErrors]) -> None:
    pg, errors = page
    with screenshot_on_exit(pg, "01_tour-page"):
        tab = NotebookTab.open(pg, "01_tour.ipynb", timeout_ms=OPEN_MS)
        tab.run_all(timeout_ms=RUN_ALL_MS)
        errors.check("after Run All on 01_tour.ipynb")

        lab = tab.panel("kvvmm-arena-lab")
        _expect(lab, "the ArenaLab panel (kvvmm-arena-lab) renders in 01_tour's outputs"
                ).to_be_visible(timeout=STEP_MS)
        _expect(lab.locator(".kvvmm-plot .main-svg").first,
                "the ArenaLab panel draws its VA map (a plotly figure)"
                ).to_be_visible(timeout=STEP_MS)
        # The state the prose describes: KV buffers reserved, slot 0 backed, no error (the
        # notebook's checks click a panel of their own).
        fig = _wait_title(lab, "kv:", "Run All")
        assert fig["backed_bytes"] > 0, fig
        _no_error(lab, "Run All")
        _expect(lab.locator(".kvvmm-policy-cost"), "the policy's over-commit shows beside it"
                ).to_contain_text("over-commit (backed - needed)", timeout=STEP_MS)
        _fits(lab, "ArenaLab after Run All")
        _shot(lab, "01-arena-lab-after-run-all")

        # Bare arena: Close the KV owner, Reserve, Allocate, Commit 8 MiB of the allocation.
        _click(lab, "kvvmm-close-button")
        _wait_title(lab, "(closed)", "Close")
        reserve_mib = int(lab.locator(".kvvmm-reserve-mib input").input_value())
        _click(lab, "kvvmm-reserve-button")
        fig = _wait_title(lab, f"{fmt_bytes(0)} backed of {fmt_bytes(reserve_mib * MiB)}",
                          "Reserve")
        assert fig["backed_bars"] == 0 and fig["title"].startswith("arena:"), fig
        _no_error(lab, "Reserve")
        _click(lab, "kvvmm-allocate-button")
        _expect(lab.locator(".kvvmm-target select option"), "Allocate adds an allocation"
                ).to_have_count(1, timeout=STEP_MS)
        alloc_mib = int(lab.locator(".kvvmm-alloc-mib input").input_value())
        _wait_slider_max(lab, "kvvmm-commit-mib", alloc_mib, "Allocate")
        _set_slider(lab, "kvvmm-commit-mib", 8)
        _click(lab, "kvvmm-commit-button")
        fig = _wait_title(lab, f"{fmt_bytes(8 * MiB)} backed", "Commit 8 MiB")
        assert fig["backed_bytes"] == 8 * MiB and fig["backed_bars"] >= 1, fig
        assert fig["drawn_backed_bars"] == fig["backed_bars"], fig
        assert "backed" in fig["legend"], fig
        _no_error(lab, "Commit")
        _shot(lab, "02-arena-lab-committed")

        # KV owner: Close, Reserve KV (slot 0 backed), Finalize 4096 tokens: backed grows.
        _click(lab, "kvvmm-close-button")
        _wait_title(lab, "arena (closed)", "Close")
        _click(lab, "kvvmm-reserve-kv-button")
        reserved = _wait_title(lab, "kv:", "Reserve KV")
        assert reserved["backed_bytes"] > 0 and reserved["backed_bars"] >= 1, reserved
        assert "slot-0 page" in reserved["legend"], reserved
        reserved_tokens = int(lab.locator(".kvvmm-reserved-tokens input").input_value())
        _wait_slider_max(lab, "kvvmm-tokens", reserved_tokens, "Reserve KV")
        _set_slider(lab, "kvvmm-tokens", 4096)
        _click(lab, "kvvmm-finalize-button")
        _expect(lab.locator(".kvvmm-plot .legendtext", has_text=re.compile(r"^final$")),
                "the 'final' marks appear after Finalize").to_have_count(1, timeout=STEP_MS)
        final = _figure(lab)
        assert final["backed_bytes"] > reserved["backed_bytes"], (reserved, final)
        assert final["backed_bars"] > reserved["backed_bars"], (reserved, final)
        assert final["drawn_backed_bars"] == final["backed_bars"], final
        assert f"{fmt_bytes(final['backed_bytes'])} backed" in final["title"], final
        _expect(lab.locator(".kvvmm-summary"), "the summary follows the figure").to_contain_text(
            f"backed   {fmt_bytes(final['backed_bytes'])}", timeout=STEP_MS)
        _no_error(lab, "Finalize")
        _shot(lab, "03-arena-lab-finalized")

        # A bad value: fewer tokens than one page. The panel shows why; nothing changes.
        _set_slider(lab, "kvvmm-tokens", 8)
        _click(lab, "kvvmm-finalize-button")
        error = lab.locator(".kvvmm-error pre")
        _expect(error, "Finalize with 8 tokens shows an error in the panel").to_contain_text(
            "n=8 is invalid", timeout=STEP_MS)
        _expect(error, "the error says what the limit is").to_contain_text("page_size")
        assert _figure(lab)["backed_bytes"] == final["backed_bytes"]
        _shot(lab, "04-arena-lab-error")
        errors.check("after using the ArenaLab panel")


def test_layout_explorer_replans_when_its_controls_change(
        page: tuple[Any, ConsoleErrors]) -> None:
    pg, errors = page
    with screenshot_on_exit(pg, "02_layouts-page"):
        tab = NotebookTab.open(pg, "02_layouts.ipynb", timeout_ms=OPEN_MS)
        tab.run_all(timeout_ms=RUN_ALL_MS)
        errors.check("after Run All on 02_layouts.ipynb")

        ex = tab.panel("kvvmm-layout-explorer")
        _expect(ex, "the LayoutExplorer panel (kvvmm-layout-explorer) renders in 02_layouts"
                ).to_be_visible(timeout=STEP_MS)
        _expect(ex.locator(".kvvmm-plot .main-svg").first,
                "the LayoutExplorer draws its VA map").to_be_visible(timeout=STEP_MS)
        report = ex.locator(".kvvmm-report")
        error = ex.locator(".kvvmm-error")
        # A real model's VA map: llama-3.1-70b at TP 8, 160 buffers, as the prose says.
        _expect(ex.locator(".kvvmm-plot .gtitle"), "the map of llama-3.1-70b renders"
                ).to_contain_text("llama-3.1-70b", timeout=STEP_MS)
        _expect(report, "the report is of TP 8").to_contain_text("tp 8", timeout=STEP_MS)
        _expect(report, "all 160 buffers").to_contain_text("160 buffers")
        _no_error(ex, "Run All")
        _fits(ex, "LayoutExplorer after Run All")
        _shot(ex, "05-layout-explorer-after-run-all")
        before = _capacity(report)

        model = _select_other(ex, "kvvmm-model", ("qwen2.5-7b", "llama-3.1-8b"))
        _expect(report, "the model preset re-plans").to_contain_text(
            f"{model} on", timeout=STEP_MS)
        after_model = _capacity(report)
        assert after_model != before, f"capacity stayed {before} tokens after model {model}"

        gpu = _select_other(ex, "kvvmm-gpu", ("b200", "h200"))
        _expect(report, "the GPU re-plans").to_contain_text(f"({gpu})", timeout=STEP_MS)
        after_gpu = _capacity(report)
        assert after_gpu != after_model, f"capacity stayed {after_model} tokens on {gpu}"

        layout = _select_other(ex, "kvvmm-layout", ("page_major", "token_major"))
        _expect(report, "the layout preset re-plans").to_contain_text(
            f"tp 8, {layout}", timeout=STEP_MS)
        _expect(report, "the buffers follow the layout").to_contain_text(
            "-token page" if layout == "page_major" else "per token")
        assert _capacity(report) == after_gpu  # the layout moves bytes, not capacity
        _expect(ex.locator(".kvvmm-plot .gtitle"), "the VA map follows the model"
                ).to_contain_text(model, timeout=STEP_MS)
        _expect(error, "no error after valid changes").to_have_text("")

        # A bad value: TP 3 splits no model's KV heads evenly. Refused, the plan stays.
        _type_int(ex, "kvvmm-tp", 3)
        _expect(error.locator("pre"), "TP 3 shows an error in the panel").to_contain_text(
            "tp=3 is invalid", timeout=STEP_MS)
        _expect(error.locator("pre"), "over the old plan, marked stale").to_contain_text(
            "stale: the last change failed: ")
        assert _capacity(report) == after_gpu
        _shot(ex, "06-layout-explorer-replanned")
        errors.check("after using the LayoutExplorer panel")


def _fits(panel: Any, why: str) -> None:
    """Every control, the error area and the figure lie within the panel: nothing cut off."""
    boxes = panel.evaluate("""(root) => {
      const r = root.getBoundingClientRect();
      const out = [];
      for (const el of root.querySelectorAll('.widget-dropdown, .widget-text, .widget-button,'
                                             + ' .widget-slider, .kvvmm-plot .main-svg')) {
        const b = el.getBoundingClientRect();
        if (b.width === 0) continue;
        out.push({cls: el.className.baseVal ?? el.className, right: b.right, limit: r.right,
                  clipped: el.scrollWidth > el.clientWidth + 1 && el.tagName !== 'svg'});
      }
      for (const s of root.querySelectorAll('select')) {
        // a dropdown whose value does not fit shows it cut ("token_majo")
        if (s.scrollWidth > s.clientWidth + 1) out.push({cls: 'select ' + s.value,
                                                          right: 0, limit: 0, clipped: true});
      }
      return out; }""")
    bad = [b for b in boxes if b["right"] > b["limit"] + 1 or b["clipped"]]
    assert not bad, f"cut off in {why}: {bad}"
    _fills_cell(panel, why)


def _tables_fit(root: Any, why: str, *, least: int) -> None:
    """Every results table under ``root`` (``kvvmm.viz._common.Table.html``) fits its cell
    with no scrolling, and no header is cut (at 1280 px 06's 18-column
    table wrapped every row, GrowthLab cut "driver time" to "driv")."""
    found = root.evaluate("""(root) => {
      const out = [];
      for (const t of root.querySelectorAll('.kvvmm-report-table')) {
        const cut = [...t.querySelectorAll('th')].filter(
          (th) => th.scrollWidth > th.clientWidth + 1).map((th) => th.textContent);
        out.push({overflow: t.scrollWidth - t.clientWidth, cut: cut,
                  head: t.querySelector('th') ? t.querySelector('th').textContent : ''});
      }
      return out; }""")
    assert len(found) >= least, f"{why}: {len(found)} results tables, expected {least}+"
    bad = [t for t in found if t["overflow"] > 1 or t["cut"]]
    assert not bad, f"tables that do not fit in {why}: {bad}"


#: JavaScript: the figure's drawn width and its cell's (the output area beside the prompt).
_WIDTHS_JS = """(root) => {
  const svg = root.querySelector('.kvvmm-plot .main-svg');
  const cell = root.closest('.jp-OutputArea-output') || root;
  return {figure: svg ? svg.getBoundingClientRect().width : 0,
          cell: cell.getBoundingClientRect().width};
}"""


def _fills_cell(panel: Any, why: str, share: float = 0.9) -> None:
    """The figure is drawn at least ``share`` of its cell's width.

    A figure that measured no width when it drew falls back to plotly's default 700 px,
    short of a cell of 850 px (at 1280) or more; the panel's figure has no width of its
    own and plotly.js's responsive mode relayouts it as its cell resizes.
    """
    from playwright.sync_api import Error as PlaywrightError

    check = f"(root) => {{ const w = ({_WIDTHS_JS})(root); return w.figure >= {share} * w.cell; }}"
    try:
        panel.page.wait_for_function(check, arg=panel.element_handle(), timeout=STEP_MS)
    except PlaywrightError:
        widths = panel.evaluate(_WIDTHS_JS)
        raise AssertionError(f"the figure is {widths['figure']:.0f} px wide in a cell of "
                             f"{widths['cell']:.0f} px in {why} (want >= {share:.0%})") from None


def test_saving_in_jupyterlab_leaves_the_checkout_clean(
        page: tuple[Any, ConsoleErrors], checkout: Path, lab_server: LabServer) -> None:
    # Autosave rewrote the tracked 03_growth.ipynb and broke `make test`.
    pg, errors = page
    with screenshot_on_exit(pg, "03_growth-page"):
        tab = NotebookTab.open(pg, "03_growth.ipynb", timeout_ms=OPEN_MS)
        tab.run_all(timeout_ms=RUN_ALL_MS)
        gl = tab.panel("kvvmm-growth-lab")
        _expect(gl.locator(".kvvmm-table"), "GrowthLab shows its run, as the prose says"
                ).to_contain_text("grown to", timeout=STEP_MS)
        _no_error(gl, "Run All")
        _expect(gl.locator(".kvvmm-default-cost"), "the default's over-commit shows"
                ).to_contain_text("over-commit", timeout=STEP_MS)
        _fits(gl, "GrowthLab after Run All")
        _tables_fit(gl, "GrowthLab after Run All at 1280 px", least=2)
        _shot(gl, "07-growth-lab-after-run-all")
        saved = Path(lab_server.root_dir) / "03_growth.ipynb"
        before = saved.stat().st_mtime_ns
        pg.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        pg.wait_for_function(
            """() => { const w = window.jupyterapp.shell.currentWidget;
                       return w && w.context && !w.context.model.dirty; }""", timeout=STEP_MS)
        assert saved.stat().st_mtime_ns != before, "the working copy was not saved"
        status = _git(checkout, "status", "--porcelain", "--untracked-files=all")
        assert status == "", f"saving in JupyterLab changed the checkout:\n{status}"
        errors.check("after saving 03_growth.ipynb")


def test_the_failures_notebooks_panel_shows_its_error_after_run_all(
        page: tuple[Any, ConsoleErrors]) -> None:
    # The 04 section meant to show an error showed a closed arena.
    pg, errors = page
    with screenshot_on_exit(pg, "04_failures-page"):
        tab = NotebookTab.open(pg, "04_failures.ipynb", timeout_ms=OPEN_MS)
        tab.run_all(timeout_ms=RUN_ALL_MS)
        lab = tab.panel("kvvmm-arena-lab")
        _expect(lab.locator(".kvvmm-error pre"), "the injected failure shows in the panel"
                ).to_contain_text("CUDA_ERROR_UNKNOWN", timeout=STEP_MS)
        _wait_title(lab, "kv:", "Run All")
        _fits(lab, "04's ArenaLab")
        _shot(lab, "08-arena-lab-failure")
        pg.set_viewport_size({"width": 1800, "height": 1000})
        _fills_cell(lab, "04's ArenaLab, the window widened to 1800 px")
        _shot(lab, "09-arena-lab-failure-1800")
        errors.check("after Run All on 04_failures.ipynb")


def test_the_workloads_notebook_says_which_traffic_it_ran_and_hands_the_trace_to_its_lab(
        page: tuple[Any, ConsoleErrors]) -> None:
    # 06 ran a generated slice even with the real hour at hand.
    pg, errors = page
    with screenshot_on_exit(pg, "06_workloads-page"):
        tab = NotebookTab.open(pg, "06_workloads.ipynb", timeout_ms=OPEN_MS)
        tab.run_all(timeout_ms=RUN_ALL_06_MS)
        ran = tab.root.locator(".jp-OutputArea-output", has_text="ran: ").first
        want = "ran: the real trace" if TRACE is not None else "ran: a generated"
        _expect(ran, "the first cell says which traffic ran").to_contain_text(
            want, timeout=STEP_MS)
        if TRACE is not None and TRACE_MINUTES:
            _expect(ran, "and the cut").to_contain_text(f"its first {TRACE_MINUTES} minutes")
        lab = tab.panel("kvvmm-workload-lab")
        _expect(lab.locator(".kvvmm-source input"), "the lab's trace field holds the trace"
                ).to_have_value(str(TRACE) if TRACE is not None else "", timeout=STEP_MS)
        tradeoff = tab.root.locator(".jp-CodeCell", has_text="tradeoff_figure(ranged)").last
        _expect(tradeoff.locator(".js-plotly-plot"), "the tradeoff chart renders"
                ).to_have_count(1, timeout=STEP_MS)
        # three results reports (five strategies, the range ones, your own), three tables each
        _tables_fit(tab.root, "06 after Run All at 1280 px", least=9)
        errors.check("after Run All on 06_workloads.ipynb")


def _type_int(panel: Any, css_class: str, value: int) -> None:
    """Type ``value`` into an IntText, press Enter and leave the field, as a person would.

    The widget sends its value on the input's ``change`` event (Enter, or leaving the
    field); the test waits for that event, so a lost keystroke fails here, by name.
    """
    box = panel.locator(f".{css_class} input")
    box.evaluate("(el) => { el.__kvvmmChanges = 0;"
                 " el.addEventListener('change', () => { el.__kvvmmChanges += 1; }); }")
    box.fill(str(value))
    box.press("Enter")
    box.press("Tab")  # leaving the field: a change event if Enter's did not come
    box.page.wait_for_function("(el) => el.__kvvmmChanges > 0", arg=box.element_handle(),
                               timeout=STEP_MS)


def _select_other(panel: Any, css_class: str, choices: tuple[str, ...]) -> str:
    """Pick the first of ``choices`` that the dropdown does not show now; return it."""
    select = panel.locator(f".{css_class} select")
    current = select.input_value()
    choice = next(c for c in choices if c != current)
    select.select_option(choice)
    return choice


def _capacity(report: Any) -> str:
    """The plan's capacity line ("tokens 1,112,464") from the report as shown."""
    m = re.search(r"^tokens\s+([\d,]+)", report.inner_text(), re.M)
    assert m, f"no capacity line in the report:\n{report.inner_text()}"
    return m.group(1)

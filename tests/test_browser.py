"""The lab as a person uses it: JupyterLab in headless Chromium, driven through Playwright.

nbval proves the notebooks' outputs; it cannot see a panel that never renders (a missing
front-end extension, a widget whose view fails). This test starts JupyterLab on a copy of
``notebooks/`` (private Jupyter directories, news and autosave off, ``KVVMM_DRIVER=sim``),
opens ``01_tour.ipynb`` in the system's Chromium, runs all cells, and then uses the
ArenaLab panel with clicks and typing: Reserve, Allocate, Commit, Reserve KV, Finalize, and
a token count below one page, whose error must appear in the panel. ``02_layouts.ipynb``
gives the LayoutExplorer, whose model, GPU and layout preset are changed from the page.
Any JavaScript error in the page fails the test. Screenshots of each step and the server's
log go to ``test-artifacts/browser/``.

Panels are found by the CSS classes ``kvvmm.lab`` gives them (``kvvmm-arena-lab``,
``kvvmm-error``, ``kvvmm-finalize-button``, ...). Skipped without Playwright or Chromium,
except under ``CI=true``, where that fails.
"""

from __future__ import annotations

import re
import shutil
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

from kvvmm.units import MiB, fmt_bytes

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"

#: Bounds for waits on a slow (2-core) machine; every wait ends as soon as its state holds.
OPEN_MS = 60_000  # JupyterLab's first load, a notebook's kernel start
RUN_ALL_MS = 120_000  # a notebook's Run All
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


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """JupyterLab on a copy of notebooks/ (so nothing the page does reaches the repo)."""
    browser_tools()  # skip (fail in CI) before starting anything
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("notebooks")
    for nb in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"):
        shutil.copy(nb, root / nb.name)
    server = LabServer(root, tmp_path_factory.mktemp("jupyter"), env={"KVVMM_DRIVER": "sim"})
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
    # Tall enough that a whole panel fits on screen, so its screenshot is the panel.
    context = browser.new_context(viewport={"width": 1400, "height": 2000})
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
        # The notebook's own cells reserved, finalized and closed the lab's owner.
        fig = _wait_title(lab, "(closed)", "Run All")
        assert fig["backed_bytes"] == 0, fig
        assert {"unbacked", "cursor"} <= set(fig["legend"]), fig
        _shot(lab, "01-arena-lab-after-run-all")

        # Bare arena: Reserve, Allocate, then Commit 8 MiB of the allocation.
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
        _shot(ex, "05-layout-explorer-after-run-all")

        # Start from a plan that works whatever the notebook left (its last cell leaves a
        # refused TP on screen): TP 1 is valid for every model.
        _type_int(ex, "kvvmm-tp", 1)
        _expect(error, "TP 1 plans without an error").to_have_text("", timeout=STEP_MS)
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
            f"tp 1, {layout}", timeout=STEP_MS)
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
        assert _capacity(report) == after_gpu
        _shot(ex, "06-layout-explorer-replanned")
        errors.check("after using the LayoutExplorer panel")


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

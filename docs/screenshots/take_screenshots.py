"""Take the lab screenshots in this folder: each notebook run top to bottom in JupyterLab.

    .venv/bin/python docs/screenshots/take_screenshots.py

Uses the browser test's helpers (tests/browser_support.py: a private JupyterLab on copies of
the notebooks, the system's Chromium, ``KVVMM_DRIVER=sim``). For each notebook it runs all
cells in a window 1280 px wide (800 high) and again 1800 px wide (1000 high), then shoots
the notebook's main panel (or figure) whole: the window is made taller for the shot only,
so the width the panel laid itself out at stays.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))

from browser_support import CHROMIUM_ARGS, ConsoleErrors, LabServer, NotebookTab, browser_tools  # noqa: E402

from kvvmm.workload import find_trace  # noqa: E402

#: notebook -> its shots: (screenshot name, what to shoot: a panel's CSS class, or a line of
#: a cell's source), each taken after the one Run All
SHOTS = {
    "01_tour.ipynb": [("lab-01-arena-lab", ".kvvmm-arena-lab")],
    "02_layouts.ipynb": [("lab-02-layout-explorer", ".kvvmm-layout-explorer")],
    "03_growth.ipynb": [("lab-03-growth-lab", ".kvvmm-growth-lab")],
    "04_failures.ipynb": [("lab-04-arena-lab-failure", ".kvvmm-arena-lab")],
    "05_gpu.ipynb": [("lab-05-va-map", "va_map(owner.snapshot())")],
    "06_workloads.ipynb": [("lab-06-results", "workload_report(cmp)"),
                           ("lab-06-tradeoff", "tradeoff_figure(ranged)")],
    "09_tenants.ipynb": [("lab-09-tenants", 'tenants_figure(runs["elastic"]')],
}
SIZES = ((1280, 800, ""), (1800, 1000, "-1800"))


def _target(tab: NotebookTab, what: str) -> object:
    if what.startswith("."):
        return tab.panel(what[1:])
    cell = tab.root.locator(".jp-CodeCell", has_text=what).last
    return cell.locator(".jp-OutputArea").first


def main(argv: list[str] | None = None) -> None:
    """Shoot every notebook of :data:`SHOTS`, or only those named (``06_workloads.ipynb``)."""
    names = (sys.argv[1:] if argv is None else argv) or list(SHOTS)
    unknown = [n for n in names if n not in SHOTS]
    if unknown:
        raise SystemExit(f"take_screenshots: unknown notebooks {unknown}; known: {list(SHOTS)}")
    sync_playwright, chromium = browser_tools()
    tmp = Path(tempfile.mkdtemp())
    root = tmp / "notebooks"
    root.mkdir()
    for nb in names:
        shutil.copy(REPO / "notebooks" / nb, root / nb)
    # 06 runs Azure's real trace when this checkout has it next door (the copies here lie in
    # a temporary folder, so it is told where): the whole hour unless KVVMM_TRACE_MINUTES.
    env = {"KVVMM_DRIVER": "sim"}
    trace = find_trace(start=REPO)
    if trace is not None:
        env |= {"KVVMM_TRACE": str(trace),
                "KVVMM_TRACE_MINUTES": os.environ.get("KVVMM_TRACE_MINUTES", "")}
    with LabServer(root, tmp / "home", env=env) as srv, \
            sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=list(CHROMIUM_ARGS))
        for nb in names:
            for width, height, suffix in SIZES:
                ctx = browser.new_context(viewport={"width": width, "height": height})
                page = ctx.new_page()
                errors = ConsoleErrors(page)
                page.goto(f"{srv.url}/lab/workspaces/shots?reset&token={srv.token}",
                          timeout=60_000)
                tab = NotebookTab.open(page, nb, timeout_ms=60_000)
                tab.run_all(timeout_ms=600_000)  # 06 on the whole real hour: ~4 min
                for name, what in SHOTS[nb]:
                    page.set_viewport_size({"width": width, "height": height})
                    page.wait_for_timeout(500)
                    target = _target(tab, what)
                    target.scroll_into_view_if_needed()  # type: ignore[attr-defined]
                    page.wait_for_timeout(1000)  # the figure's relayout after it is drawn
                    page.set_viewport_size({"width": width, "height": 2400})
                    page.wait_for_timeout(500)
                    target.screenshot(path=str(HERE / f"{name}{suffix}.png"))  # type: ignore[attr-defined]
                    print(f"{name}{suffix}.png")
                errors.check(f"{nb} at {width} px")
                ctx.close()
                srv.shutdown_kernels()
        browser.close()


if __name__ == "__main__":
    main()

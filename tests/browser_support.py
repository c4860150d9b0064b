"""What the browser test needs around it: a private JupyterLab server, Chromium, page helpers.

- :func:`browser_tools`: Playwright's sync API and the system's Chromium, or a skip with the
  reason (a failure under ``CI=true``, so CI cannot skip the test silently). Playwright's own
  browser download (``playwright install``) is never used.
- :class:`LabServer`: JupyterLab on 127.0.0.1, the port picked by the OS, a random token,
  private config / data / runtime / settings / workspace / IPython directories, the
  announcements ("news") and update check off, autosave off, ``window.jupyterapp`` exposed.
  Front-end extensions (ipywidgets, plotly) still come from the venv's
  ``share/jupyter/labextensions``: ``JUPYTER_DATA_DIR`` replaces only the user's data dir.
- :class:`ConsoleErrors`: every ``console.error`` and uncaught exception of a page.
- :class:`NotebookTab`: one open notebook, driven as a person would (run all, click, type).

No fixed sleeps: every wait is on a page or server state, with a bounded timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: Where screenshots and the server log go (gitignored: ``test-artifacts/``).
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "browser"

#: Chromium flags for a machine with no display, no GPU, no network and a small /dev/shm.
#: The network ones stop Chromium's own background requests (component updates, sync,
#: safe-browsing lists), which would otherwise fill the log with refused connections.
CHROMIUM_ARGS = (
    "--headless=new",
    "--no-sandbox",  # we run as root in CI containers; the sandbox refuses root
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--disable-extensions",
    "--disable-features=Translate,OptimizationHints,MediaRouter",
)

# JupyterLab settings written into the private user-settings directory.
LAB_SETTINGS: dict[str, dict[str, Any]] = {
    # No "Would you like to receive official Jupyter news?" toast, no update check.
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
    # The server serves a copy of the notebooks, but never write behind the test's back.
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}

# Server configuration (the private JUPYTER_CONFIG_DIR's jupyter_server_config.json).
SERVER_CONFIG: dict[str, Any] = {
    "LabApp": {
        # None turns the news handler off and tells the page news are disabled.
        "news_url": None,
        "check_for_updates_class": "jupyterlab.handlers.announcements.NeverCheckForUpdate",
        # window.jupyterapp: the test runs commands (run all cells) and reads kernel state.
        "expose_app_in_browser": True,
    },
}


def in_ci() -> bool:
    """True on a CI machine (``CI`` set to anything but empty, 0 or false)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _skip_or_fail(reason: str) -> None:
    if in_ci():
        pytest.fail(f"{reason}; CI=true, so this fails instead of skipping: .ci/run installs "
                    "chromium (apt) and `make venv` installs playwright (the test extra)",
                    pytrace=False)
    pytest.skip(reason)


def find_chromium() -> str | None:
    """The system's Chromium: ``$KVVMM_CHROMIUM``, else ``chromium`` (or its kin) on PATH.

    Debian's ``/usr/bin/chromium`` is a shell wrapper that adds flags from
    ``/etc/chromium.d`` (remote extensions on, an extension dir to load); when the binary it
    wraps (``/usr/lib/chromium/chromium``) is there, that is used, with our flags only.
    """
    explicit = os.environ.get("KVVMM_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found is None:
            continue
        debian_binary = Path("/usr/lib/chromium/chromium")
        if name == "chromium" and os.access(debian_binary, os.X_OK):
            return str(debian_binary)
        return found
    return None


def browser_tools() -> tuple[Any, str]:
    """(``playwright.sync_api.sync_playwright``, chromium path), or skip (fail in CI)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _skip_or_fail("the playwright Python package is not installed (`make venv` installs "
                      "it with the test extra)")
        raise  # unreachable: skip and fail raise
    chromium = find_chromium()
    if chromium is None:
        _skip_or_fail("no Chromium found (apt-get install chromium, or set KVVMM_CHROMIUM)")
        raise AssertionError("unreachable")
    return sync_playwright, chromium


# -- the server --------------------------------------------------------------------------


class LabServer:
    """JupyterLab serving ``root_dir`` from private directories under ``home``.

    Use as a context manager; ``url`` and ``token`` are set once it answers. ``log()``
    gives its output so far (stdout and stderr), for failure messages.
    """

    def __init__(self, root_dir: Path, home: Path, *, env: dict[str, str] | None = None,
                 start_timeout_s: float = 60.0) -> None:
        self.root_dir = root_dir
        self.home = home
        self.extra_env = dict(env or {})
        self.start_timeout_s = start_timeout_s
        self.token = secrets.token_hex(24)
        self.port = 0
        self.url = ""
        self.log_path = home / "jupyterlab.log"
        self.proc: subprocess.Popen[bytes] | None = None

    # -- set-up ------------------------------------------------------------------------

    def _dirs(self) -> dict[str, Path]:
        d = {name: self.home / name for name in
             ("config", "data", "runtime", "settings", "workspaces", "ipython")}
        for p in d.values():
            p.mkdir(parents=True, exist_ok=True)
        (d["config"] / "jupyter_server_config.json").write_text(json.dumps(SERVER_CONFIG))
        for rel, values in LAB_SETTINGS.items():
            f = d["settings"] / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(values))
        return d

    def _env(self, d: dict[str, Path]) -> dict[str, str]:
        env = dict(os.environ)
        # Nothing from the user's own Jupyter set-up: extra paths would add extensions,
        # kernels or config the test does not know about.
        for var in ("JUPYTER_PATH", "JUPYTER_CONFIG_PATH", "JUPYTER_PORT", "JUPYTER_TOKEN",
                    "JUPYTER_PREFER_ENV_PATH", "JUPYTER_PLATFORM_DIRS"):
            env.pop(var, None)
        env.update({
            "JUPYTER_CONFIG_DIR": str(d["config"]),
            "JUPYTER_DATA_DIR": str(d["data"]),
            "JUPYTER_RUNTIME_DIR": str(d["runtime"]),
            "JUPYTERLAB_SETTINGS_DIR": str(d["settings"]),
            "JUPYTERLAB_WORKSPACES_DIR": str(d["workspaces"]),
            "IPYTHONDIR": str(d["ipython"]),
            # The kernel's debugger warns about frozen modules on stderr otherwise.
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            **self.extra_env,
        })
        return env

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "jupyter", "lab", "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                "--ServerApp.port=0",  # the OS picks a free port; read back from runtime/
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={self.root_dir}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            argv.append("--allow-root")  # CI containers run as root; Jupyter refuses it else
        return argv

    def start(self) -> None:
        d = self._dirs()
        log = self.log_path.open("wb")
        try:
            self.proc = subprocess.Popen(self.argv(), cwd=self.root_dir, env=self._env(d),
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self._wait_until_ready(d["runtime"])

    def _wait_until_ready(self, runtime: Path) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        info = runtime / f"jpserver-{self.proc.pid}.json"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with code {self.proc.returncode} "
                                   f"before answering; its log:\n{self.log()}")
            if not self.port and info.exists():
                with contextlib.suppress(ValueError, OSError):  # written while we read
                    self.port = int(json.loads(info.read_text())["port"])
                    self.url = f"http://127.0.0.1:{self.port}"
            if self.port and self._status_ok():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"JupyterLab did not answer /api/status within {self.start_timeout_s:.0f} s"
                    f" (port {self.port or 'not yet known'}); its log:\n{self.log()}")
            self._wait_for_exit(0.2)  # bounded poll interval: returns early if it dies

    def _wait_for_exit(self, timeout_s: float) -> None:
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)

    def api(self, path: str, method: str = "GET") -> Any:
        """Call the REST API with the token; the decoded JSON (None when empty)."""
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def _status_ok(self) -> bool:
        try:
            return isinstance(self.api("/api/status"), dict)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def shutdown_kernels(self) -> None:
        """Shut every session's kernel down (between tests: each starts from nothing)."""
        for session in self.api("/api/sessions") or []:
            self.api(f"/api/sessions/{session['id']}", method="DELETE")

    def log(self, tail_chars: int = 6000) -> str:
        """The server's output so far (the last ``tail_chars`` characters)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return text[-tail_chars:]

    # -- tear-down ---------------------------------------------------------------------

    def stop(self) -> None:
        """Shut kernels and server down through the API; then SIGTERM, then SIGKILL."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        if self.port:
            with contextlib.suppress(urllib.error.URLError, OSError, ValueError):
                self.api("/api/shutdown", method="POST")  # shuts its kernels down too
            self._wait_for_exit(10)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # the server's own session: it and its kernels
            self._wait_for_exit(10)

    def __enter__(self) -> LabServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the page ----------------------------------------------------------------------------


class ConsoleErrors:
    """Collects a page's ``console.error`` messages and uncaught exceptions."""

    def __init__(self, page: Any) -> None:
        self.messages: list[str] = []
        page.on("console", self._on_console)
        page.on("pageerror", lambda err: self.messages.append(f"uncaught: {err}"))

    def _on_console(self, msg: Any) -> None:
        if msg.type == "error":
            loc = msg.location or {}
            where = f" ({loc.get('url', '')}:{loc.get('lineNumber', '')})" if loc else ""
            self.messages.append(f"console.error: {msg.text}{where}")

    def check(self, when: str) -> None:
        """Fail if any error came since the last check (each is reported once)."""
        found, self.messages = self.messages, []
        assert not found, f"JavaScript errors in the page ({when}):\n" + "\n".join(found)


#: JavaScript: the notebook panel of ``path`` in window.jupyterapp's shell, or null.
_PANEL_JS = """
(path) => {
  const app = window.jupyterapp;
  if (!app) return null;
  for (const w of app.shell.widgets('main')) {
    if (w.context && w.context.path === path && w.content && w.content.widgets) return w;
  }
  return null;
}
"""


class NotebookTab:
    """A notebook open in JupyterLab's main area; ``root`` is its panel's DOM node."""

    def __init__(self, page: Any, path: str, timeout_ms: float) -> None:
        self.page = page
        self.path = path
        self.timeout_ms = timeout_ms
        self.root = page.locator(f'.jp-NotebookPanel[data-kvvmm-path="{path}"]')

    @classmethod
    def open(cls, page: Any, path: str, timeout_ms: float = 30_000) -> NotebookTab:
        """Open ``path`` (relative to the server's root) and wait for its kernel to be idle."""
        page.wait_for_function("() => !!window.jupyterapp", timeout=timeout_ms)
        # Commands exist only once every plugin has started and the layout is restored.
        page.evaluate("() => { window.jupyterapp.restored.then("
                      "() => { window.__kvvmmRestored = true; }); }")
        page.wait_for_function("() => window.__kvvmmRestored === true", timeout=timeout_ms)
        page.evaluate("(path) => window.jupyterapp.commands.execute('docmanager:open', "
                      "{path, factory: 'Notebook'})", path)
        tab = cls(page, path, timeout_ms)
        # Mark the panel's node so locators can be scoped to this notebook.
        page.wait_for_function(
            f"""(path) => {{
              const w = ({_PANEL_JS})(path);
              if (!w) return false;
              w.node.setAttribute('data-kvvmm-path', path);
              return true;
            }}""", arg=path, timeout=timeout_ms)
        tab.wait_for_kernel_idle()
        return tab

    def wait_for_kernel_idle(self) -> None:
        """Wait until the notebook's kernel is started and idle."""
        self.page.wait_for_function(
            f"""(path) => {{
              const w = ({_PANEL_JS})(path);
              if (!w || !w.sessionContext.isReady) return false;
              const k = w.sessionContext.session && w.sessionContext.session.kernel;
              return !!k && k.status === 'idle' && k.connectionStatus === 'connected';
            }}""", arg=self.path, timeout=self.timeout_ms)

    def run_all(self, timeout_ms: float) -> None:
        """Run > Run All Cells; wait until every code cell has run and the kernel is idle.

        Raises AssertionError with the first error output if a cell failed (JupyterLab then
        stops running the cells after it).
        """
        self.page.evaluate(
            f"""(path) => {{
              const app = window.jupyterapp;
              app.shell.activateById(({_PANEL_JS})(path).id);
              return app.commands.execute('notebook:run-all-cells');
            }}""", self.path)
        self.page.wait_for_function(
            f"""(path) => {{
              const w = ({_PANEL_JS})(path);
              const k = w.sessionContext.session && w.sessionContext.session.kernel;
              const cells = w.content.widgets.filter(c => c.model.type === 'code');
              const failed = cells.some(c => c.model.outputs.toJSON()
                                              .some(o => o.output_type === 'error'));
              const done = cells.every(c => c.model.executionCount !== null
                                            && !c.node.classList.contains('jp-mod-running'));
              return failed || (done && k && k.status === 'idle');
            }}""", arg=self.path, timeout=timeout_ms)
        errors = self.page.evaluate(
            f"""(path) => ({_PANEL_JS})(path).content.widgets
                 .flatMap((c, i) => c.model.type !== 'code' ? [] : c.model.outputs.toJSON()
                   .filter(o => o.output_type === 'error')
                   .map(o => `cell ${{i}}: ${{o.ename}}: ${{o.evalue}}\\n`
                             + o.traceback.join('\\n').replace(/\\x1b\\[[0-9;]*m/g, '')))""",
            self.path)
        assert not errors, f"{self.path}: a cell failed under Run All:\n" + "\n".join(errors)

    def panel(self, css_class: str) -> Any:
        """The (one) widget panel with ``css_class`` in this notebook's outputs."""
        return self.root.locator(f".{css_class}")


@contextlib.contextmanager
def screenshot_on_exit(page: Any, name: str) -> Iterator[None]:
    """Save a full-page screenshot as ``ARTIFACTS/name.png`` however the block ends."""
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a dead page must not hide the real failure
            page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

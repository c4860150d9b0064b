"""Save a figure to a file, the format chosen by its suffix: HTML always, images via kaleido.

Static images (PNG, SVG, PDF) need kaleido >= 1.0, which drives a Chrome or Chromium found on
the machine (``BROWSER_PATH``, else its own search of the usual places); kvvmm never
downloads one. When either is missing the error names the fix.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import plotly.graph_objects as go

from kvvmm.checks import int_arg
from kvvmm.errors import ArgumentError, KvvmmError

__all__ = ["ExportError", "save_figure"]

_IMAGE = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
_HTML = (".html", ".htm")
#: Where a system Chromium usually lives (Debian/Ubuntu packages, snap, Chrome).
_BROWSERS = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/snap/bin/chromium",
             "/usr/bin/google-chrome", "/usr/bin/google-chrome-stable")


class ExportError(KvvmmError):
    """A static image cannot be written here: install what the message names, or save .html."""


def _browser() -> str | None:
    """A Chrome/Chromium for kaleido: ``BROWSER_PATH`` if set, else a usual system one."""
    env = os.environ.get("BROWSER_PATH")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return next((p for p in _BROWSERS if os.path.exists(p)), None)


def save_figure(fig: go.Figure, path: str | os.PathLike[str], *, width: int | None = None,
                height: int | None = None) -> Path:
    """Write ``fig`` to ``path``: ``.html`` (the default without a suffix), ``.png``,
    ``.svg`` or ``.pdf``.

    HTML embeds plotly.js (the file opens offline) and stays responsive; images are drawn by
    kaleido in the system Chromium at ``width`` x ``height`` pixels (default: 1280 wide, the
    figure's own height).

    Args:
        fig: a plotly figure (``va_map(...)``, ``timeline(...)``, ...).
        path: where to write; its suffix picks the format; a path without one gets ``.html``.
        width: image width in pixels, >= 1 (images only; HTML fills the window).
        height: image height in pixels, >= 1 (default: ``fig.layout.height``, else 600).
    Returns:
        The path written.
    Raises:
        ArgumentError: an unknown suffix or a bad size.
        ExportError: an image was asked for and kaleido (>= 1.0) or Chrome/Chromium is
            missing; the message says what to install.
    """
    if not isinstance(fig, go.Figure):
        raise ArgumentError("fig", type(fig).__name__, "a plotly.graph_objects.Figure")
    for name, value in (("width", width), ("height", height)):
        if value is not None:
            int_arg(name, value, lo=1, limit="an int >= 1 (pixels) or None")
    out = Path(path)
    suffix = out.suffix.lower()
    if not suffix:
        out, suffix = out.with_suffix(".html"), ".html"
    if suffix in _HTML:
        import plotly.io as pio

        pio.write_html(fig, out, include_plotlyjs=True, full_html=True,
                       config={"responsive": True})
        return out
    if suffix not in _IMAGE:
        raise ArgumentError("path", str(path),
                            f"a file ending in one of {[*_HTML, *_IMAGE]}")
    _write_image(fig, out, _IMAGE[suffix], _kaleido_browser(out), width or 1280,
                 height or fig.layout.height or 600)
    return out


def _kaleido_browser(out: Path) -> str:
    """The browser kaleido (>= 1.0) draws ``out`` with.

    Raises:
        ExportError: kaleido missing or older than 1.0, or no Chrome/Chromium found.
    """
    try:
        import kaleido  # type: ignore[import-untyped]  # untyped, optional
    except ImportError as e:
        raise ExportError(
            f"saving {out.name} needs kaleido >= 1.0: pip install 'kaleido>=1.0' (or the "
            "lab extra), or save to .html instead") from e
    version = getattr(kaleido, "__version__", "1")
    if int(str(version).split(".")[0]) < 1:
        raise ExportError(f"kaleido {version} is too old for plotly's image export: "
                          "pip install 'kaleido>=1.0'")
    browser = _browser()
    if browser is None:
        raise ExportError(
            f"saving {out.name} needs Chrome or Chromium for kaleido: install it "
            "(apt-get install chromium) or set BROWSER_PATH to its executable; or save to "
            ".html instead")
    return browser


def _write_image(fig: go.Figure, out: Path, fmt: str, browser: str, width: int,
                 height: int) -> None:
    """``fig`` drawn by kaleido in ``browser`` as ``fmt`` at ``width`` x ``height`` px.

    Raises:
        ExportError: kaleido could not draw it (the browser did not start, ...).
    """
    # kaleido (through choreographer) reads BROWSER_PATH when it starts a browser; set it
    # only when unset, and only for this call.
    had = "BROWSER_PATH" in os.environ
    os.environ.setdefault("BROWSER_PATH", browser)
    try:
        import plotly.io as pio

        pio.write_image(fig, out, format=fmt, width=width, height=height)
    except (RuntimeError, OSError) as e:
        raise ExportError(f"kaleido could not draw {out.name} with {browser}: {e}; check "
                          "that the browser starts, or save to .html instead") from e
    finally:
        if not had:
            os.environ.pop("BROWSER_PATH", None)

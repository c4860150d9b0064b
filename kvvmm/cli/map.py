"""``kvvmm map trace.json -o map.html``: a saved trace's arenas as a standalone page."""

from __future__ import annotations

import argparse
import html
from collections.abc import Sequence
from pathlib import Path

from kvvmm.cli.common import _err, output_path, show

#: Suffixes ``kvvmm map -o`` writes as images (one per figure) rather than one HTML page.
_IMAGE_SUFFIXES = (".png", ".svg", ".pdf")


def _cmd_map(args: argparse.Namespace) -> int:
    from kvvmm.record import Trace
    from kvvmm.replay import replay_arenas
    from kvvmm.viz import timeline, va_map

    src = Path(args.trace)
    if not src.is_file():
        _err("map", f"trace {str(src)!r} is not a file (a trace JSON: Trace.save)")
        return 2
    # Checked before the trace is read: a bad -o is said at once, and the file named after
    # is the one written.
    out = output_path(args.output if args.output else str(src.with_suffix(".html")),
                      (".html", *_IMAGE_SUFFIXES))
    trace = Trace.load(src)
    snaps = replay_arenas(trace)
    figs = [va_map(s) for s in snaps]
    if not args.no_timeline:
        figs.append(timeline(trace))
    if not figs:
        _err("map", f"{str(src)!r} recorded no arena and no call: nothing to draw")
        return 2
    what = f"{len(snaps)} arena maps{'' if args.no_timeline else ' + timeline'}"
    if out.suffix.lower() in _IMAGE_SUFFIXES:
        written = _map_images(figs, out)
        print(f"wrote {show(', '.join(map(str, written)))} ({what})")
        return 0
    parts = [f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs)]
    # The trace's file name is the user's (or an attacker's) text: escape it, or a name such
    # as "<script>...</script>.json" runs in the browser of whoever opens the page.
    title = html.escape(f"kvvmm map of {src.name}")
    page = ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{title}</title></head><body>\n<h3 style=\"font-family:sans-serif\">{title}"
            f" ({len(snaps)} arenas, {len(trace.driver_calls())} driver calls)</h3>\n"
            + "\n".join(parts) + "\n</body></html>\n")
    out.write_text(page, encoding="utf-8")
    print(f"wrote {show(out)} ({what})")
    return 0


def _map_images(figs: Sequence[object], out: Path) -> list[Path]:
    """One image per figure: ``out`` itself for one, ``stem-0``, ``stem-1``... for several."""
    from kvvmm.viz.export import save_figure

    if len(figs) == 1:
        return [save_figure(figs[0], out)]
    return [save_figure(f, out.with_name(f"{out.stem}-{i}{out.suffix}"))
            for i, f in enumerate(figs)]

"""The ``kvvmm`` command: ``lab``, ``map``, ``plan``, ``bench`` and ``budget``.

- ``kvvmm lab``: JupyterLab on the repository's ``notebooks/``, with ``KVVMM_DRIVER`` set
  for the notebooks to read (``cuda`` when a GPU is usable, else ``sim``).
- ``kvvmm map trace.json -o map.html``: a standalone HTML page (plotly.js inline, works
  offline) with the VA map of every arena a saved trace recorded, and its timeline. With
  ``-o map.png`` (or .svg, .pdf) each figure becomes one image (kaleido + Chromium):
  ``map.png`` for one figure, ``map-0.png``, ``map-1.png``, ... in page order for several.
- ``kvvmm plan --model llama-3.1-8b --gpu h200``: the capacity plan as a table, or ``--json``.
- ``kvvmm bench ...``: the GPU benchmarks (``kvvmm.measure.bench``); without a usable GPU it says
  so in one line.
- ``kvvmm budget show | set TENANT BYTES | init BYTES``: the per-GPU budget ledger
  (``kvvmm.budget.cli``).
- ``kvvmm --version``.

Exit codes: 0 success, 2 bad input or a missing piece (with one line saying why), else
what the delegated command returns.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvvmm.errors import KvvmmError
from kvvmm.hardware import GPU_HELP, profile_summary
from kvvmm.units import GiB, KiB, MiB, TiB

__all__ = ["find_notebooks", "lab_command", "main", "parse_bytes"]

#: The environment variable the notebooks read to pick their driver.
DRIVER_ENV = "KVVMM_DRIVER"

Launcher = Callable[[Sequence[str], Mapping[str, str]], int]
GpuProbe = Callable[[], bool]

_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920; plain ints are bytes; KiB/MiB/GiB/TiB and KB/MB/GB/TB.

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: use bytes (85899345920) or a unit (80GiB, 512MiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(value)


# -- lab ---------------------------------------------------------------------------------


def find_notebooks(start: Path | None = None) -> Path | None:
    """The notebooks folder: ``./notebooks`` (or ``.`` if it holds them), else the repo's.

    The repository's folder is found next to the package (an editable install or a checkout).
    """
    here = Path.cwd() if start is None else start
    pkg_repo = Path(__file__).resolve().parent.parent
    for cand in (here / "notebooks", here, pkg_repo / "notebooks"):
        if cand.is_dir() and any(cand.glob("[0-9][0-9]_*.ipynb")):
            return cand
    return None


def _gpu_usable() -> bool:
    """True when the CUDA driver opens; asked in a child process so no context stays here."""
    code = "from kvvmm.driver import open_driver; open_driver('cuda')"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def lab_command(args: argparse.Namespace, notebooks: Path, gpu_probe: GpuProbe = _gpu_usable,
                environ: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start JupyterLab for ``kvvmm lab`` (nothing is run).

    ``--driver auto`` becomes ``cuda`` when ``gpu_probe()`` says a GPU is usable, else
    ``sim`` (every notebook runs there, and its outputs match the saved ones).
    """
    driver = args.driver
    if driver == "auto":
        driver = "cuda" if gpu_probe() else "sim"
    argv = [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={notebooks}"]
    tour = notebooks / "01_tour.ipynb"
    if tour.exists():
        argv.append("--LabApp.default_url=/lab/tree/01_tour.ipynb")
    if args.port is not None:
        argv.append(f"--ServerApp.port={args.port}")
    if args.no_browser:
        argv.append("--no-browser")
    if is_root():
        # Jupyter refuses to start as root without it; containers and CI machines run so.
        argv.append("--allow-root")
    argv += list(args.jupyter_args or [])
    env = dict(os.environ if environ is None else environ)
    env[DRIVER_ENV] = driver
    return argv, env


def is_root() -> bool:
    """True when running as root (POSIX); Jupyter then needs ``--allow-root``."""
    geteuid = getattr(os, "geteuid", None)
    return geteuid is not None and geteuid() == 0


def _launch(argv: Sequence[str], env: Mapping[str, str]) -> int:
    try:
        return subprocess.call(list(argv), env=dict(env))
    except KeyboardInterrupt:
        return 0


def _cmd_lab(args: argparse.Namespace, launch: Launcher, gpu_probe: GpuProbe) -> int:
    notebooks = Path(args.notebooks) if args.notebooks else find_notebooks()
    if notebooks is None or not notebooks.is_dir():
        _err("lab", "no notebooks folder found: run this in the kvvmm repository (it has "
                    "notebooks/) or pass --notebooks DIR")
        return 2
    # JupyterLab autosaves whatever it opens: it opens working copies in an ignored folder,
    # so using the lab never changes a tracked notebook (a user's edits stay in the copies).
    from kvvmm.workspace import prepare_workspace

    work = prepare_workspace(notebooks)
    argv, env = lab_command(args, work, gpu_probe)
    print(f"kvvmm lab: {DRIVER_ENV}={env[DRIVER_ENV]}, working copies of {notebooks} in "
          f"{work} (git ignores them; delete one to get the current version back)", flush=True)
    return launch(argv, env)


# -- map ---------------------------------------------------------------------------------


#: Suffixes ``kvvmm map -o`` writes as images (one per figure) rather than one HTML page.
_IMAGE_SUFFIXES = (".png", ".svg", ".pdf")


def _cmd_map(args: argparse.Namespace) -> int:
    from kvvmm.record import Trace
    from kvvmm.replay import replay_arenas
    from kvvmm.viz import timeline, va_map

    src = Path(args.trace)
    out = Path(args.output) if args.output else src.with_suffix(".html")
    trace = Trace.load(src)
    snaps = replay_arenas(trace)
    figs = [va_map(s) for s in snaps]
    if not args.no_timeline:
        figs.append(timeline(trace))
    if not figs:
        _err("map", f"{src} recorded no arena and no call: nothing to draw")
        return 2
    what = f"{len(snaps)} arena maps{'' if args.no_timeline else ' + timeline'}"
    if out.suffix.lower() in _IMAGE_SUFFIXES:
        written = _map_images(figs, out)
        print(f"wrote {', '.join(map(str, written))} ({what})")
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
    print(f"wrote {out} ({what})")
    return 0


def _map_images(figs: Sequence[object], out: Path) -> list[Path]:
    """One image per figure: ``out`` itself for one, ``stem-0``, ``stem-1``... for several.

    Separate files rather than one stacked image: the figures differ in kind and height
    (a VA map per arena, a timeline), and each stays readable at its own size.
    """
    from kvvmm.viz.export import save_figure

    if len(figs) == 1:
        return [save_figure(figs[0], out)]
    return [save_figure(f, out.with_name(f"{out.stem}-{i}{out.suffix}"))
            for i, f in enumerate(figs)]


# -- plan --------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    from kvvmm.layout import plan
    from kvvmm.viz import format_plan

    p = plan(gpu=args.gpu, model=args.model, dtype=args.dtype, page_size=args.page_size,
             tp=args.tp, budget_bytes=args.budget_bytes, headroom_bytes=args.headroom_bytes,
             free_bytes=args.free_bytes, layout=args.layout,
             reserved_tokens=args.reserved_tokens, count_overhead=args.count_overhead,
             mem_fraction_static=args.mem_fraction_static, weights_dtype=args.weights_dtype,
             max_total_tokens=args.max_total_tokens)
    used = profile_summary(args.gpu)
    if args.json:
        print(json.dumps({**p.to_dict(), "profile": used}, indent=2))
    else:
        print(f"profile: {used['key']} ({used['card']}, measured {used['date']}; "
              f"{used['path']})")
        print(format_plan(p))
    return 0


# -- bench -------------------------------------------------------------------------------


def _torch_cuda_usable() -> bool:
    """True when torch is installed with CUDA and sees a GPU (what the benchmarks run on)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _cmd_bench(rest: Sequence[str], gpu_probe: GpuProbe) -> int:
    try:
        from kvvmm.measure import bench
    except ImportError as e:
        _err("bench", f"the benchmarks are not available in this install ({e})")
        return 2
    asks_help = any(a in ("-h", "--help") for a in rest)
    if not asks_help and not gpu_probe():
        # Said here, in one line: deeper down torch raises an AssertionError with a traceback.
        _err("bench", "needs a CUDA GPU and a CUDA build of torch; none is usable here "
                      "(torch.cuda.is_available() is False). Run it on a GPU machine; "
                      "`kvvmm lab` runs the notebooks on the sim driver.")
        return 2
    try:
        return int(bench.main(list(rest)) or 0)
    except KvvmmError as e:
        _err("bench", f"{type(e).__name__}: {e}")
        return 2


# -- main --------------------------------------------------------------------------------


def _err(cmd: str, msg: str) -> None:
    # One line, whatever the message holds (a hostile trace's text may carry newlines).
    one_line = msg.replace("\r", "\\r").replace("\n", "\\n")
    print(f"kvvmm {cmd}: error: {one_line}", file=sys.stderr)


def _version() -> str:
    from kvvmm import __version__

    return __version__


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvvmm", description="CUDA virtual memory for LLM KV caches: lab and tools.")
    ap.add_argument("--version", action="version", version=f"kvvmm {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    lab = sub.add_parser("lab", help="open JupyterLab on the notebooks",
                         description="Open JupyterLab on notebooks/ with KVVMM_DRIVER set.")
    lab.add_argument("--driver", choices=["auto", "sim", "host", "cuda"], default="auto",
                     help="driver the notebooks use (auto: cuda with a usable GPU, else sim)")
    lab.add_argument("--port", type=int, default=None, help="JupyterLab's port")
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser")
    lab.add_argument("--notebooks", default=None, help="notebooks folder (default: found)")
    lab.add_argument("jupyter_args", nargs="*", help="more arguments for jupyter lab "
                                                     "(after --)")

    mp = sub.add_parser("map", help="write an HTML VA map of a saved trace",
                        description="Replay a trace's arenas and draw them as standalone HTML "
                                    "(or images: -o map.png).")
    mp.add_argument("trace", help="trace JSON (Trace.save / TracingDriver)")
    mp.add_argument("-o", "--output", default=None,
                    help="HTML file (default: TRACE.html); .png/.svg/.pdf write one image per "
                         "figure (MAP-0.png, MAP-1.png, ... when several; needs kaleido and "
                         "Chromium)")
    mp.add_argument("--no-timeline", action="store_true", help="only the VA maps")

    pl = sub.add_parser("plan", help="plan a KV cache: tokens, VA, backing, handles",
                        description="Capacity plan for a model on one GPU (kvvmm.plan).")
    pl.add_argument("--model", default="llama-3.1-8b",
                    help="shipped model key (llama-3.1-8b, ...), a Hugging Face repo id of one "
                         "(meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen2.5-7B, ...), or a path "
                         "to a config.json")
    pl.add_argument("--gpu", default="h200", help=GPU_HELP)
    pl.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    pl.add_argument("--dtype", default="bfloat16", help="KV dtype")
    pl.add_argument("--page-size", type=int, default=16, help="tokens per page")
    pl.add_argument("--layout", default="token_major", choices=["token_major", "page_major"])
    pl.add_argument("--budget-bytes", type=parse_bytes, default=None,
                    help="KV budget (80GiB, or bytes), alone; default "
                         "max(0, free - headroom) + backed, as SGLang sizes after capture")
    pl.add_argument("--free-bytes", type=parse_bytes, default=None,
                    help="free memory measured after loading weights and capturing graphs "
                         "(torch.cuda.mem_get_info); default: the card less the weights")
    pl.add_argument("--headroom-bytes", type=parse_bytes, default=None,
                    help="memory kept back for activations, graphs and the allocator; "
                         "default total * (1 - mem-fraction-static)")
    pl.add_argument("--mem-fraction-static", type=float, default=None,
                    help="SGLang's share of the card for weights + KV (default 0.9); "
                         "not with --headroom-bytes")
    pl.add_argument("--weights-dtype", default=None,
                    help="dtype the weights are counted in (default: the model's, as its "
                         "config says: fp8 for DeepSeek-V3, else its torch_dtype)")
    pl.add_argument("--max-total-tokens", type=int, default=None,
                    help="cap on the KV tokens (SGLang's --max-total-tokens)")
    pl.add_argument("--reserved-tokens", type=int, default=None,
                    help="upper bound the VA is reserved for (default: the planned tokens)")
    pl.add_argument("--count-overhead", action="store_true",
                    help="count padding and granularity rounding against the budget")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    sub.add_parser("bench", help="run the GPU benchmarks (kvvmm.measure.bench; arguments pass on)",
                   add_help=False)
    sub.add_parser("calibrate", help="measure this GPU and write a sim profile "
                                     "(kvvmm.measure.calibrate; arguments pass on)", add_help=False)
    from kvvmm.workload.cli import add_replay_parser

    add_replay_parser(sub)
    from kvvmm.budget.cli import add_budget_parser

    add_budget_parser(sub)
    return ap


def main(argv: Sequence[str] | None = None, *, launch: Launcher | None = None,
         gpu_probe: GpuProbe | None = None) -> int:
    """Run the ``kvvmm`` command line.

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).
        launch: runs ``(argv, env)`` for ``kvvmm lab`` (default: a child process); tests
            pass a fake to see the command without starting JupyterLab.
        gpu_probe: says whether a GPU is usable, for ``lab --driver auto`` and ``bench``
            (default: a child process opening the CUDA driver; for bench, torch's view).
    Returns:
        The exit code.
    """
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in and args_in[0] == "bench":
        return _cmd_bench(args_in[1:], gpu_probe or _torch_cuda_usable)
    if args_in and args_in[0] == "calibrate":
        from kvvmm.measure import calibrate  # it says itself, in one line, when there is no GPU

        return int(calibrate.main(args_in[1:]))
    args = _parser().parse_args(args_in)
    try:
        if args.cmd == "lab":
            return _cmd_lab(args, launch or _launch, gpu_probe or _gpu_usable)
        if args.cmd == "map":
            return _cmd_map(args)
        if args.cmd == "plan":
            return _cmd_plan(args)
        if args.cmd == "replay":
            from kvvmm.workload.cli import replay_command

            return replay_command(args)
        if args.cmd == "budget":
            from kvvmm.budget.cli import budget_command

            return budget_command(args)
    except BrokenPipeError:  # `kvvmm plan | head`: the reader left; not an error
        return 0
    except (KvvmmError, ValueError, OSError) as e:
        _err(args.cmd, f"{type(e).__name__}: {e}")
        return 2
    raise AssertionError(f"unhandled command {args.cmd!r}")  # argparse allows no other


if __name__ == "__main__":
    sys.exit(main())

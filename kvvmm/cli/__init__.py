"""The ``kvvmm`` command: parses and dispatches to one module per command (``lab``, ``map``,
``plan``, ``bench``, ``replay``, ``budget``; ``calibrate`` is :mod:`kvvmm.measure`'s).

Exit codes: 0 success, 2 bad input or a missing piece (one escaped line saying why, never a
traceback: :mod:`kvvmm.cli.common`), else what the delegated command returns.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvvmm.cli.bench import _cmd_bench, _torch_cuda_usable
from kvvmm.cli.common import (
    MAX_TOKENS,
    MAX_TP,
    CliParser,
    _err,
    help_columns,
    int_type,
    number_type,
    parse_bytes,
    path_type,
)
from kvvmm.cli.lab import GpuProbe, Launcher, _cmd_lab, _gpu_usable, _launch, find_notebooks
from kvvmm.cli.map import _cmd_map
from kvvmm.cli.plan import _cmd_plan
from kvvmm.driver import DRIVER_KINDS
from kvvmm.errors import KvvmmError
from kvvmm.hardware import GPU_HELP

__all__ = ["find_notebooks", "main", "parse_bytes"]


def _version() -> str:
    from kvvmm import __version__

    return __version__


def _parser() -> argparse.ArgumentParser:
    ap = CliParser(
        prog="kvvmm", description="CUDA virtual memory for LLM KV caches: lab and tools.")
    ap.add_argument("--version", action="version", version=f"kvvmm {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    lab = sub.add_parser("lab", help="open JupyterLab on the notebooks",
                         description="Open JupyterLab on notebooks/ with KVVMM_DRIVER set.")
    lab.add_argument("--driver", choices=["auto", *DRIVER_KINDS], default="auto",
                     help="driver the notebooks use (auto: cuda with a usable GPU, else sim)")
    lab.add_argument("--port", type=int_type(1, 65535, "a TCP port"), default=None,
                     help="JupyterLab's port")
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser")
    lab.add_argument("--notebooks", type=path_type, default=None,
                     help="notebooks folder (default: found)")
    lab.add_argument("jupyter_args", nargs="*", help="more arguments for jupyter lab "
                                                     "(after --)")

    mp = sub.add_parser("map", help="write an HTML VA map of a saved trace",
                        description="Replay a trace's arenas and draw them as standalone HTML "
                                    "(or images: -o map.png).")
    mp.add_argument("trace", type=path_type, help="trace JSON (Trace.save / TracingDriver)")
    mp.add_argument("-o", "--output", type=path_type, default=None,
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
    pl.add_argument("--tp", type=int_type(1, MAX_TP, "GPUs"), default=1,
                    help="tensor-parallel size")
    pl.add_argument("--dtype", default="bfloat16", help="KV dtype")
    pl.add_argument("--page-size", type=int_type(1, MAX_TOKENS, "tokens"), default=16,
                    help="tokens per page")
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
    pl.add_argument("--mem-fraction-static", type=number_type(0, 1, "a share", lo_open=True),
                    default=None,
                    help="SGLang's share of the card for weights + KV (default 0.9); "
                         "not with --headroom-bytes")
    pl.add_argument("--weights-dtype", default=None,
                    help="dtype the weights are counted in (default: the model's, as its "
                         "config says: fp8 for DeepSeek-V3, else its torch_dtype)")
    pl.add_argument("--max-total-tokens", type=int_type(1, MAX_TOKENS, "tokens"), default=None,
                    help="cap on the KV tokens (SGLang's --max-total-tokens)")
    pl.add_argument("--reserved-tokens", type=int_type(1, MAX_TOKENS, "tokens"), default=None,
                    help="upper bound the VA is reserved for (default: the planned tokens)")
    pl.add_argument("--count-overhead", action="store_true",
                    help="count padding and granularity rounding against the budget")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    sub.add_parser("bench", help="run the GPU benchmarks (kvvmm.measure.bench; arguments pass on)",
                   add_help=False)
    sub.add_parser("calibrate", help="measure this GPU and write a sim profile "
                                     "(kvvmm.measure.calibrate; arguments pass on)", add_help=False)
    from kvvmm.cli.replay import add_replay_parser

    add_replay_parser(sub)
    from kvvmm.cli.budget import add_budget_parser

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
    if args_in and args_in[0] in ("bench", "calibrate"):
        with help_columns():  # their own parsers: laid out for HELP_COLUMNS as well
            return _cmd_delegated(args_in[0], args_in[1:], gpu_probe)
    args = _parser().parse_args(args_in)
    try:
        if args.cmd == "lab":
            return _cmd_lab(args, launch or _launch, gpu_probe or _gpu_usable)
        if args.cmd == "map":
            return _cmd_map(args)
        if args.cmd == "plan":
            return _cmd_plan(args)
        if args.cmd == "replay":
            from kvvmm.cli.replay import replay_command

            return replay_command(args)
        if args.cmd == "budget":
            from kvvmm.cli.budget import budget_command

            return budget_command(args)
    except BrokenPipeError:  # `kvvmm plan | head`: the reader left; not an error
        return 0
    except (KvvmmError, ValueError, OSError) as e:
        _err(args.cmd, f"{type(e).__name__}: {e}")
        return 2
    except Exception as e:
        # Input read deep inside (a trace, a config, a profile) is still input: one line and
        # exit 2, never a traceback. Named as what it is, so a bug still shows its class.
        _err(args.cmd, f"could not be run ({type(e).__name__}: {e})")
        return 2
    raise AssertionError(f"unhandled command {args.cmd!r}")  # argparse allows no other


def _cmd_delegated(cmd: str, rest: list[str], gpu_probe: GpuProbe | None) -> int:
    """``kvvmm bench`` and ``kvvmm calibrate``: their modules parse their own arguments."""
    if cmd == "bench":
        return _cmd_bench(rest, gpu_probe or _torch_cuda_usable)
    from kvvmm.measure import calibrate  # it says itself, in one line, when there is no GPU

    try:
        return int(calibrate.main(rest))
    except (KvvmmError, ValueError, OSError) as e:
        _err(cmd, f"{type(e).__name__}: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``kvvmm replay``: a trace through the serving model and memory strategies, on the sim.

    kvvmm replay TRACE --model llama-3.1-70b --gpu h200 --tp 8 --strategy prefix [...]

TRACE is an Azure LLM inference trace CSV or a JSONL of requests, or ``generated`` for the
generator fitted to Azure's conversation trace (``--seed``). Prints the summary table,
writes an HTML report (``-o``; and a PNG beside it with ``--png``), or prints JSON
(``--json``). Bad input exits 2 with one line naming it. This module sits at the CLI layer
(it writes reports through :mod:`kvvmm.viz`); ``kvvmm.cli`` wires it in.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvvmm.errors import KvvmmError
from kvvmm.hardware import GPU_HELP, profile_summary
from kvvmm.workload import (
    SLOT_ORDERS,
    STRATEGIES,
    ServingConfig,
    generate,
    load_workload,
    run_workload,
)

__all__ = ["add_replay_parser", "replay_command"]


def add_replay_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``replay`` sub-command to ``subparsers`` (``parser.add_subparsers(dest="cmd")``)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "replay", help="replay a request trace against memory strategies (sim driver)",
        description="Serve a request trace (Azure CSV, JSONL, or 'generated') with continuous "
                    "batching, once per memory strategy, each on a real KvBufferOwner; print "
                    "the summary and write an HTML report.")
    p.add_argument("trace", help="a .csv (Azure format) or .jsonl trace, or 'generated'")
    p.add_argument("--model", default="llama-3.1-70b")
    p.add_argument("--gpu", default="h200", help=GPU_HELP)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--strategy", action="append", choices=STRATEGIES, default=None,
                   help="a strategy to run (repeat it; default: all)")
    p.add_argument("--slot-order", choices=SLOT_ORDERS, default="lowest")
    p.add_argument("--seconds", type=float, default=None,
                   help="only the first SECONDS of the trace (generated: its length, "
                        "default 600)")
    p.add_argument("--seed", type=int, default=0, help="generated workloads' seed")
    p.add_argument("--driver", choices=("sim", "host", "cuda"), default="sim")
    p.add_argument("--pool-tokens", type=int, default=None,
                   help="KV pool tokens per rank (default: what the planner fits)")
    p.add_argument("-o", "--output", default=None,
                   help="HTML report (default: <trace>-replay.html in the current folder)")
    p.add_argument("--png", action="store_true", help="also write the figure as PNG "
                                                      "(needs kaleido and Chromium)")
    p.add_argument("--json", action="store_true",
                   help="print the summary as JSON and write no report")
    p.add_argument("--no-bands", action="store_true",
                   help="skip the p10-p90 bands of the timed figures (on the sim they run "
                        "the replay twice more, at the profile's p10 and p90 costs)")
    return p


#: the longest error line replay prints (a message quoting a huge input is cut)
_MAX_LINE = 500


def _fail(msg: str) -> int:
    line = " ".join(msg.split())  # one line, whatever the message held
    if len(line) > _MAX_LINE:
        line = line[:_MAX_LINE] + f"... ({len(line):,} characters)"
    print(f"kvvmm replay: {line}", file=sys.stderr)
    return 2


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float as None: the output is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _profile_line(used: dict[str, str]) -> str:
    return (f"profile: {used['key']} ({used['card']}, measured {used['date']}; "
            f"{used['path']})")


def replay_command(args: argparse.Namespace) -> int:
    """Run ``kvvmm replay`` with parsed ``args``; the exit code (2: bad input)."""
    try:
        if args.trace == "generated":
            wl = generate(seed=args.seed,
                          duration_s=600.0 if args.seconds is None else args.seconds)
        else:
            if not Path(args.trace).is_file():
                return _fail(f"trace {args.trace!r} is not a file (a .csv, a .jsonl, or "
                             f"'generated')")
            wl = load_workload(args.trace)
            if args.seconds is not None:
                wl = wl.first(args.seconds)
        if not len(wl):
            return _fail(f"trace {args.trace!r} has no requests")
        cmp = run_workload(wl, args.strategy or list(STRATEGIES), model=args.model,
                           gpu=args.gpu, tp=args.tp, driver=args.driver,
                           pool_tokens=args.pool_tokens,
                           config=ServingConfig(slot_order=args.slot_order))
    except (KvvmmError, ValueError, OSError) as e:
        return _fail(f"{type(e).__name__}: {e}")
    except Exception as e:
        # Input this deep inside is still input: one line and exit 2, never a traceback
        # (hardening round 2). Named as what it is, so a bug still shows its class.
        return _fail(f"the input could not be replayed ({type(e).__name__}: {e})")
    used = profile_summary(args.gpu)
    bands: dict[str, Any] = {}
    if args.driver == "sim" and not args.no_bands:
        from kvvmm.workload.bands import workload_bands

        try:
            bands = workload_bands(wl, [r.strategy for r in cmp.results], gpu=args.gpu,
                                   mid=cmp, model=args.model, tp=args.tp,
                                   pool_tokens=args.pool_tokens,
                                   config=ServingConfig(slot_order=args.slot_order))
        except Exception as e:  # the point figures stand; the bands say why they are missing
            return _fail(f"the bands could not be run ({type(e).__name__}: {e})")
    if args.json:
        from kvvmm.workload.bands import BAND_QUANTILES, band_notes

        s = cmp.setup
        results: list[dict[str, Any]] = [dict(r) for r in cmp.summary()]
        for row in results:
            if row["strategy"] in bands:
                row["bands"] = {k: b.as_list() for k, b in bands[str(row["strategy"])].items()}
        print(json.dumps(_strict({"model": s.model, "gpu": s.gpu, "profile": used, "tp": s.tp,
                                  "pool_tokens": s.pool_tokens, "requests": s.requests,
                                  "workload": s.workload, "slot_order": s.config.slot_order,
                                  "band": {"quantiles": list(BAND_QUANTILES),
                                           "fields": "[low, mid, high] per timed figure",
                                           "notes": band_notes(args.gpu)} if bands else None,
                                  "results": results}), indent=1, allow_nan=False))
        return 0
    from kvvmm.viz import save_figure
    from kvvmm.viz.workload import format_workload, workload_figure

    text = format_workload(cmp)
    print(_profile_line(used))
    print(text)
    if bands:
        from kvvmm.viz.bands import add_decode_bands, format_workload_bands
        from kvvmm.workload.bands import band_notes

        print(format_workload_bands(bands, band_notes(args.gpu)))
    stem = "generated" if args.trace == "generated" else Path(args.trace).stem
    out = Path(args.output) if args.output else Path(f"{stem}-replay.html")
    fig = workload_figure(cmp)
    if bands:
        add_decode_bands(fig, cmp, bands)
    fig.update_layout(title_text=f"kvvmm replay: {stem}")  # text only: the placement stays
    try:
        save_figure(fig, out)
        print(f"wrote {out}")
        if args.png:
            save_figure(fig, out.with_suffix(".png"))
            print(f"wrote {out.with_suffix('.png')}")
    except (KvvmmError, OSError) as e:
        return _fail(f"{type(e).__name__}: {e}")
    return 0

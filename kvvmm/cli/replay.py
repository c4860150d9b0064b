"""``kvvmm replay``: a trace through the serving model and memory strategies, on the sim.

    kvvmm replay TRACE --model llama-3.1-70b --gpu h200 --tp 8 --strategy prefix [...]

TRACE is an Azure LLM inference trace CSV or a JSONL of requests, or ``generated`` for the
generator fitted to Azure's conversation trace (``--seed``). With ``--tenants`` (and no TRACE)
several models share one simulated GPU's budget (:mod:`kvvmm.workload.tenants`):

    kvvmm replay --tenants llama-3.1-8b:conv,qwen2.5-7b:generated@300 --budget 2GiB
 Prints the summary table,
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

from kvvmm.driver import DRIVER_KINDS
from kvvmm.errors import ArgumentError, KvvmmError
from kvvmm.hardware import GPU_HELP, profile_summary
from kvvmm.layout import load_model
from kvvmm.workload import (
    SLOT_ORDERS,
    STRATEGIES,
    ServingConfig,
    Workload,
    find_trace,
    generate,
    load_workload,
    run_workload,
)
from kvvmm.workload.run import Progress, tqdm_progress
from kvvmm.workload.tenants import Demand, Tenant, compare_tenants, shifted

__all__ = ["add_replay_parser", "parse_tenants", "replay_command"]


def add_replay_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``replay`` sub-command to ``subparsers`` (``parser.add_subparsers(dest="cmd")``)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "replay", help="replay a request trace against memory strategies (sim driver)",
        description="Serve a request trace (Azure CSV, JSONL, or 'generated') with continuous "
                    "batching, once per memory strategy, each on a real KvBufferOwner; print "
                    "the summary and write an HTML report.")
    p.add_argument("trace", nargs="?", default=None,
                   help="a .csv (Azure format) or .jsonl trace, or 'generated' (not with "
                        "--tenants)")
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
    p.add_argument("--driver", choices=DRIVER_KINDS, default="sim")
    p.add_argument("--real-time", action="store_true",
                   help="on the sim, charge each call the cold premium an engine serving the "
                        "trace as it came would pay (its calls are a step or more apart); "
                        "default: as warm as back to back")
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
    t = p.add_argument_group(
        "tenants", "several models on one simulated GPU sharing one KV budget, e.g. "
        "--tenants llama-3.1-8b:conv,qwen2.5-7b:generated@300 --budget 2GiB; each tenant is "
        "MODEL:TRACE[@OFFSET_S], TRACE 'conv' (Azure's conversation trace, when present), "
        "'generated' (the generator, seed --seed plus the tenant's index) or a .csv/.jsonl "
        "path; --seconds cuts each trace (default 600)")
    t.add_argument("--tenants", default=None, metavar="MODEL:TRACE[@S],...",
                   help="run tenants instead of strategies: alone on the budget, a static "
                        "equal split, and elastic sharing")
    t.add_argument("--budget", default=None, metavar="BYTES",
                   help="the KV budget the tenants share (2GiB, 512MiB or bytes; needed with "
                        "--tenants)")
    t.add_argument("--demand", default=None, metavar="BYTES@S",
                   help="also take BYTES of the budget at S seconds (a second engine "
                        "starting) and measure each answer: reject, shed, preempt")
    t.add_argument("--deadline-ms", type=float, default=5.0,
                   help="driver time a request may wait for other tenants to shed")
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


def _tenant_workload(trace: str, seed: int, seconds: float) -> Workload:
    if trace == "generated":
        return generate(seed=seed, duration_s=seconds)
    path = find_trace() if trace == "conv" else Path(trace)
    if path is None:
        raise ArgumentError("TRACE", "conv", "a trace present (Azure's conversation trace was "
                            "not found: name a .csv or .jsonl, or use 'generated')")
    if not Path(path).is_file():
        raise ArgumentError("TRACE", trace, "'conv', 'generated' or a .csv/.jsonl file")
    return load_workload(path).first(seconds)


def parse_tenants(text: str, *, seed: int = 0, seconds: float = 600.0) -> list[Tenant]:
    """``MODEL:TRACE[@OFFSET_S],...`` -> tenants (elastic, each on the whole budget).

    Raises:
        ArgumentError: a bad item (no ':', an unknown model, a bad offset, an empty list).
    """
    items = [x.strip() for x in str(text).split(",")]
    if not items or any(not x for x in items):
        raise ArgumentError("--tenants", text, "MODEL:TRACE[@OFFSET_S] items separated by ','")
    out: list[Tenant] = []
    for i, item in enumerate(items):
        model, sep, rest = item.partition(":")
        if not sep or not model or not rest:
            raise ArgumentError("--tenants", item, "MODEL:TRACE[@OFFSET_S], e.g. "
                                "llama-3.1-8b:conv or qwen2.5-7b:generated@300")
        load_model(model)  # an unknown model says which exist
        trace, _, off = rest.rpartition("@") if "@" in rest else (rest, "", "0")
        try:
            offset = float(off)
        except ValueError:
            raise ArgumentError("--tenants", item, "an offset in seconds after '@'") from None
        if not (math.isfinite(offset) and offset >= 0):
            raise ArgumentError("--tenants", item, "an offset >= 0 seconds after '@'")
        wl = shifted(_tenant_workload(trace, seed + i, seconds), offset)
        name = model if all(t.name != model for t in out) else f"{model}#{i + 1}"
        out.append(Tenant(name=name, model=model, workload=wl))
    return out


def _tenants_command(args: argparse.Namespace) -> int:
    from kvvmm.cli.common import parse_bytes

    if args.trace is not None:
        return _fail(f"give a TRACE ({args.trace!r}) or --tenants, not both")
    if args.budget is None:
        return _fail("--tenants needs --budget (the KV bytes they share, e.g. 2GiB)")
    try:
        budget = parse_bytes(args.budget)
        demand = None
        if args.demand is not None:
            size, _, when = str(args.demand).partition("@")
            try:
                demand = Demand(name="demand", at_s=float(when), nbytes=parse_bytes(size),
                                patience_s=1.0)
            except (ValueError, argparse.ArgumentTypeError):
                return _fail(f"--demand {args.demand!r} is not BYTES@SECONDS (e.g. 1GiB@120)")
        seconds = 600.0 if args.seconds is None else args.seconds
        tenants = parse_tenants(args.tenants, seed=args.seed, seconds=seconds)
        runs = compare_tenants(tenants, budget_bytes=budget, gpu=args.gpu,
                               deadline_s=args.deadline_ms * 1e-3, demand=demand)
    except argparse.ArgumentTypeError as e:
        return _fail(f"--budget: {e}")
    except (KvvmmError, ValueError, OSError) as e:
        return _fail(f"{type(e).__name__}: {e}")
    except Exception as e:
        return _fail(f"the tenants could not be replayed ({type(e).__name__}: {e})")
    if args.json:
        print(json.dumps(_strict({"gpu": args.gpu, "budget_bytes": budget,
                                  "profile": profile_summary(args.gpu),
                                  "runs": {k: r.summary() for k, r in runs.items()}}),
                         indent=1, allow_nan=False))
        return 0
    from kvvmm.viz import save_figure
    from kvvmm.viz.tenants import format_tenants, tenants_figure

    print(_profile_line(profile_summary(args.gpu)))
    print(format_tenants(runs))
    out = Path(args.output) if args.output else Path("tenants-replay.html")
    last = "elastic" if "elastic" in runs else next(iter(runs))
    try:
        save_figure(tenants_figure(runs[last], title=f"kvvmm replay --tenants: {last}"), out)
        print(f"wrote {out}")
    except (KvvmmError, OSError) as e:
        return _fail(f"{type(e).__name__}: {e}")
    return 0


def _progress_bar(desc: str) -> tuple[Any, Progress | None]:
    """A bar on stderr, in serving seconds, when stderr is a terminal (none in a pipe)."""
    if not sys.stderr.isatty():
        return None, None
    return tqdm_progress(desc)


def replay_command(args: argparse.Namespace) -> int:
    """Run ``kvvmm replay`` with parsed ``args``; the exit code (2: bad input)."""
    if getattr(args, "tenants", None) is not None:
        return _tenants_command(args)
    if args.trace is None:
        return _fail("give a TRACE (a .csv, a .jsonl, or 'generated') or --tenants")
    pause_scale = 1.0 if args.real_time else None  # the replay and its bands alike
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
        bar, report = _progress_bar("replay")
        try:
            cmp = run_workload(wl, args.strategy or list(STRATEGIES), model=args.model,
                               gpu=args.gpu, tp=args.tp, driver=args.driver,
                               pool_tokens=args.pool_tokens,
                               config=ServingConfig(slot_order=args.slot_order),
                               pause_scale=pause_scale, progress=report)
        finally:
            if bar is not None:
                bar.close()
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

        bar, report = _progress_bar("bands (p10, p90)")
        try:
            bands = workload_bands(wl, [r.strategy for r in cmp.results], gpu=args.gpu,
                                   mid=cmp, model=args.model, tp=args.tp,
                                   pool_tokens=args.pool_tokens,
                                   config=ServingConfig(slot_order=args.slot_order),
                                   pause_scale=pause_scale, progress=report)
        except Exception as e:  # the point figures stand; the bands say why they are missing
            return _fail(f"the bands could not be run ({type(e).__name__}: {e})")
        finally:
            if bar is not None:
                bar.close()
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

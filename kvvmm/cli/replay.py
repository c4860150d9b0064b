"""``kvvmm replay``: a trace through the serving model and memory strategies, on the sim.

    kvvmm replay TRACE --model llama-3.1-70b --gpu h200 --tp 8 --strategy prefix [...]

TRACE is an Azure LLM inference trace CSV or a JSONL of requests, or ``generated`` for the
generator fitted to Azure's conversation trace (``--seed``), drawn as it is replayed, so a
week (``--days 7``; ``--rate-scale 8.07`` for Azure's 2024 week, about 27 M requests) runs
in bounded memory:

    kvvmm replay generated --days 7 --strategy request-ranges+deferred --no-bands

With ``--tenants`` (and no TRACE) several models share one simulated GPU's budget
(:mod:`kvvmm.workload.tenants`):

    kvvmm replay --tenants llama-3.1-8b:conv,qwen2.5-7b:generated@300 --budget 2GiB

Prints the summary table, writes an HTML report (``-o``; and a PNG beside it with ``--png``),
or prints JSON (``--json``). Bad input exits 2 with one line naming it, before any work:
every option is read and bounded (at most :data:`MAX_TENANTS` tenants, offsets and times up
to :data:`MAX_SECONDS`), the output path, card, models and trace files checked. This module sits
at the CLI layer (it writes reports through :mod:`kvvmm.viz`); ``kvvmm.cli`` wires it in.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvvmm.checks import number_arg
from kvvmm.cli.common import (
    MAX_TOKENS,
    MAX_TP,
    float_text,
    int_type,
    number_type,
    one_line,
    output_path,
    path_type,
    profile_line,
    show,
    size_type,
)
from kvvmm.driver import DRIVER_KINDS
from kvvmm.errors import ArgumentError, KvvmmError, OutOfRangeError
from kvvmm.hardware import GPU_HELP, get_profile, profile_summary
from kvvmm.layout import load_model
from kvvmm.units import fmt_bytes, parse_size
from kvvmm.workload import (
    SLOT_ORDERS,
    STRATEGIES,
    ServingConfig,
    Workload,
    WorkloadComparison,
    find_trace,
    generate,
    generate_stream,
    load_workload,
    run_workload,
)
from kvvmm.workload.generator import AZURE_2024_WEEK_SCALE, MAX_STREAM_S
from kvvmm.workload.requests import Requests
from kvvmm.workload.run import Progress, RunOptions, tqdm_progress
from kvvmm.workload.tenants import Demand, Tenant, compare_tenants, run_tenants, shifted

__all__ = ["MAX_SECONDS", "MAX_TENANTS", "TenantSpec", "add_replay_parser", "parse_tenants",
           "replay_command", "split_tenants"]


def add_replay_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``replay`` sub-command to ``subparsers`` (``parser.add_subparsers(dest="cmd")``)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "replay", help="replay a request trace against memory strategies (sim driver)",
        description="Serve a request trace (Azure CSV, JSONL, or 'generated') with continuous "
                    "batching, once per memory strategy, each on a real KvBufferOwner; print "
                    "the summary and write an HTML report.")
    p.add_argument("trace", nargs="?", default=None, type=path_type,
                   help="a .csv (Azure format) or .jsonl trace, or 'generated' (not with "
                        "--tenants)")
    p.add_argument("--model", default="llama-3.1-70b")
    p.add_argument("--gpu", default="h200", help=GPU_HELP)
    p.add_argument("--tp", type=int_type(1, MAX_TP, "GPUs"), default=8,
                   help="tensor-parallel size")
    p.add_argument("--strategy", action="append", choices=STRATEGIES, default=None,
                   metavar="NAME",
                   help=f"a strategy to run (repeat it; default: all): {', '.join(STRATEGIES)}")
    p.add_argument("--slot-order", choices=SLOT_ORDERS, default="lowest")
    span = p.add_mutually_exclusive_group()
    span.add_argument("--seconds", type=float_text, default=None,
                      help="only the first SECONDS of the trace (generated: its length, "
                           "default 600)")
    span.add_argument("--days", type=number_type(0, MAX_STREAM_S / 86400, "days", lo_open=True),
                      default=None,
                      help="generated: its length in days (7: a week), read as replayed")
    p.add_argument("--rate-scale", type=number_type(0, 1e6, "times", lo_open=True), default=None,
                   metavar="X",
                   help=f"generated: times the fitted hour's rate of requests "
                        f"({AZURE_2024_WEEK_SCALE}: Azure's 2024 week, ~27 M requests)")
    p.add_argument("--seed", type=int_type(0, MAX_SEED), default=0,
                   help="generated workloads' seed")
    p.add_argument("--driver", choices=DRIVER_KINDS, default="sim")
    p.add_argument("--real-time", action="store_true",
                   help="on the sim, charge each call the cold premium an engine serving the "
                        "trace as it came would pay (its calls are a step or more apart); "
                        "default: as warm as back to back")
    p.add_argument("--pool-tokens", type=int_type(1, MAX_TOKENS, "tokens"), default=None,
                   help="KV pool tokens per rank (default: what the planner fits)")
    p.add_argument("-o", "--output", type=path_type, default=None,
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
    t.add_argument("--deadline-ms", type=number_type(0, MAX_DEADLINE_MS, "milliseconds"),
                   default=5.0,
                   help="driver time a request may wait for other tenants to shed")
    t.add_argument("--tenant-backing", default="elastic",
                   choices=("elastic", "request-ranges+deferred"),
                   help="how the sharing tenants back their pages: granules on first touch, "
                        "or request ranges with a reserve and a deferred cache (given back "
                        "first, within the deadline, when another tenant asks)")
    return p


#: The most tenants ``--tenants`` takes: engines sharing one card are a handful, and each
#: one costs a run alone plus its share of two more; more is refused before any work.
MAX_TENANTS = 16
#: The latest time a tenant's offset or a demand names, seconds: a week. The simulated clock
#: runs (and samples) through it, so it bounds the work as well.
MAX_SECONDS = 7 * 24 * 3600.0
#: The longest ``--deadline-ms``: a minute of waiting on sheds is no deadline.
MAX_DEADLINE_MS = 60_000.0
#: Generated workloads take seeds of 32 bits.
MAX_SEED = (1 << 32) - 1
#: A tenant's workload while its options are checked: nothing is read or generated yet.
_NO_REQUESTS = Workload((), "no requests yet")
#: What ``-o`` writes: an HTML report (the default) or the figure as an image.
_OUTPUTS = (".html", ".png", ".svg", ".pdf")


def _fail(msg: str) -> int:
    print(f"kvvmm replay: {one_line(' '.join(msg.split()))}", file=sys.stderr)
    return 2


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One ``MODEL:TRACE[@OFFSET_S]`` item of ``--tenants``, read but not loaded."""

    model: str
    trace: str  #: ``conv``, ``generated`` or a path
    offset_s: float


def split_tenants(text: str) -> list[TenantSpec]:
    """``MODEL:TRACE[@OFFSET_S],...`` -> its items, checked as text: nothing is loaded.

    Raises:
        ArgumentError: an empty item, no ':', more than :data:`MAX_TENANTS` items, an
            offset that is not a number of seconds in [0, :data:`MAX_SECONDS`].
    """
    form = ("MODEL:TRACE[@OFFSET_S] items separated by ',' "
            "(llama-3.1-8b:conv,qwen2.5-7b:generated@300)")
    if not isinstance(text, str) or not text.strip():
        raise ArgumentError("--tenants", text, form)
    # Counted before anything is split further: a list of a million items costs nothing.
    count = text.count(",") + 1
    if count > MAX_TENANTS:
        raise ArgumentError("--tenants", f"<{count} items>",
                            f"at most {MAX_TENANTS} tenants (engines sharing one card)")
    offset_of = number_type(0, MAX_SECONDS, "seconds")
    out: list[TenantSpec] = []
    for item in (x.strip() for x in text.split(",")):
        model, sep, rest = item.partition(":")
        if not item or not sep or not model or not rest:
            raise ArgumentError("--tenants", item, form)
        trace, _, off = rest.rpartition("@") if "@" in rest else (rest, "", "0")
        if not trace:
            raise ArgumentError("--tenants", item, form)
        try:
            offset = offset_of(off)
        except argparse.ArgumentTypeError:
            raise ArgumentError("--tenants", item, f"an offset after '@' in [0, "
                                f"{MAX_SECONDS:g}] seconds") from None
        out.append(TenantSpec(model=model, trace=trace, offset_s=offset))
    return out


def _demand(text: str) -> Demand:
    """``--demand BYTES@SECONDS`` read and bounded (the size exactly, the time in [0,
    :data:`MAX_SECONDS`]).

    Raises:
        ArgumentError: not in this form, or a part out of its bounds (the message says which).
    """
    size, at, when = text.partition("@")
    try:
        if not at:
            raise argparse.ArgumentTypeError("")
        nbytes = size_type(lo=1)(size.strip())
        at_s = number_type(0, MAX_SECONDS, "seconds")(when.strip())
    except argparse.ArgumentTypeError as e:
        raise ArgumentError("--demand", text, "BYTES@SECONDS (e.g. 1GiB@120)", str(e)) from None
    return Demand(name="demand", at_s=at_s, nbytes=nbytes, patience_s=1.0)


def _strict(value: Any) -> Any:
    """``value`` with every non-finite float as None: the output is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _output(args: argparse.Namespace, default: str) -> Path:
    """The report's path, checked before any work (also with ``--json``, which writes no
    report: a bad ``-o`` is still refused rather than ignored)."""
    return output_path(default if args.output is None else args.output, _OUTPUTS)


def _trace_path(trace: str) -> Path:
    """The file a tenant's TRACE names (``conv``: Azure's conversation trace), checked."""
    path = find_trace() if trace == "conv" else Path(trace)
    if path is None:
        raise ArgumentError("TRACE", "conv", "a trace present (Azure's conversation trace was "
                            "not found: name a .csv or .jsonl, or use 'generated')")
    if not Path(path).is_file():
        raise ArgumentError("TRACE", trace, "'conv', 'generated' or a .csv/.jsonl file")
    return Path(path)


def _shells(text: str) -> list[tuple[Tenant, TenantSpec, Path | None]]:
    """Every ``--tenants`` item checked (its form, offset, model, trace file) and made a
    tenant with no requests yet, with the file its workload comes from (None: generated)."""
    specs = split_tenants(text)
    out: list[tuple[Tenant, TenantSpec, Path | None]] = []
    for i, spec in enumerate(specs):
        load_model(spec.model)  # an unknown model says which exist
        path = None if spec.trace == "generated" else _trace_path(spec.trace)
        # The name is the user's text: escaped here, it is printed safely everywhere.
        base = show(spec.model)
        name = base if all(t.name != base for t, _, _ in out) else f"{base}#{i + 1}"
        out.append((Tenant(name=name, model=spec.model, workload=_NO_REQUESTS), spec, path))
    return out


def _filled(shells: list[tuple[Tenant, TenantSpec, Path | None]], seed: int,
            seconds: float) -> list[Tenant]:
    """The tenants with their workloads (generated, or read and cut to ``seconds``)."""
    out: list[Tenant] = []
    for i, (shell, spec, path) in enumerate(shells):
        wl = (generate(seed=seed + i, duration_s=seconds) if path is None
              else load_workload(path).first(seconds))
        out.append(replace(shell, workload=shifted(wl, spec.offset_s)))
    return out


def parse_tenants(text: str, *, seed: int = 0, seconds: float = 600.0) -> list[Tenant]:
    """``MODEL:TRACE[@OFFSET_S],...`` -> tenants (elastic, each on the whole budget).

    Every item is checked (its form, its model, its trace file, its offset) before any
    workload is read or generated.

    Raises:
        ArgumentError: a bad item (no ':', an unknown model, a missing trace, a bad offset,
            an empty list, more than :data:`MAX_TENANTS`), or ``seconds`` not a finite
            number > 0.
    """
    _check_seconds(seconds)
    return _filled(_shells(text), seed, seconds)


def _check_seconds(seconds: float) -> None:
    """A trace's cut (``--seconds``): a finite number of seconds > 0 (a generated workload
    is bounded further by the generator, in requests)."""
    number_arg("--seconds", seconds, lo=0, lo_open=True, limit="a finite number of seconds > 0")


def _dry_run(tenants: list[Tenant], budget_bytes: int, gpu: str, deadline_s: float,
             demand: Demand | None) -> None:
    """Refuse now what the comparison would refuse after minutes of replaying.

    Each tenant is set up (no requests) at the smallest limit the comparison gives it (the
    static equal share; the whole budget with a demand), with the rules and the demand, so
    a budget too small for a model, a bad deadline or a demand the budget cannot hold is
    said before any workload is made. Milliseconds: no page is backed.
    """
    share = budget_bytes if demand is not None else budget_bytes // len(tenants)
    run_tenants([replace(t, strategy="elastic", limit_bytes=max(1, share)) for t in tenants],
                budget_bytes=budget_bytes, gpu=gpu, deadline_s=deadline_s,
                demands=() if demand is None else (demand,))


def _tenants_command(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return _fail(f"give a TRACE ({args.trace!r}) or --tenants, not both")
    if args.budget is None:
        return _fail("--tenants needs --budget (the KV bytes they share, e.g. 2GiB)")
    try:
        # Every option read and bounded first, in the order given: no work before.
        split_tenants(args.tenants)  # its form, count and offsets
        budget = parse_size(args.budget, name="--budget", lo=1)
        demand = None if args.demand is None else _demand(args.demand)
        out = _output(args, "tenants-replay.html")
        used = profile_summary(args.gpu)
        # The budget is the simulated card's memory: more than the card has is no budget
        # (and the books of every granule of it would fill this machine's memory).
        capacity = get_profile(args.gpu).capacity_bytes
        if budget > capacity:
            raise OutOfRangeError("--budget", args.budget, f"at most the {used['key']}'s "
                                  f"memory, {capacity} bytes ({fmt_bytes(capacity)})")
        seconds = 600.0 if args.seconds is None else args.seconds
        _check_seconds(seconds)
        deadline_s = args.deadline_ms * 1e-3
        shells = _shells(args.tenants)
        _dry_run([t for t, _, _ in shells], budget, args.gpu, deadline_s, demand)
        tenants = _filled(shells, args.seed, seconds)
        runs = compare_tenants(tenants, budget_bytes=budget, gpu=args.gpu,
                               deadline_s=deadline_s, demand=demand,
                               strategy=args.tenant_backing)
    except (KvvmmError, ValueError, OSError) as e:
        return _fail(f"{type(e).__name__}: {e}")
    except Exception as e:
        return _fail(f"the tenants could not be replayed ({type(e).__name__}: {e})")
    if args.json:
        print(json.dumps(_strict({"gpu": args.gpu, "budget_bytes": budget,
                                  "profile": used,
                                  "runs": {k: r.summary() for k, r in runs.items()}}),
                         indent=1, allow_nan=False))
        return 0
    from kvvmm.viz import save_figure
    from kvvmm.viz.tenants import format_tenants, tenants_figure

    print(profile_line(used))
    print(format_tenants(runs))
    last = "elastic" if "elastic" in runs else next(iter(runs))
    try:
        title = f"kvvmm replay --tenants: {last}<br><sub>{html.escape(used['label'])}</sub>"
        written = save_figure(tenants_figure(runs[last], title=title), out)
        print(f"wrote {show(written)}")
    except (KvvmmError, OSError) as e:
        return _fail(f"{type(e).__name__}: {e}")
    return 0


def _progress_bar(desc: str) -> tuple[Any, Progress | None]:
    """A bar on stderr, in serving seconds, when stderr is a terminal (none in a pipe)."""
    if not sys.stderr.isatty():
        return None, None
    return tqdm_progress(desc)


class _Refused(Exception):
    """Input refused with a message of its own (printed as it is, exit 2)."""


def _read_workload(args: argparse.Namespace) -> Requests:
    """The trace ``args`` names, cut to ``--seconds``, or the generated workload (a
    stream: drawn as it is replayed, so ``--days 7`` holds no week of requests).

    Raises:
        _Refused: not a file, no requests, or a generated-only option on a file.
        KvvmmError, ValueError, OSError: a bad trace or a bad ``--seconds``.
    """
    if args.seconds is not None and args.trace != "generated":  # the generator says its own
        _check_seconds(args.seconds)
    if args.trace != "generated":
        for opt, v in (("--days", getattr(args, "days", None)),
                       ("--rate-scale", getattr(args, "rate_scale", None))):
            if v is not None:
                raise _Refused(f"{opt} is for the 'generated' trace, not {args.trace!r}")
    wl: Requests
    if args.trace == "generated":
        days = getattr(args, "days", None)
        seconds = (days * 86400.0 if days is not None
                   else 600.0 if args.seconds is None else args.seconds)
        scale = getattr(args, "rate_scale", None)
        wl = generate_stream(seed=args.seed, duration_s=seconds,
                             rate_scale=1.0 if scale is None else scale)
        if next(iter(wl), None) is None:
            raise _Refused(f"trace {args.trace!r} has no requests")
        return wl
    if not Path(args.trace).is_file():
        raise _Refused(f"trace {args.trace!r} is not a file (a .csv, a .jsonl, or "
                       f"'generated')")
    wl = load_workload(args.trace)
    if args.seconds is not None:
        wl = wl.first(args.seconds)
    if not len(wl):
        raise _Refused(f"trace {args.trace!r} has no requests")
    return wl


def _options(args: argparse.Namespace) -> RunOptions:
    """What the replay and its bands run with, from the command line (on the sim with
    bands, the replay prices its calls at the band's quantiles in the same pass)."""
    return RunOptions(model=args.model, gpu=args.gpu, tp=args.tp, pool_tokens=args.pool_tokens,
                      config=ServingConfig(slot_order=args.slot_order),
                      pause_scale=1.0 if args.real_time else None,
                      band_prices=args.driver == "sim" and not args.no_bands)


def _replay(args: argparse.Namespace, wl: Requests, opts: RunOptions) -> WorkloadComparison:
    """Every strategy asked for over ``wl``, with a progress bar on a terminal."""
    bar, report = _progress_bar("replay")
    try:
        return run_workload(wl, args.strategy or list(STRATEGIES), options=opts,
                            driver=args.driver, progress=report)
    finally:
        if bar is not None:
            bar.close()


def _bands(args: argparse.Namespace, wl: Requests, cmp: WorkloadComparison,
           opts: RunOptions) -> dict[str, Any]:
    """The p10-p90 bands of every timed figure (sim only; none with ``--no-bands``)."""
    if args.driver != "sim" or args.no_bands:
        return {}
    from kvvmm.workload.bands import workload_bands

    bar, report = _progress_bar("bands (p10, p90)")
    try:
        return dict(workload_bands(wl, [r.strategy for r in cmp.results], gpu=args.gpu,
                                   mid=cmp, options=opts, progress=report))
    finally:
        if bar is not None:
            bar.close()


def _json(args: argparse.Namespace, cmp: WorkloadComparison, bands: dict[str, Any],
          used: dict[str, Any]) -> str:
    """The summary as strict JSON: the setup, the profile and whose figures the times
    are (``profile.label``), each strategy's row with its bands."""
    from kvvmm.workload.bands import BAND_QUANTILES, band_notes

    s = cmp.setup
    results: list[dict[str, Any]] = [dict(r) for r in cmp.summary()]
    for row in results:
        if row["strategy"] in bands:
            row["bands"] = {k: b.as_list() for k, b in bands[str(row["strategy"])].items()}
    band = {"quantiles": list(BAND_QUANTILES), "fields": "[low, mid, high] per timed figure",
            "notes": band_notes(args.gpu)} if bands else None
    return json.dumps(_strict({"model": s.model, "gpu": s.gpu, "profile": used,
                               "costs": used["label"], "tp": s.tp,
                               "pool_tokens": s.pool_tokens, "requests": s.requests,
                               "workload": s.workload, "slot_order": s.config.slot_order,
                               "band": band, "results": results}), indent=1, allow_nan=False)


def _report(args: argparse.Namespace, cmp: WorkloadComparison, bands: dict[str, Any],
            used: dict[str, Any], out: Path, stem: str) -> int:
    """Print the tables (and the bands'), write the figure: HTML, and PNG with ``--png``."""
    from kvvmm.viz import save_figure
    from kvvmm.viz.workload import format_workload, workload_figure

    prof = get_profile(args.gpu)
    print(profile_line(used))
    print(format_workload(cmp, profile=prof))
    fig = workload_figure(cmp, profile=prof)
    if bands:
        from kvvmm.viz.bands import add_decode_bands, format_workload_bands
        from kvvmm.workload.bands import band_notes

        print(format_workload_bands(bands, band_notes(args.gpu)))
        add_decode_bands(fig, cmp, bands)
    # text only: the placement stays; the costs line stays under the new title
    fig.update_layout(title_text=f"kvvmm replay: {stem}<br>{fig.layout.title.text or ''}")
    try:
        print(f"wrote {show(save_figure(fig, out))}")
        if args.png and out.suffix.lower() != ".png":
            print(f"wrote {show(save_figure(fig, out.with_suffix('.png')))}")
    except (KvvmmError, OSError) as e:
        return _fail(f"{type(e).__name__}: {e}")
    return 0


def replay_command(args: argparse.Namespace) -> int:
    """Run ``kvvmm replay`` with parsed ``args``; the exit code (2: bad input).

    Every option is checked before any work: the output path, the card, the model, the
    trace file; then the trace is read and replayed.
    """
    if getattr(args, "tenants", None) is not None:
        return _tenants_command(args)
    if args.trace is None:
        return _fail("give a TRACE (a .csv, a .jsonl, or 'generated') or --tenants")
    stem = "generated" if args.trace == "generated" else Path(args.trace).stem
    try:
        out = _output(args, f"{stem}-replay.html")
        used = profile_summary(args.gpu)
        load_model(args.model)
        wl = _read_workload(args)
        opts = _options(args)  # the replay's and its bands' options alike
        cmp = _replay(args, wl, opts)
    except _Refused as e:
        return _fail(str(e))
    except (KvvmmError, ValueError, OSError) as e:
        return _fail(f"{type(e).__name__}: {e}")
    except Exception as e:
        # Input this deep inside is still input: one line and exit 2, never a traceback
        # Named as what it is, so a bug still shows its class.
        return _fail(f"the input could not be replayed ({type(e).__name__}: {e})")
    try:
        bands = _bands(args, wl, cmp, opts)
    except Exception as e:  # the point figures stand; the bands say why they are missing
        return _fail(f"the bands could not be run ({type(e).__name__}: {e})")
    if args.json:
        print(_json(args, cmp, bands, used))
        return 0
    return _report(args, cmp, bands, used, out, stem)

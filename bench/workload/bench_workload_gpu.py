"""GPU run (not a test): the first 10 minutes of Azure's conversation trace on CUDA, per strategy.

    python bench/workload/bench_workload_gpu.py [--trace PATH] [--out h200-workload.json]
        [--seconds 600] [--profile h100]
    python bench/workload/bench_workload_gpu.py --repredict RUN.json --profile h100 --out X.json

Each strategy (default: all, page-elastic with and without its handle pool included)
serves the trace's first ``--seconds`` (llama-3.1-70b TP8's rank-0 KV pool on
one H200: 160 buffers, what the planner fits) twice: on the CUDA driver with real tensors
(every page handed out is written in the first and last buffer, so an unbacked page is an
illegal address at once) and on the sim driver with ``--profile``'s call costs (default the
H200's). The JSON puts the measured (CUDA: wall time of each driver call) and predicted (sim:
its cost model) driver time, calls, handles and backed bytes side by side. Fails with one
line without a GPU. The workload itself (the pool the planner fits, the step time model that
is the serving clock) is the H200's whatever ``--profile`` says, as every committed run had
it, so a prediction with another card's costs serves the same steps as the run it predicts.

The trace is Azure's public LLM inference trace (CC-BY 4.0; Patel et al., "Splitwise",
ISCA 2024): ``../shared/data/azure-llm-inference-2023/`` or ``.data/`` in the repository.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvvmm.driver import driver_for  # noqa: E402
from kvvmm.errors import KvvmmError  # noqa: E402
from kvvmm.hardware import GPU_HELP, get_profile, profile_summary  # noqa: E402
from kvvmm.workload import STRATEGIES, Workload, load_azure_csv, run_workload  # noqa: E402

NAME = "AzureLLMInferenceTrace_conv.csv"
CANDIDATES = (ROOT.parent / "shared" / "data" / "azure-llm-inference-2023" / NAME,
              ROOT / ".data" / NAME)


#: what the GPU run compares by default: every strategy (page-elastic with and without the
#: pool included: the decode-path cost of mapping pages anywhere is the number to measure)
DEFAULT_STRATEGIES = tuple(STRATEGIES)
#: what each round keeps when a strategy runs several (the timed figures and the memory)
_ROUND_KEYS = ("decode_driver_ms", "p99_stall_us", "max_stall_us", "stalled_steps",
               "stalled_share", "stalled_p50_us", "stalled_p99_us",
               "background_driver_ms", "mean_backed_bytes", "mean_pool_bytes",
               "mean_used_bytes", "held_over_used", "driver_calls", "run_wall_s")
#: the GPU whose pool and step time model the workload is served with (every committed run's)
WORKLOAD_GPU = "h200"


def find_trace(arg: str | None) -> Path | None:
    """The trace to read: ``arg``, else the first of :data:`CANDIDATES` that exists."""
    trace = Path(arg) if arg else next((p for p in CANDIDATES if p.exists()), None)
    return trace if trace is not None and trace.exists() else None


def _run(wl: Workload, name: str, *, model: str, tp: int, driver: str, measured: bool,
         pause_scale: float | None = None, sync: Callable[[], object] | None = None,
         profile: str = WORKLOAD_GPU, **kw: Any) -> dict[str, Any]:
    """One strategy once on ``driver``: its summary, wall time, startup and held / used. A
    ``measured`` run touches real tensors and is synchronized before its wall time ends. On
    the sim, ``profile`` gives the call costs; the pool and the serving clock stay
    :data:`WORKLOAD_GPU`'s."""
    t0 = time.perf_counter()
    drv: Any = driver
    if driver == "sim" and profile != WORKLOAD_GPU:  # its costs on the workload's pool
        drv = functools.partial(driver_for, "sim", profile=get_profile(profile))
    cmp = run_workload(wl, [name], model=model, gpu=WORKLOAD_GPU, tp=tp, driver=drv,
                       touch=measured, pause_scale=pause_scale, **kw)
    if sync is not None and measured:
        sync()
    r = cmp.results[0]
    return {**r.summary(), "run_wall_s": round(time.perf_counter() - t0, 3),
            "startup_driver_ms": round(r.startup_driver_s * 1e3, 3),
            "held_over_used": round(r.held_over_used, 4) if r.mean_used_bytes > 0 else None}


def replay_scale(measured: dict[str, Any]) -> float:
    """A measured replay's host seconds per serving second (its wall over its serving time).

    The replay runs the serving clock ~100x faster than real time, so its driver calls are
    ~1-2 ms apart, partly cold: the prediction of it pauses the sim at this scale."""
    return measured["run_wall_s"] / measured["end_s"] if measured["end_s"] > 0 else 0.0


def predictions(wl: Workload, name: str, scale: float, *, model: str, tp: int,
                predicted: str = "sim", profile: str = WORKLOAD_GPU,
                **kw: Any) -> dict[str, Any]:
    """The three predictions of a replay: at its own pause ``scale``, without pauses, and in
    real time (what an engine serving the requests as they came would pay: calls hundreds of
    ms apart, fully cold); on the sim with ``profile``'s call costs."""
    def once(s: float | None) -> dict[str, Any]:
        return _run(wl, name, model=model, tp=tp, driver=predicted, measured=False,
                    pause_scale=s, profile=profile, **kw)

    return {f"predicted_{predicted}": once(scale), "predicted_pause_scale": round(scale, 6),
            f"predicted_{predicted}_without_pauses": once(None),
            f"predicted_{predicted}_real_time": once(1.0)}


def side_by_side(wl: Workload, names: Sequence[str], *, model: str, tp: int,
                 measured: str = "cuda", predicted: str = "sim",
                 sync: Callable[[], object] | None = None, rounds: int = 1,
                 profile: str = WORKLOAD_GPU, **kw: Any) -> list[dict[str, Any]]:
    """Each strategy run on the ``measured`` driver (real tensors, touched) ``rounds`` times
    and on the ``predicted`` one (the sim is deterministic) as :func:`predictions` says: one
    row per strategy, the median round and the predictions side by side.

    No GPU in here: the CUDA run passes ``measured="cuda"`` and torch's synchronize; tests
    pass the host driver, so everything but the device itself is checked on a laptop.
    """
    rows = []
    for name in names:
        rounds_m = [_run(wl, name, model=model, tp=tp, driver=measured, measured=True,
                         sync=sync, **kw) for _ in range(rounds)]
        # the round whose decode-path driver time is the median stands for the strategy;
        # every round's figures are kept, and the median of each timed figure beside them
        rounds_m.sort(key=lambda r: r["decode_driver_ms"])
        mid = rounds_m[len(rounds_m) // 2]
        row: dict[str, Any] = {"strategy": name, f"measured_{measured}": mid,
                               **predictions(wl, name, replay_scale(mid), model=model, tp=tp,
                                             predicted=predicted, profile=profile, **kw)}
        if rounds > 1:
            row[f"measured_{measured}_rounds"] = [{k: r[k] for k in _ROUND_KEYS}
                                                  for r in rounds_m]
            row[f"measured_{measured}_median"] = {
                k: statistics.median(r[k] for r in rounds_m) for k in _ROUND_KEYS}
        rows.append(row)
        m, p = row[f"measured_{measured}"], row[f"predicted_{predicted}"]
        print(f"{name:18s} decode driver measured {m['decode_driver_ms']:9.3f} ms, predicted "
              f"{p['decode_driver_ms']:9.3f} ms; startup {m['startup_driver_ms']:9.3f} vs "
              f"{p['startup_driver_ms']:9.3f} ms; peak backed {m['peak_backed_bytes'] / 2**30:.2f}"
              f" GiB, pool {m['peak_pool_bytes'] / 2**30:.2f} GiB; calls {m['driver_calls']} vs "
              f"{p['driver_calls']}", flush=True)
    return rows


#: the timed figures set side by side as predicted over measured (the median round's)
RATIO_KEYS = ("decode_driver_ms", "background_driver_ms", "max_stall_us")


def ratios(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, float | None]:
    """Predicted over measured per timed figure (None where the card measured 0)."""
    return {k: round(predicted[k] / measured[k], 3) if measured.get(k) else None
            for k in RATIO_KEYS}


def repredict(doc: dict[str, Any], wl: Workload, model: str, tp: int,
              profile: str = WORKLOAD_GPU) -> dict[str, Any]:
    """A committed run's CUDA figures beside the sim as it predicts them now (no GPU): each
    strategy's :func:`predictions` with ``profile``'s call costs and predicted over measured,
    the measured median of the rounds where there are several."""
    out = {k: v for k, v in doc.items() if k != "runs"}
    out["repredicted"] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "note": "measured_* as the card ran them; predicted_* made again on this tree's sim "
                f"with the call costs of profile {profile} (the workload's pool and serving "
                f"clock: {WORKLOAD_GPU}'s, as the run had them)",
        "profile": profile_summary(profile), "workload_gpu": WORKLOAD_GPU}
    out["runs"] = []
    for run in doc["runs"]:
        name = run["strategy"]
        mk = next(k for k in run if k.startswith("measured_")
                  and not k.endswith(("_rounds", "_median")))  # measured_cuda on the card
        med = run.get(f"{mk}_median", run[mk])
        row = {k: v for k, v in run.items() if k.startswith("measured") or k == "strategy"}
        row |= predictions(wl, name, replay_scale(run[mk]), model=model, tp=tp,
                           profile=profile)
        for key in ("", "_without_pauses", "_real_time"):
            row["ratio" + key] = ratios(row["predicted_sim" + key], med)
        out["runs"].append(row)
        print(f"{name:24s} predicted / measured at the replay's pause scale "
              f"{row['predicted_pause_scale']:.4f}: {row['ratio']}; without pauses "
              f"{row['ratio_without_pauses']}", flush=True)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--trace", default=None, help=f"default: the first of {CANDIDATES}")
    ap.add_argument("--out", default="h200-workload.json")
    ap.add_argument("--repredict", default=None, metavar="FILE",
                    help="no GPU: a committed run of this bench beside the sim's predictions "
                         "as this tree makes them (the trace and model of that run)")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--strategy", action="append", choices=STRATEGIES, default=None,
                    help=f"repeat it; default: {', '.join(DEFAULT_STRATEGIES)}")
    ap.add_argument("--smoke", action="store_true",
                    help="a small side by side on the host driver (no GPU, no trace): a check "
                         "that it runs, written to --out")
    ap.add_argument("--rounds", type=int, default=1,
                    help="CUDA runs per strategy (the median round is reported)")
    ap.add_argument("--profile", default=WORKLOAD_GPU,
                    help="the predictions' call costs: " + GPU_HELP + "; the workload's pool "
                         f"and serving clock stay {WORKLOAD_GPU}'s")
    return ap.parse_args(argv)


def smoke(out: str) -> int:
    """The side by side on the host driver, small (a generated 3 s workload, qwen2.5-7b on
    one GPU, a 4,096-token pool): page-elastic+pool once, request-ranges+deferred over 3
    rounds, and the second made again with ``--repredict``'s arithmetic, with the H200's call
    costs and with the H100's (``--profile h100``); written to ``out`` with the strategies a
    run takes by default (a check that it runs: no GPU)."""
    from kvvmm.workload import generate

    wl = generate(seed=3, duration_s=3.0, rate_scale=2.0)
    kw: dict[str, Any] = {"model": "qwen2.5-7b", "tp": 1, "measured": "host",
                          "pool_tokens": 4096}
    rows = side_by_side(wl, ["page-elastic+pool"], **kw)
    (row,) = side_by_side(wl, ["request-ranges+deferred"], rounds=3, **kw)
    doc = {"model": "qwen2.5-7b", "tp": 1, "trace": {"seconds": 3.0}, "runs": [row]}
    (again,) = repredict(doc, wl, "qwen2.5-7b", 1)["runs"]
    h100 = repredict(doc, wl, "qwen2.5-7b", 1, profile="h100")
    Path(out).write_text(json.dumps({"default_strategies": list(DEFAULT_STRATEGIES),
                                     "runs": [*rows, row], "repredicted": again,
                                     "repredicted_h100": {"profile": h100["repredicted"][
                                         "profile"], **h100["runs"][0]}},
                                    indent=1) + "\n", encoding="utf-8")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        return smoke(args.out)
    try:
        get_profile(args.profile)
    except (KvvmmError, OSError) as e:
        print(f"bench_workload_gpu: --profile: {e}", file=sys.stderr)
        return 2
    if args.repredict is not None:
        doc = json.loads(Path(args.repredict).read_text(encoding="utf-8"))
        trace = find_trace(args.trace)
        if trace is None:
            print(f"bench_workload_gpu: no trace at {args.trace or CANDIDATES}",
                  file=sys.stderr)
            return 2
        wl = load_azure_csv(trace).first(doc["trace"]["seconds"])
        out = repredict(doc, wl, doc["model"], doc["tp"], profile=args.profile)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.out}")
        return 0
    try:
        import torch
    except ImportError:
        print("bench_workload_gpu: needs torch with CUDA; torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_workload_gpu: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "bench/workload/bench_workload.py runs the sim only", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"bench_workload_gpu: --rounds must be >= 1, got {args.rounds}", file=sys.stderr)
        return 2
    trace = find_trace(args.trace)
    if trace is None:
        print(f"bench_workload_gpu: no trace at {args.trace or CANDIDATES}; copy {NAME} "
              f"to .data/ or pass --trace", file=sys.stderr)
        return 2
    wl = load_azure_csv(trace).first(args.seconds)
    card = torch.cuda.get_device_name(0)
    t_all = time.perf_counter()
    out: dict[str, Any] = {
        "benchmark": "workload-gpu", "card": card,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()},
        "trace": {"file": trace.name, "seconds": args.seconds, "requests": len(wl),
                  "source": "Azure Public Dataset (CC-BY 4.0; Patel et al., Splitwise, "
                            "ISCA 2024)"},
        "model": args.model, "tp": args.tp, "rank": 0, "rounds": args.rounds,
        "predicted_profile": profile_summary(args.profile), "workload_gpu": WORKLOAD_GPU,
        "note": "measured: CUDA driver, wall time of each driver call, real tensors; "
                f"predicted: sim driver, profile {args.profile}'s cost model (the pool and "
                f"the step model: {WORKLOAD_GPU}'s); the serving clock of "
                "both is the step time model, so the same steps run; page-elastic+pool "
                "retains decommitted handles (peak_pool_bytes, mean_pool_bytes)",
        "runs": []}
    # written after each strategy (``"complete": false`` until the last), so a run cut
    # short by a time limit keeps what it measured
    for name in args.strategy or DEFAULT_STRATEGIES:
        out["runs"] += side_by_side(wl, [name], model=args.model, tp=args.tp,
                                    sync=torch.cuda.synchronize, rounds=args.rounds,
                                    profile=args.profile)
        out["total_wall_s"] = round(time.perf_counter() - t_all, 3)
        out["complete"] = len(out["runs"]) == len(args.strategy or DEFAULT_STRATEGIES)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

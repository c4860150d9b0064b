"""GPU run (not a test): the first 10 minutes of Azure's conversation trace on CUDA, per strategy.

    python bench/bench_workload_gpu.py [--trace PATH] [--out h200-workload.json] [--seconds 600]

Each strategy serves the trace's first ``--seconds`` (llama-3.1-70b TP8's rank-0 KV pool on
one H200: 160 buffers, what the planner fits) twice: on the CUDA driver with real tensors
(every page handed out is written in the first and last buffer, so an unbacked page is an
illegal address at once) and on the sim driver with the H200 profile. The JSON puts the
measured (CUDA: wall time of each driver call) and predicted (sim: its cost model) driver
time, calls, handles and backed bytes side by side. Fails with one line without a GPU.

The trace is Azure's public LLM inference trace (CC-BY 4.0; Patel et al., "Splitwise",
ISCA 2024): ``../shared/data/azure-llm-inference-2023/`` or ``.data/`` in the repository.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvvmm.workload import STRATEGIES, load_azure_csv, run_workload  # noqa: E402

NAME = "AzureLLMInferenceTrace_conv.csv"
CANDIDATES = (ROOT.parent / "shared" / "data" / "azure-llm-inference-2023" / NAME,
              ROOT / ".data" / NAME)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help=f"default: the first of {CANDIDATES}")
    ap.add_argument("--out", default="h200-workload.json")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--strategy", action="append", choices=STRATEGIES, default=None)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_workload_gpu: needs torch with CUDA; torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_workload_gpu: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "bench/bench_workload.py runs the sim only", file=sys.stderr)
        return 2
    trace = Path(args.trace) if args.trace else next((p for p in CANDIDATES if p.exists()), None)
    if trace is None or not trace.exists():
        print(f"bench_workload_gpu: no trace at {args.trace or CANDIDATES}; copy {NAME} "
              f"to .data/ or pass --trace", file=sys.stderr)
        return 2
    wl = load_azure_csv(trace).first(args.seconds)
    card = torch.cuda.get_device_name(0)
    rows = []
    t_all = time.perf_counter()
    for name in args.strategy or STRATEGIES:
        runs = {}
        for kind in ("cuda", "sim"):
            t0 = time.perf_counter()
            cmp = run_workload(wl, [name], model=args.model, gpu="h200", tp=args.tp,
                               driver=kind, touch=kind == "cuda")
            torch.cuda.synchronize()
            r = cmp.results[0]
            runs[kind] = {**r.summary(), "run_wall_s": round(time.perf_counter() - t0, 3),
                          "startup_driver_ms": round(r.startup_driver_s * 1e3, 3)}
        rows.append({"strategy": name, "measured_cuda": runs["cuda"],
                     "predicted_sim": runs["sim"]})
        m, p = runs["cuda"], runs["sim"]
        print(f"{name:14s} decode driver measured {m['decode_driver_ms']:9.3f} ms, predicted "
              f"{p['decode_driver_ms']:9.3f} ms; startup {m['startup_driver_ms']:9.3f} vs "
              f"{p['startup_driver_ms']:9.3f} ms; peak backed {m['peak_backed_bytes'] / 2**30:.2f}"
              f" GiB; calls {m['driver_calls']} vs {p['driver_calls']}", flush=True)
    out = {"benchmark": "workload-gpu", "card": card,
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                        "python": platform.python_version()},
           "trace": {"file": trace.name, "seconds": args.seconds, "requests": len(wl),
                     "source": "Azure Public Dataset (CC-BY 4.0; Patel et al., Splitwise, "
                               "ISCA 2024)"},
           "model": args.model, "tp": args.tp, "rank": 0,
           "note": "measured: CUDA driver, wall time of each driver call, real tensors; "
                   "predicted: sim driver, H200 profile cost model; the serving clock of "
                   "both is the step time model, so the same steps run",
           "total_wall_s": round(time.perf_counter() - t_all, 3), "runs": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

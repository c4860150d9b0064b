"""Time a generated hour, day and week replayed for one strategy, and its peak memory.

    PYTHONPATH=. python bench/workload_week/bench_week.py [--spans 3600,86400,604800]
        [--strategy request-ranges+deferred] [--rate-scale 1] [--limit-s 1800]

Each span runs what ``kvvmm replay generated --seconds SPAN --strategy S --no-bands`` runs
(:func:`kvvmm.workload.run_workload` over :func:`kvvmm.workload.generate_stream`: the
requests drawn as they are read) in a child process of its own, so its peak resident memory
(``ru_maxrss`` from ``wait4``) and CPU seconds are its own. The child reports every 30 s
of wall time how far it has got (serving seconds, requests read, CPU, resident memory), so a
span cut at ``--limit-s`` still says its memory over the part it ran and what the whole
would take at the speed it ran at. Writes ``bench/results/cpu-workload-week.json`` (``--out``):
each span's wall and CPU seconds, peak RSS, requests, CPU per request, the reports, the
summary row, and the machine (its load before and after: the machine may be shared). A
figure, not a test: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvvmm.measure.machine import commit, cpu_model, load_average

ROOT = Path(__file__).resolve().parents[2]
#: wall seconds between a child's reports
_EVERY_S = 30.0


def _rss_mib() -> float:
    """This process's resident memory now, MiB (Linux; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def _child(seconds: float, strategy: str, rate_scale: float, seed: int) -> int:
    """One span's replay; JSON reports on stderr as it goes, the result on stdout."""
    from kvvmm.workload import RequestStream, generate_stream, run_workload

    w0, c0 = time.perf_counter(), time.process_time()
    base = generate_stream(seed=seed, duration_s=seconds, rate_scale=rate_scale)
    read = [0]

    def counted() -> Any:
        for r in base:
            read[0] += 1
            yield r

    stream = RequestStream(counted, base.source, span_s=base.span_s)
    last = [w0]

    def report(done: float, total: float) -> None:
        now = time.perf_counter()
        if now - last[0] >= _EVERY_S:
            last[0] = now
            print(json.dumps({"serving_s": round(done, 1), "requests": read[0],
                              "wall_s": round(now - w0, 1),
                              "cpu_s": round(time.process_time() - c0, 1),
                              "rss_mib": _rss_mib()}), file=sys.stderr, flush=True)

    cmp = run_workload(stream, [strategy], progress=report)
    r = cmp.results[0]
    row = r.summary()
    print(json.dumps({"requests": cmp.setup.requests, "workload": cmp.setup.workload,
                      "steps": r.serving.steps, "timeline_samples": len(r.timeline),
                      "timeline_kept_every": r.timeline.kept_every,
                      "first_token_exact": r.serving.first_token.exact,
                      "summary": row}))
    return 0


def _run_span(seconds: float, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", str(seconds), "--strategy", args.strategy,
           "--rate-scale", str(args.rate_scale), "--seed", str(args.seed)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    load0 = load_average()
    w0 = time.perf_counter()
    reports: list[dict[str, Any]] = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        assert p.stderr is not None and p.stdout is not None
        cut = False
        os.set_blocking(p.stderr.fileno(), False)
        while True:  # wait4, not poll: the child's own rusage (peak RSS, CPU)
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(1.0)
            for line in p.stderr.readlines():
                if line.startswith("{"):
                    reports.append(json.loads(line))
                    print(f"  {seconds:>9g} s span: {line.strip()}", flush=True)
            if args.limit_s and time.perf_counter() - w0 > args.limit_s:
                p.kill()
                cut = True
                _, status, usage = os.wait4(p.pid, 0)
                break
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - w0
        out = p.stdout.read()
        os.set_blocking(p.stderr.fileno(), True)
        err = p.stderr.read()
        for line in err.splitlines():
            if line.startswith("{"):
                reports.append(json.loads(line))
    got: dict[str, Any] = {"seconds": seconds, "completed": not cut,
                           "wall_s": round(wall, 1),
                           "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
                           "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
                           "load_before": load0, "load_after": load_average(), "reports": reports}
    if not cut:
        if not out.strip():
            raise RuntimeError(f"the {seconds:g} s span failed:\n{err[-3000:]}")
        res = json.loads(out)
        got.update(res)
        got["cpu_us_per_request"] = round(got["cpu_s"] / max(1, res["requests"]) * 1e6, 1)
    elif reports:
        last = reports[-1]
        got["reached_serving_s"] = last["serving_s"]
        got["requests_read"] = last["requests"]
        got["cpu_us_per_request"] = round(last["cpu_s"] / max(1, last["requests"]) * 1e6, 1)
        got["cpu_s_projected"] = round(last["cpu_s"] * seconds / max(1.0, last["serving_s"]))
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spans", default="3600,86400,604800",
                    help="serving seconds of each span, comma-separated")
    ap.add_argument("--strategy", default="request-ranges+deferred")
    ap.add_argument("--rate-scale", type=float, default=1.0,
                    help="times the fitted hour's rate (8.07: Azure's 2024 week)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit-s", type=float, default=0.0,
                    help="cut a span after this many wall seconds (0: never)")
    ap.add_argument("--child", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu-workload-week.json"))
    args = ap.parse_args(argv)
    if args.child is not None:
        return _child(args.child, args.strategy, args.rate_scale, args.seed)
    import kvvmm

    spans = [float(x) for x in args.spans.split(",")]
    load0 = load_average()
    runs: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "benchmark": "workload_week",
        "what": f"kvvmm replay generated --seconds SPAN --strategy {args.strategy} "
                f"--no-bands: a stream of the generator fitted to Azure's conversation hour "
                f"(rate x{args.rate_scale:g}), llama-3.1-70b TP8 on the sim, profile h200",
        "card": "sim, profile h200",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(),
                    "load_before": load0, "load_after": None},
        "versions": {"kvvmm": getattr(kvvmm, "__version__", "?"), "commit": commit(ROOT),
                     "python": platform.python_version(), "platform": platform.platform()},
        "strategy": args.strategy, "rate_scale": args.rate_scale, "seed": args.seed,
        "limit_s": args.limit_s or None, "runs": runs,
        "note": "each span in a child process: cpu_s and peak_rss_mib are its own (wait4); "
                "wall time on a shared machine moves with its load; a span cut at --limit-s "
                "has completed false, its reports (rss_mib: resident memory then) and "
                "cpu_s_projected (its CPU per serving second times the span)",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for s in spans:  # the file is written after each span: a long one cut short keeps the rest
        print(f"span {s:g} s ...", flush=True)
        runs.append(_run_span(s, args))
        r = runs[-1]
        print(f"span {s:g} s: wall {r['wall_s']} s, cpu {r['cpu_s']} s, peak RSS "
              f"{r['peak_rss_mib']} MiB, completed {r['completed']}", flush=True)
        out["machine"]["load_after"] = load_average()
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

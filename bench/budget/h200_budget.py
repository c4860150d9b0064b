"""Two engine processes sharing one GPU through the budget broker (issue 29, part 3).

    python bench/budget/h200_budget.py --driver cuda --out $OUT/h200-budget-tenants.json
    python bench/budget/h200_budget.py --driver host --budget-mib 512 --minutes 1   # a smoke run

Each tenant is a spawned process with its own owner (the interleaved layout, one handle per
request range) on a ``BudgetedDriver``: tenant ``conv`` (llama-3.1-8b's shape) replays the
Azure conversation trace's first ``--minutes`` (``kvvmm.workload.load_azure_csv``), tenant
``gen`` (qwen2.5-7b's shape) the fitted generator's, offset by ``--offset-s``; both at
``--speed`` times the trace's clock. A request is admitted at its arrival (its slot range
committed: prompt + output tokens), and freed when it would finish (prefill at
``--prefill-tps``, decode at ``--decode-tps``); a commit the budget refuses rejects it.
Between events each tenant polls its shed requests and preempts its newest requests until
it has given back what was asked.

The parent samples the ledger every ``--sample-ms``: the sum of backing against the budget at
every sample (the target: never above), lowers ``conv``'s limit to a quarter of the budget
at 40% of the run through ``kvvmm budget set`` (a subprocess, as an operator would) and puts
it back at 60%, timing how long ``conv`` takes to get under it; at 80% it SIGKILLs ``gen``
and times until the ledger has reclaimed its share (target < 1 s) and, on CUDA, until the
device's free memory (``mem_info``) shows its memory back. Each tenant checks, every 50 ms,
that its driver's own physical bytes equal what the ledger books to it.

One JSON: config, card, versions, date, per tenant (admitted, rejected, preempted, commit
p50/p99 us, peak booked), the samples' maximum, the limit and kill timings, and a
downsampled timeline of every tenant's booking for a chart.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

MiB = 1 << 20
GiB = 1 << 30
#: (layers, kv heads, head dim) of the two tenants' models (bf16)
SHAPES = {"conv": ("llama-3.1-8b", 32, 8, 128), "gen": ("qwen2.5-7b", 28, 4, 128)}


def _requests(source: str, trace: str, minutes: float, seed: int) -> list[Any]:
    from kvvmm.workload import generate, load_azure_csv

    if source == "trace":
        return list(load_azure_csv(trace).first(minutes * 60).requests)
    return list(generate(seed=seed, duration_s=minutes * 60).requests)


def tenant_main(conn: Any, cfg: dict[str, Any], name: str, source: str) -> None:
    import kvvmm
    from kvvmm.budget import BudgetedDriver, BudgetExceededError, Ledger
    from kvvmm.layout.presets import layer_interleaved
    from kvvmm.layout.ranges import RangesFullError, SlotRanges

    model, layers, heads, dim = SHAPES[name]
    led = Ledger(cfg["ledger"])
    tenant = led.register(name, shed_wait_s=cfg["shed_wait_s"])
    inner = kvvmm.open_driver(cfg["driver"])
    drv = BudgetedDriver(inner, tenant)
    per_token = layers * 2 * heads * dim * 2
    reserved = cfg["budget_bytes"] // per_token // 1024 * 1024  # VA for the whole budget
    descs = layer_interleaved(layers=layers, kv_heads=heads, head_dim=dim,
                              reserved_tokens=reserved, page_size=16, dtype="bfloat16")
    owner = kvvmm.KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16,
                                reserved_tokens=reserved, descs=descs)
    block = owner.slot_block_tokens()
    ranges = SlotRanges(reserved // block, first=1)  # block 0 holds slot 0
    reqs = _requests(source, cfg["trace"], cfg["minutes"], seed=1)
    offset = cfg["offset_s"] if name == "gen" else 0.0
    stats = {"model": model, "source": source, "requests": len(reqs), "admitted": 0,
             "rejected_budget": 0, "rejected_full": 0, "preempted": 0, "finished": 0,
             "shed_requests_seen": 0, "book_mismatch_samples": 0, "book_checks": 0,
             "peak_booked_bytes": 0}
    commit_us: list[float] = []
    active: dict[int, tuple[int, int, float]] = {}  # id -> (start unit, units, end trace s)
    ends: list[tuple[float, int]] = []
    conn.send(("ready", os.getpid()))
    t0 = conn.recv()  # the shared start (time.monotonic of the parent: system-wide)

    def now_s() -> float:
        return (time.monotonic() - t0) * cfg["speed"] - offset

    def drop(rid: int) -> None:
        start, n, _ = active.pop(rid)
        owner.decommit_slots([(start * block, (start + n) * block)])
        ranges.free(start, n)

    i = 0
    next_check = time.monotonic()
    # Until the parent's run ends (not the trace's end: the parent's events need both alive)
    while time.monotonic() - t0 < cfg["wall_s"]:
        now = now_s()
        while ends and ends[0][0] <= now:
            _, rid = heapq.heappop(ends)
            if rid in active:
                drop(rid)
                stats["finished"] += 1
        req = tenant.poll()
        if req is not None:
            stats["shed_requests_seen"] += 1
            goal = tenant.backed_bytes - req.shed_bytes
            for rid in sorted(active, reverse=True):  # the newest first
                if tenant.backed_bytes <= goal:
                    break
                drop(rid)
                stats["preempted"] += 1
        if i < len(reqs) and reqs[i].arrival_s <= now:
            r = reqs[i]
            n = math.ceil((r.prompt_tokens + r.output_tokens) / block)
            try:
                start = ranges.alloc(n)
            except RangesFullError:
                stats["rejected_full"] += 1
            else:
                a = time.perf_counter_ns()
                try:
                    owner.commit_slots([(start * block, (start + n) * block)])
                except BudgetExceededError:
                    ranges.free(start, n)
                    stats["rejected_budget"] += 1
                else:
                    commit_us.append((time.perf_counter_ns() - a) / 1e3)
                    end = r.arrival_s + r.prompt_tokens / cfg["prefill_tps"] \
                        + r.output_tokens / cfg["decode_tps"]
                    active[i] = (start, n, end)
                    heapq.heappush(ends, (end, i))
                    stats["admitted"] += 1
            i += 1
        else:
            time.sleep(0.0005)
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + 0.05
            stats["book_checks"] += 1
            booked = tenant.backed_bytes
            stats["peak_booked_bytes"] = max(stats["peak_booked_bytes"], booked)
            if inner.stats().physical_bytes != booked:
                stats["book_mismatch_samples"] += 1
    for rid in list(active):
        drop(rid)
    commit_us.sort()
    if commit_us:
        stats["commit_p50_us"] = round(commit_us[len(commit_us) // 2], 1)
        stats["commit_p99_us"] = round(commit_us[min(len(commit_us) - 1,
                                                     int(0.99 * len(commit_us)))], 1)
    owner.close()
    stats["booked_after_close"] = tenant.backed_bytes
    conn.send(("done", stats))
    tenant.close()
    led.close()


def _card_versions(driver: str) -> tuple[str, dict[str, str]]:
    import platform

    import kvvmm

    v = {"python": platform.python_version(), "kvvmm": kvvmm.__version__}
    card = f"cpu ({driver} driver)"
    try:
        import torch

        v["torch"] = torch.__version__
        if driver == "cuda":
            card = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        from cuda import bindings

        v["cuda-bindings"] = getattr(bindings, "__version__", "?")
    except ImportError:
        pass
    return card, v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--trace", default=".data/AzureLLMInferenceTrace_conv.csv")
    ap.add_argument("--minutes", type=float, default=10.0, help="of each trace, replayed")
    ap.add_argument("--speed", type=float, default=10.0, help="trace seconds per wall second")
    ap.add_argument("--offset-s", type=float, default=120.0,
                    help="trace seconds the generator's tenant starts late")
    ap.add_argument("--budget-mib", type=int, default=6 * 1024)
    ap.add_argument("--shed-wait-s", type=float, default=0.02)
    ap.add_argument("--prefill-tps", type=float, default=10000.0)
    ap.add_argument("--decode-tps", type=float, default=30.0)
    ap.add_argument("--sample-ms", type=float, default=5.0)
    ap.add_argument("--out", default="h200-budget-tenants.json")
    args = ap.parse_args(argv)

    from kvvmm.budget import Ledger

    trace = Path(args.trace)
    if not trace.is_file():
        print(f"no trace at {trace}: carry .data (AzureLLMInferenceTrace_conv.csv)")
        return 2
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tmp = tempfile.mkdtemp(prefix="kvvmm-budget-", dir=folder)
    path = os.path.join(tmp, "ledger")
    budget = args.budget_mib * MiB
    cfg = {"ledger": path, "driver": args.driver, "trace": str(trace),
           "minutes": args.minutes, "speed": args.speed, "offset_s": args.offset_s,
           "budget_bytes": budget, "shed_wait_s": args.shed_wait_s,
           "prefill_tps": args.prefill_tps, "decode_tps": args.decode_tps,
           "wall_s": (args.minutes * 60 + args.offset_s) / args.speed}
    led = Ledger(path, budget_bytes=budget)
    gpu = None
    if args.driver == "cuda":
        import kvvmm

        gpu = kvvmm.open_driver("cuda")  # the parent's view of the device's free memory
    ctx = multiprocessing.get_context("spawn")
    kids = {}
    for name, source in (("conv", "trace"), ("gen", "generator")):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=tenant_main, args=(child, cfg, name, source), daemon=True)
        p.start()
        child.close()
        kids[name] = (p, parent)
    pids = {}
    for name, (_, conn) in kids.items():
        assert conn.poll(120), f"{name} did not start"
        pids[name] = conn.recv()[1]
    wall = cfg["wall_s"]
    t0 = time.monotonic()
    for _, conn in kids.values():
        conn.send(t0)

    samples: list[tuple[float, int, int, int]] = []  # t, sum, conv, gen
    events: dict[str, Any] = {}
    over = 0
    max_sum = 0
    phase = 0
    limit_low = budget // 4
    kill_t = free_before_kill = None
    cli = [sys.executable, "-m", "kvvmm", "budget", "set", "conv"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    done: dict[str, Any] = {}
    while len(done) < 2 and time.monotonic() - t0 < wall + 60:
        el = time.monotonic() - t0
        snap = led.snapshot(sweep=phase >= 3)
        by = {t.name: t.backed_bytes for t in snap.tenants}
        total = snap.backed_bytes
        max_sum = max(max_sum, total)
        over += total > budget
        samples.append((round(el, 3), total, by.get("conv", 0), by.get("gen", 0)))
        if phase == 0 and el >= 0.4 * wall:
            t = time.monotonic()
            res = subprocess.run([*cli, str(limit_low), "--shed-wait", "1", "--ledger", path],
                                 env=env, capture_output=True, text=True, check=False)
            events["limit_set_cli"] = (res.stdout + res.stderr).strip()[-300:]
            events["limit_set_cli_s"] = round(time.monotonic() - t, 3)
            events["limit_set_at_s"] = round(el, 3)
            events["limit_low_bytes"] = limit_low
            events["conv_booked_at_set"] = by.get("conv", 0)
            phase = 1
        elif phase == 1:
            if by.get("conv", 0) <= limit_low and "conv_under_limit_s" not in events:
                events["conv_under_limit_s"] = round(el - events["limit_set_at_s"], 4)
            if el >= 0.6 * wall:
                subprocess.run([*cli, str(budget), "--ledger", path], env=env,
                               capture_output=True, check=False)
                events["limit_restored_at_s"] = round(el, 3)
                phase = 2
        elif phase == 2 and el >= 0.8 * wall:
            events["gen_booked_at_kill"] = by.get("gen", 0)
            if gpu is not None:  # free + conv's backing: what gen's death should raise
                free_before_kill = gpu.mem_info()[0] + by.get("conv", 0)
            os.kill(pids["gen"], signal.SIGKILL)
            kill_t = time.monotonic()
            events["killed_at_s"] = round(el, 3)
            phase = 3
        elif phase == 3:
            if "gen" not in by and "ledger_reclaim_s" not in events and kill_t is not None:
                events["ledger_reclaim_s"] = round(time.monotonic() - kill_t, 4)
            if gpu is not None and "device_free_back_s" not in events and kill_t is not None \
                    and free_before_kill is not None \
                    and gpu.mem_info()[0] + by.get("conv", 0) \
                    >= free_before_kill + events["gen_booked_at_kill"] - 64 * MiB:
                events["device_free_back_s"] = round(time.monotonic() - kill_t, 4)
        for name, (p, conn) in kids.items():
            if name in done:
                continue
            if name == "gen" and phase >= 3:  # killed: its pipe ends without a word
                if not p.is_alive():
                    done[name] = {"killed": True, "exitcode": p.exitcode}
            elif conn.poll():
                try:
                    done[name] = conn.recv()[1]
                except EOFError:
                    done[name] = {"died": True, "exitcode": p.exitcode}
        time.sleep(args.sample_ms / 1000)
    for p, _ in kids.values():
        p.join(30)
    card, versions = _card_versions(args.driver)
    step = max(1, len(samples) // 2000)
    doc = {
        "benchmark": "budget-tenants", "date": datetime.datetime.now(datetime.UTC).isoformat(
            timespec="seconds"),
        "card": card, "versions": versions, "config": {k: v for k, v in cfg.items()
                                                        if k != "ledger"},
        "budget_bytes": budget, "samples": len(samples), "max_sum_bytes": max_sum,
        "samples_over_budget": over, "events": events, "tenants": done,
        "targets": {"never_over_budget": over == 0,
                    "reclaim_under_1s": events.get("ledger_reclaim_s", 99) < 1.0},
        "timeline": {"columns": ["t_s", "sum_bytes", "conv_bytes", "gen_bytes"],
                     "rows": samples[::step]},
    }
    led.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: doc[k] for k in ("max_sum_bytes", "samples", "samples_over_budget",
                                          "events", "targets")}, indent=1))
    for name, st in done.items():
        print(name, json.dumps(st))
    print(f"wrote {out}")
    return 0 if over == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (not a test): what the budget broker adds to a commit that needs no shedding.

    python bench/budget/bench_budget.py [--driver host|cuda|auto] [--reps 1000] [--out PATH]

The target: the broker adds <= 20 us to a commit that needs no shedding. Measured
three ways, each rep interleaved so drift hits both sides alike:

1. ``charge_credit``: ``Tenant.charge`` then ``Tenant.credit`` of one granule, alone: the
   broker's own work per create and release (two file-lock round trips and the ledger
   reads and writes).
2. ``commit_decommit``: ``Arena.commit`` of one handle then ``Arena.decommit`` to zero,
   over the driver itself and over a ``BudgetedDriver`` of it; the difference of medians is
   what the broker adds to a commit and its release, end to end.
3. the same with ``--tenants`` other tenants registered in the ledger (the sum over every
   slot is what each charge reads; the file has a fixed number of slots, so it should not
   matter: this shows it).

Writes one JSON (card, versions, date): ``bench/results/cpu-budget.json`` for the host
driver, ``h200-budget.json`` on an H200 (``--out`` to choose).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import kvvmm
from kvvmm.budget import BudgetedDriver, Ledger, Tenant
from kvvmm.measure.machine import cpu_model, load_average, versions

ROOT = Path(__file__).resolve().parents[2]

TARGET_US = 20.0


def _q(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"p50_us": round(statistics.median(s), 2),
            "p99_us": round(s[min(len(s) - 1, int(0.99 * len(s)))], 2),
            "min_us": round(s[0], 2), "n": len(s)}


def charge_credit(tenant: Tenant, size: int, reps: int) -> dict[str, Any]:
    charge, credit = [], []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        tenant.charge(size)
        t1 = time.perf_counter_ns()
        tenant.credit(size)
        t2 = time.perf_counter_ns()
        charge.append((t1 - t0) / 1e3)
        credit.append((t2 - t1) / 1e3)
    both = [a + b for a, b in zip(charge, credit, strict=True)]
    return {"charge": _q(charge), "credit": _q(credit), "charge_plus_credit": _q(both)}


def commit_decommit(plain: Any, budgeted: Any, size: int, reps: int) -> dict[str, Any]:
    arenas = [kvvmm.Arena(d, reserve_bytes=4 * size, name=n)
              for d, n in ((plain, "plain"), (budgeted, "budgeted"))]
    offs = [a.allocate(size) for a in arenas]
    times: dict[str, dict[str, list[float]]] = {
        n: {"commit": [], "decommit": []} for n in ("plain", "budgeted")}
    for i in range(reps + 50):
        for a, o in (zip(arenas, offs, strict=True) if i % 2 else
                     reversed(list(zip(arenas, offs, strict=True)))):
            t0 = time.perf_counter_ns()
            a.commit(o, size)
            t1 = time.perf_counter_ns()
            a.decommit(o, 0)
            t2 = time.perf_counter_ns()
            if i >= 50:  # warm-up dropped
                times[a.name]["commit"].append((t1 - t0) / 1e3)
                times[a.name]["decommit"].append((t2 - t1) / 1e3)
    for a in arenas:
        a.close()
    out: dict[str, Any] = {n: {k: _q(v) for k, v in t.items()} for n, t in times.items()}
    out["added_us"] = {
        k: round(out["budgeted"][k]["p50_us"] - out["plain"][k]["p50_us"], 2)
        for k in ("commit", "decommit")}
    return out


def _card(driver: Any) -> str:
    if driver.kind == "cuda":
        import torch

        return str(torch.cuda.get_device_name(driver.device))
    return f"cpu: {cpu_model()} (host driver)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", default="host", choices=["host", "cuda", "auto"])
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--tenants", type=int, default=7, help="other tenants in case 3")
    ap.add_argument("--ledger-dir", default=None,
                    help="folder for the ledger file (default /dev/shm, else a temp dir)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    plain = kvvmm.open_driver(args.driver)
    g = plain.granularity()
    folder = args.ledger_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    with tempfile.TemporaryDirectory(dir=folder) as d, \
            Ledger(Path(d) / "ledger", budget_bytes=1 << 40) as led:
        tenant = led.register("bench")
        budgeted = BudgetedDriver(plain, tenant)
        res: dict[str, Any] = {
            "charge_credit": charge_credit(tenant, g, args.reps),
            "commit_decommit": {f"{size >> 20}MiB": commit_decommit(
                plain, budgeted, size, args.reps)
                # host memory is zeroed by the kernel (ms per 64 MiB): keep it small there
                for size in ((g, 4 * g) if plain.kind == "host" else (g, 32 * g))},
        }
        others = [Ledger(Path(d) / "ledger") for _ in range(args.tenants)]
        for i, o in enumerate(others):
            o.register(f"other{i}").charge(g)
        res["charge_credit_with_others"] = charge_credit(tenant, g, args.reps)
        res["charge_credit_with_others"]["tenants"] = args.tenants + 1
        for o in others:
            o.close()
        tenant.close()
    added = res["charge_credit"]["charge_plus_credit"]["p50_us"]
    doc = {
        "benchmark": "budget", "date": datetime.datetime.now(datetime.UTC).isoformat(
            timespec="seconds"),
        "card": _card(plain), "driver": plain.kind,
        "versions": versions(ROOT, "torch", "cuda-bindings"),
        "load_average": load_average(),
        "granularity_bytes": g, "reps": args.reps, "target_added_us": TARGET_US,
        "results": res,
        "summary": {
            "broker_charge_plus_credit_p50_us": added,
            "commit_added_p50_us": res["commit_decommit"][f"{g >> 20}MiB"]["added_us"]["commit"],
            "target_met": added <= TARGET_US,
        },
        "notes": "charge_plus_credit is the broker's own work per create+release; "
                 "commit_decommit.added_us is the difference of medians end to end (noisier: "
                 "it includes the driver's own variance).",
    }
    default = "cpu-budget.json" if plain.kind == "host" else "h200-budget.json"
    out = Path(args.out) if args.out else Path(__file__).parent.parent / "results" / default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"], indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long RangeBacking.give_back takes to trim N GiB of deferred cache, per unit.

A llama-3.1-8b interleaved owner (one buffer, 2 MiB = 16 slots a block) on the given driver;
leases of ``unit`` bytes each are admitted, mapped and released until ``total`` bytes are
cached (one unit each: one handle, one mapping), then ``give_back(None, deadline_s=60)``
trims all of it on the backing thread; a second round trims under a 5 ms deadline and says
where it stopped. Writes one JSON (card, versions, date, load): by default
``bench/results/cpu-elastic-giveback.json`` on the host driver.

    PYTHONPATH=. python bench/elastic/bench_giveback.py [--driver host] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvvmm import KvBufferOwner, open_driver
from kvvmm.layout import model_descs
from kvvmm.measure.machine import cpu_model, load_average, versions
from kvvmm.owner import RangeBacking

ROOT = Path(__file__).resolve().parents[2]

MiB = 1 << 20
GiB = 1 << 30


def _round(driver_kind: str, total: int, unit: int, deadline_s: float) -> dict[str, object]:
    drv = open_driver(driver_kind)
    tokens = (total + unit) // (2 * MiB) * 16 + 16
    descs = model_descs("llama-3.1-8b", layout="interleaved", reserved_tokens=tokens,
                        page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=tokens,
                          descs=descs)
    backing = RangeBacking(owner, high_bytes=total + unit)
    per = unit // (2 * MiB) * 16
    leases = [backing.admit(per) for _ in range(total // unit)]
    for lease in leases:
        backing.wait(lease, timeout_s=120)
    for lease in leases:
        backing.release(lease)
    assert backing.drain(120)
    cached = backing.givable_bytes
    got = backing.give_back(None, deadline_s=deadline_s).wait(120)
    row = {"cached_bytes": cached, "unit_bytes": unit, "deadline_s": deadline_s,
           "freed_bytes": got.freed_bytes, "units": got.units, "stopped": got.stopped,
           "elapsed_ms": round(got.elapsed_s * 1e3, 3),
           "per_unit_ms": round(got.elapsed_s * 1e3 / max(got.units, 1), 4),
           "unit_max_ms": round(got.unit_max_s * 1e3, 3),
           "per_gib_ms": round(got.elapsed_s * 1e3 * GiB / max(got.freed_bytes, 1), 3)}
    backing.close()
    owner.close()
    drv.close()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--driver", default="host")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    card = f"cpu: {cpu_model()} ({args.driver} driver)"
    if args.driver == "cuda":
        import torch

        card = torch.cuda.get_device_name(0)
    cases = [(GiB, 2 * MiB), (GiB, 32 * MiB), (GiB, 256 * MiB), (4 * GiB, 32 * MiB)]
    results = []
    for total, unit in cases:
        rounds = [_round(args.driver, total, unit, 60.0) for _ in range(args.rounds)]
        med = statistics.median(r["elapsed_ms"] for r in rounds)  # type: ignore[misc]
        results.append({"total_bytes": total, "unit_bytes": unit, "rounds": rounds,
                        "median_elapsed_ms": med})
        print(f"{total // GiB} GiB in {unit // MiB} MiB units: median {med:.1f} ms "
              f"({rounds[0]['per_unit_ms']} ms a unit)", flush=True)
    bounded = [_round(args.driver, GiB, 32 * MiB, 0.005) for _ in range(args.rounds)]
    for r in bounded:
        print(f"1 GiB, 32 MiB units, deadline 5 ms: {r['freed_bytes'] // MiB} MiB in "
              f"{r['elapsed_ms']} ms, stopped: {r['stopped']}", flush=True)
    doc = {"benchmark": "elastic-giveback",
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "card": card, "driver": args.driver,
           "versions": versions(ROOT),
           "load_average": load_average(),
           "model": "llama-3.1-8b interleaved (2 MiB = 16 slots a block)",
           "what": "RangeBacking.give_back(None, deadline_s) of every cached unit on the "
                   "backing thread; elapsed from the call to the stop",
           "results": results, "bounded_5ms": bounded}
    out = Path(args.out) if args.out else (Path(__file__).resolve().parents[1] / "results"
                                          / f"{'cpu' if args.driver == 'host' else args.driver}"
                                            f"-elastic-giveback.json")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

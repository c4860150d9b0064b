"""Probe: is the default policy's bandwidth ratio below 0.99 of cudaMalloc, or is it noise?

`kvvmm bench` measured the new default, Geometric(2, 256 MiB, min 8 MiB), at 0.9857x and
Geometric(2, 256 MiB) at 1.001x in the same run, with Chunked(64/128/256 MiB) at 0.985, 1.005
and 0.993x: differences of the size of the run-to-run noise. This grows and finalizes an owner
exactly as the bench does, measures the same 1 GiB copy, and alternates the policies over
rounds, so each policy's spread shows next to its median.

    PYTHONPATH=$PWD python3 bench/probes/probe_default_bandwidth.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from kvvmm.driver.cuda import CudaDriver
from kvvmm.measure import BENCH_WORKLOAD, SETTLE_S, copy_vs_malloc, grow, rotated
from kvvmm.policy import Chunked, Geometric, default_policy
from kvvmm.units import GiB, MiB


def main(out_dir: str, rounds: int = 3) -> None:
    import torch

    torch.empty(1, device="cuda")
    cd = CudaDriver()
    policies = [default_policy(), Geometric(2.0, 256 * MiB), Chunked(128 * MiB)]
    ratios: dict[str, list[float]] = {str(p): [] for p in policies}
    for r in range(rounds):
        for p in rotated(policies, r):  # as the bench's rounds
            time.sleep(SETTLE_S)
            owner, _, _ = grow(cd, p)
            owner.finalize(BENCH_WORKLOAD.finalize_tokens)
            vm = owner.tensors[2].view(-1)[: GiB // 2]
            vm2 = owner.tensors[3].view(-1)[: GiB // 2]
            ratios[str(p)].append(copy_vs_malloc(vm, vm2)["ratio"])
            del vm, vm2
            owner.close()
            print(p, ratios[str(p)][-1], flush=True)
    out = {"benchmark": "probe_default_bandwidth", "card": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rounds": rounds,
           "ratios": ratios,
           "median": {k: statistics.median(v) for k, v in ratios.items()},
           "spread": {k: round(max(v) - min(v), 4) for k, v in ratios.items()}}
    with open(f"{out_dir}/h200-default-bandwidth.json", "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["median"]), json.dumps(out["spread"]))


if __name__ == "__main__":
    main(sys.argv[1])

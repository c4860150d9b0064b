"""Benchmark (not a test): what agreeing on a KV resize costs, against a per-rank resize.

    python bench/distributed/bench_distributed.py [--driver sim|host|cuda] [--backend gloo|nccl]
                                      [--world 2] [--rounds 20] [--tokens 65536]
                                      [--out bench/results/cpu-distributed-bench.json]

Every rank of a ``kvvmm.owner.distributed.spawn`` world (127.0.0.1) builds the same owner
(``--model`` sharded over ``--world`` ranks, ``--reserved`` tokens) and, ``--rounds`` times,
backs ``--tokens`` tokens and gives them back again, two ways: ``owner.finalize(n)`` (each
rank alone) and ``DistributedOwner.finalize(n)`` (prepare, agree, map, confirm: two
all-reduces). A barrier lines the ranks up before each timed call. It also times the bare
agreement all-reduce. Times are medians of the rounds in ms, per rank, then the slowest rank.

On a GPU: ``--driver cuda --backend nccl --world 1`` (one rank a GPU; the tensors of the
agreement live on the GPU) or ``--backend gloo`` (the CPU group SGLang uses for control).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

PS = 16


def _rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from kvvmm.driver import driver_for
    from kvvmm.owner import KvBufferOwner
    from kvvmm.owner.distributed import DistributedOwner
    from kvvmm.owner.tp import tp_descs

    kind = opts["driver"]
    if kind == "cuda":
        torch.cuda.set_device(rank)
    drv = driver_for(kind, device=rank, profile="h200")
    descs = tp_descs(opts["model"], tp=world, reserved_tokens=opts["reserved"], page_size=PS,
                     dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PS,
                          reserved_tokens=opts["reserved"], descs=descs)
    coll = DistributedOwner(owner, model=opts["model"])
    n = opts["tokens"]
    # The agreement's all-reduce as DistributedOwner makes it (an int64 vector: the op's code,
    # the token count and one flag per rank, each with its negation; MIN over the ranks; on
    # the GPU for NCCL, on the CPU otherwise), through torch.distributed's public calls.
    agree_on = (torch.device("cuda", torch.cuda.current_device())
                if "nccl" in str(dist.get_backend()) else torch.device("cpu"))

    def all_reduce_min(values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=agree_on)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, async_op=True)
        assert work is not None
        work.wait()
        return [int(x) for x in t.cpu().tolist()]

    def timed(fn: Any) -> float:
        dist.barrier()
        if kind == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if kind == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    plain, collective, agree = [], [], []
    for i in range(opts["rounds"] + 1):  # round 0 warms up (first creates, first collective)
        p = timed(lambda: owner.finalize(n))
        owner.shrink(PS)
        c = timed(lambda: coll.finalize(n))
        owner.shrink(PS)
        a = timed(lambda: all_reduce_min([2, -2, n, -n, *([1] * world)]))
        if i:
            plain.append(p)
            collective.append(c)
            agree.append(a)
    added = owner.finalize(n)
    out = {"rank": rank, "device_name": drv.name, "handles": len(owner.snapshot().arena.mappings),
           "backed_bytes": owner.backed_bytes, "added_last": added,
           "plain_ms": statistics.median(plain), "collective_ms": statistics.median(collective),
           "all_reduce_ms": statistics.median(agree)}
    owner.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from kvvmm.driver import DRIVER_KINDS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--driver", default="sim", choices=DRIVER_KINDS)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--reserved", type=int, default=131072)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import torch

    import kvvmm
    from kvvmm.owner.distributed import spawn

    opts = vars(args).copy()
    t0 = time.time()
    ranks = spawn(_rank, args.world, opts, backend=args.backend, timeout_s=600,
                  group_timeout_s=120)
    slow = {k: max(r[k] for r in ranks) for k in ("plain_ms", "collective_ms", "all_reduce_ms")}
    result = {
        "what": "collective finalize (prepare, agree, map, confirm) vs per-rank finalize, "
                "same sizes; medians of rounds, slowest rank",
        "card": (ranks[0]["device_name"] if args.driver == "cuda" else
                 f"{args.driver} driver ({ranks[0]['device_name']}), {platform.machine()} CPU"),
        "driver": args.driver, "backend": args.backend,
        "world": args.world, "rounds": args.rounds, "model": args.model,
        "reserved_tokens": args.reserved, "tokens": args.tokens,
        "backed_bytes_per_rank": ranks[0]["backed_bytes"],
        "handles_per_rank": ranks[0]["handles"],
        "plain_finalize_ms": slow["plain_ms"], "collective_finalize_ms": slow["collective_ms"],
        "agreement_all_reduce_ms": slow["all_reduce_ms"],
        "overhead_ms": slow["collective_ms"] - slow["plain_ms"],
        "per_rank": ranks,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "kvvmm": getattr(kvvmm, "__version__", "?"),
                     "platform": platform.platform()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.time() - t0, 1),
    }
    text = json.dumps(result, indent=1, sort_keys=True)
    print(text)
    out = args.out or os.path.join(os.path.dirname(__file__), "..", "results",
                                   f"{args.driver}-{args.backend}-x{args.world}-distributed.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

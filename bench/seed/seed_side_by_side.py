"""SGLang's KV arena (the seed) on ``kvvmm bench``'s workload: the ``seed`` section of its JSON.

    PYTHONPATH=$PWD python3 bench/seed/seed_side_by_side.py PATH/kv_vmm_backing_seed.py

``kvvmm bench --seed-file PATH --seed-script bench/seed/seed_side_by_side.py`` runs this file in a
child process, after its own sections, on the same card: the seed compiles a C++ stub for
every arena (into a shared temp dir) and may abort at exit (a tensor outliving its arena's
close), and neither may touch the benchmark's process. The workload and the bandwidth
measurement are ``kvvmm bench``'s own (``kvvmm.measure.BENCH_WORKLOAD``: 64 buffers, 4096-token
decode steps to 500k tokens, finalize to 1M; ``kvvmm.measure.copy_vs_malloc``), imported from
there so the two sides cannot drift apart.

The seed file must be named ``kv_vmm_backing_seed.py``: it is imported by that name. Prints
one line, ``SEED_JSON {...}``: arena and owner construction, decode growth, handles, finalize,
copy bandwidth vs cudaMalloc, close.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any

SEED_MODULE = "kv_vmm_backing_seed"


def measure(seed: Any) -> dict[str, Any]:
    """Time the seed's arena and owner as ``kvvmm bench`` times kvvmm's."""
    import torch

    from kvvmm.measure import BENCH_WORKLOAD as w
    from kvvmm.measure import copy_vs_malloc

    pc = time.perf_counter
    r: dict[str, Any] = {}
    t = pc()
    arena = seed.KvVmmArena(0, reserve_bytes=64 << 30)
    r["arena_ctor_s"] = round(pc() - t, 3)
    t = pc()
    arena.close()
    r["arena_close_ms"] = round((pc() - t) * 1e3, 2)

    descs = w.descs()
    t = pc()
    own = seed.KvVmmBufferOwner(device="cuda:0", device_id=0, store_dtype=torch.bfloat16,
                                page_size=w.page_size, reserved_num_tokens=w.reserved_tokens,
                                buffer_descs=descs)
    r["owner_ctor_s"] = round(pc() - t, 3)
    r["reserved_bytes"] = own._arena.reserved

    torch.cuda.synchronize()
    t = pc()
    for n in w.decode_steps():
        own.ensure_prefix(n)
    torch.cuda.synchronize()
    r["grow_ms"] = round((pc() - t) * 1e3, 2)
    r["handles_after_growth"] = len(own._arena._ranges)

    t = pc()
    own.finalize(w.finalize_tokens)
    torch.cuda.synchronize()
    r["finalize_1M_ms"] = round((pc() - t) * 1e3, 2)

    nbytes = 1 << 30
    vm = own.tensors[2].view(-1)[: nbytes // 2]
    vm2 = own.tensors[3].view(-1)[: nbytes // 2]
    r["bandwidth"] = copy_vs_malloc(vm, vm2)
    del vm, vm2
    t = pc()
    own.close()
    r["close_ms"] = round((pc() - t) * 1e3, 2)
    return r


def main(argv: list[str]) -> int:
    if len(argv) != 1 or os.path.basename(argv[0]) != f"{SEED_MODULE}.py":
        print(f"usage: seed_side_by_side.py PATH/{SEED_MODULE}.py (got {argv})", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    seed = importlib.import_module(SEED_MODULE)
    print("SEED_JSON " + json.dumps(measure(seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Probe: is the interleaved layout's SDPA cost (0.92x of token-major) its own or the backend's?

`bench/bench_elastic.py` times torch's scaled_dot_product_attention over every layer's K and V,
the batch's 8 sequences sharing one KV (an expand with a zero batch stride), and lets torch
pick the backend. This times each backend torch has (math, memory-efficient, flash, cuDNN) on
both layouts, one decode query per sequence over 32 layers of 8 KV heads, 32 query heads (GQA),
for a shared KV (the bench's case) and for 8 sequences of their own KV; a backend that refuses
a layout is reported as such, not as slow.

    PYTHONPATH=$PWD python3 bench/probes/probe_xl_sdpa.py OUT_DIR [TOKENS]
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

from kvvmm.driver.cuda import CudaDriver
from kvvmm.owner import KvBufferOwner, layer_views

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the same owner, timer
from bench_elastic import _owner as bench_owner
from bench_elastic import _time_ms

LAYERS, HEADS, DIM, QHEADS, BATCH = 32, 8, 128, 32, 8


def _owner(drv: Any, layout: str, tokens: int) -> KvBufferOwner:
    owner: KvBufferOwner = bench_owner(drv, layout, tokens)  # bench_elastic's, backed here
    owner.finalize(tokens - 16)
    return owner


def main(out_dir: str, tokens: int = 65536) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.empty(1, device="cuda")
    drv = CudaDriver()
    xl, tm = _owner(drv, "interleaved", tokens), _owner(drv, "token_major", tokens)
    per_seq = tokens // BATCH
    layouts = {
        "interleaved": [(k[:tokens], v[:tokens]) for k, v in layer_views(xl)],
        "token_major": [(tm.tensors[i][:tokens], tm.tensors[LAYERS + i][:tokens])
                        for i in range(LAYERS)],
    }
    for kv in layouts.values():
        for k, v in kv:
            k.normal_()
            v.normal_()
    q = torch.randn(BATCH, QHEADS, 1, DIM, dtype=torch.bfloat16, device="cuda")
    moved = 2 * LAYERS * tokens * HEADS * DIM * 2
    backends = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    res: dict[str, Any] = {"tokens": tokens, "layers": LAYERS, "kv_heads": HEADS,
                           "q_heads": QHEADS, "batch": BATCH, "runs": {}}

    def shared(kv: list[tuple[Any, Any]]) -> None:  # the bench's case
        for k, v in kv:
            kk = k.permute(1, 0, 2).unsqueeze(0).expand(BATCH, HEADS, tokens, DIM)
            vv = v.permute(1, 0, 2).unsqueeze(0).expand(BATCH, HEADS, tokens, DIM)
            F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

    def own(kv: list[tuple[Any, Any]]) -> None:  # each sequence its own tokens // 8 slots
        for k, v in kv:
            kk = k.view(BATCH, per_seq, HEADS, DIM).transpose(1, 2)
            vv = v.view(BATCH, per_seq, HEADS, DIM).transpose(1, 2)
            F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

    for case, fn in (("shared_kv", shared), ("own_kv", own)):
        for bname, backend in [("auto", None), *backends.items()]:
            row: dict[str, Any] = {}
            for lname, kv in layouts.items():
                try:
                    if backend is None:
                        ms = _time_ms(lambda kv=kv, fn=fn: fn(kv))
                    else:
                        with sdpa_kernel([backend]):
                            ms = _time_ms(lambda kv=kv, fn=fn: fn(kv))
                    row[lname] = {"ms": round(ms, 3), "read_tb_s": round(moved / ms / 1e9, 3)}
                except (RuntimeError, ValueError) as e:
                    row[lname] = {"refused": str(e).splitlines()[0][:200]}
            if all("ms" in row[x] for x in layouts):
                row["interleaved_vs_token_major"] = round(
                    row["token_major"]["ms"] / row["interleaved"]["ms"], 4)
            res["runs"][f"{case}/{bname}"] = row
            print(case, bname, json.dumps(row), flush=True)
    res["card"] = torch.cuda.get_device_name(0)
    res["torch"] = torch.__version__
    res["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    with open(f"{out_dir}/h200-xl-sdpa.json", "w") as f:
        json.dump(res, f, indent=1)
    layouts.clear()  # the views pin the owners' memory
    del k, v
    xl.close()
    tm.close()


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))

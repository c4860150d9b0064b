"""The seed and kvvmm's SGLang adapter, side by side through SGLang's call sequence.

For MHA (one pool) and hybrid SWA (two pools, two owners alive at once), each pool gets a seed
owner (``kv_vmm_backing_seed.KvVmmBufferOwner``) and an adapter owner
(``kvvmm.integrations.sglang.KvVmmBufferOwner``) built from the same descriptors, and both go
through: construct (slot 0 backed); capture a CUDA graph that writes slot 0 and reads it back;
finalize to a budget; replay; write the same pattern over every final slot; read
``backed_bytes``; close. Checked: equal per-buffer spans and backed bytes, pointers unchanged by
finalize (each side against itself), equal tensor contents and graph outputs. Construction time
of both is recorded (the seed compiles a C++ stub per arena, ~20 s each).

The sequence runs in a child process (this file as a script): the seed loads per-arena ``.so``
files and may abort at exit when a tensor outlives its arena, which must not take pytest down.
The child prints one ``CONFORMANCE_JSON {...}`` line; the test writes it to
``$OUT/sglang_conformance.json`` when ``OUT`` is set, prints it, and asserts on it.

Needs: a CUDA GPU, torch with CUDA, cuda-bindings, a C++ compiler and ninja for the seed's
``load_inline``; the seed file at ``$KVVMM_SEED_FILE`` or ``.seed/kv_vmm_backing_seed.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = 16
HEADS, HEAD_DIM = 8, 128
TAG = "CONFORMANCE_JSON "

#: layout -> its pools: (name, layers, reserved tokens, budget bytes for finalize).
LAYOUTS: dict[str, list[tuple[str, int, int, int]]] = {
    "mha": [("mha", 4, 200_000, 1 << 30)],
    "hybrid_swa": [("full", 2, 300_000, 768 << 20), ("swa", 6, 40_000, 256 << 20)],
}


def seed_path() -> Path | None:
    env = os.environ.get("KVVMM_SEED_FILE")
    path = Path(env) if env else ROOT / ".seed" / "kv_vmm_backing_seed.py"
    return path if path.is_file() else None


class SglDesc:
    """SGLang's descriptor as the adapter sees it: four fields, nothing else."""

    def __init__(self, name: str, shape: tuple[int, ...], row_bytes: int,
                 tokens_per_row: int) -> None:
        self.name, self.shape = name, shape
        self.row_bytes, self.tokens_per_row = row_bytes, tokens_per_row


def _pool_descs(prefix: str, layers: int, size: int) -> list[Any]:
    from kvvmm.integrations.sglang import KvBufferDesc

    row = HEADS * HEAD_DIM * 2  # bfloat16
    return [KvBufferDesc(f"{prefix}_{kv}{i}", (size + PAGE, HEADS, HEAD_DIM), row, 1)
            for kv in "kv" for i in range(layers)]


def _pattern(torch: Any, n: int, i: int) -> Any:
    # Exact in bfloat16 (small integers), different per buffer and per row.
    col = (torch.arange(n, device="cuda", dtype=torch.float32) % 61 + i).to(torch.bfloat16)
    return col.view(n, 1, 1)


def _spans(side: str, owner: Any) -> list[int]:
    """Bytes backed per buffer: the seed's bookkeeping, kvvmm's snapshot."""
    if side == "seed":
        return [s.backed_to for s in owner._specs]
    return [b.backed_bytes for b in owner.snapshot().buffers]


def _same_spans(sides: dict[str, list[Any]], k: int) -> bool:
    return _spans("seed", sides["seed"][k]) == _spans("kvvmm", sides["kvvmm"][k])


def _capture(torch: Any, owners: list[Any]) -> tuple[Any, list[Any]]:
    """A CUDA graph that adds to every buffer's slot-0 page and reads its sum; and the reads.

    A function of its own so that no tensor stays bound in the caller's frame: kvvmm's close
    waits for every live tensor, and a leftover loop variable would be one.
    """
    tensors = [t for o in owners for t in o.tensors]
    for t in tensors:
        t[:PAGE].zero_()
    reads = [torch.zeros((), device="cuda", dtype=torch.float32) for _ in tensors]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
        for t, r in zip(tensors, reads, strict=True):
            r.copy_(t[:PAGE].float().sum())
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j, (t, r) in enumerate(zip(tensors, reads, strict=True)):
            t[:PAGE].add_(float(j % 7 + 1))
            r.copy_(t[:PAGE].float().sum())
    torch.cuda.synchronize()
    return g, reads


def _same_contents(torch: Any, sides: dict[str, list[Any]], finals: list[int]) -> bool:
    """Slot 0 as the graph left it, then the same pattern over every final slot: equal?"""
    equal = True
    for k, n in enumerate(finals):
        for i, (a, b) in enumerate(zip(sides["seed"][k].tensors, sides["kvvmm"][k].tensors,
                                       strict=True)):
            equal &= torch.equal(a[:PAGE], b[:PAGE])  # what the graph wrote
            pat = _pattern(torch, n + PAGE, i)
            a[: n + PAGE] = pat
            b[: n + PAGE] = pat
            equal &= torch.equal(a[: n + PAGE], b[: n + PAGE])
    torch.cuda.synchronize()
    return bool(equal)


def _sequence(seed: Any) -> dict[str, Any]:
    """Run both owners through SGLang's sequence for every layout; what was seen, as JSON."""
    import torch

    from kvvmm.integrations.sglang import KvVmmBufferOwner

    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    for layout, pools in LAYOUTS.items():
        out: dict[str, Any] = {}
        sides: dict[str, list[Any]] = {"seed": [], "kvvmm": []}
        for name, layers, size, _budget in pools:
            descs = _pool_descs(name, layers, size)
            kw = dict(device="cuda:0", device_id=0, store_dtype=torch.bfloat16,
                      page_size=PAGE, reserved_num_tokens=size)
            t = time.perf_counter()
            sides["seed"].append(seed.KvVmmBufferOwner(buffer_descs=descs, **kw))
            seed_s = time.perf_counter() - t
            duck = [SglDesc(d.name, d.shape, d.row_bytes, d.tokens_per_row) for d in descs]
            t = time.perf_counter()
            sides["kvvmm"].append(KvVmmBufferOwner(buffer_descs=duck, name=name, **kw))
            kvvmm_s = time.perf_counter() - t
            out[name] = {"seed_ctor_s": round(seed_s, 3), "kvvmm_ctor_s": round(kvvmm_s, 4)}

        for k, (name, *_rest) in enumerate(pools):
            out[name]["slot0_spans_equal"] = _same_spans(sides, k)
            out[name]["slot0_backed_bytes"] = {s: sides[s][k].backed_bytes for s in sides}

        # Capture: every buffer's slot-0 page is written, then read into a static output.
        ptrs = {s: [[t.data_ptr() for t in o.tensors] for o in sides[s]] for s in sides}
        captured = {s: _capture(torch, sides[s]) for s in sides}

        finals = []
        for k, (name, _layers, size, budget) in enumerate(pools):
            per_token = sides["kvvmm"][k].bytes_per_token()
            n = min(budget // per_token // PAGE * PAGE, size)
            finals.append(n)
            for s in sides:
                sides[s][k].finalize(n)
            out[name]["final_tokens"] = n
            out[name]["final_spans_equal"] = _same_spans(sides, k)
            out[name]["backed_bytes"] = {s: sides[s][k].backed_bytes for s in sides}
        for s in sides:
            out[f"{s}_pointers_stable"] = (
                [[t.data_ptr() for t in o.tensors] for o in sides[s]] == ptrs[s])
            captured[s][0].replay()
            captured[s][0].replay()
        torch.cuda.synchronize()
        reads = {s: captured[s][1] for s in sides}
        out["graph_reads_equal"] = all(
            torch.equal(a, b) for a, b in zip(reads["seed"], reads["kvvmm"], strict=True))
        out["graph_reads"] = [float(r) for r in reads["kvvmm"][:4]]
        out["contents_equal"] = _same_contents(torch, sides, finals)

        # Close: kvvmm first (it must give everything back once our references go: helpers
        # held the tensors, so none is left here), then the seed, whose close unmaps at once.
        del captured, reads
        for o in sides["kvvmm"]:
            out.setdefault("kvvmm_released", []).append(o.close(wait=True, timeout=10.0))
        for o in sides["seed"]:
            o.close()
            out.setdefault("seed_backed_after_close", []).append(o.backed_bytes)
        torch.cuda.synchronize()
        res[layout] = out
    return res


def _load_seed(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("kv_vmm_backing_seed", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_adapter_matches_the_seed_through_sglangs_sequence_on_the_gpu(
        needs_torch_cuda: None) -> None:
    path = seed_path()
    if path is None:
        pytest.skip("the seed file is absent: set KVVMM_SEED_FILE or put it at "
                    ".seed/kv_vmm_backing_seed.py (SGLang's kv_vmm_backing.py, not in git)")
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.run([sys.executable, __file__, str(path)], capture_output=True, text=True,
                          env=env, timeout=170)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(TAG)]
    assert lines, f"child exited {proc.returncode} without a result:\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1][len(TAG):])
    res["child_exit_code"] = proc.returncode  # the seed may abort at exit: recorded, not fatal
    text = json.dumps(res, indent=1, sort_keys=True)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "sglang_conformance.json").write_text(text + "\n")
    assert "error" not in res, res.get("error")
    for layout, pools in LAYOUTS.items():
        got = res[layout]
        for name, *_ in pools:
            p = got[name]
            assert p["slot0_spans_equal"] and p["final_spans_equal"], (layout, name, p)
            assert p["slot0_backed_bytes"]["seed"] == p["slot0_backed_bytes"]["kvvmm"]
            assert p["backed_bytes"]["seed"] == p["backed_bytes"]["kvvmm"], (layout, name, p)
        assert got["seed_pointers_stable"] and got["kvvmm_pointers_stable"], layout
        assert got["graph_reads_equal"] and got["contents_equal"], (layout, got)
        assert all(got["kvvmm_released"]), (layout, got)


if __name__ == "__main__":
    # The child: run the sequence, print the one result line, and leave without the seed's
    # teardown at interpreter exit (its MemPool and .so handles can abort it).
    try:
        result = _sequence(_load_seed(sys.argv[1]))
    except BaseException as e:  # report, so the parent shows what broke
        import traceback

        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    print(TAG + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)

"""Peer benchmark (not a test): kvcached 0.1.6's per-request KV alloc/free cost on one GPU.

    LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6) PYTHONPATH=.peers-build \
        python bench/elastic/peer_kvcached.py --tokens 100,2000,...|@file [--pool-gib 51.4]  # JSON

kvcached is built into ``.peers-build`` from ``shared/peers/kvcached-0.1.6.tar.gz`` (see
shared/peers/README.md; without the preload its extension can crash in ``PageAllocator``
init); ``bench/elastic/bench_elastic.py`` calls :func:`run_kvcached` in its own process instead.

The pool is built as kvcached's vLLM integration builds it, for a llama-3.1-8b-like model
(``layers`` K and V of ``kv_heads`` x ``head_dim``, ``block_tokens``-token blocks, contiguous
layout unless ``KVCACHED_CONTIGUOUS_LAYOUT=false``): ``init_kvcached(is_worker=True)``,
``alloc_kv_cache(...)``, ``get_kv_cache_manager(...)`` (a ``KVCacheManager`` of ``pool_bytes``
of KV). Timed with ``time.perf_counter_ns()`` on the calling thread: admit, every request's
``KVCacheManager.alloc(ceil(tokens / block_tokens))`` in order, all held; free,
``KVCacheManager.free(ids)`` of each; churn, with all admitted again, ``free`` then ``alloc``
of request i as one pair; ``torch.cuda.synchronize()`` after each phase. kvcached maps pages
inside ``alloc`` (or takes ones its C++ prealloc thread mapped ahead): admitted is ready.
With ``--work @file`` (``bench_elastic.py --churn-growth`` writes it), the same pool runs
that random churn and decode-like growth through ``bench_elastic.run_work`` instead, each
request's blocks written and read back through the per-layer views.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

KNOBS = ("KVCACHED_CONTIGUOUS_LAYOUT", "KVCACHED_PAGE_PREALLOC_ENABLED", "KVCACHED_PAGE_SIZE_MB",
         "KVCACHED_PAGE_SIZE", "KVCACHED_MIN_RESERVED_PAGES", "KVCACHED_MAX_RESERVED_PAGES",
         "KVCACHED_GPU_UTILIZATION", "KVCACHED_LOG_LEVEL", "KVCACHED_IPC_NAME")


def _import_kvcached(notes: list[str]) -> tuple[Any, Any, Any]:
    """Import kvcached; its knobs are read from the environment when kvcached.utils loads."""
    if "kvcached.utils" in sys.modules:
        notes.append("kvcached was already imported: its env knobs were fixed before this call")
    os.environ.setdefault("KVCACHED_CONTIGUOUS_LAYOUT", "true")
    os.environ.setdefault("KVCACHED_LOG_LEVEL", "WARNING")  # no INFO lines from timed calls
    try:
        import kvcached
        from kvcached import utils
        from kvcached.integration.vllm import interfaces
    except Exception as e:  # ImportError, or OSError from loading the built extension
        why = (str(e).splitlines() or [""])[0]
        raise ImportError(f"kvcached is not importable ({type(e).__name__}: {why}); build it "
                          "into .peers-build and put that on PYTHONPATH") from e
    return kvcached, utils, interfaces


def _manager(itf: Any, num_blocks: int, block_tokens: int, cell: int, layers: int,
             config: dict[str, Any]) -> Any:
    make = getattr(itf, "get_kv_cache_manager", None)
    if make is not None:  # the vLLM path: validated against the tensors, registered, null block
        config["manager_api"] = "interfaces.get_kv_cache_manager (reserve_null_block=True)"
        return make(num_blocks, block_tokens, cell, layers, num_kv_buffers=2)
    from kvcached.kv_cache_manager import KVCacheManager

    config["manager_api"] = "KVCacheManager (direct, as tests/test_kvcache_manager.py)"
    return KVCacheManager(num_blocks=num_blocks, block_size=block_tokens, cell_size=cell,
                          num_layers=layers, world_size=1)


def _settle(manager: Any, utils: Any, pages: int, notes: list[str]) -> None:
    """Wait for the manager's background init and for the prealloc thread's first reserve."""
    done = getattr(manager, "_post_init_done", None)
    if done is not None and not done.wait(timeout=30.0):
        notes.append("KVCacheManager post-init not done after 30 s")
    want = min(int(utils.MIN_RESERVED_PAGES), pages - 1) if utils.PAGE_PREALLOC_ENABLED else 0
    deadline = time.monotonic() + 10.0
    while manager.page_allocator.get_num_reserved_pages() < want:
        if time.monotonic() > deadline:
            notes.append(f"prealloc reserve below {want} pages after 10 s")
            return
        time.sleep(0.01)


def _mapped(manager: Any, bundle: int) -> dict[str, Any]:
    try:
        st = {k: int(v) for k, v in dict(manager.page_allocator.get_page_state()).items()}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"page_state": st, "inuse_bytes": st["inuse_pages"] * bundle,
            "reserved_bytes": st["reserved_pages"] * bundle,
            "mapped_bytes": (st["inuse_pages"] + st["reserved_pages"]) * bundle}


def _check(manager: Any, ids: Any, n: int, i: int) -> list[int]:
    if ids is None or len(ids) != n:  # alloc() returns None when the pool cannot back n
        raise RuntimeError(f"kvcached alloc({n}) for request {i} returned "
                           f"{None if ids is None else len(ids)} blocks "
                           f"(available_size={manager.available_size()})")
    return list(ids)


class _Side:
    """kvcached as ``bench_elastic.run_work`` drives it: a request is its list of block ids,
    one alloc per admit or grow; the pattern's page is a block's first token in every
    layer's K and V (``layers``: alloc_kv_cache's per-layer views)."""

    def __init__(self, manager: Any, layers: list[Any], block_tokens: int) -> None:
        import torch

        self.m, self.bt, self.free = manager, block_tokens, manager.free
        self.views = [t.view(torch.int16).transpose(0, 1)[:, :, 0] for t in layers]
        self.wait = self.pages = lambda ids: ids  # alloc returns its blocks mapped

    def admit(self, tokens: int) -> list[int]:
        n = -(-tokens // self.bt)
        return _check(self.m, self.m.alloc(n), n, -1)

    def grow(self, ids: list[int], tokens: int) -> list[int]:
        n = -(-tokens // self.bt) - len(ids)
        ids += _check(self.m, self.m.alloc(n), n, -1)
        return ids


def _shutdown(itf: Any, manager: Any, notes: list[str]) -> None:
    if manager is not None:
        try:  # stops the prealloc and resize-watcher threads, unlinks the /dev/shm segment
            if manager.shutdown() is False:
                notes.append("KVCacheManager.shutdown() returned False")
        except Exception as e:
            notes.append(f"KVCacheManager.shutdown() raised {type(e).__name__}: {e}")
    for _ in range(3):  # stops the worker IPC listener, then frees the FTensors (C++)
        try:
            if itf.shutdown_kvcached():
                return
        except Exception as e:
            notes.append(f"shutdown_kvcached() raised {type(e).__name__}: {e}")
            return
        time.sleep(0.5)
    notes.append("shutdown_kvcached() returned False 3 times (a listener or pool still active)")


def run_kvcached(requests: list[int], *, layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
                 block_tokens: int = 16, dtype: str = "bfloat16", pool_bytes: int,
                 repeats: int = 1, device: int = 0,
                 work: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time kvcached's alloc/free per request; raw per-call microseconds (see module doc).
    With ``work`` (``bench_elastic.work``), its churn and growth instead, pages checked."""
    notes: list[str] = []
    kvcached, utils, itf = _import_kvcached(notes)
    import torch

    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {dtype!r}")
    page = int(utils.PAGE_SIZE)
    cell = kv_heads * head_dim * tdtype.itemsize  # bytes per token of one layer's K (or V)
    block_mem = block_tokens * cell
    bundle = page * layers * 2  # one kvcached page id maps this much (all layers, K and V)
    pages = pool_bytes // bundle
    num_blocks = pages * page // block_mem
    need = [-(-int(t) // block_tokens) for t in requests]
    if num_blocks < 2 or sum(need) > num_blocks - 1:  # block 0 is the null block
        raise ValueError(f"pool of {num_blocks} blocks cannot hold {sum(need)} (+1 null block)")
    config: dict[str, Any] = {
        "kvcached_version": getattr(kvcached, "__version__", "unknown"),
        "kvcached_path": os.path.dirname(getattr(kvcached, "__file__", "") or ""),
        "torch": torch.__version__, "device": torch.cuda.get_device_name(device),
        "layout": "contiguous" if getattr(itf, "_contiguous_layout", utils.CONTIGUOUS_LAYOUT)
        else "per-layer", "page_prealloc": bool(utils.PAGE_PREALLOC_ENABLED),
        "reserved_pages_min_max": [int(utils.MIN_RESERVED_PAGES), int(utils.MAX_RESERVED_PAGES)],
        "gpu_utilization": float(utils.GPU_UTILIZATION), "page_size_bytes": page,
        "env": {k: os.environ.get(k) for k in KNOBS},
        "model": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype},
        "block_tokens": block_tokens, "block_bytes_per_layer_kv": block_mem,
        "page_bundle_bytes": bundle, "blocks_per_page": page // block_mem,
        "pool_bytes_requested": pool_bytes, "pool_bytes": pages * bundle, "pool_pages": pages,
        "num_blocks": num_blocks, "requests": len(need), "blocks_needed": sum(need),
        "repeats": repeats, "timer": "time.perf_counter_ns around each call, calling thread"}
    if os.environ.get("KVCACHED_PAGE_SIZE"):
        notes.append("KVCACHED_PAGE_SIZE is not read by kvcached 0.1.6; KVCACHED_PAGE_SIZE_MB is")
    if "libstdc++" not in os.environ.get("LD_PRELOAD", ""):
        notes.append("LD_PRELOAD has no libstdc++ (its extension has crashed without it)")
    out: dict[str, list[float]] = {"admit_us": [], "free_us": [], "churn_us": []}
    mapped_bytes: int | None = None
    ns, dev = time.perf_counter_ns, f"cuda:{device}"
    manager: Any = None
    kv: list[Any] = []  # kvcached's per-layer views, dropped before its virtual range is freed
    torch.cuda.set_device(device)
    torch.zeros(1, device=dev)  # the CUDA context exists before kvcached's init
    try:
        itf.init_kvcached(tp_rank=0, world_size=1, is_worker=True, device=dev, async_sched=False)
        kv.append(itf.alloc_kv_cache(kvcache_shape=(2, num_blocks, block_tokens, kv_heads,
                                                    head_dim), block_size=block_tokens,
                                     dtype=tdtype, device=dev, num_layers=layers))
        manager = _manager(itf, num_blocks, block_tokens, cell, layers, config)
        _settle(manager, utils, pages, notes)
        config["null_block"] = getattr(manager, "null_block", None)
        config["mapped_at_start"] = _mapped(manager, bundle)
        if work is not None:
            from bench_elastic import run_work  # this script's folder is on sys.path

            side = _Side(manager, kv[0], block_tokens)
            try:
                return {**run_work(side, work), "config": config, "notes": notes}
            finally:
                side.views.clear()
        for _ in range(repeats):
            held: list[list[int]] = []
            for i, n in enumerate(need):
                t0 = ns()
                ids = manager.alloc(n)
                out["admit_us"].append((ns() - t0) / 1e3)
                held.append(_check(manager, ids, n, i))
            torch.cuda.synchronize()
            after = config["mapped_after_admit"] = _mapped(manager, bundle)
            if isinstance(after.get("mapped_bytes"), int):
                mapped_bytes = max(mapped_bytes or 0, after["mapped_bytes"])
            for ids in held:
                t0 = ns()
                manager.free(ids)
                out["free_us"].append((ns() - t0) / 1e3)
            torch.cuda.synchronize()
            config["mapped_after_free"] = _mapped(manager, bundle)
            held = [_check(manager, manager.alloc(n), n, i) for i, n in enumerate(need)]
            for i, n in enumerate(need):
                t0 = ns()
                manager.free(held[i])
                ids = manager.alloc(n)
                out["churn_us"].append((ns() - t0) / 1e3)
                held[i] = _check(manager, ids, n, i)
            torch.cuda.synchronize()
            for ids in held:
                manager.free(ids)
    finally:
        kv.clear()
        _shutdown(itf, manager, notes)
    notes.append("mapped_bytes: in-use + prealloc-reserved pages after admit (max over repeats);"
                 " kvcached also backs unmapped ranges with one zero page (not counted)")
    return {**out, "mapped_bytes": mapped_bytes, "config": config, "notes": notes}


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """kvcached's C++ writes to stdout (std::cout); keep stdout for the JSON alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kvcached alloc/free per request (JSON on stdout)")
    first = p.add_mutually_exclusive_group(required=True)
    first.add_argument("--tokens", help="comma-separated token counts, or @file")
    first.add_argument("--work", help="@file: bench_elastic.work()'s JSON (churn, growth)")
    p.add_argument("--pool-gib", type=float, default=51.4)
    p.add_argument("--dtype", default="bfloat16")
    for name, default in (("repeats", 1), ("device", 0), ("layers", 32), ("kv-heads", 8),
                          ("head-dim", 128), ("block-tokens", 16)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args(argv)
    work = json.loads(Path(a.work.removeprefix("@")).read_text()) if a.work else None
    text = "" if work else (Path(a.tokens[1:]).read_text() if a.tokens.startswith("@")
                            else a.tokens)
    reqs = [int(x) for x in text.replace("\n", ",").split(",") if x.strip()]
    try:
        with _stdout_to_stderr():
            res = run_kvcached(reqs, layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim,
                               block_tokens=a.block_tokens, dtype=a.dtype,
                               pool_bytes=int(a.pool_gib * (1 << 30)), repeats=a.repeats,
                               device=a.device, work=work)
    except ImportError as e:
        print(f"peer_kvcached: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (not a test): elastic KV memory per request, kvvmm and kvcached side by side.

    python bench/elastic/bench_elastic.py [--trace PATH] [--requests 200] [--out h200-elastic.json]

The same real requests (the first ``--requests`` of Azure's conversation trace, context +
generated tokens each) go into the same llama-3.1-8b-like pool (32 layers, 8 KV heads of
128, bf16, 16-token pages, ``--pool-gib`` of KV) on one GPU, and each call is timed on the
calling thread (``perf_counter_ns``), as an engine's decode thread would pay it:

- **admit**: every request in order, all held at once; **free**: each in order; **churn**:
  with all admitted, free request i and admit it again (the pair timed).
- kvvmm runs :class:`kvvmm.owner.RangeBacking` over the interleaved layout
  (:func:`kvvmm.layout.layer_interleaved`: one handle per fresh range) four ways:
  ``thread`` (mapping on the backing thread, a 256 MiB reserve, deferred reclamation: the
  admit call and, separately, admit-until-ready), ``thread_peer_reserve`` (the same
  with kvcached's reserve for this pool, 640 MiB, high mark 1,280 MiB), ``inline`` (every
  map and give-back on the calling thread, nothing deferred: the cost of one request's
  mappings) and the page
  path the lab replaced (``commit_pages`` of each request's pages on the per-layer
  layout, for the first 50 requests).
- the card's **limit** beside each round: one handle per request from the driver's own
  calls, nothing above them (``inline_over_limit``: what kvvmm's Python adds per request).
- kvcached 0.1.6 (``bench/elastic/peer_kvcached.py``, built into ``.peers-build``) in a child
  process, on the same requests, after kvvmm's runs.
- **layout bandwidth**: per-layer copy of K and V and a decode SDPA (torch's
  ``scaled_dot_product_attention``, GQA) over ``--bw-tokens`` tokens of every layer, read
  through the interleaved layout's strided views and through per-layer token-major buffers
  (each layout in its own owner, backed by ``finalize``), and the same on cudaMalloc'd
  tensors; the ratio interleaved / token-major is the layout's cost.

One JSON with per-op p50/p99/max microseconds, bytes mapped, the card, versions and date.

    python bench/elastic/bench_elastic.py --churn-growth [--driver cuda|host|sim] [--live 64]
        [--ops 1000] [--steps 512] [--seed 0] [--out h200-elastic-churn-growth.json]

runs harder work alone (:func:`work`: random churn and decode-like growth, the same sequence
for both sides) on kvvmm's ``RangeBacking`` in each mode above on the given driver and on
kvcached (CUDA only): every admit, grow and free timed on the calling thread and until the
memory is usable, and every request's pages written through torch tensors over the backed
memory and read back (:class:`Pattern`; host memory on the host driver, so CI runs it).
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvvmm.driver import DriverWrapper  # noqa: E402

NAME = "AzureLLMInferenceTrace_conv.csv"
CANDIDATES = (ROOT.parent / "shared" / "data" / "azure-llm-inference-2023" / NAME,
              ROOT / ".data" / NAME)
GiB, MiB = 1 << 30, 1 << 20


def _q(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def at(p: float) -> float:
        return s[min(len(s) - 1, max(0, -(-int(p * len(s)) // 100) - 1))]

    return {"n": len(s), "p50_us": round(at(50), 2), "p99_us": round(at(99), 2),
            "max_us": round(s[-1], 2), "mean_us": round(statistics.fmean(s), 2)}


def _tokens(path: Path, n: int) -> list[int]:
    from kvvmm.workload import load_azure_csv

    wl = load_azure_csv(path)
    return [r.prompt_tokens + r.output_tokens for r in wl.requests[:n]]


def _owner(driver: Any, layout: str, tokens: int) -> Any:
    from kvvmm.layout import model_descs
    from kvvmm.owner import KvBufferOwner

    descs = model_descs("llama-3.1-8b", layout=layout, reserved_tokens=tokens, page_size=16,
                        dtype="bfloat16")
    return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16,
                         reserved_tokens=tokens, descs=descs)


def _ns() -> int:
    return time.perf_counter_ns()


#: kvvmm's reserve (high mark: twice it) in the ``thread`` mode, and kvcached 0.1.6's for this
#: pool in ``thread_peer_reserve``: its MIN / MAX_RESERVED_PAGES (5 / 10) page bundles of 128
#: MiB (2 MiB in each of the 64 K and V buffers), so admissions until mapped compare with the
#: peer's at the same bytes kept mapped ahead
RESERVES = {"thread": (256 * MiB, 512 * MiB), "thread_peer_reserve": (640 * MiB, 1280 * MiB),
            "inline": (0, 0)}


def run_kvvmm(driver: Any, reqs: list[int], pool_tokens: int, mode: str) -> dict[str, Any]:
    import torch

    from kvvmm.owner import RangeBacking

    owner = _owner(driver, "interleaved", pool_tokens)
    threaded = mode != "inline"
    reserve, high = RESERVES[mode]
    backing = RangeBacking(owner, reserve_bytes=reserve, high_bytes=high,
                           executor=None if threaded else "inline")
    try:
        backing.drain()
        admit, ready, free, churn = [], [], [], []
        leases = []
        for t in reqs:
            t0 = _ns()
            lease = backing.admit(t)
            t1 = _ns()
            backing.wait(lease)
            t2 = _ns()
            admit.append((t1 - t0) / 1e3)
            ready.append((t2 - t0) / 1e3)
            leases.append(lease)
        torch.cuda.synchronize()
        mapped = owner.backed_bytes
        stats_admitted = backing.stats()
        for lease in leases:
            t0 = _ns()
            backing.release(lease)
            free.append((_ns() - t0) / 1e3)
        backing.drain()
        torch.cuda.synchronize()
        leases = [backing.wait(backing.admit(t)) for t in reqs]
        backing.drain()
        churn_ready = []
        for i, t in enumerate(reqs):
            t0 = _ns()
            backing.release(leases[i])
            leases[i] = backing.admit(t)
            t1 = _ns()
            backing.wait(leases[i])
            churn.append((t1 - t0) / 1e3)
            churn_ready.append((_ns() - t0) / 1e3)
        torch.cuda.synchronize()
        t0 = _ns()
        for lease in leases:
            backing.release(lease)
        backing.drain()
        given = backing.reclaim(0)
        reclaim_ms = (_ns() - t0) / 1e6
        return {"mode": mode, "reserve_bytes": reserve, "high_bytes": high,
                "admit": _q(admit), "admit_until_ready": _q(ready),
                "free": _q(free), "churn": _q(churn), "churn_until_ready": _q(churn_ready),
                "mapped_bytes": mapped, "reclaim_all_ms": round(reclaim_ms, 2),
                "reclaimed_bytes": given, "stats_when_admitted": str(stats_admitted),
                "block_tokens": backing.block_tokens, "block_bytes": backing.block_bytes}
    finally:
        backing.close()
        owner.close()


def run_limit(driver: Any, reqs: list[int], pool_tokens: int) -> dict[str, Any]:
    """The card's limit for the same requests: ONE handle per request, made by the driver's
    own calls with no arena or owner above them (create + map + set_access to admit, unmap +
    release to free), each request at a fixed place in one reservation, timed as
    :func:`run_kvvmm` times its calls. ``kvvmm inline / limit`` is what kvvmm's Python adds."""
    import torch

    gran = driver.granularity()
    per_token = 32 * 2 * 8 * 128 * 2  # the interleaved layout's bytes per token slot
    sizes = [-(-t * per_token // gran) * gran for t in reqs]
    total = -(-pool_tokens * per_token // gran) * gran
    places, at = [], 0
    for n in sizes:
        places.append(at)
        at += n
    if at > total:
        raise SystemExit(f"bench_elastic: the requests need {at} bytes, the pool {total}")
    base = driver.reserve(total, gran)
    handles: list[int | None] = [None] * len(reqs)
    admit, free, churn = [], [], []

    def back(i: int) -> None:
        h = driver.create(sizes[i])
        driver.map(base + places[i], sizes[i], h)
        driver.set_access(base + places[i], sizes[i])
        handles[i] = h

    def give(i: int) -> None:
        driver.unmap(base + places[i], sizes[i])
        h = handles[i]
        assert h is not None
        driver.release(h)
        handles[i] = None

    try:
        for i in range(len(reqs)):
            t0 = _ns()
            back(i)
            admit.append((_ns() - t0) / 1e3)
        torch.cuda.synchronize()
        mapped = sum(sizes)
        for i in range(len(reqs)):
            t0 = _ns()
            give(i)
            free.append((_ns() - t0) / 1e3)
        for i in range(len(reqs)):
            back(i)
        for i in range(len(reqs)):
            t0 = _ns()
            give(i)
            back(i)
            churn.append((_ns() - t0) / 1e3)
        torch.cuda.synchronize()
    finally:
        for i, h in enumerate(handles):
            if h is not None:
                give(i)
        driver.free(base, total)
    return {"mode": "limit (one handle per request, the driver's calls alone)",
            "admit": _q(admit), "free": _q(free), "churn": _q(churn), "mapped_bytes": mapped}


def run_pages(driver: Any, reqs: list[int], pool_tokens: int, n: int = 50) -> dict[str, Any]:
    """The 0.2 path: commit_pages of each request's pages on the per-layer layout."""
    owner = _owner(driver, "token_major", pool_tokens)
    try:
        admit, free = [], []
        nxt = 1
        held = []
        for t in reqs[:n]:
            pages = list(range(nxt, nxt + -(-t // 16)))
            nxt += len(pages)
            t0 = _ns()
            owner.commit_pages(pages)
            admit.append((_ns() - t0) / 1e3)
            held.append(pages)
        for pages in held:
            t0 = _ns()
            owner.decommit_pages(pages)
            free.append((_ns() - t0) / 1e3)
        return {"mode": "pages (0.2, per-layer)", "admit": _q(admit), "free": _q(free)}
    finally:
        owner.close()


def _time_ms(fn: Any, repeats: int = 10, device: str = "cuda") -> float:
    import torch

    fn()
    if device != "cuda":  # the host driver's tensors (tests): wall time
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_bandwidth(driver: Any, tokens: int, repeats: int = 10) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from kvvmm.owner import layer_views

    layers, heads, dim = 32, 8, 128
    out: dict[str, Any] = {"tokens": tokens, "layers": layers}
    pools: dict[str, list[tuple[Any, Any]]] = {}
    owners = []
    xl = _owner(driver, "interleaved", tokens)
    xl.finalize(tokens - 16)
    owners.append(xl)
    pools["interleaved"] = [(k[:tokens], v[:tokens]) for k, v in layer_views(xl)]
    tm = _owner(driver, "token_major", tokens)
    tm.finalize(tokens - 16)
    owners.append(tm)
    ts = tm.tensors
    dev = ts[0].device.type
    pools["token_major"] = [(ts[i][:tokens], ts[layers + i][:tokens]) for i in range(layers)]
    pools["cudaMalloc"] = [(torch.empty(tokens, heads, dim, dtype=torch.bfloat16, device=dev),
                            torch.empty(tokens, heads, dim, dtype=torch.bfloat16, device=dev))
                           for _ in range(layers)]
    for kv in pools.values():
        for k, v in kv:
            k.normal_()
            v.normal_()
    dst = torch.empty(tokens, heads, dim, dtype=torch.bfloat16, device=dev)
    q = torch.randn(8, 32, 1, dim, dtype=torch.bfloat16, device=dev)
    moved = 2 * layers * tokens * heads * dim * 2
    page = 16
    # a paged gather (what a torch-native attention backend does with a page table): every
    # page of every layer's K and V, in a shuffled order, into a contiguous buffer
    order = torch.randperm(tokens // page, device=dev)
    gathered = torch.empty(tokens // page, page, heads, dim, dtype=torch.bfloat16, device=dev)
    # a request's KV copied out whole (offload, migration): 16 ranges of tokens // 16 slots,
    # every layer's K and V; one contiguous copy per range in the interleaved layout
    span = tokens // 16
    req_dst = torch.empty(span, layers, 2, heads, dim, dtype=torch.bfloat16, device=dev)
    # per-layer layouts copy each buffer's range into its own contiguous chunk of the same
    # bytes (a strided destination would cost them the non-vectorized kernel)
    chunks = req_dst.view(-1).view(2 * layers, span, heads, dim)
    xl_t = xl.tensors[0]
    for name, kv in pools.items():
        def copy(kv: list[tuple[Any, Any]] = kv) -> None:
            for k, v in kv:
                dst.copy_(k)
                dst.copy_(v)

        def gather(kv: list[tuple[Any, Any]] = kv) -> None:
            for k, v in kv:
                for x in (k, v):
                    torch.index_select(x.unflatten(0, (-1, page)), 0, order, out=gathered)

        if name == "interleaved":
            def request_copy() -> None:
                for r in range(16):
                    req_dst.copy_(xl_t[r * span:(r + 1) * span])
        else:
            def request_copy(kv: list[tuple[Any, Any]] = kv) -> None:
                for r in range(16):
                    s0 = slice(r * span, (r + 1) * span)
                    for i, (k, v) in enumerate(kv):
                        chunks[2 * i].copy_(k[s0])
                        chunks[2 * i + 1].copy_(v[s0])

        def sdpa(kv: list[tuple[Any, Any]] = kv) -> None:
            for k, v in kv:
                kk = k.permute(1, 0, 2).unsqueeze(0).expand(8, heads, tokens, dim)
                vv = v.permute(1, 0, 2).unsqueeze(0).expand(8, heads, tokens, dim)
                F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

        c, s = _time_ms(copy, repeats, dev), _time_ms(sdpa, repeats, dev)
        g, rc = _time_ms(gather, repeats, dev), _time_ms(request_copy, repeats, dev)
        out[name] = {"copy_ms": round(c, 3), "copy_read_write_tb_s": round(2 * moved / c / 1e9, 3),
                     "sdpa_ms": round(s, 3), "sdpa_read_tb_s": round(moved / s / 1e9, 3),
                     "gather_ms": round(g, 3),
                     "gather_read_write_tb_s": round(2 * moved / g / 1e9, 3),
                     "request_copy_ms": round(rc, 3),
                     "request_copy_read_write_tb_s": round(2 * moved / rc / 1e9, 3)}
    ops = ("copy", "sdpa", "gather", "request_copy")
    for base in ("token_major", "cudaMalloc"):
        out[f"interleaved_vs_{base}"] = {
            op: round(out[base][f"{op}_ms"] / out["interleaved"][f"{op}_ms"], 4) for op in ops}
    out["ops"] = {
        "copy": "each layer's K and V into a contiguous tensor with Tensor.copy_ (torch's "
                "elementwise kernel; a strided source is not vectorized)",
        "sdpa": "decode attention, 8 sequences x 32 query heads (GQA) over every token",
        "gather": "index_select of every 16-token page in a shuffled order, per layer",
        "request_copy": "16 slot ranges copied out with every layer's K and V (one copy per "
                        "range interleaved, 2 x layers per range otherwise)"}
    # the strided views read the same bytes as the token-major buffers: check one layer
    k0, _ = pools["interleaved"][5]
    tm_k = pools["token_major"][5][0]
    tm_k.copy_(k0)
    out["views_agree"] = bool(torch.equal(tm_k, k0))
    pools.clear()
    for o in owners:
        o.close()
    return out


def run_peer(reqs: list[int], pool_gib: float,
             work: dict[str, Any] | None = None) -> dict[str, Any]:
    """kvcached on the same requests (or the same ``work``: :func:`run_work` there), in its
    own process (its extension wants libstdc++ preloaded, and a crash there must not lose
    this run): ``bench/elastic/peer_kvcached.py`` with ``.peers-build`` on its path."""
    import shutil
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(json.dumps(work) if work else ",".join(map(str, reqs)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / ".peers-build"), str(ROOT),
                                                    env.get("PYTHONPATH", "")) if p)
    gxx = shutil.which("g++")
    if gxx:
        lib = subprocess.run([gxx, "-print-file-name=libstdc++.so.6"], capture_output=True,
                             text=True).stdout.strip()
        if os.path.isabs(lib):
            env["LD_PRELOAD"] = lib
    cmd = [sys.executable, str(Path(__file__).with_name("peer_kvcached.py")),
           "--work" if work else "--tokens", "@" + f.name, "--pool-gib", str(pool_gib)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    except subprocess.TimeoutExpired:
        return {"error": "kvcached ran past 300 s"}
    finally:
        os.unlink(f.name)
    if p.returncode != 0:
        return {"error": f"rc={p.returncode}: {p.stderr.strip()[-1500:]}"}
    peer = json.loads(p.stdout.strip().splitlines()[-1])
    if work:
        return dict(peer)
    return {"admit": _q(peer["admit_us"]), "free": _q(peer["free_us"]),
            "churn": _q(peer["churn_us"]), "mapped_bytes": peer.get("mapped_bytes"),
            "config": peer.get("config"), "notes": peer.get("notes")}


# -- harder work: random churn and decode-like growth, every request's pages checked ---------

#: ops each pattern times; ``*_until_ready``: the call and then a wait until the memory is
#: usable (kvvmm: the lease mapped; kvcached's alloc returns its blocks mapped)
WORK_OPS = {"churn": ("free", "admit", "admit_until_ready"),
            "growth": ("grow", "grow_until_ready")}


class PatternError(RuntimeError):
    """A request's pages read back other than what was written to them: two requests on the
    same memory, or a page that is not the request's (a wrong mapping)."""


def work(path: Path, live: int, ops: int, steps: int, seed: int) -> dict[str, Any]:
    """The same work for both sides, from the trace's requests (context + generated tokens).

    churn: the first ``live`` requests admitted, then ``ops`` times a live request drawn at
    random (``seed``) is freed and the next request of another size admitted in its place.
    growth: the first ``live`` admitted with their context, then ``steps`` decode steps of
    one token for every one; an op is a request's step that needs a new 16-token block.
    """
    import random

    from kvvmm.workload import load_azure_csv

    reqs = load_azure_csv(path).requests
    sizes = [r.prompt_tokens + r.output_tokens for r in reqs]
    rng, cur, nxt, churn = random.Random(seed), sizes[:live], live, []
    for _ in range(ops):
        j = rng.randrange(live)
        while sizes[nxt % len(sizes)] == cur[j]:
            nxt += 1
        cur[j] = sizes[nxt % len(sizes)]
        nxt += 1
        churn.append((j, cur[j]))
    ctx = [r.prompt_tokens for r in reqs[:live]]
    growth = [(i, c + s) for s in range(1, steps + 1) for i, c in enumerate(ctx)
              if (c + s) % 16 == 1]
    return {"seed": seed, "live": live, "steps": steps, "trace": path.name,
            "churn": {"initial": sizes[:live], "ops": churn},
            "growth": {"initial": ctx, "ops": growth}}


class Pattern:
    """Each request's pages written through torch tensors over the backed memory and read
    back: after each admit and grow (its new pages), and before it is freed (all of them, so
    a later request's write over its memory shows). ``views``: tensors whose first index is
    a page id (one token of each page, every layer, as int16); none: nothing checked (the
    simulator holds no bytes)."""

    def __init__(self, views: list[Any]) -> None:
        self.views, self.held, self.rid, self.checked = views, {}, 0, 0

    def _vals(self, rid: int, pages: list[int]) -> tuple[Any, Any]:
        import torch

        idx = torch.tensor(pages, dtype=torch.long, device=self.views[0].device)
        vals = ((idx * 40503 + rid * 9973) % 32749 + 1).to(torch.int16)  # never 0: no zero page
        return idx, vals

    def write(self, key: int, pages: list[int]) -> None:
        """``pages`` of request ``key`` in order taken; those not yet written are new."""
        if not self.views:
            return
        if key not in self.held:
            self.rid += 1
            self.held[key] = (self.rid, [])
        rid, done = self.held[key]
        new = pages[len(done):]
        if not new:  # a grow its blocks already held (blocks of more than 16 slots)
            return
        done += new
        idx, vals = self._vals(rid, new)
        for v in self.views:
            v[idx] = vals.view(-1, *[1] * (v.dim() - 1))
        self._check(rid, new)

    def _check(self, rid: int, pages: list[int]) -> None:
        import torch

        idx, vals = self._vals(rid, pages)
        bad = torch.stack([(v[idx] != vals.view(-1, *[1] * (v.dim() - 1))).flatten(1).any(1)
                           for v in self.views]).any(0)
        if bool(bad.any()):  # one sync a check, however many views
            i = int(bad.nonzero()[0])
            got = sorted({int(x) for v in self.views for x in v[pages[i]].unique()})[:4]
            raise PatternError(f"request {rid}: page {pages[i]} reads {got}, {int(vals[i])} "
                               "written (a wrong mapping: another request's memory, or none)")
        self.checked += len(pages)

    def done(self, key: int) -> None:
        """Request ``key`` is about to be freed: read all its pages back, forget it."""
        if self.views:
            self._check(*self.held.pop(key))


def run_work(side: Any, seq: dict[str, Any]) -> dict[str, Any]:
    """Churn, then growth, on ``side`` (``admit(tokens)``, ``grow(h, tokens)``, ``wait(h)``,
    ``free(h)``, ``pages(h)``, ``views``: one engine's calls, kvvmm's or kvcached's), every
    call timed on the calling thread (``perf_counter_ns``); per-op p50/p99/max."""
    pat = Pattern(side.views)
    out: dict[str, Any] = {}

    def take(t: dict[str, list[float]], op: str, key: int, fn: Any, *args: Any) -> Any:
        t0 = _ns()
        h = fn(*args)
        t1 = _ns()
        side.wait(h)
        t2 = _ns()
        if op in t:  # not the requests admitted before the timed ops
            t[op].append((t1 - t0) / 1e3)
            t[op + "_until_ready"].append((t2 - t0) / 1e3)
        pat.write(key, side.pages(h))
        return h

    for name, ops in WORK_OPS.items():
        t: dict[str, list[float]] = {op: [] for op in ops}
        held = [take(t, "", j, side.admit, n) for j, n in enumerate(seq[name]["initial"])]
        for j, n in seq[name]["ops"]:
            if name == "growth":
                held[j] = take(t, "grow", j, side.grow, held[j], n)
                continue
            pat.done(j)
            t0 = _ns()
            side.free(held[j])
            t["free"].append((_ns() - t0) / 1e3)
            held[j] = take(t, "admit", j, side.admit, n)
        for j, h in enumerate(held):
            pat.done(j)
            side.free(h)
        out[name] = {op: _q(v) for op, v in t.items()}
    out["pages_checked"] = pat.checked
    return out


class WrongMap(DriverWrapper):
    """``--wrong-map``, the check's own test: a map of a size some live handle was mapped at
    first maps that handle instead (two requests on one memory); the pattern check must fail."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.first: dict[int, int] = {}  # size -> the live handle first mapped at it

    def _call(self, call: str, fn: Any, *args: Any) -> Any:
        if call == "map":
            args = (*args[:2], self.first.setdefault(args[1], args[2]))
        elif call == "release" and args[0] in self.first.values():
            self.first = {s: h for s, h in self.first.items() if h != args[0]}
        return fn(*args)


class _KvvmmSide:
    def __init__(self, backing: Any, views: list[Any]) -> None:
        self.b, self.views = backing, views
        self.admit, self.wait, self.free = backing.admit, backing.wait, backing.release

    def grow(self, lease: Any, tokens: int) -> Any:
        self.b.grow(lease, tokens)
        return lease

    def pages(self, lease: Any) -> list[int]:
        return list(lease.pages(16))


def run_kvvmm_work(driver: Any, seq: dict[str, Any], pool_tokens: int,
                   mode: str) -> dict[str, Any]:
    import torch

    from kvvmm.owner import RangeBacking

    owner = _owner(driver, "interleaved", pool_tokens)
    reserve, high = RESERVES[mode]
    backing = RangeBacking(owner, reserve_bytes=reserve, high_bytes=high,
                           executor=None if mode != "inline" else "inline")
    views = [] if driver.kind == "sim" else [owner.tensors[0].view(torch.int16)[::16]]
    try:
        backing.drain()
        return {"mode": mode, **run_work(_KvvmmSide(backing, views), seq)}
    finally:
        views.clear()
        backing.close()
        owner.close()


def main_work(args: argparse.Namespace, trace: Path) -> int:
    """``--churn-growth``: one JSON, both sides and their ratios (kvvmm / kvcached)."""
    import torch

    import kvvmm
    from kvvmm import open_driver
    from kvvmm.measure import machine

    seq = work(trace, args.live, args.ops, args.steps, args.seed)
    pool_tokens = int(args.pool_gib * GiB) // (32 * 2 * 8 * 128 * 2) // 16 * 16
    drv = open_driver(args.driver)
    cuda = args.driver == "cuda"
    res: dict[str, Any] = {
        "benchmark": "bench_elastic --churn-growth",
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "card": torch.cuda.get_device_name(0) if cuda else
        f"cpu: {machine.cpu_model()} ({args.driver} driver)",
        "versions": {"kvvmm": kvvmm.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "commit": machine.commit(ROOT), "load_average_before": machine.load_average(),
        "model": "llama-3.1-8b-like: 32 layers, 8 KV heads x 128, bf16, 16-token pages",
        "pool_tokens": pool_tokens, "fast_path": drv.fast_path, "ops": WORK_OPS,
        "work": {**{k: seq[k] for k in ("seed", "live", "steps", "trace")},
                 "churn_ops": len(seq["churn"]["ops"]), "growth_ops": len(seq["growth"]["ops"])},
        "pattern_checked": args.driver != "sim",  # the simulator holds no bytes
        "kvvmm": {}}
    try:
        for mode in args.modes.split(","):
            d = WrongMap(drv) if args.wrong_map else drv
            res["kvvmm"][mode] = run_kvvmm_work(d, seq, pool_tokens, mode)
    except PatternError as e:  # the views its traceback holds go with it, before the close
        print(f"bench_elastic: kvvmm {mode}: PatternError: {e}", file=sys.stderr)
        return 1
    finally:
        drv.close()
    res["kvcached"] = (run_peer([], args.pool_gib, seq) if cuda and not args.skip_peer else
                       {"skipped": "--skip-peer" if cuda else "kvcached runs on CUDA only"})
    res["load_average_after"], peer = machine.load_average(), res["kvcached"]
    if "churn" in peer:
        res["kvvmm_over_kvcached"] = {mode: {w: {op: {
            q: round(r[w][op][q] / peer[w][op][q], 3) for q in ("p50_us", "p99_us", "max_us")
            if peer[w][op].get(q)} for op in ops} for w, ops in WORK_OPS.items()}
            for mode, r in res["kvvmm"].items()}
    out = Path(args.out)
    if not out.is_absolute() and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / out
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("card", "kvvmm_over_kvcached") if k in res}, indent=1))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=None)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--pool-gib", type=float, default=51.4)
    ap.add_argument("--bw-tokens", type=int, default=65536)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="h200-elastic.json")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--churn-growth", action="store_true",
                    help="random churn and decode-like growth (work()) alone, kvvmm on "
                         "--driver and kvcached (cuda), each request's pages checked")
    ap.add_argument("--driver", default="cuda", choices=("cuda", "host", "sim"))
    for name, default in (("live", 64), ("ops", 1000), ("steps", 512), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--modes", default=",".join(RESERVES), help="kvvmm's, comma-separated")
    ap.add_argument("--wrong-map", action="store_true",
                    help="the check's own test: requests mapped onto one memory (WrongMap); "
                         "the run must fail with a PatternError")
    ap.add_argument("--smoke", action="store_true",
                    help="the bandwidth section alone on the host driver's real bytes, small "
                         "(--bw-tokens 256, one repeat): a check that it runs and the views "
                         "agree, written to --out (no GPU)")
    args = ap.parse_args(argv)
    if args.smoke:
        from kvvmm.driver.host import HostDriver

        drv = HostDriver(capacity_bytes=4 * GiB)
        try:
            res = run_bandwidth(drv, min(args.bw_tokens, 256), repeats=1)
            res["driver_clean"] = drv.stats().clean
        finally:
            drv.close()
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        return 0
    trace = Path(args.trace) if args.trace else next((p for p in CANDIDATES if p.exists()), None)
    if trace is None:
        print(f"bench_elastic: no trace (looked in {[str(p) for p in CANDIDATES]})",
              file=sys.stderr)
        return 2
    if args.churn_growth:
        return main_work(args, trace)
    try:
        import torch
    except ImportError:
        print("bench_elastic: needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_elastic: no GPU (this benchmark measures a CUDA device)", file=sys.stderr)
        return 2
    import kvvmm
    from kvvmm import open_driver

    reqs = _tokens(trace, args.requests)
    pool_tokens = int(args.pool_gib * GiB) // (32 * 2 * 8 * 128 * 2) // 16 * 16
    torch.zeros(1, device="cuda")
    drv = open_driver("cuda")
    res: dict[str, Any] = {
        "benchmark": "bench_elastic", "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "card": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "kvvmm": getattr(kvvmm, "__version__", "?"), "python": platform.python_version(),
        "fast_path": drv.fast_path, "requests": len(reqs),
        "tokens_total": sum(reqs), "pool_tokens": pool_tokens,
        "model": "llama-3.1-8b-like: 32 layers, 8 KV heads x 128, bf16, 16-token pages",
        "kvvmm_rounds": []}
    res["limit_rounds"] = []
    for _ in range(args.rounds):
        res["kvvmm_rounds"].append({m: run_kvvmm(drv, reqs, pool_tokens, m)
                                    for m in RESERVES})
        res["limit_rounds"].append(run_limit(drv, reqs, pool_tokens))
    res["inline_over_limit"] = {  # per round, side by side: what kvvmm's Python adds
        op: [round(r["inline"][op]["p50_us"] / lim[op]["p50_us"], 3)
             for r, lim in zip(res["kvvmm_rounds"], res["limit_rounds"], strict=True)]
        for op in ("admit", "free", "churn")}
    res["until_ready_over_limit_admit"] = [
        round(r["thread"]["admit_until_ready"]["p50_us"] / lim["admit"]["p50_us"], 3)
        for r, lim in zip(res["kvvmm_rounds"], res["limit_rounds"], strict=True)]
    res["kvvmm_pages"] = run_pages(drv, reqs, pool_tokens)
    res["bandwidth"] = run_bandwidth(drv, args.bw_tokens)
    if not args.skip_peer:
        res["kvcached"] = run_peer(reqs, args.pool_gib)
    if isinstance(res.get("kvcached"), dict) and "admit" in res["kvcached"]:
        best = res["kvvmm_rounds"][len(res["kvvmm_rounds"]) // 2]["thread"]
        res["kvvmm_over_kvcached"] = {
            op: {q: round(best[op][q] / res["kvcached"][op][q], 3)
                 for q in ("p50_us", "p99_us", "max_us") if res["kvcached"][op].get(q)}
            for op in ("admit", "free", "churn")}
        # until mapped: kvcached's alloc returns mapped, so its admit is the one to compare
        peer = res["kvcached"]["admit"]
        res["kvvmm_until_ready_over_kvcached_admit"] = {
            m: {q: [round(r[m]["admit_until_ready"][q] / peer[q], 3)
                    for r in res["kvvmm_rounds"]] for q in ("p50_us", "p99_us") if peer.get(q)}
            for m in ("thread", "thread_peer_reserve")}
    out = Path(args.out)
    if not out.is_absolute() and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / out
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in res if k in ("kvvmm_over_kvcached", "inline_over_limit",
                                                      "until_ready_over_limit_admit",
                                                      "kvvmm_until_ready_over_kvcached_admit")},
                     indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

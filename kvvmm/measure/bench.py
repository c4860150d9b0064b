"""``kvvmm bench``: measure kvvmm on a real GPU, side by side with the raw driver and the seed.

Sections (each a key of the JSON result):

- ``per_call``: microseconds per driver call by handle size: raw cuda-python (with its
  error check), CudaDriver as it runs (hot calls in C where ``_cudafast`` is built) and
  CudaDriver with every call in Python, interleaved rep by rep in a shuffled order so all
  see the same card.
- ``arena``: Arena construction and close (64 GiB reservation).
- ``owner``: KvBufferOwner construction with 64 buffers (Llama-3-8B-like: 32 layers x K/V,
  8 KV heads x 128, bf16, page 64, 2M reserved tokens: ~246 GiB of VA) and close.
- ``growth``: per policy, decode growth of those 64 buffers in 4096-token steps to 500k
  tokens (122 steps): the median of three rounds with the policies' order rotated, each
  started 2 s after the previous owner closed (``_grow_rounds`` says why), and for the
  default policy three rounds back to back as well; then finalize to 1M tokens; driver
  calls, handles, over-commit, copy bandwidth of the owner's tensors vs cudaMalloc tensors
  of the same size (median of 21 alternations).
- ``elastic_growth`` (issue 19): the default policy's growth of those 64 buffers without
  and with a HandlePool + look-ahead (``LOOKAHEAD_BYTES``), ``GAP_S`` slept between steps
  (standing for the decode step's GPU time, an assumption stated in the JSON), settled and
  back to back, plus a look-ahead sweep: what ``ensure_prefix`` blocks for (total, p50/p99
  per step), driver time on the decode thread and the pool's (``TimedDriver``), over-commit
  at the end and at the worst step.
- ``page_ops``: single pages in the middle of a buffer (``commit_pages``/``decommit_pages``
  of one page id) and single granules (``Arena.commit_range``/``decommit_range``), µs per
  page, two cycles, without and with the pool.
- ``elastic_bandwidth``: copy bandwidth of tensors with holes and after out-of-order
  commit/decommit vs cudaMalloc.
- ``seed`` (with ``--seed-file``): SGLang's arena on the same workload, run by
  ``bench/seed_side_by_side.py`` in a child process (the seed compiles a stub per arena and
  may abort at exit). That script is a bench file, not part of the package: it is found in
  the repository checkout next to the package (an editable install or ``PYTHONPATH``), or
  in ``./bench/``, or given with ``--seed-script``.

The result goes to ``bench/results/<card>-kvvmm-bench.json`` (``h200-kvvmm-bench.json``),
with the card, versions and date inside; a new run replaces the file and git keeps the old
one. What the figures have shown so far, and why the sections are timed as they are:
``docs/MEASUREMENTS.md``. A progress bar (tqdm) goes to stderr, the summary to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvvmm.units import GiB, MiB

__all__ = ["BENCH_WORKLOAD", "GAP_S", "LOOKAHEAD_BYTES", "LOOKAHEAD_SWEEP", "SEED_SCRIPT",
           "TimedDriver", "Workload", "elastic_bandwidth", "elastic_growth", "elastic_targets",
           "find_seed_script", "main", "page_ops", "run"]

_LAYERS, _HEADS, _DIM, _PAGE, _RESERVED = 32, 8, 128, 64, 2_000_000
_STEP, _GROW_TO, _FINAL = 4096, 500_000, 1_000_000
#: Seconds between an owner's close and the next timed growth (see ``_grow_rounds``).
_SETTLE_S = 2.0


#: The seed's side of the benchmark, a bench file (see the module docstring).
SEED_SCRIPT = Path("bench") / "seed_side_by_side.py"


def _med_us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 3)


def _per_call(drv_mod: Any, cd: Any, cd_py: Any | None = None) -> dict[str, Any]:
    """Raw cuda-python vs CudaDriver, per call, interleaved rep by rep (order shuffled).

    ``cd`` is the CudaDriver as it runs by default (its hot calls in C when ``_cudafast`` is
    built); ``cd_py``, when given, one with every call in Python (``KVVMM_CUDA_FASTPATH=0``),
    timed in the same reps so the two ratios compare on the same card at the same moment.
    """
    d = drv_mod
    ok = d.CUresult.CUDA_SUCCESS
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = cd.device
    acc = d.CUmemAccessDesc()
    acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = cd.device
    acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    drivers = [("kvvmm", cd)] + ([("kvvmm_python", cd_py)] if cd_py is not None else [])
    ops = ("create", "map", "set_access", "unmap_sync", "release")
    out: dict[str, Any] = {}
    pc = time.perf_counter
    for size, reps in ((2 * MiB, 300), (32 * MiB, 300), (512 * MiB, 90)):
        raw_va = int(_ck(d.cuMemAddressReserve(size, 0, 0, 0)))
        k_vas = [(w, drv, drv.reserve(size)) for w, drv in drivers]
        t: dict[str, list[float]] = {f"raw_{op}": [] for op in (*ops, "unmap")}
        for w, _ in drivers:
            t.update({f"{w}_{op}": [] for op in ops})

        def raw_rep(size: int = size, raw_va: int = raw_va,
                    t: dict[str, list[float]] = t) -> None:
            # the raw calls, with the error check any caller needs
            t0 = pc()
            err, h = d.cuMemCreate(size, prop, 0)
            if err != ok:
                raise RuntimeError(err)
            t1 = pc()
            if d.cuMemMap(raw_va, size, 0, h, 0)[0] != ok:
                raise RuntimeError("map")
            t2 = pc()
            if d.cuMemSetAccess(raw_va, size, [acc], 1)[0] != ok:
                raise RuntimeError("access")
            t3 = pc()
            if d.cuCtxSynchronize()[0] != ok:
                raise RuntimeError("sync")
            t4 = pc()
            if d.cuMemUnmap(raw_va, size)[0] != ok:
                raise RuntimeError("unmap")
            t5 = pc()
            if d.cuMemRelease(h)[0] != ok:
                raise RuntimeError("release")
            t6 = pc()
            for k, v in (("create", t1 - t0), ("map", t2 - t1), ("set_access", t3 - t2),
                         ("unmap", t5 - t4), ("unmap_sync", t5 - t3), ("release", t6 - t5)):
                t[f"raw_{k}"].append(v)

        def kvvmm_rep(w: str, drv: Any, k_va: int, size: int = size,
                      t: dict[str, list[float]] = t) -> None:
            t0 = pc()
            hk = drv.create(size)
            t1 = pc()
            drv.map(k_va, size, hk)
            t2 = pc()
            drv.set_access(k_va, size)
            t3 = pc()
            drv.unmap(k_va, size)  # synchronizes first
            t4 = pc()
            drv.release(hk)
            t5 = pc()
            for k, v in (("create", t1 - t0), ("map", t2 - t1), ("set_access", t3 - t2),
                         ("unmap_sync", t4 - t3), ("release", t5 - t4)):
                t[f"{w}_{k}"].append(v)

        runners: list[Callable[[], None]] = [raw_rep]
        runners += [functools.partial(kvvmm_rep, w, drv, k_va) for w, drv, k_va in k_vas]
        # A fresh random order each rep (seeded): what one call costs depends on the call
        # before it, so every runner must follow every other as often. Turning a fixed order
        # is not enough: it keeps who follows whom (docs/MEASUREMENTS.md, "Per-call costs").
        rng = random.Random(size)
        for _ in range(reps):
            rng.shuffle(runners)
            for run_one in runners:
                run_one()
        _ck(d.cuMemAddressFree(raw_va, size))
        for _, drv, k_va in k_vas:
            drv.free(k_va, size)
        row: dict[str, Any] = {k: _med_us(v) for k, v in t.items() if v}
        for w, _ in drivers:
            row[f"ratio_{w}_over_raw"] = {
                op: round(row[f"{w}_{op}"] / row[f"raw_{op}"], 3) for op in ops}
        out[f"{size // MiB}MiB"] = row
    return out


def _ck(res: Any) -> Any:
    from cuda.bindings import driver as d

    err = res[0] if isinstance(res, tuple) else res
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA call failed: {err}")
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None


def _descs() -> list[Any]:
    from kvvmm.layout import mha_token_major

    return mha_token_major(layers=_LAYERS, kv_heads=_HEADS, head_dim=_DIM,
                           reserved_tokens=_RESERVED, page_size=_PAGE, dtype="bfloat16")


def _bandwidth(dst: Any, src: Any, reps: int = 30) -> float:
    """TB/s of ``dst.copy_(src)``: the median of ``reps`` copies after 5 warm-up copies,
    event-timed on a GPU; on the CPU (the host driver's tensors, in tests) by the clock."""
    import torch

    for _ in range(5):
        dst.copy_(src)
    ts = []
    for _ in range(reps):
        if dst.device.type != "cuda":
            t0 = time.perf_counter()
            dst.copy_(src)
            ts.append(max(time.perf_counter() - t0, 1e-9))
            continue
        e0 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        e1 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        e0.record()
        dst.copy_(src)
        e1.record()
        e1.synchronize()
        ts.append(float(e0.elapsed_time(e1)) / 1e3)
    nbytes = 2 * int(dst.numel()) * int(dst.element_size())
    return round(nbytes / statistics.median(ts) / 1e12, 3)


def _bw_pair(vm: Any, vm2: Any, alternations: int = 21, reps: int = 30) -> dict[str, Any]:
    """Owner tensors vs cudaMalloc tensors of the same size, alternated 21 times."""
    import torch

    pl = torch.empty_like(vm, device=vm.device)
    pl2 = torch.empty_like(vm, device=vm.device)
    for x in (vm, vm2, pl, pl2):
        x.normal_()
    # 21 alternations: with fewer, the ratio moved between runs of the benchmark by as much
    # as the effect measured (docs/MEASUREMENTS.md, "Copy bandwidth").
    runs_vmm, runs_plain = [], []
    for _ in range(alternations):
        runs_vmm.append(_bandwidth(vm2, vm, reps))
        runs_plain.append(_bandwidth(pl2, pl, reps))
    del pl, pl2
    torch.cuda.empty_cache()
    vmm, plain = statistics.median(runs_vmm), statistics.median(runs_plain)
    return {"vmm_TBps": vmm, "plain_TBps": plain, "runs_vmm": runs_vmm,
            "runs_plain": runs_plain, "ratio": round(vmm / plain, 4)}


def _grow(cd: Any, policy: Any) -> tuple[Any, int, float]:
    """An owner grown by decode steps; returns it, its handles before growth, and seconds."""
    import torch

    from kvvmm.owner import KvBufferOwner

    owner = KvBufferOwner(driver=cd, dtype="bfloat16", page_size=_PAGE,
                          reserved_tokens=_RESERVED, descs=_descs(), policy=policy)
    h0 = owner.snapshot().handles
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for n in range(_STEP, _GROW_TO + 1, _STEP):
        owner.ensure_prefix(n)
    torch.cuda.synchronize()
    return owner, h0, time.perf_counter() - t0


def _grow_rounds(cd: Any, policies: list[Any], rounds: int = 3) -> dict[str, list[float]]:
    """Growth times per policy over ``rounds`` rounds, the order rotated each round, each
    started ``_SETTLE_S`` after the previous owner closed.

    Why the pause: right after an owner released its 64 GiB, the driver's creates run
    slower for a while (it is still reclaiming the memory; docs/MEASUREMENTS.md, "Decode
    growth"). A server grows its KV cache long after anything that large was freed, so the
    growth is timed settled; ``_back_to_back`` times the other case, reported beside it.
    """
    runs: dict[str, list[float]] = {str(p): [] for p in policies}
    n = len(policies)
    for r in range(rounds):
        for p in policies[r % n:] + policies[:r % n]:
            time.sleep(_SETTLE_S)
            owner, _, secs = _grow(cd, p)
            owner.close()
            runs[str(p)].append(round(secs * 1e3, 2))
    return runs


def _back_to_back(cd: Any, policy: Any, rounds: int = 3) -> list[float]:
    """Growth times with no pause: each growth starts right after the previous owner (64 GiB
    backed) closed."""
    out = []
    time.sleep(_SETTLE_S)
    for _ in range(rounds + 1):
        owner, _, secs = _grow(cd, policy)
        owner.close()
        out.append(round(secs * 1e3, 2))
    return out[1:]  # the first one started settled


def _growth(cd: Any, policy: Any, rounds: list[float]) -> dict[str, Any]:
    import torch

    time.sleep(_SETTLE_S)
    owner, h0, grow_s = _grow(cd, policy)
    descs = owner.descs
    steps = _GROW_TO // _STEP
    snap = owner.snapshot()
    need = sum(d.prefix_span_bytes(steps * _STEP, _PAGE) for d in descs)
    over = [b.backed_bytes - b.prefix_bytes for b in snap.buffers]
    t0 = time.perf_counter()
    owner.finalize(_FINAL)
    torch.cuda.synchronize()
    fin_s = time.perf_counter() - t0
    fsnap = owner.snapshot()
    nbytes = 1 * GiB
    vm = owner.tensors[2].view(-1)[: nbytes // 2]
    vm2 = owner.tensors[3].view(-1)[: nbytes // 2]
    bw = _bw_pair(vm, vm2)
    del vm, vm2
    t0 = time.perf_counter()
    owner.close()
    close_s = time.perf_counter() - t0
    handles = snap.handles - h0
    return {
        "policy": str(policy), "steps": steps,
        "grow_ms": statistics.median(rounds), "grow_ms_rounds": rounds,
        "settle_s_before_each_round": _SETTLE_S,
        "grow_ms_with_finalize_run": round(grow_s * 1e3, 2),
        "grow_driver_calls": 3 * handles, "grow_handles": handles,
        "handles_after_growth": snap.handles, "backed_after_growth_bytes": snap.backed_bytes,
        "overcommit_bytes": snap.backed_bytes - need, "max_overcommit_per_buffer": max(over),
        "finalize_1M_ms": round(fin_s * 1e3, 2), "handles_after_finalize": fsnap.handles,
        "backed_after_finalize_bytes": fsnap.backed_bytes, "bandwidth": bw,
        "close_ms": round(close_s * 1e3, 2),
    }


# -- issue 19: elastic backing (holes, the handle pool, the look-ahead) -------------------
#
# Every function here takes any driver (sim, host, CUDA) and a Workload, so tests run them
# on the sim and host drivers with small sizes (tests/test_bench_elastic.py); only ``run``
# passes the CudaDriver and the bench's workload.

#: Seconds between two decode steps in the elastic growth: the GPU time of one decode step,
#: during which a server's CPU is free and the pool's thread works. An assumption, not a
#: measurement: ~20 ms is a Llama-3.1-8B-class decode step on one H200 at a large batch
#: (a step reads the weights, 16 GB at ~4 TB/s = 4 ms, plus the KV cache of the batch). The
#: bench sleeps it (``time.sleep``) instead of running a kernel, so the driver and the GPU
#: are idle as they would be under a kernel that touches no VMM state.
GAP_S = 0.020
#: Look-ahead per buffer for the pooled growth: 4 decode steps of one buffer (a step grows
#: each buffer by 4096 tokens x 2 KiB = 8 MiB), so a background job that misses a gap or two
#: still leaves steps in hand. On the sim (bench/bench_sim.py, 20 ms gaps, stepped pool)
#: every look-ahead from 16 MiB up keeps the decode path clear (0 ms blocked; the thread's
#: work takes at most 4.9 ms of a gap), and its cost is about buffers x look-ahead at the
#: worst step: peak over-commit 16.6 GB with no pool (the policy's own), 17.7 / 18.8 / 20.9 /
#: 25.2 / 33.8 GB with 16 / 32 / 64 / 128 / 256 MiB. 32 MiB: the margin for a slow job at
#: +2.1 GB.
LOOKAHEAD_BYTES = 32 * MiB
#: Look-aheads timed once each beside the chosen one (what over-commit buys).
LOOKAHEAD_SWEEP = (16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB)
#: The decode path's per-step target (issue 19).
STEP_TARGET_US = 50.0


@dataclass(frozen=True)
class Workload:
    """The decode growth the elastic sections time: buffers, tokens, steps."""

    layers: int = _LAYERS
    kv_heads: int = _HEADS
    head_dim: int = _DIM
    page_size: int = _PAGE
    reserved_tokens: int = _RESERVED
    step_tokens: int = _STEP
    grow_to_tokens: int = _GROW_TO
    #: ``"token_major"`` (K and V per layer: ``2 x layers`` buffers) or ``"interleaved"``
    #: (one buffer of every layer, :func:`kvvmm.layout.layer_interleaved`): the same bytes
    layout: str = "token_major"

    def descs(self) -> Any:
        from kvvmm.layout import layer_interleaved, mha_token_major

        make = layer_interleaved if self.layout == "interleaved" else mha_token_major
        return make(layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                    reserved_tokens=self.reserved_tokens, page_size=self.page_size,
                    dtype="bfloat16")

    @property
    def buffers(self) -> int:
        return 1 if self.layout == "interleaved" else 2 * self.layers

    @property
    def steps(self) -> int:
        return self.grow_to_tokens // self.step_tokens

    def as_dict(self) -> dict[str, int | str]:
        return {"buffers": self.buffers, "layout": self.layout, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "page_size": self.page_size,
                "reserved_tokens": self.reserved_tokens, "step_tokens": self.step_tokens,
                "grow_to_tokens": self.grow_to_tokens, "steps": self.steps}


BENCH_WORKLOAD = Workload()


class TimedDriver:
    """A driver that forwards every call to ``inner`` and times the VMM calls, split by
    thread: the thread that made it (the decode path) and any other (the pool's thread).

    Why a wrapper and not the pool's counters: the pool counts handles, not seconds, and
    the foreground's own creates (a step the look-ahead did not cover) must count too. Each
    counter is written by one side only, so no lock (a lock would be timed as well).
    The pool and the arena must be built on this object (the arena checks that its pool
    shares its driver).
    """

    def __init__(self, inner: Any) -> None:
        from kvvmm.driver.base import check_driver

        check_driver(inner, "inner")
        self.inner = inner
        self.kind: str = inner.kind
        self.device: int = inner.device
        self.name: str = inner.name
        self.memory: Any = inner.memory
        self._fg = threading.get_ident()
        self.reset()

    def reset(self) -> None:
        """Zero the counters (from now on, the decode path is the calling thread)."""
        self._fg = threading.get_ident()
        self.fg_s = self.bg_s = 0.0
        self.fg_calls = self.bg_calls = 0

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            dt = time.perf_counter() - t0
            if threading.get_ident() == self._fg:
                self.fg_s += dt
                self.fg_calls += 1
            else:
                self.bg_s += dt
                self.bg_calls += 1

    def granularity(self) -> int:
        return int(self.inner.granularity())

    def reserve(self, size: int, align: int = 0) -> int:
        return int(self._call(self.inner.reserve, size, align))

    def free(self, va: int, size: int) -> None:
        self._call(self.inner.free, va, size)

    def create(self, size: int) -> int:
        return int(self._call(self.inner.create, size))

    def release(self, handle: int) -> None:
        self._call(self.inner.release, handle)

    def map(self, va: int, size: int, handle: int) -> None:
        self._call(self.inner.map, va, size, handle)

    def unmap(self, va: int, size: int) -> None:
        self._call(self.inner.unmap, va, size)

    def set_access(self, va: int, size: int, devices: Any = None) -> None:
        # Two arguments when the arena passes two: CudaDriver's C fast path takes only
        # (va, size) and hands a third, even None, to the slower Python path.
        if devices is None:
            self._call(self.inner.set_access, va, size)
        else:
            self._call(self.inner.set_access, va, size, devices)

    def mem_info(self) -> tuple[int, int]:
        free, total = self.inner.mem_info()
        return int(free), int(total)

    def stats(self) -> Any:
        return self.inner.stats()

    def export_handle(self, handle: int) -> int:
        return int(self.inner.export_handle(handle))

    def import_handle(self, fd: int, size: int) -> int:
        return int(self.inner.import_handle(fd, size))

    def __getattr__(self, name: str) -> Any:
        # pin/unpin, granularity_min, synchronize, ...: what the arena and tensors look up
        # on a driver beyond the protocol, untimed.
        return getattr(self.inner, name)


def _pct(xs: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (p99 of 122 steps: the second largest)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


def _elastic_round(drv: Any, w: Workload, *, lookahead_bytes: int | None, gap_s: float,
                   sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """One decode growth of ``w`` with the default policy, ``gap_s`` between steps.

    ``lookahead_bytes=None``: no pool (every driver call on the decode path, as today);
    else a threaded HandlePool and that look-ahead. The owner is made and its look-ahead
    primed (``ensure_prefix(0)``) one gap before the first step: a server makes its KV
    cache, captures graphs, then decodes. What ``ensure_prefix`` blocks for is wall time on
    the calling thread: what a decode step would wait for.
    """
    from kvvmm.arena.pool import HandlePool
    from kvvmm.owner import KvBufferOwner

    td = TimedDriver(drv)
    pool = HandlePool(td) if lookahead_bytes is not None else None
    descs = w.descs()
    owner = KvBufferOwner(driver=td, dtype="bfloat16", page_size=w.page_size,
                          reserved_tokens=w.reserved_tokens, descs=descs, pool=pool,
                          lookahead_bytes=lookahead_bytes or 0)
    try:
        td.reset()
        owner.ensure_prefix(0)
        sleep(gap_s)
        blocked: list[float] = []
        over_steps: list[int] = []
        pc = time.perf_counter
        for n in range(w.step_tokens, w.grow_to_tokens + 1, w.step_tokens):
            t0 = pc()
            owner.ensure_prefix(n)
            blocked.append(pc() - t0)
            # over-commit at every step, not only at the end: where the growth stops decides
            # whether the policy's next extension was taken early (not timed)
            over_steps.append(owner.backed_bytes - sum(d.prefix_span_bytes(n, w.page_size)
                                                       for d in descs))
            sleep(gap_s)
        if pool is not None:
            pool.drain(timeout_s=30)  # the last look-ahead's driver time counts too
        driver_fg, driver_bg = td.fg_s, td.bg_s
        calls_fg, calls_bg = td.fg_calls, td.bg_calls
        # The floor under a step: ensure_prefix with nothing to back, after a gap. Python's
        # own pass over the buffers, run cold after the sleep (tens of µs on a CPU that
        # idles in the gap, a few µs in a tight loop): it bounds what p50/p99 can show.
        noop = []
        for _ in range(10):
            sleep(gap_s)
            t0 = pc()
            owner.ensure_prefix(w.grow_to_tokens)
            noop.append(pc() - t0)
        snap = owner.snapshot()
        need = sum(d.prefix_span_bytes(w.steps * w.step_tokens, w.page_size) for d in descs)
        over = [b.backed_bytes - b.prefix_bytes for b in snap.buffers]
        pstats = pool.stats() if pool is not None else None
        res: dict[str, Any] = {
            "pool": pool is not None, "lookahead_bytes": lookahead_bytes or 0,
            "blocked_ms": round(sum(blocked) * 1e3, 3),
            "step_p50_us": round(_pct(blocked, 0.5) * 1e6, 1),
            "step_p99_us": round(_pct(blocked, 0.99) * 1e6, 1),
            "step_max_us": round(max(blocked) * 1e6, 1),
            "steps_over_target": sum(b * 1e6 > STEP_TARGET_US for b in blocked),
            "noop_step_after_gap_us_median": round(statistics.median(noop) * 1e6, 1),
            "driver_ms": round((driver_fg + driver_bg) * 1e3, 3),
            "driver_decode_path_ms": round(driver_fg * 1e3, 3),
            "driver_background_ms": round(driver_bg * 1e3, 3),
            "driver_calls_decode_path": calls_fg,
            "driver_calls_background": calls_bg,
            "inflight_waits": owner.arena.inflight_waits,
            "handles_after_growth": snap.handles,
            "backed_after_growth_bytes": snap.arena.backed_bytes,
            "overcommit_bytes": snap.arena.backed_bytes - need,
            "max_overcommit_per_buffer": max(over),
            "overcommit_peak_bytes": max(over_steps),
            "overcommit_mean_bytes": int(statistics.fmean(over_steps)),
            "pool_held_bytes": pool.held_bytes if pool is not None else 0,
            "pool_jobs": pstats.jobs if pstats is not None else 0,
            "pool_errors": pstats.errors if pstats is not None else 0,
        }
    finally:
        owner.close()
        if pool is not None:
            pool.close()
    return res


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds (and the worst p99), plus every round."""
    med = statistics.median
    return {"blocked_ms_median": round(med(r["blocked_ms"] for r in rounds), 3),
            "blocked_ms_rounds": [r["blocked_ms"] for r in rounds],
            "step_p50_us_median": round(med(r["step_p50_us"] for r in rounds), 1),
            "step_p99_us_median": round(med(r["step_p99_us"] for r in rounds), 1),
            "step_p99_us_max": max(r["step_p99_us"] for r in rounds),
            "driver_ms_median": round(med(r["driver_ms"] for r in rounds), 3),
            "noop_step_after_gap_us_median": round(
                med(r["noop_step_after_gap_us_median"] for r in rounds), 1),
            "overcommit_peak_bytes_max": max(r["overcommit_peak_bytes"] for r in rounds),
            "rounds": rounds}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def elastic_growth(drv: Any, w: Workload = BENCH_WORKLOAD, *, gap_s: float = GAP_S,
                   lookahead_bytes: int = LOOKAHEAD_BYTES,
                   sweep: tuple[int, ...] = LOOKAHEAD_SWEEP, rounds: int = 3,
                   settle_s: float = _SETTLE_S,
                   sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Decode growth without and with the pool + look-ahead, settled and back to back.

    Settled: ``rounds`` rounds of each, alternated (the order turned each round) so both see
    the card in the same state, each started ``settle_s`` after the previous owner closed
    (as ``_grow_rounds``). Back to back: per variant, ``rounds`` + 1 growths with no pause,
    the first dropped (it started settled), as ``_back_to_back``. Then each look-ahead of
    ``sweep`` other than ``lookahead_bytes``, one settled round.
    """
    variants: list[tuple[str, int | None]] = [("without_pool", None),
                                              ("with_pool", lookahead_bytes)]
    settled: dict[str, list[dict[str, Any]]] = {k: [] for k, _ in variants}
    for r in range(rounds):
        for key, la in variants[r % 2:] + variants[:r % 2]:
            sleep(settle_s)
            settled[key].append(_elastic_round(drv, w, lookahead_bytes=la, gap_s=gap_s,
                                               sleep=sleep))
    out: dict[str, Any] = {
        "workload": w.as_dict(), "policy": _default_policy_name(),
        "assumptions": {
            "gap_s_between_steps": gap_s,
            "gap_stands_for": "the GPU time of one decode step (Llama-3.1-8B-class on one "
                              "H200, ~20 ms), slept with time.sleep: the pool's thread "
                              "works during it as it would while a server's GPU decodes",
            "blocked": "wall time of ensure_prefix on the decode thread, summed over steps",
            "driver_time": "every VMM driver call timed by a wrapper (TimedDriver), on the "
                           "decode thread and on the pool's thread",
            "primed": "ensure_prefix(0) one gap before the first step (a server makes its "
                      "cache, captures graphs, then decodes); its cost is not in blocked",
            "settle_s_before_settled_rounds": settle_s,
        },
    }
    for key, la in variants:
        sleep(settle_s)
        b2b = [_elastic_round(drv, w, lookahead_bytes=la, gap_s=gap_s, sleep=sleep)
               for _ in range(rounds + 1)][1:]
        s, b = _summary(settled[key]), _summary(b2b)
        out[key] = {"lookahead_bytes": la or 0, "settled": s, "back_to_back": b,
                    "back_to_back_over_settled_blocked": _ratio(b["blocked_ms_median"],
                                                                s["blocked_ms_median"]),
                    "back_to_back_over_settled_driver": _ratio(b["driver_ms_median"],
                                                               s["driver_ms_median"])}
    # What the look-ahead costs in over-commit: against the policy alone, at the end of the
    # growth and at its worst step (the end alone can flatter either).
    base_over = statistics.median(r["overcommit_bytes"] for r in settled["without_pool"])
    base_peak = statistics.median(r["overcommit_peak_bytes"] for r in settled["without_pool"])
    chosen = statistics.median(r["overcommit_bytes"] for r in settled["with_pool"])
    chosen_peak = statistics.median(r["overcommit_peak_bytes"] for r in settled["with_pool"])
    out["with_pool"]["lookahead_overcommit_bytes"] = int(chosen - base_over)
    out["with_pool"]["lookahead_overcommit_peak_bytes"] = int(chosen_peak - base_peak)
    rows = []
    for la in sweep:
        if la == lookahead_bytes:
            row = settled["with_pool"][0]
        else:
            sleep(settle_s)
            row = _elastic_round(drv, w, lookahead_bytes=la, gap_s=gap_s, sleep=sleep)
        rows.append({k: row[k] for k in (
            "lookahead_bytes", "blocked_ms", "step_p50_us", "step_p99_us", "driver_ms",
            "overcommit_bytes", "max_overcommit_per_buffer", "overcommit_peak_bytes")}
            | {"lookahead_overcommit_bytes": int(row["overcommit_bytes"] - base_over),
               "lookahead_overcommit_peak_bytes": int(row["overcommit_peak_bytes"] - base_peak)})
    out["lookahead_sweep"] = rows
    out["without_pool_overcommit_bytes"] = int(base_over)
    out["without_pool_overcommit_peak_bytes"] = int(base_peak)
    return out


def _default_policy_name() -> str:
    from kvvmm.policy import default_policy

    return str(default_policy())


def _us_stats(xs: list[float], per: int) -> dict[str, float]:
    """µs per op (median, mean, max) and per mapping (``per`` mappings per op)."""
    med, mean = statistics.median(xs) * 1e6, statistics.fmean(xs) * 1e6
    return {"us_median": round(med, 1), "us_mean": round(mean, 1),
            "us_max": round(max(xs) * 1e6, 1), "us_per_mapping_median": round(med / per, 1)}


def page_ops(drv: Any, w: Workload = BENCH_WORKLOAD, *, pages: int = 16,
             granules: int = 64, seed: int = 19) -> dict[str, Any]:
    """Single pages in the middle of a buffer, one at a time, without and with the pool.

    Owner: ``commit_pages([p])`` / ``decommit_pages([p])`` of ``pages`` page ids, one per
    granule (so each is its own handle in every buffer: a page id maps one handle per
    buffer), in a shuffled order. Arena: ``commit_range`` / ``decommit_range`` of one
    granule, ``granules`` of them. Two cycles each: the first commit creates; with the pool
    the decommit keeps the handles (under its cap: 16 pages x 64 buffers x 2 MiB = 2 GiB <
    4 GiB) and the second commit only maps and grants access.
    """
    from kvvmm.arena import Arena
    from kvvmm.arena.pool import HandlePool
    from kvvmm.owner import KvBufferOwner

    rng = random.Random(seed)
    pc = time.perf_counter
    out: dict[str, Any] = {"pages": pages, "granules": granules}
    for pooled in (False, True):
        td = TimedDriver(drv)
        pool = HandlePool(td, threaded=False) if pooled else None
        descs = w.descs()
        owner = KvBufferOwner(driver=td, dtype="bfloat16", page_size=w.page_size,
                              reserved_tokens=w.reserved_tokens, descs=descs, pool=pool)
        gran = owner.arena.granularity
        page_bytes = descs[0].prefix_span_bytes(w.page_size, w.page_size)
        per_granule = max(1, gran // page_bytes)
        ids = [owner.pages // 2 + i * per_granule for i in range(pages)]
        row: dict[str, Any] = {}
        try:
            for cycle in (1, 2):
                for op in ("commit", "decommit"):
                    rng.shuffle(ids)
                    fn = owner.commit_pages if op == "commit" else owner.decommit_pages
                    c0 = td.fg_calls
                    ts = []
                    for p in ids:
                        t0 = pc()
                        fn([p])
                        ts.append(pc() - t0)
                    row[f"owner_{op}_page_cycle{cycle}"] = _us_stats(ts, len(descs)) | {
                        "driver_calls_per_page": round((td.fg_calls - c0) / len(ids), 1)}
        finally:
            owner.close()
        arena = Arena(td, reserve_bytes=4 * granules * gran, pool=pool)
        try:
            off = arena.allocate(4 * granules * gran, "x")
            starts = [(granules + 2 * i) * gran for i in range(granules)]  # the middle half
            for cycle in (1, 2):
                for op in ("commit", "decommit"):
                    rng.shuffle(starts)
                    afn = arena.commit_range if op == "commit" else arena.decommit_range
                    ts = []
                    for s in starts:
                        t0 = pc()
                        afn(off, s, gran)
                        ts.append(pc() - t0)
                    row[f"arena_{op}_granule_cycle{cycle}"] = _us_stats(ts, 1)
        finally:
            arena.close()
            if pool is not None:
                pool.close()
        out["with_pool" if pooled else "without_pool"] = row
    return out


def elastic_bandwidth(drv: Any, w: Workload = BENCH_WORKLOAD, *, nbytes: int = 1 * GiB,
                      chunk_bytes: int = 128 * MiB, lookahead_bytes: int = LOOKAHEAD_BYTES,
                      bw_pair: Callable[[Any, Any], dict[str, Any]] | None = None,
                      seed: int = 19) -> dict[str, Any]:
    """Copy bandwidth of KV tensors with holes and after out-of-order commit/decommit, vs
    cudaMalloc (``bw_pair``: :func:`_bw_pair` by default).

    - ``owner_with_holes``: the owner grown with the pool and look-ahead (stepped, so its
      handle sizes are the look-ahead's), then pages committed and decommitted out of order
      past the prefix (holes); the copy is between two buffers' backed prefixes.
    - ``ranges_out_of_order``: an arena allocation of 2 x ``nbytes`` committed in
      ``chunk_bytes`` ranges in a shuffled order, half of them decommitted and committed
      again in other orders (with the pool: its retained handles); copy one half to the other.
    - ``granules_out_of_order``: the same with one-granule ranges (what page-granular
      backing gives): 2 MiB handles, which copy at ~0.86x whatever their order
      (docs/MEASUREMENTS.md §4); reported, not held to the target.
    """
    import torch

    from kvvmm.arena import Arena
    from kvvmm.arena.pool import HandlePool
    from kvvmm.owner import KvBufferOwner

    bw = bw_pair or _bw_pair
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    pool = HandlePool(drv, threaded=False)
    descs = w.descs()
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=w.page_size,
                          reserved_tokens=w.reserved_tokens, descs=descs, pool=pool,
                          lookahead_bytes=lookahead_bytes)
    try:
        for n in range(w.step_tokens, w.grow_to_tokens + 1, w.step_tokens):
            owner.ensure_prefix(n)
            pool.run_once()  # the background's work, stepped: sizes do not depend on timing
        gran = owner.arena.granularity
        page_bytes = descs[0].prefix_span_bytes(w.page_size, w.page_size)
        per_granule = max(1, gran // page_bytes)
        first = owner.snapshot().buffers[0].backed_bytes // page_bytes + per_granule
        ids = [p for p in range(first, owner.pages, 4 * per_granule)][:32]
        rng.shuffle(ids)
        owner.commit_pages(ids)
        gone = ids[::2]
        rng.shuffle(gone)
        owner.decommit_pages(gone)
        snap = owner.snapshot()
        i = 2 if len(descs) >= 4 else 0  # layer 1's K and V, as the growth section copies
        prefix = min(b.prefix_bytes for b in snap.buffers[i:i + 2])
        elems = min(nbytes, prefix // gran * gran) // 2
        src = owner.tensors[i].view(-1)[:elems]
        dst = owner.tensors[i + 1].view(-1)[:elems]
        r = bw(src, dst)
        del src, dst
        out["owner_with_holes"] = r | {
            "copy_bytes": 2 * elems, "holes": len(ids) - len(gone),
            "handles": snap.handles, "lookahead_bytes": lookahead_bytes}
    finally:
        owner.close()
    for key, size in (("ranges_out_of_order", chunk_bytes),
                      ("granules_out_of_order", pool.driver.granularity())):
        size = min(size, nbytes)
        arena = Arena(drv, reserve_bytes=2 * nbytes, pool=pool)
        try:
            off = arena.allocate(2 * nbytes, "x")
            starts = list(range(0, 2 * nbytes, size))
            rng.shuffle(starts)
            arena.commit_ranges([(off, s, size) for s in starts])
            half = starts[::2]
            rng.shuffle(half)
            for s in half:
                arena.decommit_range(off, s, size)
            rng.shuffle(half)
            for s in half:
                arena.commit_range(off, s, size)
            a = arena.tensor(off, (nbytes // 2,), torch.bfloat16)
            b = arena.tensor(off + nbytes, (nbytes // 2,), torch.bfloat16)
            r = bw(a, b)
            del a, b
            out[key] = r | {"handle_bytes": size, "handles": len(arena.snapshot().mappings),
                            "copy_bytes": nbytes}
        finally:
            arena.close()
    pool.close()
    return out


def _package_parent() -> Path:
    """The folder holding the ``kvvmm`` package: the repository checkout, when it is one."""
    return Path(__file__).resolve().parents[2]  # kvvmm/measure/bench.py -> the checkout


def find_seed_script(explicit: str | None = None) -> Path:
    """The seed's side of the benchmark: ``bench/seed_side_by_side.py``.

    Args:
        explicit: a path given with ``--seed-script``; used as is.
    Returns:
        ``explicit``, else the file in the repository checkout that holds this package (an
        editable install, or ``PYTHONPATH`` set to the checkout), else ``./bench/``'s.
    Raises:
        FileNotFoundError: none of them exists (an installed wheel has no ``bench/``).
    """
    if explicit is not None:
        cands = [Path(explicit)]
    else:
        cands = [_package_parent() / SEED_SCRIPT, Path.cwd() / SEED_SCRIPT]
    for cand in cands:
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"the seed's benchmark script is not at {' or '.join(map(str, cands))}: run kvvmm "
        "bench from a kvvmm checkout, or pass --seed-script PATH/seed_side_by_side.py")


def _check_seed_file(seed_file: str) -> str:
    """The seed file's absolute path; it must exist and be named ``kv_vmm_backing_seed.py``."""
    path = os.path.abspath(seed_file)
    if os.path.basename(path) != "kv_vmm_backing_seed.py":
        raise SystemExit(f"--seed-file must be named kv_vmm_backing_seed.py, got {seed_file}")
    if not os.path.isfile(path):
        raise SystemExit(f"--seed-file {seed_file}: no such file")
    return path


def _seed(seed_file: str, script: Path) -> dict[str, Any]:
    """Run ``script`` on the seed file in a child process; its ``SEED_JSON`` line, or the error."""
    env = dict(os.environ)
    # The child imports the same kvvmm as this process (the script takes its workload from
    # kvvmm.measure.bench).
    env["PYTHONPATH"] = os.pathsep.join([str(_package_parent()), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), seed_file],
                          capture_output=True, text=True, env=env, timeout=540)
    for line in proc.stdout.splitlines():
        if line.startswith("SEED_JSON "):
            res: dict[str, Any] = json.loads(line[len("SEED_JSON "):])
            res["exit_code"] = proc.returncode
            res["stderr_tail"] = proc.stderr[-600:]
            return res
    return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _tqdm() -> Any:
    """tqdm's bar class, imported only here: ``import kvvmm`` does not load it."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError as e:
        e.add_note("kvvmm bench shows its progress with tqdm, a kvvmm dependency: pip install tqdm")
        raise
    return tqdm


def _card_slug(card: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``: the card's part of a result's file name."""
    return card.lower().replace("nvidia ", "").strip().replace(" ", "-")


def run(out_dir: str, seed_file: str | None, device: int = 0,
        seed_script: str | None = None) -> dict[str, Any]:
    """Run every section; return the result dict (also written as JSON under ``out_dir``).

    Args:
        out_dir: folder for ``<card>-kvvmm-bench.json`` (made if missing).
        seed_file: SGLang's ``kv_vmm_backing_seed.py`` to run side by side, or None.
        device: the CUDA device ordinal.
        seed_script: the seed's benchmark script (default: :func:`find_seed_script`).
    Returns:
        The result, with ``"path"`` set to the file written.
    Raises:
        DriverUnavailableError: no usable GPU.
        FileNotFoundError: ``seed_file`` is given and the seed's script is not found.
        ImportError: tqdm is missing.
    """
    import importlib.metadata as md

    from kvvmm._version import __version__

    # All three checked before minutes of measuring, not after them.
    seed = _check_seed_file(seed_file) if seed_file else None
    script = find_seed_script(seed_script) if seed else None
    tqdm = _tqdm()
    from kvvmm.policy import Chunked, Exact, Geometric, default_policy

    policies = [default_policy(), Exact(), Chunked(64 * MiB), Chunked(128 * MiB),
                Chunked(256 * MiB), Geometric(2.0, 256 * MiB)]
    unique: dict[str, Any] = {}
    for p in policies:
        unique.setdefault(str(p), p)
    policies = list(unique.values())

    import torch
    from cuda.bindings import driver as d

    from kvvmm.arena import Arena
    from kvvmm.driver.cuda import CudaDriver
    from kvvmm.owner import KvBufferOwner

    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.empty(1, device=f"cuda:{device}")
    cd = CudaDriver(device=device)
    free, total = cd.mem_info()
    res: dict[str, Any] = {
        "benchmark": "kvvmm bench (gpu)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "card": torch.cuda.get_device_name(device),
        "versions": {"torch": torch.__version__, "cuda_bindings": md.version("cuda-bindings"),
                     "driver": int(_ck(d.cuDriverGetVersion())), "kvvmm": __version__,
                     "python": platform.python_version()},
        "mem_total_bytes": total, "mem_free_bytes": free,
        "granularity_min": cd.granularity_min,
        "granularity_recommended": cd.granularity_recommended,
        "workload": {"buffers": 2 * _LAYERS, "kv_heads": _HEADS, "head_dim": _DIM,
                     "page_size": _PAGE, "reserved_tokens": _RESERVED, "step_tokens": _STEP,
                     "grow_to_tokens": _GROW_TO, "finalize_tokens": _FINAL},
        "default_policy": str(default_policy()),
    }

    def per_call() -> None:
        old = os.environ.get("KVVMM_CUDA_FASTPATH")
        os.environ["KVVMM_CUDA_FASTPATH"] = "0"
        try:
            cd_py = CudaDriver(device=device)  # every call in Python, timed beside the default
        finally:
            if old is None:
                del os.environ["KVVMM_CUDA_FASTPATH"]
            else:
                os.environ["KVVMM_CUDA_FASTPATH"] = old
        res["fast_path"] = cd.fast_path
        res["per_call"] = _per_call(d, cd, cd_py)
        cd_py.close()

    def arena() -> None:
        Arena(cd, reserve_bytes=64 * GiB).close()  # warm-up: the first reserve costs more
        arenas: list[Arena] = []
        ctor = _timed(lambda: arenas.append(Arena(cd, reserve_bytes=64 * GiB)), 10)
        close = _timed(lambda: arenas.pop().close(), 10)
        res["arena"] = {"reserve_bytes": 64 * GiB, "ctor_ms_median": _med_us(ctor) / 1e3,
                        "ctor_ms_max": round(max(ctor) * 1e3, 3),
                        "close_ms_median": _med_us(close) / 1e3}

    def owner() -> None:
        owners: list[KvBufferOwner] = []

        def make_owner() -> None:
            owners.append(KvBufferOwner(driver=cd, dtype="bfloat16", page_size=_PAGE,
                                        reserved_tokens=_RESERVED, descs=_descs()))

        octor = _timed(make_owner, 5)
        reserved = owners[0].arena.reserved_bytes
        oclose = _timed(lambda: owners.pop().close(), 5)
        res["owner"] = {"buffers": 2 * _LAYERS, "reserved_bytes": reserved,
                        "ctor_ms_median": _med_us(octor) / 1e3,
                        "ctor_ms_max": round(max(octor) * 1e3, 3),
                        "close_ms_median": _med_us(oclose) / 1e3}

    rounds: dict[str, list[float]] = {}
    b2b: list[float] = []

    def growth_rounds() -> None:
        rounds.update(_grow_rounds(cd, policies))
        b2b.extend(_back_to_back(cd, policies[0]))
        res["growth"] = []

    def growth(p: Any) -> None:
        g = _growth(cd, p, rounds[str(p)])
        if p is policies[0]:
            g["grow_ms_back_to_back"] = b2b
        res["growth"].append(g)

    def malloc() -> None:
        nbytes = res["growth"][0]["backed_after_finalize_bytes"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        big = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        torch.cuda.synchronize()
        res["cudaMalloc_same_bytes_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
        del big
        torch.cuda.empty_cache()

    def elastic() -> None:
        res["elastic_growth"] = elastic_growth(cd)

    def pages() -> None:
        res["page_ops"] = page_ops(cd)

    def holes_bandwidth() -> None:
        res["elastic_bandwidth"] = elastic_bandwidth(cd)

    sections: list[tuple[str, Callable[[], None]]] = [
        ("per-call costs", per_call), ("arena construction", arena),
        ("owner construction", owner), ("growth, rotated rounds", growth_rounds),
        *[(f"finalize and bandwidth {p}", functools.partial(growth, p)) for p in policies],
        ("cudaMalloc of the same bytes", malloc),
        # issue 19, after the sections above so their figures stay comparable with earlier
        # runs (nothing before them has held a pool's thread or a look-ahead's memory)
        ("elastic growth, pool vs none", elastic), ("single-page map/unmap", pages),
        ("bandwidth with holes", holes_bandwidth),
    ]
    if seed is not None and script is not None:
        seed_path, script_path = seed, script

        def seed_side_by_side() -> None:
            res["seed"] = _seed(seed_path, script_path)

        sections.append(("seed (SGLang arena) in a subprocess", seed_side_by_side))
    # One step of the bar per section, on stderr: stdout is the summary.
    with tqdm(total=len(sections), file=sys.stderr, unit="section", dynamic_ncols=True) as bar:
        for label, section in sections:
            bar.set_description_str(label)
            section()
            bar.update()
    res["targets"] = _targets(res)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{_card_slug(res['card'])}-kvvmm-bench.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    res["path"] = path
    return res


def _targets(res: dict[str, Any]) -> dict[str, Any]:
    default = next(g for g in res["growth"] if g["policy"] == res["default_policy"])
    ratios = [v for row in res["per_call"].values()
              for v in row["ratio_kvvmm_over_raw"].values()]
    out = {
        "arena_ctor_ms<=50": res["arena"]["ctor_ms_max"] <= 50,
        "owner_ctor_ms<=50": res["owner"]["ctor_ms_max"] <= 50,
        "per_call_ratio<=1.1": max(ratios) <= 1.1,
        "per_call_ratio_max": max(ratios),
        "default_growth_ms<=60": default["grow_ms"] <= 60,
        "default_growth_ms_rounds": default["grow_ms_rounds"],
        "default_growth_ms_back_to_back": default.get("grow_ms_back_to_back"),
        "default_bandwidth_ratio>=0.99": default["bandwidth"]["ratio"] >= 0.99,
        "default_overcommit<=one_chunk": default["max_overcommit_per_buffer"],
    }
    out.update(elastic_targets(res))
    return out


def elastic_targets(res: dict[str, Any]) -> dict[str, Any]:
    """Issue 19's targets from the elastic sections of ``res`` (those present): a bool per
    target and the figures it was judged on."""
    out: dict[str, Any] = {}
    eg = res.get("elastic_growth")
    if eg is not None:
        wp, np_ = eg["with_pool"], eg["without_pool"]
        s = wp["settled"]
        ratio = wp["back_to_back_over_settled_blocked"]
        out |= {
            "elastic_blocked_ms<=10": s["blocked_ms_median"] <= 10,
            "elastic_blocked_ms": s["blocked_ms_median"],
            "elastic_blocked_ms_rounds": s["blocked_ms_rounds"],
            "elastic_blocked_ms_back_to_back": wp["back_to_back"]["blocked_ms_rounds"],
            "elastic_blocked_ms_without_pool": np_["settled"]["blocked_ms_median"],
            f"elastic_step_p99_us<={STEP_TARGET_US:g}": s["step_p99_us_max"] <= STEP_TARGET_US,
            "elastic_step_p99_us_rounds": [r["step_p99_us"] for r in s["rounds"]],
            "elastic_step_p99_us_without_pool": np_["settled"]["step_p99_us_median"],
            # the target is on what the decode path waits for; None (no blocking at all
            # when settled) cannot be a ratio and counts as met only if back to back is 0 too
            "elastic_back_to_back<=1.2x_settled": (
                ratio <= 1.2 if ratio is not None
                else wp["back_to_back"]["blocked_ms_median"] == 0),
            "elastic_back_to_back_over_settled": ratio,
            "elastic_back_to_back_over_settled_driver_time":
                wp["back_to_back_over_settled_driver"],
            "elastic_driver_ms_with_pool": s["driver_ms_median"],
            "elastic_driver_ms_without_pool": np_["settled"]["driver_ms_median"],
            "elastic_lookahead_bytes": wp["lookahead_bytes"],
            "elastic_lookahead_overcommit_bytes": wp["lookahead_overcommit_bytes"],
            "elastic_lookahead_overcommit_peak_bytes": wp["lookahead_overcommit_peak_bytes"],
            "elastic_noop_step_after_gap_us": s["noop_step_after_gap_us_median"],
        }
    bw = res.get("elastic_bandwidth")
    if bw is not None:
        held = {k: bw[k]["ratio"] for k in ("owner_with_holes", "ranges_out_of_order")}
        out |= {"elastic_bandwidth_ratio>=0.99": min(held.values()) >= 0.99,
                "elastic_bandwidth_ratios": held,
                # 2 MiB handles: not held to the target (docs/MEASUREMENTS.md §4)
                "elastic_bandwidth_ratio_2MiB_granules": bw["granules_out_of_order"]["ratio"]}
    po = res.get("page_ops")
    if po is not None:
        out["page_commit_us_median"] = {
            k: po[k]["owner_commit_page_cycle2"]["us_median"]
            for k in ("without_pool", "with_pool")}
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvvmm bench``."""
    ap = argparse.ArgumentParser(prog="kvvmm bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join("bench", "results"),
                    help="folder for the JSON result (default: bench/results)")
    ap.add_argument("--seed-file", default=None,
                    help="path to SGLang's kv_vmm_backing as kv_vmm_backing_seed.py: run it "
                         "side by side")
    ap.add_argument("--seed-script", default=None,
                    help="the seed's benchmark script (default: bench/seed_side_by_side.py "
                         "of the kvvmm checkout, or of ./bench)")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args(argv)
    from kvvmm.errors import DriverUnavailableError

    script = None
    if args.seed_file:
        try:
            script = str(find_seed_script(args.seed_script))
        except FileNotFoundError as e:
            print(f"kvvmm bench: {e}", file=sys.stderr)
            return 2
    try:
        res = run(args.out, args.seed_file, args.device, seed_script=script)
    except DriverUnavailableError as e:
        print(f"kvvmm bench needs a GPU: {e}", file=sys.stderr)
        return 2
    summary = {k: res[k] for k in ("card", "arena", "owner", "targets")}
    summary["growth"] = [{k: g[k] for k in ("policy", "grow_ms", "grow_ms_rounds",
                                             "grow_handles", "max_overcommit_per_buffer")}
                         | {"bw_ratio": g["bandwidth"]["ratio"]} for g in res["growth"]]
    if "seed" in res:
        summary["seed"] = res["seed"]
    print(json.dumps(summary, indent=1))
    print("wrote", res["path"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

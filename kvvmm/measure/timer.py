"""Timing what kvvmm does: a driver wrapper that times every VMM call, the copy timer, and the
statistics the sections report."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TimedDriver"]

def _med_us(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e6, 3)


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


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _pct(xs: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (p99 of 122 steps: the second largest)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


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


"""Timing what kvvmm does: a driver wrapper that times every VMM call, the copy timer, and the
statistics the sections report."""

from __future__ import annotations

import contextlib
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from kvvmm.driver.base import Driver
from kvvmm.driver.wrapper import DriverWrapper
from kvvmm.measure.stats import Measurement

T = TypeVar("T")

__all__ = ["HANDLE_CALLS", "CallTimes", "TimedDriver", "copy_tb_s", "copy_vs_malloc", "rotated",
           "time_handle_calls", "wrapper_cost_s"]

#: Where each timed VMM call has its size (a release is timed by its handle's size).
_SIZE_AT = {"reserve": 0, "free": 1, "create": 0, "map": 1, "unmap": 1, "set_access": 1}
#: What a recording holds beyond the VMM calls.
_RECORDED_ONLY = frozenset(("mem_info", "pin", "unpin"))

def copy_tb_s(dst: Any, src: Any, reps: int = 30) -> float:
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
    # 4 significant digits, not 3 decimals: a CPU's copy (the host driver's tensors on a
    # busy machine) runs at 0.0004 TB/s, which 3 decimals made 0 (and a ratio 0 / 0)
    return float(f"{nbytes / statistics.median(ts) / 1e12:.4g}")


def copy_vs_malloc(vm: Any, vm2: Any, alternations: int = 21, reps: int = 30) -> dict[str, Any]:
    """Owner tensors vs cudaMalloc tensors of the same size, alternated 21 times."""
    import torch

    pl = torch.empty_like(vm, device=vm.device)
    pl2 = torch.empty_like(vm, device=vm.device)
    for x in (vm, vm2, pl, pl2):
        x.normal_()
    # 21 alternations: with fewer, the ratio moved between runs by as much as the effect.
    runs_vmm, runs_plain = [], []
    for _ in range(alternations):
        runs_vmm.append(copy_tb_s(vm2, vm, reps))
        runs_plain.append(copy_tb_s(pl2, pl, reps))
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


class TimedDriver(DriverWrapper):
    """A driver that forwards every call to ``inner`` and times it, for both commands.

    - Always: the VMM calls (reserve, free, create, release, map, unmap, set_access) are summed
      by thread: the thread that made the wrapper or last called :meth:`reset` (the decode path:
      ``fg_s``, ``fg_calls``) and any other (the pool's: ``bg_s``, ``bg_calls``). Each counter
      is written by one side only, so no lock (it would be timed too).
    - Inside ``with td.record() as calls:``: every call, ``mem_info``, ``pin`` and ``unpin``
      too, is appended to ``calls`` as ``(op, size, seconds)`` instead (a release by the size of
      its handle).

    A pool and an arena timed must be built on this object (the arena checks that its pool
    shares its driver).
    """

    def __init__(self, inner: Driver, clock: Callable[[], float] | None = None) -> None:
        super().__init__(inner)
        #: seconds now: the wall clock, or a simulator's (``lambda: d.clock_us / 1e6``)
        self._now = clock or time.perf_counter
        self.calls: list[tuple[str, int, float]] = []
        self.recording = False
        # handle -> size: a release costs by the size of its handle, and names only the handle
        self._sizes: dict[int, int] = {}
        self._fg = threading.get_ident()
        self.reset()

    def reset(self) -> None:
        """Zero the counters (from now on, the decode path is the calling thread)."""
        self._fg = threading.get_ident()
        self.fg_s = self.bg_s = 0.0
        self.fg_calls = self.bg_calls = 0

    def _call(self, call: str, fn: Callable[..., Any], *args: Any) -> Any:
        at = _SIZE_AT.get(call)
        if at is not None:
            size = args[at]
        elif call == "release":  # timed by its handle's size
            size = self._sizes.get(args[0], 0)
        elif self.recording and call in _RECORDED_ONLY:
            # mem_info, pin, unpin: not VMM calls, in the counters never, in a recording
            # always (on the same path as a VMM call: wrapper_cost_s times it)
            return self._recorded(call, 0, fn, *args)
        else:  # export_handle and import_handle pass through untimed
            return fn(*args)
        if self.recording:
            out = self._recorded(call, size, fn, *args)
        else:
            t0 = self._now()
            try:
                out = fn(*args)
            finally:
                dt = self._now() - t0
                if threading.get_ident() == self._fg:
                    self.fg_s += dt
                    self.fg_calls += 1
                else:
                    self.bg_s += dt
                    self.bg_calls += 1
        if call == "create":
            self._sizes[out] = size
        elif call == "release":
            self._sizes.pop(args[0], None)
        return out

    def _recorded(self, op: str, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = self._now()
        out = fn(*args)
        self.calls.append((op, size, self._now() - t0))
        return out

    @contextmanager
    def record(self) -> Iterator[list[tuple[str, int, float]]]:
        """Record the calls made inside the block (a fresh list each time)."""
        self.calls = []
        self.recording = True
        try:
            yield self.calls
        finally:
            self.recording = False


def wrapper_cost_s(td: TimedDriver, n: int = 2000) -> float:
    """Seconds the wrapper adds per call beyond what it times (median of 5 batches)."""
    out = []
    for _ in range(5):
        with td.record() as calls:
            t0 = td._now()
            for _ in range(n):
                td.mem_info()
            wall = td._now() - t0
        out.append((wall - sum(c[2] for c in calls)) / n)
    return max(0.0, statistics.median(out))


def rotated(items: list[T], r: int) -> list[T]:
    """``items`` turned by ``r`` places: round ``r`` of rounds that alternate what they time
    starts each round with the next one, so every variant sees the card in every state."""
    n = len(items)
    return items[r % n:] + items[:r % n]


#: The handle calls the timing loop times, in the order one rep makes them.
HANDLE_CALLS = ("create", "map", "set_access", "unmap", "release")


class CallTimes:
    """What the timing loop appends: each handle call's samples by size (bytes)."""

    __slots__ = ("samples",)

    def __init__(self, sizes: Iterable[int]) -> None:
        sizes = tuple(sizes)
        self.samples: dict[str, dict[int, list[float]]] = {
            op: {s: [] for s in sizes} for op in HANDLE_CALLS}

    def measurement(self, op: str, size: int) -> Measurement:
        """Every sample of ``op`` at ``size`` (at least one rep timed)."""
        return Measurement.of(self.samples[op][size])

    def reps(self, size: int) -> int:
        """How many reps timed ``size``."""
        return len(self.samples["create"][size])


def time_handle_calls(d: Driver, places: Mapping[int, int], clock: Callable[[], float],
                      rng: random.Random, into: CallTimes | None) -> None:
    """One rep of the call-timing loop ``kvvmm bench``, ``kvvmm calibrate`` and the quick
    refresh share: every size created, mapped and given access, then every size unmapped, then
    every size released (as an owner's decommit and close make them), each phase in a fresh
    ``rng`` order. Only the calls sit between two clock readings.

    Args:
        d: the driver whose calls are timed.
        places: handle size (bytes) -> the VA it is mapped at (reserved by the caller).
        clock: now, in the unit the samples are kept in.
        rng: the order's source.
        into: where the times go (None: a warm-up rep, nothing kept).
    Raises:
        DriverError: a call failed; what this rep made is given back first.
    """
    order = list(places)
    rng.shuffle(order)
    handles: dict[int, int] = {}
    s = h = -1
    try:
        for s in order:
            va = places[s]
            t0 = clock()
            h = d.create(s)
            t1 = clock()
            d.map(va, s, h)
            t2 = clock()
            d.set_access(va, s)
            t3 = clock()
            handles[s] = h
            if into is not None:
                got = into.samples
                got["create"][s].append(t1 - t0)
                got["map"][s].append(t2 - t1)
                got["set_access"][s].append(t3 - t2)
        rng.shuffle(order)
        for s in order:
            va = places[s]
            t0 = clock()
            d.unmap(va, s)  # CudaDriver synchronizes first
            t1 = clock()
            if into is not None:
                into.samples["unmap"][s].append(t1 - t0)
        rng.shuffle(order)
        for s in order:
            h = handles[s]
            t0 = clock()
            d.release(h)
            t1 = clock()
            del handles[s]
            if into is not None:
                into.samples["release"][s].append(t1 - t0)
    except BaseException:
        _give_back(d, places, handles, s, h)
        raise


def _give_back(d: Driver, places: Mapping[int, int], handles: Mapping[int, int],
               size: int, in_flight: int) -> None:
    """Unmap and release what a failed rep still holds: ``handles``, and the handle made at
    ``size`` whose map or access failed (each step may already be undone: its own error is
    not the one to report)."""
    from kvvmm.errors import KvvmmError

    left = dict(handles)
    if in_flight >= 0 and size in places and in_flight not in left.values():
        left[size] = in_flight
    for s, h in left.items():
        if s in places:
            with contextlib.suppress(KvvmmError):
                d.unmap(places[s], s)
        with contextlib.suppress(KvvmmError):
            d.release(h)

"""Replay a workload through the serving model and memory strategies; results over time.

:func:`run_workload` gives every strategy a fresh driver and a real
:class:`~kvvmm.owner.KvBufferOwner` of the model's KV pool on one tensor-parallel rank (the
ranks are alike: each backs the same pages of its own shard), serves the workload with
:class:`~kvvmm.workload.serving.ServingModel`, and records, over simulated time: bytes used by
requests, backed, held by a handle pool, what page-elastic backing would need at best, handles,
driver calls and their time on the decode path (the sim's clock on the sim driver, measured
wall time of each call on host and CUDA), the batch, and the KV tensors' predicted bandwidth
factor. Every driver call goes through a :class:`~kvvmm.record.TracingDriver` (a range
strategy makes about 140,000 in an hour of Azure's conversation trace); with ``record`` the run
keeps them, so its trace can be replayed on a fresh sim driver.

A run's memory does not grow with its length unless ``record`` asks for the trace: the
requests are read one ahead (a :class:`~kvvmm.workload.requests.RequestStream` holds none),
the traced calls are folded into counters and dropped, what is kept per step or per request
is a :class:`~kvvmm.workload.tally.Tally` (exact up to a million values, then within 0.5 %),
the means and peaks over time are running sums over every sample, and the timeline keeps
every sample up to :data:`TIMELINE_CAP`, then one in two, four, ... (a figure's points).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import time
from array import array
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol, runtime_checkable

from kvvmm.checks import bool_arg, int_arg, number_arg
from kvvmm.driver import Driver, MemoryKind, driver_for
from kvvmm.errors import ArgumentError
from kvvmm.hardware import (
    H200_BANDWIDTH,
    DeviceProfile,
    get_profile,
    predicted_bandwidth_tb_s,
)
from kvvmm.hardware.bandwidth import predicted_mix_tb_s
from kvvmm.layout import KvBufferDesc, full_pool_descs, plan
from kvvmm.owner import KvBufferOwner
from kvvmm.record import Trace, TracingDriver
from kvvmm.snapshot import ArenaSnapshot
from kvvmm.workload.bands import BAND_QUANTILES, QuantilePrices
from kvvmm.workload.requests import Request, Requests, as_requests
from kvvmm.workload.serving import (
    ServingConfig,
    ServingModel,
    ServingStats,
    StepTimeModel,
    fewer_collections,
)
from kvvmm.workload.strategies import LeaseAllocator, RequestRanges, Strategy, make_strategy
from kvvmm.workload.tally import Tally

__all__ = ["TIMELINE_CAP", "Progress", "RunOptions", "RunSetup", "StrategyResult", "Timeline",
           "WorkloadComparison", "run_workload", "tqdm_progress"]

#: Samples a timeline keeps one by one (an hour takes about 4,000); past it every other
#: one is dropped and the stride doubles, so a week's timeline stays this size.
TIMELINE_CAP = 1 << 18

_PLAIN_TB_S = H200_BANDWIDTH.reference_tb_s("plain") or 4.19


@dataclass(frozen=True, slots=True)
class Timeline:
    """Samples over simulated time (every ``sample_s`` and after each backing change)."""

    t_s: tuple[float, ...]
    step: tuple[int, ...]
    used_bytes: tuple[int, ...]  #: pages held by requests (and slot 0's), in every buffer
    high_water_pages: tuple[int, ...]  #: one past the highest page in use (how compact)
    backed_bytes: tuple[int, ...]
    pool_held_bytes: tuple[int, ...]  #: held by a handle pool, not mapped (0 without one)
    elastic_bytes: tuple[int, ...]  #: page-elastic at best: granules a used page touches
    handles: tuple[int, ...]  #: handles alive
    driver_calls: tuple[int, ...]  #: calls so far
    driver_s: tuple[float, ...]  #: driver time so far on the decode path
    running: tuple[int, ...]
    waiting: tuple[int, ...]
    bandwidth_factor: tuple[float, ...]  #: KV tensors' predicted bandwidth vs cudaMalloc
    #: one sample in this many is kept (1: every one; more past :data:`TIMELINE_CAP`)
    kept_every: int = 1

    def __len__(self) -> int:
        return len(self.t_s)


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """One strategy's run of a workload."""

    strategy: str
    driver: str  #: driver kind
    serving: ServingStats
    timeline: Timeline
    reserved_bytes: int  #: the arena's VA
    startup_driver_s: float  #: driver time before serving (prepare, start)
    decode_driver_s: float  #: driver time at step boundaries (stalls)
    driver_calls: int  #: every driver call of the run (startup and decode path)
    decode_driver_calls: int
    peak_backed_bytes: int
    mean_backed_bytes: float  #: time-weighted
    mean_used_bytes: float  #: time-weighted
    peak_elastic_bytes: int
    mean_elastic_bytes: float  #: time-weighted
    peak_pool_bytes: int  #: held by the handle pool (idle handles: memory, not backing)
    mean_pool_bytes: float  #: time-weighted
    #: page-elastic at best, one granule handle per buffer at a time: granules it would
    #: create + map + set access, and unmap + release, over the run (slot 0's included)
    elastic_maps: int
    elastic_unmaps: int
    p50_stall_s: float  #: over every step (most have none: see stalled_p50_s / _p99_s)
    p99_stall_s: float  #: over every step: what the p99 decode step waits
    max_stall_s: float
    stalled_steps: int  #: steps that had a driver stall
    used_over_backed: int  #: boundaries where used > backed (must be 0)
    conservation_errors: int  #: snapshots where backed + unbacked != reserved (must be 0)
    final_handles: int
    predicted_tb_s: float  #: KV tensors' predicted copy bandwidth at the end (H200 table)
    wall_s: float  #: wall time of the serving loop
    final_snapshot: ArenaSnapshot | None  #: the arena before close
    trace: Trace | None  #: driver calls and arena ops up to the final snapshot (``record``)
    #: driver time run off the decode path (a backing thread's upkeep and commits), seconds;
    #: a step waited only for the part of it that a lease it needed was still behind
    background_driver_s: float = 0.0
    layout: str = "token_major"  #: the buffers' layout the owner was built with
    #: a range allocator's record (request-ranges*): admits, split_admits (leases that got
    #: more than one range), grows, grows_moved, fragmentation_mean / _max (of the free
    #: blocks, ``1 - largest / free``, at each admission), units_max (mapped units at most)
    ranges: Mapping[str, float] = field(default_factory=dict)
    #: each timed figure of the band (``kvvmm.workload.bands.WORKLOAD_TIMES``, as
    #: :meth:`summary` rounds them) at each band quantile, priced in this run's own pass
    #: (``band_prices``): quantile -> figure -> value; empty where the run was not priced
    #: or its strategy cannot be (a backing thread: its band is served again)
    band_times: Mapping[float, Mapping[str, float]] = field(default_factory=dict)

    @property
    def held_over_used(self) -> float:
        """Memory held per byte the requests used: time-weighted mean of backed bytes plus
        the handle pool's idle handles (memory too), over the mean used (``inf`` when
        nothing was used)."""
        used = self.mean_used_bytes
        return (self.mean_backed_bytes + self.mean_pool_bytes) / used if used > 0 \
            else float("inf")

    @property
    def stalled_share(self) -> float:
        """The share of decode steps that waited on the driver at all (0..1)."""
        return self.stalled_steps / self.serving.steps if self.serving.steps else 0.0

    @property
    def stalled_p50_s(self) -> float:
        """Median driver wait of the steps that had one (0 when none did)."""
        return self.serving.stalls.quantile(50)

    @property
    def stalled_p99_s(self) -> float:
        """p99 driver wait of the steps that had one: what a stalled step costs. The p99
        over *every* step (:attr:`p99_stall_s`) is what a step costs (most cost nothing)."""
        return self.serving.stalls.quantile(99)

    @property
    def mean_waste_bytes(self) -> float:
        """Time-weighted mean of backed - used."""
        return self.mean_backed_bytes - self.mean_used_bytes

    def wait_summary(self) -> dict[str, float | int]:
        """What a request waited, for the summary row: time to first token (arrival to the
        end of its prefill step) at p50 / p99 / max, ms; what memory added to it
        (``first_token_added_*_ms``: the time its admission was put off plus its prefill
        step's driver stall, 0 for most; over every served request's first token);
        admissions put off until their memory was mapped (``request-ranges+deferred``; 0
        for the others); request latency (arrival to last token) at p50 / p99, seconds."""
        s = self.serving
        ttft, lat, added = s.first_token, s.latency, s.first_token_added
        put_off = self.ranges.get("deferred_admits", 0)
        return {"first_token_p50_ms": round(ttft.quantile(50) * 1e3, 3),
                "first_token_p99_ms": round(ttft.quantile(99) * 1e3, 3),
                "first_token_max_ms": round(ttft.max * 1e3, 3) if ttft.count else 0.0,
                "first_token_added_p50_ms": round(added.quantile(50) * 1e3, 3),
                "first_token_added_p99_ms": round(added.quantile(99) * 1e3, 3),
                "first_token_added_max_ms": round(added.max * 1e3, 3) if added.count else 0.0,
                "admissions_put_off": int(put_off),
                "latency_p50_s": round(lat.quantile(50), 3),
                "latency_p99_s": round(lat.quantile(99), 3)}

    def summary(self) -> dict[str, float | int | str]:
        """The summary row: plain numbers, for a table or JSON."""
        s = self.serving
        return {"strategy": self.strategy, "driver": self.driver,
                "peak_backed_bytes": self.peak_backed_bytes,
                "mean_backed_bytes": round(self.mean_backed_bytes),
                "mean_used_bytes": round(self.mean_used_bytes),
                "mean_waste_bytes": round(self.mean_waste_bytes),
                "mean_elastic_bytes": round(self.mean_elastic_bytes),
                "peak_pool_bytes": self.peak_pool_bytes,
                "mean_pool_bytes": round(self.mean_pool_bytes),
                "elastic_maps": self.elastic_maps, "elastic_unmaps": self.elastic_unmaps,
                "p50_stall_us": round(self.p50_stall_s * 1e6, 3),
                "p99_stall_us": round(self.p99_stall_s * 1e6, 3),
                "stalled_share": round(self.stalled_share, 6),
                "stalled_p50_us": round(self.stalled_p50_s * 1e6, 3),
                "stalled_p99_us": round(self.stalled_p99_s * 1e6, 3),
                "max_stall_us": round(self.max_stall_s * 1e6, 3),
                "stalled_steps": self.stalled_steps,
                "decode_driver_ms": round(self.decode_driver_s * 1e3, 3),
                "background_driver_ms": round(self.background_driver_s * 1e3, 3),
                "startup_driver_ms": round(self.startup_driver_s * 1e3, 3),
                "driver_calls": self.driver_calls, "final_handles": self.final_handles,
                "bandwidth_factor": round(self.predicted_tb_s / _PLAIN_TB_S, 4),
                **self.wait_summary(),
                "completed": s.completed, "rejected": s.rejected,
                "preemptions": s.preemptions, "steps": s.steps,
                "end_s": round(s.end_s, 3), "wall_s": round(self.wall_s, 3),
                **{f"ranges_{k}": v for k, v in self.ranges.items()}}


@dataclass(frozen=True, slots=True)
class RunSetup:
    """What every strategy of a comparison shared."""

    model: str
    gpu: str
    tp: int
    dtype: str
    page_size: int
    pool_tokens: int  #: the pool's tokens (page 0 included): the owner's reserved_tokens
    buffers: int
    page_bytes: int  #: bytes of one page over all buffers (one rank)
    config: ServingConfig
    step_model: StepTimeModel
    workload: str  #: the workload's source
    requests: int  #: requests in it (a stream's as read; -1: a stream no strategy read)
    #: host seconds the sim was told pass per serving second (None: no pauses; 1.0: real time)
    pause_scale: float | None = None


@dataclass(frozen=True, slots=True)
class WorkloadComparison:
    """Strategies run on one workload with one setup."""

    setup: RunSetup
    results: tuple[StrategyResult, ...]

    def result(self, strategy: str) -> StrategyResult:
        for r in self.results:
            if r.strategy == strategy:
                return r
        raise ArgumentError("strategy", strategy, f"one of {[r.strategy for r in self.results]}")

    def summary(self) -> list[dict[str, float | int | str]]:
        return [r.summary() for r in self.results]


def _tally_with_zeros(nonzero: Tally, total: int, q: float) -> float:
    """The q-th percentile (nearest rank) of ``total`` values: zeros and a tally of the
    nonzero ones (as exact as the tally is)."""
    if total <= 0:
        return 0.0
    rank = max(1, -(-int(q * total) // 100)) if q < 100 else total  # nearest-rank, 1-based
    zeros = total - nonzero.count
    return 0.0 if rank <= zeros else nonzero.at_rank(rank - zeros)


class _Mappings:
    """The arena's mappings, kept from the driver calls a trace records: the handle sizes
    that back it, in address order, without a snapshot of every mapping at each change.

    A map adds one mapping; an unmap takes every mapping in its range (an arena unmaps a
    run of adjacent mappings in one call). :meth:`mix` gives ``(size, count)`` in the order
    the sizes first appear by address, the order a snapshot's mappings list them in.
    """

    def __init__(self) -> None:
        self.vas: list[int] = []  # mapped addresses, sorted
        self.size_at: dict[int, int] = {}  # address -> its mapping's size
        self.count: dict[int, int] = {}  # size -> mappings of that size
        self._lowest: dict[int, list[int]] = {}  # size -> min-heap of its addresses (lazy)
        self.mapped_bytes = 0

    def map(self, va: int, size: int) -> None:
        bisect.insort(self.vas, va)
        self.size_at[va] = size
        n = self.count[size] = self.count.get(size, 0) + 1
        heap = self._lowest.setdefault(size, [])
        heapq.heappush(heap, va)
        self.mapped_bytes += size
        if len(heap) > 2 * n + 64:  # stale entries (unmapped since) past the live ones: drop
            size_at = self.size_at  # them, so a week's maps do not pile up (a sorted list
            heap[:] = sorted({v for v in heap if size_at.get(v) == size})  # is a heap)

    def unmap(self, va: int, size: int) -> None:
        vas = self.vas
        i = j = bisect.bisect_left(vas, va)
        end = va + size
        while j < len(vas) and vas[j] < end:
            gone = self.size_at.pop(vas[j])
            left = self.count[gone] - 1
            if left:
                self.count[gone] = left
            else:
                del self.count[gone]
            self.mapped_bytes -= gone
            j += 1
        del vas[i:j]

    def mix(self) -> list[tuple[int, int]]:
        """``(size, count)`` of the mappings, sizes in order of their lowest address."""
        first = []
        for size, n in self.count.items():
            heap = self._lowest[size]
            while self.size_at.get(heap[0]) != size:  # unmapped since (or mapped anew)
                heapq.heappop(heap)
            first.append((heap[0], size, n))
        first.sort()
        return [(size, n) for _, size, n in first]


class _Hooks:
    """The serving loop's side of a strategy: calls it, measures it, samples the state."""

    def __init__(self, strategy: Strategy, owner: KvBufferOwner, tracer: TracingDriver,
                 page_bytes: int, gran: int, sim: bool, touch: bool) -> None:
        self.strategy = strategy
        self.owner = owner
        self.trace = tracer.trace
        self.page_bytes = page_bytes
        self.sim = sim
        self.touch = touch
        self.kv_bandwidth_factor = 1.0
        self.backed = owner.backed_bytes
        self.reserved = owner.arena.snapshot().reserved_bytes
        self.hpool = owner.arena.handle_pool
        self.mappings = _Mappings()
        self.handles = 0
        self.calls = 0
        self.decode_calls = 0
        self.driver_s = 0.0
        self.used_over_backed = 0
        self.conservation_errors = 0
        self.seen = 0  # trace events accounted for
        self.pool_held = 0
        self.used_pages = 0
        self.background_s = 0.0  # driver time of off-path work
        self.worker_until = 0.0  # when the modelled backing thread is free again
        # (when each recent job was given to the thread, worker_until after it): how busy
        # the thread was at an earlier time, for a commit given to it when its request
        # joined the queue, before the jobs of the boundaries since
        self._issued: list[tuple[float, float]] = []
        self.waited_s = 0.0  # decode-path waits for off-path work since the last update
        self._in_job = False  # a job runs: one it queues waits its turn (a thread's queue)
        self._later: list[Callable[[], None]] = []
        # The sim's cold calls: host seconds per serving second between driver calls
        self.pause: Callable[[float], None] | None = None
        self.pause_scale = 0.0
        self._paused_to = 0.0  # serving time the sim has been told has passed
        self.allocator: object = None  # the strategy's allocator, for its clock
        #: the band quantiles' prices of every call (``band_prices``), else None; each
        #: quantile's stalls, decode-path seconds and µs of calls already counted
        self.prices: QuantilePrices | None = None
        self.q_stalls = [Tally() for _ in BAND_QUANTILES]
        self.q_driver = [0.0] * len(BAND_QUANTILES)
        self._q_seen = [0.0] * len(BAND_QUANTILES)
        self.threaded = False  # a job ran on the backing thread since serving started
        # Page-elastic at best: per buffer geometry, granules any used page touches.
        ps = owner.page_size
        kinds = Counter((d.row_bytes * ps // d.tokens_per_row) for d in owner.descs)
        pages = owner.max_prefix_tokens // ps + 1  # past every page a request can be handed
        # used pages per granule, a list indexed by granule: the hottest loop of a replay
        self.kinds = [(pb, count, [0] * ((pages * pb - 1) // gran + 1))
                      for pb, count in kinds.items()]
        self.gran = gran
        self.elastic = 0
        self.elastic_maps = 0  # granule handles page-elastic backing would create and map
        self.elastic_unmaps = 0  # ... and unmap and release
        self._elastic_pages([0], 1)  # slot 0's page is always in use
        self._factors: dict[tuple[tuple[int, int], ...], float] = {}
        #: drop the trace's calls once counted (the run does not keep its trace): set when
        #: serving starts, after the startup's calls are summed
        self.prune = False
        self.cols: list[array[float]] = [array("d") for _ in range(13)]
        self._stride = 1  # keep one sample in this many (doubles past TIMELINE_CAP)
        self._skipped = 0  # samples since the last one kept
        # Over every sample, kept or not: the last one's time and values (used, backed,
        # pool, elastic), each value's time-weighted sum so far, and the peaks.
        self._first_t: float | None = None
        self._last_t = 0.0
        self._last: tuple[int, int, int, int] = (0, 0, 0, 0)
        self._sums = [0.0, 0.0, 0.0, 0.0]
        self.peaks = [0, 0, 0, 0]  #: most used, backed, pool-held, elastic bytes sampled
        self.account()

    def account(self) -> float:
        """Fold new trace events into the counters; return their driver time, seconds."""
        events = self.trace.events
        n = len(events)
        if n == self.seen:
            return 0.0
        cost = 0.0
        sim = self.sim
        maps = self.mappings
        for ev in events[self.seen:n]:
            cost += ev.sim_us if sim else ev.wall_us
            if ev.error is None:
                op = ev.op
                if op == "map":
                    maps.map(ev.args["va"], ev.args["size"])
                elif op == "unmap":
                    maps.unmap(ev.args["va"], ev.args["size"])
                elif op == "create":
                    self.handles += 1
                elif op == "release":
                    self.handles -= 1
        self.calls += n - self.seen
        self.seen = n
        if self.prune:  # counted: a week's calls are not kept
            del events[:]
            del self.trace.ops[:]
            self.seen = 0
        self.backed = backed = self.owner.backed_bytes
        self.pool_held = 0 if self.hpool is None else self.hpool.held_bytes
        # Conservation: what the driver calls mapped is what the arena says it backs.
        if maps.mapped_bytes != backed or backed > self.reserved:
            self.conservation_errors += 1
        # The factor depends only on how many handles of each size back the buffers, in
        # the order the sizes first appear (the prediction sums them in that order): the
        # mixes recur through a run, each predicted once.
        key = tuple(maps.mix())
        factor = self._factors.get(key)
        if factor is None:
            if len(self._factors) >= _FACTORS_KEPT:  # a cache, bounded over a week
                self._factors.clear()
            factor = self._factors[key] = (predicted_mix_tb_s(
                key, interleaved=len(self.owner.descs) > 1) / _PLAIN_TB_S) if key else 1.0
        self.kv_bandwidth_factor = factor
        return cost * 1e-6

    def _elastic_pages(self, pages: Sequence[int], sign: int) -> None:
        g = self.gran
        gained = lost = 0  # granules that went from no used page to one, and back, per kind
        for pb, count, per in self.kinds:
            if not g % pb:  # whole pages per granule: each page is in one, page // per_granule
                ppg = g // pb
                if sign > 0:
                    for p in pages:
                        gi = p // ppg
                        before = per[gi]
                        per[gi] = before + 1
                        if not before:
                            gained += count
                else:
                    for p in pages:
                        gi = p // ppg
                        before = per[gi]
                        per[gi] = before - 1
                        if before == 1:
                            lost += count
                continue
            for p in pages:
                lo = p * pb // g
                for gi in range(lo, ((p + 1) * pb - 1) // g + 1):
                    before = per[gi]
                    per[gi] = before + sign
                    if sign > 0:
                        if before == 0:
                            gained += count
                    elif before == 1:
                        lost += count
        self.elastic += (gained - lost) * g
        self.elastic_maps += gained
        self.elastic_unmaps += lost

    def executor(self, job: Callable[[], None], waited: bool) -> None:
        """Run ``job`` as a backing thread would: its driver time goes on that thread's
        clock, not the decode path's; a ``waited`` job (a lease the next step needs) makes
        the decode thread wait until that thread has finished it. A job queued by the job
        running (a refill when an admission's commit ends) runs after it, on the thread's
        clock, as the backing thread's queue would run it: it is nobody's wait."""
        self.threaded = True
        if self._in_job:
            self._later.append(job)
            return
        self._pass_time(getattr(self.allocator, "now_s", 0.0))
        self.waited_s += self.account()  # what came before ran on the decode thread
        self._run_job(job, waited)
        while self._later:
            self._run_job(self._later.pop(0), False)

    def _run_job(self, job: Callable[[], None], waited: bool) -> None:
        self._in_job = True
        try:
            job()
        finally:
            self._in_job = False
        cost = self.account()
        now = getattr(self.allocator, "now_s", 0.0)
        # An admission's commit can start when its request joined the queue (an engine calls
        # admit then, with the prompt's size), if the thread was free by then.
        queued = getattr(self.allocator, "queued_s", None)
        start = now if queued is None or not waited else min(now, queued)
        # The thread runs jobs in the order they were given: one given at ``start`` (before
        # this boundary) waits only for those given by then, not for the refills and
        # give-backs of the boundaries since (those wait for it: the thread's end moves on
        # by its cost).
        busy = self.worker_until
        if start < now:
            busy = max((u for t, u in self._issued if t <= start), default=0.0)
        end = max(busy, start) + cost
        self.worker_until = max(self.worker_until, start) + cost
        issued = self._issued
        issued.append((start, self.worker_until))
        if len(issued) > 256:  # only the last second's jobs can still be running
            issued[:] = [(t, u) for t, u in issued if u > now - 1.0]
        self.background_s += cost
        if waited and getattr(self.allocator, "deferring", False):
            # an admission the engine puts off until its lease is mapped: nobody waits now;
            # the allocator admits it at the first boundary at or after this
            self.allocator.ready_at = max(  # type: ignore[attr-defined]
                self.allocator.ready_at, end)  # type: ignore[attr-defined]
        elif waited:
            wait = max(0.0, end - now)
            self.waited_s += wait
            if wait > 0:  # which call a decode step waited for (range strategies say)
                doing = getattr(self.allocator, "doing", None)
                if doing == "admit":
                    self.allocator.stalled_admits += 1  # type: ignore[attr-defined]
                elif doing == "grow":
                    self.allocator.stalled_grows += 1  # type: ignore[attr-defined]

    def _pass_time(self, now_s: float) -> None:
        """Tell the sim the host time that passed since it was last told (its next call of
        each kind pays the cold premium's share of it): the serving time times the scale."""
        if self.pause is not None and now_s > self._paused_to:
            self.pause((now_s - self._paused_to) * self.pause_scale)
            self._paused_to = now_s

    def update(self, allocated: list[int], freed: list[int], high_water: int, step: int,
               now_s: float) -> float:
        self._pass_time(now_s)
        if freed:
            self._elastic_pages(freed, -1)
        if allocated:
            self._elastic_pages(allocated, 1)
        self.strategy.now_s = now_s
        self.strategy.update(allocated, freed, high_water)
        self.used_pages += len(allocated) - len(freed)
        stall, self.waited_s = self.waited_s, 0.0
        if isinstance(self.allocator, LeaseAllocator):  # its steps' spins on leases
            stall += self.allocator.take_wait()
        if len(self.trace.events) != self.seen:
            before = self.calls
            stall += self.account()
            self.decode_calls += self.calls - before
        self.driver_s += stall
        if self.prices is not None:  # the same calls at each quantile: their stalls
            us, seen = self.prices.us, self._q_seen
            for i, tally in enumerate(self.q_stalls):
                d = (us[i] - seen[i]) * 1e-6
                seen[i] = us[i]
                if d > 0.0:
                    self.q_driver[i] += d
                    tally.append(d)
        if (self.used_pages + 1) * self.page_bytes > self.backed:  # checked at every boundary
            self.used_over_backed += 1
        if self.touch and allocated:
            self._touch(allocated)
        return stall

    def _touch(self, pages: Sequence[int]) -> None:
        # Write one token slot of each new page in the first and last buffer: an unbacked
        # page faults here (an illegal address on CUDA), not silently later.
        ps = self.owner.page_size
        for i in (0, len(self.owner.descs) - 1):
            t = self.owner.tensors[i]
            rows, tpr = t.shape[0], self.owner.descs[i].tokens_per_row
            for p in pages:
                row = p * ps // tpr
                if row < rows:
                    t[row].fill_(1)

    def sample(self, t_s: float, step: int, used_pages: int, high_water: int, running: int,
               waiting: int, *, keep: bool = False) -> None:
        """Record the state now: into the running means and peaks always, into the
        timeline when its stride says (or ``keep``: the run's last sample)."""
        used = (used_pages + 1) * self.page_bytes  # slot 0's page is used by capture
        now = (used, self.backed, self.pool_held, self.elastic)
        if self._first_t is None:
            self._first_t = t_s
        else:  # the previous sample held until now (the means are time-weighted)
            dt = max(0.0, t_s - self._last_t)
            sums, last = self._sums, self._last
            for i in range(4):
                sums[i] += last[i] * dt
        self._last_t, self._last = t_s, now
        peaks = self.peaks
        for i in range(4):
            if now[i] > peaks[i]:
                peaks[i] = now[i]
        self._skipped += 1
        if self._skipped < self._stride and not keep:
            return
        self._skipped = 0
        c = self.cols
        for col, v in zip(c, (t_s, step, used, high_water, self.backed, self.pool_held,
                              self.elastic, self.handles, self.calls, self.driver_s,
                              running, waiting, self.kv_bandwidth_factor), strict=True):
            col.append(v)
        if len(c[0]) >= TIMELINE_CAP:  # every other one goes; one in twice as many is kept
            for i, col in enumerate(c):
                c[i] = col[::2]
            self._stride *= 2

    def time_means(self, end: float) -> tuple[float, float, float, float]:
        """Time-weighted means of used, backed, pool-held and elastic bytes from the first
        sample to ``end``, each sample holding until the next (the last until ``end``)."""
        if self._first_t is None:
            return (0.0, 0.0, 0.0, 0.0)
        span = end - self._first_t
        dt = max(0.0, end - self._last_t)
        totals = [s + v * dt for s, v in zip(self._sums, self._last, strict=True)]
        if span > 0:
            return (totals[0] / span, totals[1] / span, totals[2] / span, totals[3] / span)
        return (float(self._last[0]), float(self._last[1]), float(self._last[2]),
                float(self._last[3]))

    def timeline(self) -> Timeline:
        c = self.cols
        ints = [tuple(int(x) for x in col) for col in c]
        return Timeline(t_s=tuple(c[0]), step=ints[1], used_bytes=ints[2],
                        high_water_pages=ints[3], backed_bytes=ints[4], pool_held_bytes=ints[5],
                        elastic_bytes=ints[6], handles=ints[7], driver_calls=ints[8],
                        driver_s=tuple(c[9]), running=ints[10], waiting=ints[11],
                        bandwidth_factor=tuple(c[12]), kept_every=self._stride)


#: bandwidth factors cached per mapping mix before the cache starts over (mixes recur; a
#: week's range strategy could otherwise meet ever more of them)
_FACTORS_KEPT = 1 << 16

#: ``progress(done, total)``: how far a long run has got, in the units it names.
Progress = Callable[[float, float], None]
#: boundaries served between two progress reports (a report costs far more than one)
_REPORT_EVERY = 2048


def _run_reporting(serving: ServingModel, wl: Requests, hooks: _Hooks,
                   report: Callable[[float], None] | None, span: float) -> ServingStats:
    """``serving.run(wl, hooks)``, telling ``report`` the serving time reached now and then
    (at most ``span``), and ``span`` at the end."""
    if report is None:
        return serving.run(wl, hooks)
    steps = serving.steps(wl, hooks)
    n = 0
    while True:
        try:
            now = next(steps)
        except StopIteration as done:
            report(span)
            stats: ServingStats = done.value
            return stats
        n += 1
        if n == _REPORT_EVERY:
            n = 0
            report(min(now, span))


def tqdm_progress(desc: str, *, unit: str = "s") -> tuple[Any, Progress]:
    """A progress bar (``tqdm.auto``: a widget in a notebook, text on stderr elsewhere) and
    the :data:`Progress` callback that moves it, in whole units of what it counts::

        bar, report = tqdm_progress("replay")
        try:
            run_workload(wl, progress=report)
        finally:
            bar.close()

    Args:
        desc: the bar's label.
        unit: what ``done`` and ``total`` count (serving seconds by default).
    Returns:
        ``(bar, report)``: the tqdm bar (close it when done) and the callback.
    """
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    bar = tqdm(total=0, desc=desc, unit=unit, leave=False, dynamic_ncols=True)

    def report(done: float, total: float) -> None:
        if round(total) != bar.total:
            bar.total = round(total)
        step = min(round(done), bar.total) - bar.n
        if step > 0:
            bar.update(step)  # tqdm redraws at most every mininterval

    return bar, report


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Every option of :func:`run_workload` but the workload and the strategies, checked at
    construction; ``run_workload(wl, tp=4)`` builds one from its keywords."""

    model: str = "llama-3.1-70b"  #: the model (a shipped key)
    gpu: str = "h200"  #: the GPU profile: the sim's, the planner's, the step model's
    tp: int = 8  #: tensor-parallel size (the run serves one rank: the ranks are alike)
    dtype: str = "bfloat16"  #: the KV dtype
    #: ``"sim"`` (with ``gpu``'s profile), ``"host"``, ``"cuda"``, or a zero-argument factory
    driver: str | Callable[[], Driver] = "sim"
    config: ServingConfig = field(default_factory=ServingConfig)  #: engine knobs (None: default)
    step_model: StepTimeModel | None = None  #: None: :meth:`StepTimeModel.for_model`
    #: the KV pool's tokens on one rank, >= 2 pages, rounded down to whole pages (None: what
    #: the planner fits on ``gpu``)
    pool_tokens: int | None = None
    sample_s: float = 1.0  #: simulated seconds between timeline samples (> 0: ServingModel's)
    record: bool = False  #: keep each run's trace (and the arena's final snapshot) for replay
    #: write a token slot of every page handed out (first and last buffer) where the VA
    #: reaches memory (host, CUDA), so an unbacked page faults at once
    touch: bool = False
    #: host seconds between driver calls per serving second, told to a driver whose calls go
    #: cold only when told (the sim's :meth:`~kvvmm.driver.sim.SimDriver.pause`): ``1.0`` for
    #: an engine serving in real time, a replay's wall over serving time to predict that
    #: replay on a real driver; None: as warm as back to back (docs/FIDELITY.md)
    pause_scale: float | None = None
    #: ``progress(done, total)`` while the strategies run, in serving seconds (``total``: the
    #: strategies times the workload's span); :func:`tqdm_progress` makes one
    progress: Progress | None = None
    #: on the sim (``driver="sim"``), price every call at the band's quantiles too
    #: (:class:`~kvvmm.workload.bands.QuantilePrices`): each result's ``band_times``, so
    #: :func:`~kvvmm.workload.bands.workload_bands` serves only the strategies with a
    #: backing thread again
    band_prices: bool = False

    def __post_init__(self) -> None:
        if self.config is None:  # what run_workload(config=None) has always meant
            object.__setattr__(self, "config", ServingConfig())
        int_arg("tp", self.tp, lo=1, unit="tensor-parallel ranks")
        if self.pool_tokens is not None:
            _pool_tokens(self.pool_tokens, self.config.page_size)
        bool_arg("record", self.record)
        bool_arg("touch", self.touch)
        bool_arg("band_prices", self.band_prices)
        if self.pause_scale is not None:
            number_arg("pause_scale", self.pause_scale, lo=0.0,
                       limit="a finite number >= 0 or None")

    @classmethod
    def build(cls, base: RunOptions | None = None, **changes: Any) -> RunOptions:
        """``base`` (None: the defaults) with ``changes``; ArgumentError for an unknown name."""
        names = [f.name for f in fields(cls)]
        for k in changes:
            if k not in names:
                raise ArgumentError("option", k, f"one of {names}")
        return cls(**changes) if base is None else replace(base, **changes)


@runtime_checkable
class _ColdCalls(Protocol):
    """A driver whose calls go cold over host time only when told it passed (the sim)."""

    def pause(self, seconds: float) -> None: ...


def _pool_tokens(tokens: object, page_size: int) -> int:
    return int_arg("pool_tokens", tokens, lo=2 * page_size,
                   limit=f"an int >= 2 pages ({2 * page_size} tokens)")


@dataclass(frozen=True, slots=True)
class _Shared:
    """What every strategy's run of one comparison shares."""

    options: RunOptions
    setup: RunSetup
    profile: DeviceProfile
    descs: Callable[[str], list[KvBufferDesc]]  #: the pool's buffers in a layout
    span: float  #: serving seconds a strategy's progress counts up to: its last arrival's


def _shared(wl: Requests, o: RunOptions) -> _Shared:
    """The pool every owner is built over: its tokens (planned unless given, in whole pages),
    its buffers in each layout (built on first use), its page's bytes, the step model."""
    prof, ps = get_profile(o.gpu), o.config.page_size
    sm = o.step_model
    if sm is None:
        sm = StepTimeModel.for_model(o.model, prof.key, tp=o.tp, dtype=o.dtype)
    tokens = o.pool_tokens
    if tokens is None:
        tokens = _pool_tokens(plan(gpu=prof, model=o.model, dtype=o.dtype, page_size=ps,
                                   tp=o.tp).tokens, ps)
    tokens = tokens // ps * ps

    @functools.cache
    def descs(layout: str) -> list[KvBufferDesc]:
        return full_pool_descs(o.model, layout=layout, reserved_tokens=tokens, page_size=ps,
                               dtype=o.dtype, tp=o.tp)

    first = descs("token_major")
    setup = RunSetup(model=o.model, gpu=prof.key, tp=o.tp, dtype=o.dtype, page_size=ps,
                     pool_tokens=tokens, buffers=len(first),
                     page_bytes=sum(d.row_bytes * ps // d.tokens_per_row for d in first),
                     config=o.config, step_model=sm, workload=wl.source,
                     requests=-1 if wl.count is None else wl.count, pause_scale=o.pause_scale)
    span = max(wl.span_s, 1e-9)
    return _Shared(o, setup, prof, descs, span)


def run_workload(
    workload: Requests | Sequence[Request],
    strategies: Sequence[str | Strategy | Callable[[], Strategy]] = ("static", "prefix"),
    *,
    options: RunOptions | None = None,
    **changes: Any,
) -> WorkloadComparison:
    """Serve ``workload`` once per strategy, each on a fresh driver and owner.

    Args:
        workload: the requests (a :class:`~kvvmm.workload.requests.Workload`, a
            :class:`~kvvmm.workload.requests.RequestStream` read once per strategy, or a
            sequence in arrival order).
        strategies: names (:data:`~kvvmm.workload.strategies.STRATEGIES`), strategy objects
            (each used once) or zero-argument factories.
        options: the model, GPU, driver, engine knobs and the rest (default
            :class:`RunOptions`'s defaults).
        changes: :class:`RunOptions` fields by name (``model=..., tp=4``), over ``options``;
            each field's comment there says what it means.
    Returns:
        A :class:`WorkloadComparison`.
    Raises:
        ArgumentError: a bad argument (an unknown option, strategy, model, gpu, a pool of
            < 2 pages).
        DriverError: a driver call failed (out of memory, say).
    """
    wl = as_requests(workload)
    o = RunOptions.build(options, **changes)
    shared = _shared(wl, o)
    results = []
    for i, spec in enumerate(strategies):
        report = None if o.progress is None else functools.partial(
            _report, o.progress, i * shared.span, shared.span * len(strategies))
        results.append(_run_one(spec, wl, shared, report))
    setup = shared.setup
    if setup.requests < 0 and results:  # a stream counts its requests as it is read
        setup = replace(setup, requests=results[0].serving.requests)
    return WorkloadComparison(setup=setup, results=tuple(results))


def _report(progress: Progress, base: float, total: float, now: float) -> None:
    progress(base + now, total)  # a strategy's serving time, after the strategies before it


def _run_one(spec: str | Strategy | Callable[[], Strategy], wl: Requests, shared: _Shared,
             report: Callable[[float], None] | None) -> StrategyResult:
    """One strategy's run on its own driver, owner and (if it has one) handle pool; all
    three closed whatever happens."""
    o = shared.options
    strat = (make_strategy(spec) if isinstance(spec, str)
             else spec if isinstance(spec, Strategy) else spec())
    inner = o.driver() if callable(o.driver) else driver_for(o.driver, profile=shared.profile)
    # A range strategy's band is served again (its waits are not sums of calls): pricing its
    # calls here would be thrown away.
    if o.band_prices and o.driver == "sim" and not isinstance(strat, RequestRanges):
        inner = QuantilePrices(inner)
    tracer = TracingDriver(inner, Trace())
    # On the tracer, so the pool's creates and releases are in the trace (and replay).
    hpool = strat.make_pool(tracer)
    try:
        owner = KvBufferOwner(driver=tracer, dtype=o.dtype, page_size=o.config.page_size,
                              reserved_tokens=shared.setup.pool_tokens,
                              descs=shared.descs(strat.layout), policy=strat.policy,
                              name=f"kv-{strat.name}", trace=tracer.trace, pool=hpool)
    except BaseException:
        if hpool is not None:
            hpool.close()
        raise
    try:
        served = _serve(strat, owner, tracer, inner, wl, shared, report)
    finally:
        try:
            strat.close()
            owner.close()
        finally:
            if hpool is not None:  # after the owner: its close gives handles back to it
                hpool.close()
    return _result(strat, inner.kind, served, interleaved=len(owner.descs) > 1)


@dataclass(frozen=True, slots=True)
class _Served:
    """What one strategy's serving left, read before its owner closed (times in seconds)."""

    hooks: _Hooks
    allocator: object
    stats: ServingStats
    startup_s: float
    wall_s: float
    snapshot: ArenaSnapshot
    trace: Trace | None
    q_startup_s: list[float]  #: the startup's driver time at each band quantile (priced)


def _serve(strat: Strategy, owner: KvBufferOwner, tracer: TracingDriver, inner: Driver,
           wl: Requests, shared: _Shared, report: Callable[[float], None] | None) -> _Served:
    """Bind the strategy to the owner, start it, and serve the workload through its hooks."""
    o, setup = shared.options, shared.setup
    pool_pages = setup.pool_tokens // setup.page_size
    strat.bind(owner, pool_pages=pool_pages)
    sim = inner.kind == "sim"  # which clock prices a call: the sim's, or the wall's
    hooks = _Hooks(strat, owner, tracer, setup.page_bytes, inner.granularity(), sim,
                   o.touch and inner.memory is not MemoryKind.NONE)
    if o.pause_scale is not None and isinstance(inner, _ColdCalls):
        hooks.pause, hooks.pause_scale = inner.pause, o.pause_scale
    allocator = strat.make_allocator(hooks.executor)
    hooks.allocator = allocator
    strat.prepare()
    strat.start()
    hooks.account()
    hooks.waited_s = hooks.background_s = hooks.worker_until = 0.0
    hooks._issued.clear()
    hooks.threaded = False
    if isinstance(inner, QuantilePrices):
        hooks.prices = inner
        hooks._q_seen = list(inner.us)
    # the constructor's slot-0 calls and prepare/start: everything before serving
    startup_s = sum((e.sim_us if sim else e.wall_us) for e in tracer.trace.events) * 1e-6
    q_startup = list(hooks.prices.us) if hooks.prices is not None else []
    hooks.prune = not o.record  # from here on, calls are counted and dropped
    serving = ServingModel(o.config, setup.step_model, pool_pages=pool_pages,
                           sample_s=o.sample_s, allocator=allocator)
    t0 = time.perf_counter()
    with fewer_collections():  # the replay's records all live to its end: fewer GC passes
        stats = _run_reporting(serving, wl, hooks, report, shared.span)
    wall = time.perf_counter() - t0
    hooks.sample(stats.end_s, stats.steps, 0, 1, 0, 0, keep=True)
    trace = None
    if o.record:
        tr = tracer.trace
        trace = Trace(meta=dict(tr.meta), events=list(tr.events), ops=list(tr.ops),
                      arenas=tr.arenas)
    return _Served(hooks, allocator, stats, startup_s, wall, owner.arena.snapshot(), trace,
                   [us * 1e-6 for us in q_startup])


def _result(strat: Strategy, driver: str, s: _Served, *, interleaved: bool) -> StrategyResult:
    """The strategy's result: its timeline, the means over time, the stalls, the bandwidth."""
    hooks, stats, snap = s.hooks, s.stats, s.snapshot
    tl = hooks.timeline()
    stalls = stats.stalls
    sizes = [m.size_bytes for m in snap.mappings]
    used, backed, pool, elastic = hooks.time_means(stats.end_s)
    return StrategyResult(
        strategy=strat.name, driver=driver, serving=stats, timeline=tl,
        reserved_bytes=snap.reserved_bytes, startup_driver_s=s.startup_s,
        decode_driver_s=hooks.driver_s, driver_calls=hooks.calls,
        decode_driver_calls=hooks.decode_calls,
        peak_backed_bytes=hooks.peaks[1], mean_backed_bytes=backed, mean_used_bytes=used,
        peak_elastic_bytes=hooks.peaks[3], mean_elastic_bytes=elastic,
        peak_pool_bytes=hooks.peaks[2], mean_pool_bytes=pool,
        elastic_maps=hooks.elastic_maps, elastic_unmaps=hooks.elastic_unmaps,
        p50_stall_s=_tally_with_zeros(stalls, stats.steps, 50),
        p99_stall_s=_tally_with_zeros(stalls, stats.steps, 99),
        max_stall_s=stalls.max if stalls.count else 0.0, stalled_steps=stalls.count,
        used_over_backed=hooks.used_over_backed,
        conservation_errors=hooks.conservation_errors, final_handles=hooks.handles,
        predicted_tb_s=predicted_bandwidth_tb_s(sizes, interleaved=interleaved)
        if sizes else 0.0,
        wall_s=s.wall_s, final_snapshot=snap, trace=s.trace,
        background_driver_s=hooks.background_s, layout=strat.layout,
        ranges=s.allocator.range_stats() if isinstance(s.allocator, LeaseAllocator) else {},
        band_times=_band_times(s))


def _band_times(s: _Served) -> dict[float, dict[str, float]]:
    """The band's timed figures at each quantile, from the run's own priced calls (rounded
    as :meth:`StrategyResult.summary` rounds them); empty where the run was not priced (a
    range strategy never is: :func:`_run_one`) or a backing thread ran (a wait for what a
    commit had left, an admission put off by when it ended: not the sum of a boundary's
    calls)."""
    hooks, steps = s.hooks, s.stats.steps
    if hooks.prices is None or hooks.threaded:
        return {}
    return {q: {"startup_driver_ms": round(start * 1e3, 3),
                "decode_driver_ms": round(decode * 1e3, 3),
                "background_driver_ms": 0.0,
                "p99_stall_us": round(_tally_with_zeros(t, steps, 99) * 1e6, 3),
                "stalled_p99_us": round(t.quantile(99) * 1e6, 3),
                "max_stall_us": round(t.max * 1e6, 3) if t.count else 0.0}
            for q, start, decode, t in zip(BAND_QUANTILES, s.q_startup_s, hooks.q_driver,
                                           hooks.q_stalls, strict=True)}

"""A serving model: continuous batching over a paged KV pool, event-driven.

What it models, and what it leaves out (each an argument where it matters):

- **Continuous batching** (vLLM/SGLang style): at each step boundary, waiting requests are
  admitted in arrival order while the batch has fewer than ``max_running`` requests, the
  step's tokens (one per decoding request plus the admitted prompts) stay within
  ``max_batched_tokens``, and the pool has the pages for the prompt and the first output
  token. A prompt longer than ``max_batched_tokens`` is prefilled whole in a step of its own
  (no chunked prefill). Admission is first come, first served: a head that does not fit
  blocks the queue.
- **Preemption** (vLLM's recompute mode): a request that needs a page when none is free
  preempts the most recently admitted running request (itself, if it is that one); the
  victim's pages are freed and it goes back to the head of the queue with its generated
  tokens folded into its prompt. A request that could never fit (prompt + output beyond the
  pool) is rejected when it arrives.
- **Slots**: a request holds ``ceil(tokens / page_size)`` pages and gets one more each time it
  crosses a page boundary. Page 0 is never handed out: CUDA-graph capture writes its dummy
  KV there (the owner's slot 0). The allocator's order decides how compact used pages are:
  ``"lowest"`` hands out the lowest free page (used pages stay packed at the bottom, so a
  prefix-backed pool can give its tail back), ``"lifo"`` the most recently freed one (a
  free list: used pages scatter over everything ever used).
- **Step time** (:class:`StepTimeModel`): a decode step is memory-bound: the rank's weights
  and the batch's KV are read once, at HBM bandwidth, plus a fixed overhead; prefill tokens
  add compute time. Driver time a memory strategy spends at a step boundary is added to the
  step that follows: it stalls the decode path.

The loop is event-driven: between events (a request finishing, one crossing a page
boundary, an arrival that could be admitted) every step has the same batch, so the steps
are advanced together in closed form. One hour of Azure's conversation trace (about 700,000
decode steps) runs in a few seconds.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import math
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvvmm.checks import int_arg, number_arg
from kvvmm.errors import ArgumentError
from kvvmm.hardware import get_profile
from kvvmm.layout import kv_bytes_per_token, weights_bytes_per_rank
from kvvmm.workload.requests import Request, Requests
from kvvmm.workload.tally import Tally

__all__ = ["SLOT_ORDERS", "ServingConfig", "ServingHooks", "ServingModel", "ServingStats",
           "SlotAllocator", "StepTimeModel", "fewer_collections"]

SLOT_ORDERS = ("lowest", "lifo")

#: HBM bandwidth a decode step reads at, bytes/s. The H200's is its measured copy bandwidth
#: into cudaMalloc memory (``plain`` in the shipped bandwidth table: 4.19 TB/s, 87 % of the
#: 4.8 TB/s spec); the others are their spec sheets' figures at the same 87 %.
HBM_BYTES_PER_S = {"h100": 3.35e12 * 0.873, "h200": 4.187e12, "b200": 8.0e12 * 0.873,
                   "gb300": 8.0e12 * 0.873}
#: Dense bf16 tensor throughput, FLOP/s (spec sheets: H100/H200 989 T, B200 2.25 P,
#: GB300 2.5 P), for prefill time.
DENSE_FLOPS = {"h100": 989e12, "h200": 989e12, "b200": 2.25e15, "gb300": 2.5e15}


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Seconds a step takes: ``overhead_s + (weights + KV read) / hbm + prefill tokens * p``.

    ``kv_bytes / (hbm_bytes_per_s * f)``: ``f`` is the KV tensors' bandwidth factor (their
    predicted copy bandwidth relative to cudaMalloc memory, from the handle sizes a strategy
    backs them with); the weights are read at full speed.
    """

    weights_bytes: int  #: weights on one rank, read once per step
    kv_bytes_per_token: int  #: KV bytes per token on one rank
    hbm_bytes_per_s: float  #: HBM bandwidth
    overhead_s: float = 1.5e-3  #: scheduler, launch and TP all-reduce per step (a guess)
    prefill_s_per_token: float = 0.0  #: compute time per prompt token

    @classmethod
    def for_model(cls, model: str, gpu: str = "h200", *, tp: int = 1, dtype: str = "bfloat16",
                  overhead_s: float = 1.5e-3, mfu: float = 0.5) -> StepTimeModel:
        """The model for ``model`` on ``gpu`` at tensor-parallel ``tp``.

        Prefill costs ``2 * parameters / tp`` FLOP per token at ``mfu`` of the GPU's dense
        bf16 throughput (:data:`DENSE_FLOPS`); HBM from :data:`HBM_BYTES_PER_S`.
        """
        key = get_profile(gpu).key
        weights = weights_bytes_per_rank(model, "bfloat16", tp)
        if weights is None:
            raise ArgumentError("model", model, "a model whose config gives its parameter count")
        if not 0 < mfu <= 1:
            raise ArgumentError("mfu", mfu, "in (0, 1]")
        params = weights / 2  # bf16 weights
        return cls(weights_bytes=weights, kv_bytes_per_token=kv_bytes_per_token(model, dtype, tp),
                   hbm_bytes_per_s=HBM_BYTES_PER_S.get(key, HBM_BYTES_PER_S["h200"]),
                   overhead_s=overhead_s,
                   prefill_s_per_token=2 * params / (DENSE_FLOPS.get(key, 989e12) * mfu))


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """The engine's knobs."""

    max_running: int = 256  #: requests in the batch at most
    max_batched_tokens: int = 8192  #: tokens per step at most (decode + prefill)
    page_size: int = 16  #: tokens per KV page
    slot_order: str = "lowest"  #: ``"lowest"`` or ``"lifo"`` (see the module docstring)
    #: a request that has waited in the queue longer than this (seconds since it last joined
    #: it) is dropped when it reaches the queue's head (counted ``timed_out``); None: never.
    #: With a budget shared by several engines (:mod:`kvvmm.workload.tenants`) a queue can
    #: wait on memory another engine holds, so served requests are counted against this.
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_running", "max_batched_tokens", "page_size"):
            v = getattr(self, name)
            int_arg(name, v, lo=1, limit="an int >= 1")
        w = self.max_wait_s
        if w is not None:
            number_arg("max_wait_s", w, lo=0, lo_open=True, limit="None or a number of seconds > 0")
        if self.slot_order not in SLOT_ORDERS:
            raise ArgumentError("slot_order", self.slot_order, f"one of {SLOT_ORDERS}")


class SlotAllocator:
    """The engine's KV page allocator over pages ``[1, pages)`` (page 0 is slot 0's).

    Args:
        pages: pages in the pool, page 0 included (>= 2).
        order: ``"lowest"`` (lowest free page first) or ``"lifo"`` (most recently freed first).
    """

    def __init__(self, pages: int, order: str = "lowest") -> None:
        int_arg("pages", pages, lo=2, limit="an int >= 2 (page 0 and one to serve)")
        if order not in SLOT_ORDERS:
            raise ArgumentError("order", order, f"one of {SLOT_ORDERS}")
        self.pages = pages
        self.order = order
        self._fresh = 1  # pages >= this have never been handed out
        self._freed: list[int] = []  # a min-heap ("lowest") or a stack ("lifo")
        self._used = bytearray(pages)
        self.used = 0  #: pages handed out now
        self.high_water = 1  #: one past the highest page in use (1: only page 0)

    #: serving time of the boundary being served (the serving loop sets it; a request-aware
    #: allocator that does driver work uses it to place that work in time)
    now_s: float = 0.0
    #: during an admission, when that request joined the queue (its prompt, and so the pages
    #: it needs, known from then: an engine can start mapping them at that time); else None
    queued_s: float | None = None

    @property
    def free(self) -> int:
        """Pages that can still be handed out."""
        return self.pages - 1 - self.used

    @property
    def capacity(self) -> int:
        """The most pages one request can ever hold."""
        return self.pages - 1

    def can_alloc(self, rid: int, n: int) -> bool:
        """Whether request ``rid`` can be handed ``n`` more pages now."""
        return n <= self.pages - 1 - self.used

    def alloc_for(self, rid: int, n: int, out: list[int]) -> None:
        """:meth:`alloc` for request ``rid`` (this allocator does not tell requests apart)."""
        self.alloc(n, out)

    def prepare(self, rid: int, n: int) -> bool:
        """Before admitting request ``rid`` with ``n`` pages: start whatever its memory needs
        and say whether it is ready now. False: the engine admits it at a later boundary (it
        stays at the head of the queue, its memory on the way) instead of making this
        step wait. Default: nothing to prepare, always ready."""
        return True

    def unprepare(self, rid: int) -> None:
        """Request ``rid`` leaves the queue without being admitted (it timed out): give back
        what :meth:`prepare` took. Default: nothing."""

    def ready_s(self, rid: int) -> float:
        """When request ``rid``'s memory, which :meth:`prepare` found not ready, will be
        (serving seconds): the serving loop's next boundary is then no later. Default: now."""
        return self.now_s

    def release_for(self, rid: int, pages: Sequence[int]) -> None:
        """:meth:`release` of request ``rid``'s pages (all it holds)."""
        self.release(pages)

    def alloc(self, n: int, out: list[int]) -> None:
        """Hand out ``n`` pages (the caller checked :attr:`free`), appending them to ``out``."""
        freed, used = self._freed, self._used
        lowest = self.order == "lowest"
        hw = self.high_water
        for _ in range(n):
            if freed:
                p = heapq.heappop(freed) if lowest else freed.pop()
            else:
                p = self._fresh
                self._fresh += 1
            used[p] = 1
            out.append(p)
            if p >= hw:
                hw = p + 1
        self.high_water = hw
        self.used += n

    def release(self, pages: Sequence[int]) -> None:
        """Take pages back."""
        freed, used = self._freed, self._used
        lowest = self.order == "lowest"
        for p in pages:
            used[p] = 0
            if lowest:
                heapq.heappush(freed, p)
            else:
                freed.append(p)
        self.used -= len(pages)
        hw = self.high_water
        while hw > 1 and not used[hw - 1]:
            hw -= 1
        self.high_water = hw


class ServingHooks(Protocol):
    """What the serving loop calls: the memory strategy's side (see :mod:`kvvmm.workload.run`)."""

    kv_bandwidth_factor: float  #: the KV tensors' bandwidth factor now (1.0: cudaMalloc's)

    def update(self, allocated: list[int], freed: list[int], high_water: int, step: int,
               now_s: float) -> float:
        """Pages just handed out (must be backed before the next step) and given back, at
        serving time ``now_s``.

        Returns the driver time this cost on the decode path, seconds.
        """
        ...

    def sample(self, t_s: float, step: int, used_pages: int, high_water: int, running: int,
               waiting: int) -> None:
        """Record the state now (called every ``sample_s`` and after each backing change)."""
        ...


@dataclass(frozen=True, slots=True)
class ServingStats:
    """What the engine did with a workload."""

    requests: int  #: requests in the workload
    completed: int  #: requests that finished
    rejected: int  #: requests refused on arrival (they could never fit the pool)
    preemptions: int  #: preemptions (a request may be preempted more than once)
    steps: int  #: engine steps
    end_s: float  #: simulated time when the last request finished
    busy_s: float  #: time spent in steps (the rest the engine idled)
    peak_running: int  #: most requests in one batch
    peak_used_pages: int  #: most pages in use at once
    #: driver stall of each step that had one, seconds (exact up to a million steps, then
    #: a summary: :class:`~kvvmm.workload.tally.Tally`)
    stalls: Tally = field(repr=False)
    mean_step_s: float = 0.0  #: mean step time, stalls included
    timed_out: int = 0  #: requests dropped after waiting ``max_wait_s`` (never finished)
    #: each served request's time to first token, seconds: from its arrival to the end of
    #: its prefill step (queueing, an admission put off while its memory maps, the step's
    #: driver stall and the prefill itself), in the order their prefills ran
    first_token: Tally = field(default_factory=Tally, repr=False)
    #: what memory added to each of those first tokens, seconds, in the same order: the
    #: time its admission was put off while its memory mapped (from the boundary it was
    #: first put off at to the one that admitted it) plus the driver stall of its prefill
    #: step (a bounded wait for its lease, another commit the step waited for, a prefix
    #: growth); 0 for a request admitted when it could be onto a step that did not stall
    first_token_added: Tally = field(default_factory=Tally, repr=False)
    #: each finished request's latency, seconds: from its arrival to its last token, in
    #: the order they finished
    latency: Tally = field(default_factory=Tally, repr=False)

    @property
    def stall_steps(self) -> tuple[float, ...]:
        """:attr:`stalls`' values, in step order (ArgumentError past its exact limit)."""
        return self.stalls.values()

    @property
    def first_token_s(self) -> tuple[float, ...]:
        """:attr:`first_token`'s values, in prefill order (ArgumentError past its limit)."""
        return self.first_token.values()

    @property
    def first_token_added_s(self) -> tuple[float, ...]:
        """:attr:`first_token_added`'s values, in prefill order (ArgumentError past its
        limit)."""
        return self.first_token_added.values()

    @property
    def latency_s(self) -> tuple[float, ...]:
        """:attr:`latency`'s values, in finishing order (ArgumentError past its limit)."""
        return self.latency.values()


class _Req:
    __slots__ = ("admit", "arrival_s", "done", "gen0", "npages", "out", "pages", "prompt",
                 "put_off_s", "queued_s", "rid", "ver")

    def __init__(self, rid: int, prompt: int, out: int, queued_s: float = 0.0) -> None:
        self.rid = rid
        self.arrival_s = queued_s  # when it arrived (its first token's and latency's start)
        self.queued_s = queued_s  # when it (last) joined the queue: its size is known from then
        self.prompt = prompt  # tokens to prefill (the original prompt + any recomputed output)
        self.out = out  # tokens still to generate
        self.admit = 0  # the step its prefill runs in
        self.done = 0  # the step its last token comes out of
        self.gen0 = 0  # tokens generated before a preemption (already folded into prompt)
        self.npages = 0
        self.pages: list[int] = []
        self.ver = 0  # bumped on preemption: heap entries of an older version are stale
        self.put_off_s: float | None = None  # the boundary its admission was first put off at


_DONE, _PAGE = 0, 1
#: how often an idle engine whose queue's head is refused memory asks again, seconds
_RETRY_S = 0.01


#: objects allocated between two collections of the youngest generation while a replay runs
#: (Python's default is 700)
_GEN0 = 100_000


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Run the block with the cyclic garbage collector's youngest generation collected every
    :data:`_GEN0` allocations instead of 700, the threshold restored after.

    A replay keeps what it allocates (trace events, timeline samples, the arena's records):
    at the default, each collection walks objects that all survive, a quarter of a page
    elastic replay's time. Nothing a replay computes depends on when garbage is collected.
    """
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], _GEN0), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


class ServingModel:
    """Continuous batching of one workload over a pool of ``pool_pages`` pages.

    Args:
        config: the engine's knobs.
        step_model: the step time model.
        pool_pages: pages in the pool, page 0 included (the owner's ``reserved_tokens``
            divided by ``page_size``).
        sample_s: simulated seconds between samples.
        allocator: the engine's page allocator (default: a :class:`SlotAllocator` in
            ``config.slot_order``); one that tells requests apart (``alloc_for(rid, ...)``)
            can hand each request a contiguous range (the workload lab's range strategies).
    """

    def __init__(self, config: ServingConfig, step_model: StepTimeModel, *, pool_pages: int,
                 sample_s: float = 1.0, allocator: SlotAllocator | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.step_model = step_model
        self.pool_pages = pool_pages
        if not sample_s > 0:
            raise ArgumentError("sample_s", sample_s, "> 0 (seconds)")
        self.sample_s = sample_s

    def run(self, workload: Requests | Sequence[Request], hooks: ServingHooks) -> ServingStats:
        """Serve every request; call ``hooks`` as pages come and go. Returns the stats."""
        steps = self.steps(workload, hooks)
        with fewer_collections():
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    stats: ServingStats = done.value
                    return stats

    def steps(self, workload: Requests | Sequence[Request], hooks: ServingHooks
              ) -> Generator[float, None, ServingStats]:
        """:meth:`run` one boundary at a time: yields the serving time of each boundary before
        serving it, returns the stats. Several engines on one simulated GPU
        (:mod:`kvvmm.workload.tenants`) advance the one whose next boundary comes first.

        The requests are read in order, one ahead of the clock (a stream of a week is never
        held); what is kept per request or per step is a :class:`Tally` (bounded)."""
        arrivals = iter(workload)
        coming = next(arrivals, None)  # the next request to arrive (None: no more)
        cfg, sm = self.config, self.step_model
        ps = cfg.page_size
        alloc = SlotAllocator(self.pool_pages, cfg.slot_order) if self.allocator is None \
            else self.allocator
        usable = alloc.capacity
        base_s = sm.overhead_s + sm.weights_bytes / sm.hbm_bytes_per_s
        kv_s = sm.kv_bytes_per_token / sm.hbm_bytes_per_s
        pre_s = sm.prefill_s_per_token
        max_run, max_tok = cfg.max_running, cfg.max_batched_tokens
        sample_s = self.sample_s

        heap: list[tuple[int, int, int, int, int]] = []  # (boundary, kind, seq, ver, rid)
        seq = 0
        running: dict[int, _Req] = {}
        waiting: deque[_Req] = deque()
        S = 0  # steps done
        now = 0.0
        K = 0  # sum over running of (prompt + 1 - admit): their KV tokens are K + B * S
        ai = 0  # requests read so far (the next one's id)
        completed = rejected = preemptions = 0
        busy = 0.0
        peak_run = peak_used = 0
        stalls = Tally()
        next_sample = 0.0
        sampled_at = -1.0  # when the last sample was taken
        allocated: list[int] = []
        freed: list[int] = []
        hp, hpop = heapq.heappush, heapq.heappop

        max_wait = cfg.max_wait_s
        timed_out = 0
        first_token = Tally()
        latency = Tally()
        firsts: list[float] = []  # arrivals of the requests whose prefill the next step runs
        first_added = Tally()
        put_offs: list[float] = []  # ... and how long each was put off (0: not at all)
        while True:
            yield now
            alloc.now_s = now
            # -- events at this boundary: finished requests, then pages for the next step --
            while heap and heap[0][0] <= S:
                _, kind, _, ver, rid = hpop(heap)
                r = running.get(rid)
                if r is None or r.ver != ver:
                    continue
                if kind == _DONE:
                    del running[rid]
                    K -= r.prompt + 1 - r.admit
                    freed.extend(r.pages)
                    alloc.release_for(rid, r.pages)
                    completed += 1
                    latency.append(now - r.arrival_s)  # its last token came out just now
                    continue
                while not alloc.can_alloc(rid, 1):  # preempt the most recently admitted one
                    victim = max(running.values(), key=lambda x: (x.admit, x.rid))
                    del running[victim.rid]
                    K -= victim.prompt + 1 - victim.admit
                    freed.extend(victim.pages)
                    alloc.release_for(victim.rid, victim.pages)
                    made = 1 + S - victim.admit  # tokens it generated since its prefill
                    victim.prompt += made
                    victim.out -= made
                    victim.gen0 += made
                    victim.ver += 1
                    victim.pages = []
                    victim.queued_s = now
                    waiting.appendleft(victim)
                    preemptions += 1
                    if victim is r:
                        break
                if running.get(rid) is not r:
                    continue
                alloc.alloc_for(rid, 1, allocated)
                r.pages.append(allocated[-1])
                r.npages += 1
                nxt = r.admit + r.npages * ps - r.prompt  # the step that needs the next page
                if nxt <= r.done:
                    hp(heap, (nxt - 1, _PAGE, seq, r.ver, rid))
                    seq += 1

            # -- arrivals, and admission --
            if max_wait is not None:
                while waiting and now - waiting[0].queued_s > max_wait:
                    alloc.unprepare(waiting.popleft().rid)
                    timed_out += 1
            while coming is not None and coming.arrival_s <= now:
                q = coming
                if -(-(q.prompt_tokens + q.output_tokens) // ps) > usable:
                    rejected += 1
                else:
                    waiting.append(_Req(ai, q.prompt_tokens, q.output_tokens, q.arrival_s))
                ai += 1
                coming = next(arrivals, None)
            B = len(running)
            budget = max_tok - B
            prefill = 0
            token_blocked = False
            head_ready: float | None = None  # the head's memory is on the way until then
            while waiting and max_run > B:
                w = waiting[0]
                need = -(-(w.prompt + 1) // ps)
                if not alloc.can_alloc(w.rid, need):
                    break
                if w.prompt > budget and prefill:  # a long prompt waits for a step of its own
                    token_blocked = True
                    break
                if w.prompt > budget and B:  # ... and one with room beside the decodes
                    token_blocked = True
                    break
                alloc.queued_s = w.queued_s
                if not alloc.prepare(w.rid, need):  # its memory is being mapped: admitted
                    alloc.queued_s = None  # at a later boundary, the step does not wait
                    head_ready = alloc.ready_s(w.rid)  # (first come, first served behind it)
                    if w.put_off_s is None:
                        w.put_off_s = now
                    break
                waiting.popleft()
                if not w.gen0:  # its first token comes out of this prefill (not a re-run)
                    firsts.append(w.arrival_s)
                    put_offs.append(0.0 if w.put_off_s is None else now - w.put_off_s)
                w.put_off_s = None
                w.admit = S + 1
                w.done = S + w.out  # its prefill step makes token 1
                w.npages = need
                w.pages = []
                alloc.alloc_for(w.rid, need, w.pages)
                alloc.queued_s = None
                allocated.extend(w.pages)
                running[w.rid] = w
                K += w.prompt + 1 - w.admit
                prefill += w.prompt
                budget -= w.prompt
                B += 1
                hp(heap, (w.done, _DONE, seq, w.ver, w.rid))
                seq += 1
                nxt = w.admit + need * ps - w.prompt
                if nxt <= w.done:
                    hp(heap, (nxt - 1, _PAGE, seq, w.ver, w.rid))
                    seq += 1

            stall = 0.0
            if allocated or freed:
                stall = hooks.update(allocated, freed, alloc.high_water, S, now)
                allocated = []
                freed = []
                if stall > 0.0:
                    stalls.append(stall)
                    hooks.sample(now, S, alloc.used, alloc.high_water, B, len(waiting))
                    sampled_at = now
            if alloc.used > peak_used:
                peak_used = alloc.used
            if peak_run < B:
                peak_run = B
            if now >= next_sample:
                hooks.sample(now, S, alloc.used, alloc.high_water, B, len(waiting))
                sampled_at = now
                next_sample = (math.floor(now / sample_s) + 1) * sample_s

            if not running:
                if head_ready is not None:
                    # Nothing runs and the head's memory is being mapped: the engine idles
                    # until it is (or the next arrival), a wait no decode step shares.
                    if sampled_at < now:
                        hooks.sample(now, S, alloc.used, alloc.high_water, B, len(waiting))
                        sampled_at = now
                    wake = head_ready if coming is None else min(head_ready, coming.arrival_s)
                    now = max(now + stall, wake)
                    continue
                if waiting and max_wait is not None:
                    # Only an allocator bound by memory outside the pool (a shared budget)
                    # refuses an empty pool's head: poll for it until it fits or times out.
                    if sampled_at < now:
                        hooks.sample(now, S, alloc.used, alloc.high_water, B, len(waiting))
                        sampled_at = now
                    now += stall + _RETRY_S
                    continue
                if coming is None:
                    break
                # Idle: record the state now (the batch just emptied), then jump to the next
                # arrival. Nothing changes in between, and a sample holds until the next one
                # (the means are time-weighted), so an idle gap of any length is one
                # iteration and one sample, not one per sample_s.
                if sampled_at < now:
                    hooks.sample(now, S, alloc.used, alloc.high_water, B, len(waiting))
                    sampled_at = now
                now = max(now + stall, coming.arrival_s)
                continue

            # -- steps until the next event, in closed form --
            k = heap[0][0] - S if heap else 1
            f = hooks.kv_bandwidth_factor
            first = base_s + kv_s / f * (K + B * S)
            if token_blocked:
                k = 1
            elif head_ready is not None:  # back at the first boundary the head can start
                k = max(1, min(k, math.ceil((head_ready - now) / first)))
            elif coming is not None and max_run > B and not waiting:
                ka = math.ceil((coming.arrival_s - now) / first)
                k = max(1, min(k, ka))
            if now + first * k > next_sample:  # stop at the next sample time
                k = max(1, min(k, math.ceil((next_sample - now) / first)))
            dt = k * base_s + kv_s / f * (k * K + B * (k * S + k * (k - 1) // 2)) \
                + prefill * pre_s + stall
            if firsts:  # the first of the k steps ends with their first tokens
                t1 = now + stall + first + prefill * pre_s
                first_token.extend(t1 - a for a in firsts)
                first_added.extend(p + stall for p in put_offs)
                firsts.clear()
                put_offs.clear()
            now += dt
            busy += dt
            S += k
        return ServingStats(
            requests=ai, completed=completed, rejected=rejected, preemptions=preemptions,
            steps=S, end_s=now, busy_s=busy, peak_running=peak_run, peak_used_pages=peak_used,
            stalls=stalls, mean_step_s=busy / S if S else 0.0, timed_out=timed_out,
            first_token=first_token, latency=latency, first_token_added=first_added)

"""Several engines (tenants) on one simulated GPU, sharing one KV budget, in simulated time.

Each tenant is a model serving its own workload through the lab's
:class:`~kvvmm.workload.serving.ServingModel`, on a real :class:`~kvvmm.owner.KvBufferOwner`
(the interleaved layout: one buffer of every layer, so a page range is one VA range) over one
shared :class:`~kvvmm.driver.sim.SimDriver` whose capacity is the budget: the driver itself
refuses any create past it, so an arbiter bug shows as an out-of-memory error, never as
memory counted twice. The engines advance together: the one whose next step boundary comes
first runs it (:meth:`ServingModel.steps`), so every decision sees every tenant's backing as it
is at that instant of simulated time.

**A tenant's backing** (its ``strategy``):

- ``"static"``: its whole limit backed before serving, never given back (a fixed share of the
  card: ``cudaMalloc`` of a pool).
- ``"elastic"``: granules are backed when a page handed out first touches them (at admission
  or when a request crosses a page boundary: the commit's driver time stalls the next step),
  and a granule no used page touches any more stays backed as *idle backing*, up to
  ``reserve_bytes`` (deferred reclamation: the next request reuses it for free); idle backing
  above that is given back at the step boundary.
- ``"request-ranges+deferred"``: a :class:`~kvvmm.owner.RangeBacking` (one lease of whole
  blocks per request, ``reserve_bytes`` mapped ahead, released blocks kept mapped up to twice
  that): its commits for a lease stall the next step, its refills and reclamations run off
  the decode path (the backing thread's work, timed on the sim's clock but charged to no
  step), and a refill maps only what the budget has free without anyone shedding.

**The arbiter's rules** (:class:`Rules`), applied whenever a tenant needs ``need`` more bytes
(the granules its next pages touch that are not backed yet):

1. *Budget*: the bytes backed by every tenant, plus what a pending demand holds, never exceed
   ``budget_bytes``, at any instant. Nothing is ever counted before it is free.
2. *Per-tenant limit*: a tenant never holds more than its ``limit_bytes`` (default: the budget;
   a static tenant's limit is its share). Past it the request is refused at once, nobody is
   asked to shed.
3. *Shed order*: when the budget lacks room, the shortfall is asked of the other tenants as
   the shipped ledger asks it (:func:`kvvmm.budget.rules.shed_plan`: the most backed first,
   ties by position, each for at most what it backs, until the shortfall is covered). Each
   answers as the shipped tenants do (:func:`kvvmm.budget.rules.shed_answer`): from idle
   backing first, up to what it was asked (whole granules; a range tenant's deferred cache
   and reserve, through ``RangeBacking.give_back`` within what is left of ``deadline_s`` of
   the sim's clock, its reserve then held for ``hold_s`` of serving time): memory no
   request uses, so no work is lost; nothing else is given at the ask. A ``"static"``
   tenant, or one whose ``answer`` is ``"reject"``, is asked like any other and gives
   nothing (it does not answer, as in the ledger).
4. *Deadline*: the asking stops once the sheds' driver time reaches ``deadline_s``; the
   requester waits for that time (it is added to its next step, as a stall). If the room is
   still not there, the request is refused: an admission waits in the queue (and is dropped
   after ``max_wait_s``, counted as rejected), a running request that needs a page preempts
   its own engine's most recently admitted request (the serving model's recompute
   preemption). Nothing else is ever taken from a tenant to make room for another.

**A scripted demand** (:class:`Demand`) is a second tenant that takes a step of
memory at time ``at_s`` (another engine starting, say) and holds it. Each serving tenant
answers it by its ``answer``: ``"reject"`` (nothing is given: the demand gets the free budget
or is refused at once), ``"shed"`` (idle backing at once, then every granule that empties as
requests finish, while the demand waits; the tenant admits nothing into memory the demand
holds), or ``"preempt"`` (idle backing at once, then the tenant's limit drops so that its next
page growth preempts its most recent requests until the demand fits). A demand that is not
whole within ``patience_s`` is refused and its held bytes go back.

What it leaves out: bandwidth (every tenant's KV reads at cudaMalloc speed), a handle pool,
sleep of a whole idle tenant (a sleeping tenant's backing is all idle backing here, and it
sheds as such), and the cross-process ledger itself (:mod:`kvvmm.budget.ledger`; what fits
and who is asked are the same functions, :mod:`kvvmm.budget.rules`). Everything is a pure
function of its inputs: the same arguments give the same result.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, replace

from kvvmm.budget.rules import Ask, TenantState, refusal, shed_answer, shed_plan
from kvvmm.checks import int_arg, seconds_arg
from kvvmm.driver import open_driver
from kvvmm.driver.base import Driver
from kvvmm.driver.wrapper import DriverWrapper
from kvvmm.errors import ArgumentError, DriverOutOfMemoryError
from kvvmm.hardware import get_profile
from kvvmm.layout import full_pool_descs
from kvvmm.owner import KvBufferOwner, RangeBacking
from kvvmm.record import Trace, TracingDriver
from kvvmm.workload.requests import Request, Workload, as_workload
from kvvmm.workload.run import _tally_with_zeros
from kvvmm.workload.serving import (
    ServingConfig,
    ServingModel,
    ServingStats,
    SlotAllocator,
    StepTimeModel,
)
from kvvmm.workload.strategies import LeaseAllocator

__all__ = ["ANSWERS", "TENANT_STRATEGIES", "Demand", "DemandResult", "Rules",
           "Tenant", "TenantResult", "TenantsRun", "compare_tenants", "run_tenants", "shifted"]

#: how a tenant backs its pages (see the module docstring)
TENANT_STRATEGIES = ("static", "elastic", "request-ranges+deferred")
#: what a tenant does when another needs memory
ANSWERS = ("reject", "shed", "preempt")

_MiB = 1 << 20


def shifted(workload: Workload | Sequence[Request], offset_s: float) -> Workload:
    """``workload`` with every arrival ``offset_s`` seconds later (>= 0)."""
    off = seconds_arg("offset_s", offset_s)
    wl = as_workload(workload)
    if not off:
        return wl
    return Workload(requests=tuple(Request(r.arrival_s + off, r.prompt_tokens, r.output_tokens,
                                           r.prefix_id) for r in wl.requests),
                    source=f"{wl.source}@{off:g}s")


@dataclass(frozen=True, slots=True)
class Tenant:
    """One engine on the shared GPU: a model, its workload, how it backs and sheds."""

    name: str
    model: str  #: a shipped model key (``kvvmm.layout`` model configs)
    workload: Workload  #: its requests, already at their times (:func:`shifted`)
    strategy: str = "elastic"  #: one of :data:`TENANT_STRATEGIES`
    limit_bytes: int | None = None  #: the most it may hold (None: the whole budget)
    #: elastic: idle backing kept for reuse (given back once it passes twice this, down to it)
    reserve_bytes: int = 64 * _MiB
    #: elastic: backing grows in aligned chunks of this many bytes (one handle each) when
    #: the budget has room for them without anyone shedding (else a page's granules)
    chunk_bytes: int = 16 * _MiB
    answer: str = "shed"  #: one of :data:`ANSWERS`

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ArgumentError("name", self.name, "a non-empty tenant name")
        if self.strategy not in TENANT_STRATEGIES:
            raise ArgumentError("strategy", self.strategy, f"one of {TENANT_STRATEGIES}")
        if self.answer not in ANSWERS:
            raise ArgumentError("answer", self.answer, f"one of {ANSWERS}")
        if self.limit_bytes is not None:
            int_arg("limit_bytes", self.limit_bytes, lo=1, unit="bytes")
        int_arg("reserve_bytes", self.reserve_bytes, lo=0, unit="bytes")
        int_arg("chunk_bytes", self.chunk_bytes, lo=1, unit="bytes")
        if not isinstance(self.workload, Workload):
            raise ArgumentError("workload", type(self.workload).__name__, "a Workload")


@dataclass(frozen=True, slots=True)
class Demand:
    """A scripted tenant: ``bytes`` of the budget wanted at ``at_s``, held ``hold_s`` (None:
    to the end), given up if not whole within ``patience_s``."""

    name: str
    at_s: float
    nbytes: int
    patience_s: float = 1.0
    hold_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ArgumentError("name", self.name, "a non-empty tenant name")
        seconds_arg("at_s", self.at_s)
        int_arg("nbytes", self.nbytes, lo=1, unit="bytes")
        seconds_arg("patience_s", self.patience_s)
        seconds_arg("hold_s", self.hold_s, none=True, zero=False)


@dataclass(frozen=True, slots=True)
class Rules:
    """The arbiter's rules (the module docstring says what each does)."""

    budget_bytes: int  #: the GPU's KV budget every tenant shares
    deadline_s: float = 0.005  #: sheds' driver time one request may wait for, seconds
    #: a range tenant's reserve stays held (no refill) this long after its last give-back
    #: at an ask, serving seconds (while a demand waits: until it is granted or refused)
    hold_s: float = 1.0

    def __post_init__(self) -> None:
        int_arg("budget_bytes", self.budget_bytes, lo=1, unit="bytes")
        seconds_arg("deadline_s", self.deadline_s)
        seconds_arg("hold_s", self.hold_s)


@dataclass(frozen=True, slots=True)
class TenantResult:
    """One serving tenant's run."""

    name: str
    model: str
    strategy: str
    answer: str
    limit_bytes: int
    serving: ServingStats
    peak_backed_bytes: int
    mean_backed_bytes: float  #: time-weighted, over the run
    shed_bytes: int  #: given back because another tenant asked
    asked: int  #: times its requests needed another tenant to shed
    refused: int  #: times its request for memory was refused
    decode_driver_s: float  #: driver time on its decode path (stalls), seconds
    #: given back at an ask (another tenant's or a demand's) from idle backing: a range
    #: tenant's deferred cache and reserve; nothing lost
    trim_bytes: int = 0
    #: given back later while a demand waited: memory its requests left (finished, preempted)
    request_bytes: int = 0
    trims: int = 0  #: give-backs at an ask
    trim_s: float = 0.0  #: their driver time in all (the sim's clock), seconds
    trim_max_s: float = 0.0  #: the longest one

    @property
    def served(self) -> int:
        """Requests that finished."""
        return self.serving.completed

    @property
    def rejected(self) -> int:
        """Requests never served: refused on arrival or dropped after ``max_wait_s``."""
        return self.serving.rejected + self.serving.timed_out

    @property
    def preempted(self) -> int:
        return self.serving.preemptions

    @property
    def stalled_share(self) -> float:
        """The share of steps that waited on the driver (0..1)."""
        s = self.serving
        return s.stalls.count / s.steps if s.steps else 0.0

    @property
    def stalled_p99_s(self) -> float:
        """p99 driver wait over the steps that had one (0 when none did)."""
        return self.serving.stalls.quantile(99)

    @property
    def p99_stall_s(self) -> float:
        """p99 driver wait over every step."""
        return _tally_with_zeros(self.serving.stalls, self.serving.steps, 99)

    def summary(self) -> dict[str, float | int | str]:
        """The summary row: plain numbers, for a table or JSON."""
        s = self.serving
        return {"tenant": self.name, "model": self.model, "strategy": self.strategy,
                "answer": self.answer, "limit_bytes": self.limit_bytes,
                "requests": s.requests, "served": self.served, "rejected": self.rejected,
                "timed_out": s.timed_out, "preempted": self.preempted,
                "stalled_share": round(self.stalled_share, 6),
                "stalled_p99_us": round(self.stalled_p99_s * 1e6, 3),
                "p99_stall_us": round(self.p99_stall_s * 1e6, 3),
                "peak_backed_bytes": self.peak_backed_bytes,
                "mean_backed_bytes": round(self.mean_backed_bytes),
                "shed_bytes": self.shed_bytes, "asked": self.asked, "refused": self.refused,
                "trim_bytes": self.trim_bytes, "request_bytes": self.request_bytes,
                "trims": self.trims, "trim_ms": round(self.trim_s * 1e3, 3),
                "trim_max_ms": round(self.trim_max_s * 1e3, 3),
                "decode_driver_ms": round(self.decode_driver_s * 1e3, 3),
                "end_s": round(s.end_s, 3)}


@dataclass(frozen=True, slots=True)
class DemandResult:
    """A scripted demand's outcome."""

    name: str
    at_s: float
    nbytes: int
    granted: bool  #: it got every byte within its patience
    wait_s: float | None  #: from ``at_s`` to the last byte (None: refused)
    peak_held_bytes: int
    trim_bytes: int = 0  #: the tenants gave back at its arrival from idle backing (cache)
    trim_s: float = 0.0  #: the driver time those give-backs took (the sim's clock)
    request_bytes: int = 0  #: given back later, while it waited: what requests left

    def summary(self) -> dict[str, float | int | str | bool | None]:
        return {"demand": self.name, "at_s": self.at_s, "nbytes": self.nbytes,
                "granted": self.granted,
                "wait_ms": None if self.wait_s is None else round(self.wait_s * 1e3, 3),
                "peak_held_bytes": self.peak_held_bytes, "trim_bytes": self.trim_bytes,
                "trim_ms": round(self.trim_s * 1e3, 3), "request_bytes": self.request_bytes}


@dataclass(frozen=True, slots=True)
class TenantsRun:
    """Tenants run together on one budget: results and every tenant's memory over time."""

    rules: Rules
    gpu: str
    tenants: tuple[TenantResult, ...]
    demands: tuple[DemandResult, ...]
    names: tuple[str, ...]  #: the columns of ``held_bytes``: tenants, then demands
    t_s: tuple[float, ...]  #: sample times (each value holds until the next)
    held_bytes: tuple[tuple[int, ...], ...]  #: per sample, what each name holds
    over_budget: int  #: samples where the sum exceeded the budget (must be 0)

    @property
    def peak_total_bytes(self) -> int:
        return max((sum(h) for h in self.held_bytes), default=0)

    def tenant(self, name: str) -> TenantResult:
        for t in self.tenants:
            if t.name == name:
                return t
        raise ArgumentError("tenant", name, f"one of {[t.name for t in self.tenants]}")

    def summary(self) -> dict[str, object]:
        return {"budget_bytes": self.rules.budget_bytes, "deadline_ms": self.rules.deadline_s
                * 1e3, "gpu": self.gpu,
                "peak_total_bytes": self.peak_total_bytes, "over_budget": self.over_budget,
                "tenants": [t.summary() for t in self.tenants],
                "demands": [d.summary() for d in self.demands]}


# -- the live side ----------------------------------------------------------------------------


class _Live:
    """A serving tenant while it runs: its owner, which granules its pages use, counters.

    What is backed is the owner's record (``owner.mapped``, ``owner.backed_bytes``), read
    whenever a decision needs it, never copied here; the tenant keeps what only it knows:
    how many used pages touch each granule, and which backed granules none does (its idle
    backing, re-read from the owner for the granules each change touched)."""

    def __init__(self, spec: Tenant, arbiter: _Arbiter, driver: object, cfg: ServingConfig,
                 gpu: str, index: int) -> None:
        self.spec = spec
        self.index = index
        self.arbiter = arbiter
        ps = cfg.page_size
        probe = full_pool_descs(spec.model, layout="interleaved", reserved_tokens=2 * ps,
                                page_size=ps, dtype="bfloat16", tp=1)
        self.pb = probe[0].row_bytes * ps // probe[0].tokens_per_row  # bytes of one page
        limit = arbiter.rules.budget_bytes if spec.limit_bytes is None else spec.limit_bytes
        self.limit = min(limit, arbiter.rules.budget_bytes)
        self.base_limit = self.limit
        self.clock_driver = driver
        self.tracer = TracingDriver(self._driver_for(driver), Trace())  # type: ignore[arg-type]
        gran = self.gran = self.tracer.granularity()
        # pool pages (page 0 included) such that the buffer (one padded page more), rounded
        # up to granules, stays within the limit
        pages = (self.limit // gran * gran) // self.pb - 1
        if pages < 2:
            raise ArgumentError("limit_bytes", self.limit, f"room for 3 pages of {spec.model} "
                                f"({3 * self.pb} bytes) in whole granules")
        self.pool_pages = pages
        descs = full_pool_descs(spec.model, layout="interleaved", reserved_tokens=pages * ps,
                                page_size=ps, dtype="bfloat16", tp=1)
        self.owner = KvBufferOwner(driver=self.tracer, dtype="bfloat16", page_size=ps,
                                   reserved_tokens=pages * ps, descs=descs,
                                   name=f"kv-{spec.name}", trace=self.tracer.trace)
        self.page_size = ps
        self.chunk_g = max(1, spec.chunk_bytes // gran)
        self.step_model = StepTimeModel.for_model(spec.model, gpu, tp=1, dtype="bfloat16")
        self.n_gran = n_gran = -(-(pages + 1) * self.pb // gran)
        self.used_ref = [0] * n_gran  # used pages touching each granule
        self.idle: set[int] = set()  # granules backed (the owner says) with no used page
        self.used_g = 0  # granules a used page touches
        for g in self._granules(0):  # slot 0's page: backed by the owner, always used
            self.used_ref[g] += 1
            self.used_g += 1
        self._read_back(range(n_gran))
        self.seen = 0
        self.pending_s = 0.0  # driver time not yet charged to a step
        self.decode_s = 0.0
        self.shed_bytes = self.asked = self.refused = 0
        self.trim_bytes = self.request_bytes = self.trims = 0
        self.trim_s = self.trim_max_s = 0.0
        self.wants_idle_back = False  # a demand waits: give back every idle granule
        self._account()
        if spec.strategy == "static":
            self._commit(list(range(1, pages)))
            self._account()
            self.pending_s = 0.0

    def _driver_for(self, driver: object) -> object:
        """The driver the tenant's owner calls (beneath its tracer)."""
        return driver

    def clock(self) -> float:
        """The sim's clock, seconds (driver time of every tenant so far)."""
        return float(self.clock_driver.clock_us) * 1e-6  # type: ignore[attr-defined]

    def make_allocator(self) -> SlotAllocator:
        return _Allocator(self, self.pool_pages)

    def note_trim(self, given: int, took_s: float) -> None:
        """Count a give-back at an ask: its bytes and how long it took."""
        self.trim_bytes += given
        self.trims += 1
        self.trim_s += took_s
        self.trim_max_s = max(self.trim_max_s, took_s)

    def _trim_of(self, asked: int) -> int:
        """What of an ask of ``asked`` bytes is given at once (:func:`shed_answer`): idle
        backing first; the lab's tenants give nothing that loses work at an ask."""
        idle = 0 if self.spec.strategy == "static" else self.idle_bytes
        return shed_answer(asked, givable_bytes=idle).trim_bytes

    def ask_shed(self, asked: int, deadline_s: float) -> tuple[int, float]:
        """Another tenant asks ``asked`` bytes: idle backing given back on this tenant's
        decode path (its next step waits for it, as the requester does). Returns bytes
        given back and the driver time they took."""
        want = self._trim_of(asked)
        before = self.pending_s
        self._account()
        t0 = self.pending_s
        given = self.give_back(want)
        self._account()
        took = self.pending_s - t0
        self.pending_s = before + took
        if want > 0:
            self.note_trim(given, took)
        return given, took

    # -- books --

    def _unbacked(self, granules: Sequence[int] | range) -> list[int]:
        """Those of ``granules`` (ascending) no mapping of the owner covers: one read of its
        record over their span, a bisection each."""
        if not granules:
            return []
        gran = self.gran
        maps = self.owner.mapped(0, granules[0] * gran, (granules[-1] + 1) * gran)
        starts = [a for a, _ in maps]
        out = []
        for g in granules:
            j = bisect_right(starts, g * gran) - 1
            if j < 0 or maps[j][1] <= g * gran:
                out.append(g)
        return out

    def _read_back(self, granules: Sequence[int] | range) -> None:
        """The idle flags of ``granules`` (ascending) from the owner's record, after a
        change of its backing that touched them."""
        used, idle = self.used_ref, self.idle
        gone = set(self._unbacked(granules))
        for g in granules:
            if g in gone or used[g]:
                idle.discard(g)
            else:
                idle.add(g)

    def _granules(self, p: int) -> range:
        pb, gran = self.pb, self.gran
        return range(p * pb // gran, -(-(p + 1) * pb // gran))

    @property
    def backed(self) -> int:
        """Bytes the owner backs (its record; slot 0's page included)."""
        return self.owner.backed_bytes

    @property
    def idle_bytes(self) -> int:
        return len(self.idle) * self.gran

    def _account(self) -> None:
        ev = self.tracer.trace.events
        if len(ev) > self.seen:
            self.pending_s += sum(e.sim_us for e in ev[self.seen:]) * 1e-6
            self.seen = len(ev)

    def need_bytes(self, pages: Sequence[int]) -> int:
        """Bytes of granules the pages touch that are not backed yet."""
        return len(self._unbacked(sorted({g for p in pages for g in self._granules(p)}))) \
            * self.gran

    def used_bytes(self) -> int:
        return self.used_g * self.gran

    def _commit(self, pages: list[int]) -> None:
        """Back what ``pages`` touch that is not backed: whole aligned chunks of
        ``chunk_bytes`` (one handle each, ``commit_slots``) when the budget and the limit
        have room for them without anyone shedding, else just the pages' granules."""
        gran = self.gran
        need = self._unbacked(sorted({g for p in pages for g in self._granules(p)}))
        if not need:
            return
        if self.spec.strategy == "elastic":
            c = self.chunk_g
            want = self._unbacked(sorted({h for g in need for h in
                                          range(g // c * c, min(g // c * c + c, self.n_gran))}))
            runs: list[list[int]] = []
            for g in want:
                if runs and runs[-1][1] == g:
                    runs[-1][1] = g + 1
                else:
                    runs.append([g, g + 1])
            ps, pb, top = self.page_size, self.pb, self.owner.pages
            slots = [(a * gran // pb * ps, min(-(-b * gran // pb), top) * ps) for a, b in runs]
            touched = sorted({g for a, b in slots for q in range(a // ps, b // ps)
                              for g in self._granules(q)})
            extra = len(self._unbacked(touched)) * gran - len(need) * gran
            if extra <= min(self.arbiter.free() - len(need) * gran,
                            self.limit - self.backed - len(need) * gran):
                self.owner.commit_slots(slots)
                self._read_back(touched)
                self.arbiter.changed(self)
                return
        unbacked = set(need)
        todo = [p for p in pages if any(g in unbacked for g in self._granules(p))]
        self.owner.commit_pages(todo)
        self._read_back(sorted({g for p in todo for g in self._granules(p)}))
        self.arbiter.changed(self)

    def use(self, pages: Sequence[int]) -> None:
        used, idle = self.used_ref, self.idle
        for p in pages:
            for g in self._granules(p):
                if not used[g]:
                    self.used_g += 1
                    idle.discard(g)
                used[g] += 1

    def unuse(self, pages: Sequence[int]) -> None:
        used, emptied = self.used_ref, []
        for p in pages:
            for g in self._granules(p):
                used[g] -= 1
                if not used[g]:
                    self.used_g -= 1
                    emptied.append(g)
        if emptied:  # backed and now unused: idle (the owner says which are backed)
            gone = set(self._unbacked(sorted(emptied)))
            self.idle.update(g for g in emptied if g not in gone)

    def _pages_of(self, g: int) -> range:
        """Pages touching granule ``g``."""
        gran, pb = self.gran, self.pb
        return range(g * gran // pb, min(((g + 1) * gran - 1) // pb + 1, self.owner.pages))

    def give_back(self, want_bytes: int) -> int:
        """Give back idle backing, highest mappings first, until ``want_bytes`` went or
        nothing more can; bytes given back.

        A mapping goes back only whole, and only if no page touching it is in use (so no
        work is lost): its pages are decommitted, and what went is read back from the arena.
        """
        if self.spec.strategy == "static" or want_bytes <= 0 or not self.idle:
            return 0
        used, gran = self.used_ref, self.gran
        drop: set[int] = set()
        touched: set[int] = set()
        freed = 0
        for a, b in reversed(self.owner.mapped(0)):
            gs = range(a // gran, b // gran)
            if any(used[g] for g in gs) or not gs.start:
                continue
            pages = {p for g in gs for p in self._pages_of(g) if p}
            if any(used[h] for p in pages for h in self._granules(p)):
                continue
            drop |= pages
            for p in pages:
                touched.update(self._granules(p))
            freed += b - a
            if freed >= want_bytes:
                break
        if not drop:
            return 0
        before = self.backed
        self.owner.decommit_pages(sorted(drop))
        self._read_back(sorted(touched))
        self.arbiter.changed(self)
        return before - self.backed

    def close(self) -> None:
        self.owner.close()

    def upkeep(self) -> None:
        """At a boundary: idle backing above the reserve (or the limit) goes back."""
        if self.spec.strategy == "static":
            return
        keep = 0 if self.wants_idle_back else self.spec.reserve_bytes
        idle = self.idle_bytes
        # hysteresis: idle backing goes back once it passes twice the reserve, down to the
        # reserve (giving back at the reserve itself re-commits on the next burst's step)
        over = max(idle - keep if idle > 2 * keep else 0, self.backed - self.limit)
        if over > 0:
            given = self.give_back(over)
            if self.wants_idle_back:
                self.request_bytes += given
                self.arbiter.note_request_bytes(given)


class _Metered(DriverWrapper):
    """A range tenant's driver: a create past what the budget has free (the other tenants'
    backing and the demands' held bytes counted), or past the tenant's limit, is refused as
    out of memory before the sim sees it. A lease's commit was granted by the arbiter first
    (so it fits); a reserve refill maps only what is free without anyone shedding."""

    def __init__(self, inner: Driver, live: _RangesLive) -> None:
        super().__init__(inner)
        self.live = live
        self.sizes: dict[int, int] = {}
        self.held = 0  # bytes of the handles it created and has not released

    def create(self, size: int) -> int:
        live = self.live
        arb = live.arbiter
        others = sum(lv.backed for lv in arb.lives if lv is not live) \
            + sum(d.held for d in arb.demands)
        if others + self.held + size > arb.rules.budget_bytes \
                or self.held + size > live.limit:
            raise DriverOutOfMemoryError("create", {"size": size}, "CUDA_ERROR_OUT_OF_MEMORY",
                                         "the lab's budget has no room without a shed")
        h = int(self.inner.create(size))
        self.sizes[h] = size
        self.held += size
        return h

    def release(self, handle: int) -> None:
        self.inner.release(handle)
        self.held -= self.sizes.pop(handle, 0)


class _RangesLive(_Live):
    """A ``"request-ranges+deferred"`` tenant: a RangeBacking whose driver work runs at once
    (the sim is a pure function), its lease commits charged to the next step and its
    upkeep (refills, reclamations, give-backs) to no step."""

    def __init__(self, spec: Tenant, arbiter: _Arbiter, driver: object, cfg: ServingConfig,
                 gpu: str, index: int) -> None:
        super().__init__(spec, arbiter, driver, cfg, gpu, index)
        self.background_s = 0.0  # driver time off the decode path
        self.held_at = 0.0  # serving time of the last give-back (the hold's start)
        self._backing: RangeBacking | None = None  # made when serving starts (below)

    @property
    def backing(self) -> RangeBacking:
        assert self._backing is not None, "the backing is made by make_allocator()"
        return self._backing

    def _driver_for(self, driver: object) -> object:
        return _Metered(driver, self)  # type: ignore[arg-type]

    def _run_job(self, job: Callable[[], None], waited: bool) -> None:
        """The backing's executor: a lease's commit (``waited``) is the next step's stall;
        other work runs off the decode path (counted, charged to no step)."""
        self._account()  # what came before: this tenant's path, as always
        ev = self.tracer.trace.events
        mark = len(ev)
        job()
        if not waited:
            self.background_s += sum(e.sim_us for e in ev[mark:]) * 1e-6
            self.seen = len(ev)

    def make_allocator(self) -> SlotAllocator:
        """The backing (its reserve mapped now, once every tenant is set up: a static
        share is backed first) and the allocator over it."""
        # what the backing can lease: whole blocks past slot 0's (its own arithmetic)
        ps, bt = self.page_size, self.owner.slot_block_tokens()
        cap = (self.owner.pages * ps // bt - -(-ps // bt)) * (bt // ps) * self.pb
        reserve = min(self.spec.reserve_bytes, cap, self.limit)
        self._backing = RangeBacking(self.owner, reserve_bytes=reserve,
                                     high_bytes=min(2 * reserve, cap, self.limit),
                                     executor=self._run_job)
        self.arbiter.changed(self)
        return _RangesAllocator(self)

    @property
    def idle_bytes(self) -> int:
        return self.backing.givable_bytes

    def used_bytes(self) -> int:
        return self.backing.leased_blocks * self.backing.block_bytes

    def trim(self, want: int | None, deadline_s: float) -> tuple[int, float]:
        """The cache and reserve given back through ``RangeBacking.give_back`` (off the
        decode path, within ``deadline_s`` of the sim's clock), the reserve held."""
        g = self.backing.give_back(want, deadline_s=max(deadline_s, 0.0), clock=self.clock)
        g.wait()
        self.held_at = self.arbiter.now_s
        self.arbiter.changed(self)
        return g.freed_bytes, g.elapsed_s

    def ask_shed(self, asked: int, deadline_s: float) -> tuple[int, float]:
        want = self._trim_of(asked)
        if want <= 0:
            return 0, 0.0
        given, took = self.trim(want, deadline_s)
        self.note_trim(given, took)
        return given, took

    def give_back(self, want_bytes: int) -> int:
        given, _ = self.trim(want_bytes, self.arbiter.rules.deadline_s)
        return given

    def upkeep(self) -> None:
        """At a boundary: while a demand waits (or past a lowered limit) the cache goes
        back (what requests left since); once the budget has room for the reserve again
        and nobody waits, the hold is lifted and the reserve refilled."""
        b = self.backing
        over = self.backed - self.limit
        if self.wants_idle_back or over > 0:
            given, _ = self.trim(None if self.wants_idle_back else over,
                                 self.arbiter.rules.deadline_s)
            self.request_bytes += given
            self.arbiter.note_request_bytes(given)
        elif b.held and self.arbiter.now_s - self.held_at >= self.arbiter.rules.hold_s:
            b.relax()  # the pressure is over: the reserve refills (what the budget has free)
            self.arbiter.changed(self)

    def close(self) -> None:
        if self._backing is not None:
            self._backing.close()
        self.owner.close()


class _RangesAllocator(LeaseAllocator):
    """A range tenant's allocator: before a lease takes fresh blocks, the arbiter grants
    their bytes (asking the others to shed); past its limit it is refused (the serving
    model then preempts or waits)."""

    def __init__(self, live: _RangesLive) -> None:
        super().__init__(live.backing, live.page_size)
        self.live = live

    def can_alloc(self, rid: int, n: int) -> bool:
        if not super().can_alloc(rid, n):
            return False
        b, live = self.backing, self.live
        got = self._leases.get(rid)
        handed = 0 if got is None else got.handed
        have = 0 if got is None else got.lease.blocks
        blocks = -(-(handed + n) * self.ps // b.block_tokens) - have
        if blocks <= 0:
            return True
        bb = b.block_bytes
        if live.used_bytes() + blocks * bb > live.limit:  # a lowered limit: refuse
            return False
        fresh = max(0, blocks - b.cached_blocks) * bb
        return fresh == 0 or live.arbiter.grant(live, fresh, self.now_s)


class _Allocator(SlotAllocator):
    """The engine's page allocator, asking the arbiter before a page touches a new granule."""

    def __init__(self, live: _Live, pages: int) -> None:
        super().__init__(pages, "lowest")
        self.live = live

    def _peek(self, n: int) -> list[int]:
        freed = self._freed
        if n == 1:
            return [min(freed[0], self._fresh) if freed else self._fresh]
        got = heapq.nsmallest(n, freed)
        got.extend(range(self._fresh, self._fresh + n - len(got)))
        return sorted(got)[:n]

    def can_alloc(self, rid: int, n: int) -> bool:
        if n > self.pages - 1 - self.used:
            return False
        live = self.live
        if live.spec.strategy == "static":
            return True
        need = live.need_bytes(self._peek(n))
        if live.used_bytes() + need > live.limit:  # a lowered limit: refuse, even idle room
            return False
        return need == 0 or live.arbiter.grant(live, need, self.now_s)

    def alloc_for(self, rid: int, n: int, out: list[int]) -> None:
        start = len(out)
        super().alloc_for(rid, n, out)
        pages = out[start:]
        self.live.use(pages)
        if self.live.spec.strategy != "static":
            self.live._commit(pages)

    def release_for(self, rid: int, pages: Sequence[int]) -> None:
        super().release_for(rid, pages)
        self.live.unuse(pages)


class _Hooks:
    """The serving loop's side: upkeep at boundaries, stalls, samples."""

    kv_bandwidth_factor = 1.0

    def __init__(self, live: _Live) -> None:
        self.live = live

    def update(self, allocated: list[int], freed: list[int], high_water: int, step: int,
               now_s: float) -> float:
        live = self.live
        live.arbiter.now_s = now_s
        live.upkeep()
        live._account()
        stall, live.pending_s = live.pending_s, 0.0
        live.decode_s += stall
        return stall

    def sample(self, t_s: float, step: int, used_pages: int, high_water: int, running: int,
               waiting: int) -> None:
        self.live.arbiter.record(t_s)


class _PendingDemand:
    def __init__(self, spec: Demand, index: int) -> None:
        self.spec = spec
        self.index = index
        self.held = 0
        self.peak = 0
        self.granted_at: float | None = None
        self.done = False  # granted or refused, or released
        self.trim_bytes = self.request_bytes = 0
        self.trim_s = 0.0


class _Arbiter:
    """The ledger and the rules; the tenants call it at their boundaries."""

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.lives: list[_Live] = []
        self.demands: list[_PendingDemand] = []
        self.now_s = 0.0
        self.t_s: list[float] = []
        self.held: list[tuple[int, ...]] = []
        self.over = 0

    def total(self) -> int:
        return sum(lv.backed for lv in self.lives) + sum(d.held for d in self.demands)

    def free(self) -> int:
        return self.rules.budget_bytes - self.total()

    def record(self, t_s: float) -> None:
        row = tuple(lv.backed for lv in self.lives) + tuple(d.held for d in self.demands)
        if sum(row) > self.rules.budget_bytes:
            self.over += 1
        if self.held and self.held[-1] == row:
            return
        if self.t_s and self.t_s[-1] == t_s:
            self.held[-1] = row
            return
        self.t_s.append(max(t_s, self.t_s[-1]) if self.t_s else t_s)
        self.held.append(row)

    def note_request_bytes(self, nbytes: int) -> None:
        """Bytes a tenant gave back while a demand waited: the first waiting one's."""
        for d in self.demands:
            if not d.done and d.granted_at is None and d.spec.at_s <= self.now_s:
                d.request_bytes += nbytes
                return

    def changed(self, live: _Live) -> None:
        """A tenant's backing changed: feed a waiting demand, then sample."""
        for d in self.demands:
            if not d.done and d.granted_at is None and d.spec.at_s <= self.now_s:
                self._feed(d)
        self.record(self.now_s)

    def state(self, live: _Live) -> TenantState:
        """``live`` as the budget rules see it (the lab's requests are answered at once: none
        stands between two grants)."""
        return TenantState(live.spec.name, live.index, live.limit, live.backed)

    def plan(self, live: _Live, short_bytes: int) -> tuple[Ask, ...]:
        """Whom ``live``'s shortfall is asked of, in order, and how much of each."""
        return shed_plan((self.state(lv) for lv in self.lives if lv is not live), short_bytes)

    def grant(self, live: _Live, need: int, now_s: float) -> bool:
        """Whether ``live`` may back ``need`` more bytes now (asking others to shed)."""
        self.now_s = now_s
        free = self.free()
        reason = refusal(self.state(live), need, free_bytes=free)
        if reason is None:
            return True
        if reason == "limit":
            live.refused += 1
            return False
        live.asked += 1
        short = need - free
        spent = 0.0
        for ask in self.plan(live, short):
            lv = self.lives[ask.index]
            if short <= 0 or spent >= self.rules.deadline_s:
                break
            if lv.spec.answer == "reject":
                continue  # asked, does not answer
            given, took = lv.ask_shed(min(ask.nbytes, short), self.rules.deadline_s - spent)
            spent += took
            lv.shed_bytes += given
            short -= given
        live.pending_s += spent  # the requester waited for the sheds
        if short > 0:
            live.refused += 1
            return False
        return True

    # -- scripted demands --

    def demand_arrives(self, d: _PendingDemand, now_s: float) -> None:
        self.now_s = now_s
        if self.free() < d.spec.nbytes and all(lv.spec.answer == "reject" for lv in self.lives):
            d.done = True  # nobody will give anything: refused at once
            return
        self._feed(d)
        if d.granted_at is None:
            for lv in self.lives:
                if lv.spec.answer != "reject":
                    want = lv._trim_of(d.spec.nbytes - d.held)
                    if want > 0:
                        t0 = lv.clock()
                        given = lv.give_back(want)
                        lv.note_trim(given, lv.clock() - t0)
                        d.trim_bytes += given
                        d.trim_s += lv.clock() - t0
                    self._feed(d)
                    lv.wants_idle_back = True
                if lv.spec.answer == "preempt" and d.granted_at is None:
                    missing = d.spec.nbytes - d.held - max(self.free(), 0)
                    lv.limit = max(lv.used_bytes() - missing, self.lives[0].gran)
        self.record(now_s)

    def _feed(self, d: _PendingDemand) -> None:
        take = min(max(self.free(), 0), d.spec.nbytes - d.held)
        if take > 0:
            d.held += take
            d.peak = max(d.peak, d.held)
        if d.held >= d.spec.nbytes and d.granted_at is None:
            d.granted_at = self.now_s
            for lv in self.lives:
                lv.wants_idle_back = False
                lv.limit = lv.base_limit

    def demand_expires(self, d: _PendingDemand, now_s: float) -> None:
        self.now_s = now_s
        if d.granted_at is None and not d.done:
            d.held = 0
            d.done = True
            for lv in self.lives:
                lv.wants_idle_back = False
                lv.limit = lv.base_limit
            self.record(now_s)

    def demand_ends(self, d: _PendingDemand, now_s: float) -> None:
        self.now_s = now_s
        d.held = 0
        d.done = True
        self.record(now_s)


def run_tenants(
    tenants: Sequence[Tenant],
    *,
    budget_bytes: int,
    demands: Sequence[Demand] = (),
    gpu: str = "h200",
    deadline_s: float = 0.005,
    config: ServingConfig | None = None,
    sample_s: float = 1.0,
    hold_s: float = 1.0,
) -> TenantsRun:
    """Serve every tenant's workload together on one simulated GPU sharing ``budget_bytes``.

    Args:
        tenants: the engines (at least one; names unique, demands' too).
        budget_bytes: the KV budget they share (the sim driver's capacity), bytes.
        demands: scripted tenants taking a step of the budget.
        gpu: the GPU profile (the sim's costs, the step time model).
        deadline_s: the arbiter's deadline (:class:`Rules`).
        hold_s: how long a range tenant's reserve stays held after a give-back (:class:`Rules`).
        config: the engines' knobs (default: :class:`ServingConfig` with ``max_wait_s=30``:
            a queue can wait on another tenant's memory, so served requests count against
            a timeout); its ``slot_order`` must be ``"lowest"``.
        sample_s: simulated seconds between each engine's samples.
    Returns:
        A :class:`TenantsRun`.
    Raises:
        ArgumentError: a bad argument (no tenants, a name twice, a limit with no room for a
            page, ``slot_order`` other than lowest, ...).
    """
    rules = Rules(budget_bytes=budget_bytes, deadline_s=deadline_s, hold_s=hold_s)
    if not tenants:
        raise ArgumentError("tenants", list(tenants), "at least one Tenant")
    for t in tenants:
        if not isinstance(t, Tenant):
            raise ArgumentError("tenants", type(t).__name__, "Tenant records")
    for d in demands:
        if not isinstance(d, Demand):
            raise ArgumentError("demands", type(d).__name__, "Demand records")
    names = [t.name for t in tenants] + [d.name for d in demands]
    if len(set(names)) != len(names):
        raise ArgumentError("tenants", names, "unique names")
    cfg = ServingConfig(max_wait_s=30.0) if config is None else config
    if cfg.slot_order != "lowest":
        raise ArgumentError("slot_order", cfg.slot_order, "'lowest' with tenants")
    if not sample_s > 0:
        raise ArgumentError("sample_s", sample_s, "> 0 (seconds)")
    static = sum(min(t.limit_bytes or budget_bytes, budget_bytes) for t in tenants
                 if t.strategy == "static")
    if static > budget_bytes:
        raise ArgumentError("limit_bytes", [t.limit_bytes for t in tenants],
                            f"static shares that fit the budget ({budget_bytes} bytes) "
                            f"together ({static} bytes asked)")
    prof = get_profile(gpu)
    driver = open_driver("sim", profile=prof, capacity_bytes=rules.budget_bytes)
    arb = _Arbiter(rules)
    lives: list[_Live] = []
    try:
        for i, spec in enumerate(tenants):
            kind = _RangesLive if spec.strategy == "request-ranges+deferred" else _Live
            lives.append(kind(spec, arb, driver, cfg, prof.key, i))
            arb.lives.append(lives[-1])
            if arb.total() > rules.budget_bytes:
                raise ArgumentError("limit_bytes", spec.limit_bytes, "static shares that fit "
                                    f"the budget ({rules.budget_bytes} bytes) together")
        arb.demands = [_PendingDemand(d, i) for i, d in enumerate(demands)]
        arb.record(0.0)
        stats = _schedule(lives, arb, cfg, sample_s)
        results = tuple(_result(lv, st, arb) for lv, st in zip(lives, stats, strict=True))
    finally:
        for lv in lives:
            lv.close()
    drs = tuple(DemandResult(
        name=d.spec.name, at_s=d.spec.at_s, nbytes=d.spec.nbytes,
        granted=d.granted_at is not None,
        wait_s=None if d.granted_at is None else d.granted_at - d.spec.at_s,
        peak_held_bytes=d.peak, trim_bytes=d.trim_bytes, trim_s=d.trim_s,
        request_bytes=d.request_bytes) for d in arb.demands)
    return TenantsRun(rules=rules, gpu=prof.key, tenants=results, demands=drs,
                      names=tuple(names), t_s=tuple(arb.t_s), held_bytes=tuple(arb.held),
                      over_budget=arb.over)


def _schedule(lives: list[_Live], arb: _Arbiter, cfg: ServingConfig,
              sample_s: float) -> list[ServingStats]:
    """Advance whichever engine's (or demand's) next event comes first, to the end."""
    gens: list[Generator[float, None, ServingStats]] = []
    for lv in lives:
        model = ServingModel(cfg, lv.step_model, pool_pages=lv.pool_pages, sample_s=sample_s,
                             allocator=lv.make_allocator())
        gens.append(model.steps(lv.spec.workload, _Hooks(lv)))
    # events: (time, kind, index); kind 0 demand arrives, 1 demand expires, 2 demand ends,
    # 3 an engine's boundary (demands first at equal times: they are the step change)
    heap: list[tuple[float, int, int]] = []
    for d in arb.demands:
        heap.append((d.spec.at_s, 0, d.index))
    stats: list[ServingStats | None] = [None] * len(lives)
    for i, g in enumerate(gens):
        heap.append((next(g), 3, i))
    heapq.heapify(heap)
    while heap:
        t, kind, i = heapq.heappop(heap)
        if kind == 3:
            arb.now_s = t
            try:
                nxt = gens[i].send(None)
            except StopIteration as done:
                stats[i] = done.value
                continue
            heapq.heappush(heap, (nxt, 3, i))
            continue
        d = arb.demands[i]
        if kind == 0:
            arb.demand_arrives(d, t)
            heapq.heappush(heap, (t + d.spec.patience_s, 1, i))
        elif kind == 1:
            arb.demand_expires(d, t)
            if d.granted_at is not None and d.spec.hold_s is not None:
                heapq.heappush(heap, (max(t, d.granted_at + d.spec.hold_s), 2, i))
        elif kind == 2:
            arb.demand_ends(d, t)
    end = max((s.end_s for s in stats if s is not None), default=0.0)
    arb.record(end)
    return [s for s in stats if s is not None]


def _result(lv: _Live, st: ServingStats, arb: _Arbiter) -> TenantResult:
    col = [row[lv.index] for row in arb.held]
    t = arb.t_s
    end = st.end_s if st.end_s > 0 else (t[-1] if t else 0.0)
    total = 0.0
    for k in range(len(t)):
        t1 = t[k + 1] if k + 1 < len(t) else end
        total += col[k] * max(0.0, min(t1, end) - t[k])
    mean = total / end if end > 0 else float(col[-1] if col else 0)
    return TenantResult(
        name=lv.spec.name, model=lv.spec.model, strategy=lv.spec.strategy,
        answer=lv.spec.answer, limit_bytes=lv.base_limit, serving=st,
        peak_backed_bytes=max(col, default=0), mean_backed_bytes=mean,
        shed_bytes=lv.shed_bytes, asked=lv.asked, refused=lv.refused,
        decode_driver_s=lv.decode_s, trim_bytes=lv.trim_bytes, request_bytes=lv.request_bytes,
        trims=lv.trims, trim_s=lv.trim_s, trim_max_s=lv.trim_max_s)



def compare_tenants(
    tenants: Sequence[Tenant],
    *,
    budget_bytes: int,
    demand: Demand | None = None,
    gpu: str = "h200",
    deadline_s: float = 0.005,
    config: ServingConfig | None = None,
    strategy: str = "elastic",
) -> dict[str, TenantsRun]:
    """The comparisons ``kvvmm replay --tenants`` prints, by label.

    Without ``demand``: ``"alone <name>"`` (each tenant by itself on the whole budget, all of
    it backed: the whole card), ``"static"`` (every tenant static on an equal share) and
    ``"elastic"`` (every tenant elastic on the whole budget, sharing it). With ``demand``:
    the tenants elastic, with the demand taking its step, once per answer (``"reject"``,
    ``"shed"``, ``"preempt"``). ``strategy`` is how the sharing tenants back (``"elastic"``
    or ``"request-ranges+deferred"``; the alone and static runs back statically).
    """
    if strategy not in TENANT_STRATEGIES[1:]:
        raise ArgumentError("strategy", strategy, f"one of {TENANT_STRATEGIES[1:]}")
    runs: dict[str, TenantsRun] = {}
    kw = {"budget_bytes": budget_bytes, "gpu": gpu, "deadline_s": deadline_s,
          "config": config}
    if demand is not None:
        for answer in ANSWERS:
            runs[answer] = run_tenants(
                [replace(t, strategy=strategy, limit_bytes=None, answer=answer)
                 for t in tenants], demands=[demand], **kw)  # type: ignore[arg-type]
        return runs
    for t in tenants:
        runs[f"alone {t.name}"] = run_tenants([replace(t, strategy="static", limit_bytes=None)],
                                              **kw)  # type: ignore[arg-type]
    share = budget_bytes // len(tenants)
    runs["static"] = run_tenants([replace(t, strategy="static", limit_bytes=share)
                                  for t in tenants], **kw)  # type: ignore[arg-type]
    runs["elastic"] = run_tenants([replace(t, strategy=strategy, limit_bytes=None)
                                   for t in tenants], **kw)  # type: ignore[arg-type]
    return runs

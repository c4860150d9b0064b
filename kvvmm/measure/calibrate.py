"""``kvvmm calibrate``: measure on a GPU what the simulator charges, and write it as a profile.

The simulator advances its clock by a cost model per driver call (:mod:`kvvmm.hardware`). A
table fitted once on one card neither follows the card's drift nor fits another card, and it
missed the library's own work (docs/MEASUREMENTS.md §10). This command measures, on the card at
hand, through :class:`~kvvmm.driver.cuda.CudaDriver` (what the sim stands in for):

- ``per_call``: µs per create, map, set_access, unmap (with its synchronize) and release by
  handle size, all sizes in one reservation (as an owner's calls are), every size
  interleaved with every other in a fresh seeded order each rep (what a call costs depends
  on the call before it: docs/MEASUREMENTS.md §2);
- ``reserve_free``: reserve and free by reservation size;
- ``access_multi``: one set_access over a range of several mappings against one call per
  mapping, and one unmap over them: µs per mapping covered (§9);
- ``library``: kvvmm's own work per arena and owner operation (what the arena and the owner
  tell the simulator: ``library_work_us``), through a driver wrapper that times every call:
  each operation's wall time minus its driver calls, the arena's fitted by handles or
  mappings, the owner's per buffer beyond the arena operations it makes;
- ``growth``: decode growth of 64 buffers x 122 steps per policy, settled rounds (as ``kvvmm
  bench`` times it), and the close of each grown owner: kept as measured, and the residual
  per call that the older per-call model fitted to it (a check; the sim charges per operation);
- ``bandwidth``: copy bandwidth of a 1 GiB bf16 tensor by handle size and interleaving;
- ``post_release``: creates right after a large release against settled creates, repeated:
  modelled only when the slowdown is there in every repeat and the repeats agree.

It writes one ``kvvmm-hardware-profile`` JSON (``--out``, default ``<card>-profile.json``) after
every section, so a run cut short still leaves a loadable profile (``calibration.complete`` is
false and ``calibration.errors`` says what failed); ``SimDriver(profile=PATH)`` loads it.
``--quick`` measures fewer sizes and one round (about a minute). Without a usable GPU it says
so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvvmm.driver.base import Driver
from kvvmm.errors import DriverUnavailableError, KvvmmError
from kvvmm.hardware.interp import Log2Curve
from kvvmm.hardware.overhead import sim_costs
from kvvmm.hardware.profiles import FORMAT, profile_from_data
from kvvmm.measure.timer import TimedDriver, wrapper_cost_s
from kvvmm.policy import parse_policy
from kvvmm.units import GiB, MiB

__all__ = ["FULL", "QUICK", "Plan", "TimedDriver", "build_profile", "fit_library_overhead",
           "main", "measure", "run", "slowdown_verdict"]

#: Written into every profile this module makes.
VERSION = 2


@dataclass(frozen=True, slots=True)
class Plan:
    """What one calibration run measures, and how often (sizes in MiB unless named)."""

    call_sizes_mib: tuple[int, ...]  #: handle sizes of the per-call section
    call_reps: tuple[int, ...]  #: reps per size (the same order)
    reserve_gib: tuple[int, ...]  #: reservation sizes of the reserve/free section
    reserve_reps: int
    access_cases: tuple[tuple[int, int], ...]  #: (mapping MiB, mappings) for access_multi
    access_reps: int
    layers: int  #: decode-growth workload: 2 x layers buffers (K and V)
    reserved_tokens: int
    step_tokens: int
    grow_to_tokens: int
    finalize_tokens: int  #: finalize after the default policy's growth (0: skip)
    policies: tuple[str, ...]  #: growth policies, as :func:`kvvmm.policy.parse_policy` reads them
    rounds: int  #: settled growth rounds per policy
    settle_s: float  #: pause after a large close, before anything timed
    commit_reps: int  #: Arena.commit calls timed
    owner_reps: int  #: owner constructions (and closes) timed
    bandwidth_handles_mib: tuple[int, ...]  #: 0: one handle for the whole tensor
    bandwidth_bytes: int
    release_bytes: int  #: released just before the slowed creates (capped by free memory)
    slow_creates: int  #: creates timed after the release, and settled
    slow_create_mib: int
    slow_repeats: int


#: The full run: under 5 minutes on an H200.
FULL = Plan(
    call_sizes_mib=(2, 8, 32, 128, 512, 2048), call_reps=(200, 150, 150, 100, 50, 20),
    reserve_gib=(1, 64, 256, 1024), reserve_reps=20,
    access_cases=((2, 64), (8, 32), (32, 16), (128, 8), (512, 4)), access_reps=5,
    layers=32, reserved_tokens=2_000_000, step_tokens=4096, grow_to_tokens=500_000,
    finalize_tokens=1_000_000,
    policies=("default", "exact", "chunked:32", "chunked:128", "geometric:2:1024"),
    rounds=3, settle_s=2.0, commit_reps=200, owner_reps=5,
    bandwidth_handles_mib=(0, 512, 64, 8, 2), bandwidth_bytes=GiB,
    release_bytes=64 * GiB, slow_creates=256, slow_create_mib=32, slow_repeats=3,
)

#: ``--quick``: about a minute; the same sections, fewer sizes, one growth round.
QUICK = replace(
    FULL, call_sizes_mib=(2, 32, 512), call_reps=(80, 60, 20), reserve_gib=(64, 256),
    reserve_reps=8, access_cases=((2, 64), (32, 16)), access_reps=3,
    policies=("default", "exact", "chunked:128"), rounds=1, settle_s=1.0, commit_reps=100,
    owner_reps=3, finalize_tokens=0, bandwidth_handles_mib=(0, 64, 2),
    release_bytes=32 * GiB, slow_creates=128, slow_repeats=2,
)


# -- the sections ------------------------------------------------------------------------


@dataclass(slots=True)
class Ctx:
    """What every section gets: the driver (wrapped), the plan, how to wait for the device."""

    td: TimedDriver
    plan: Plan
    sync: Callable[[], None]
    cuda: bool  #: a GPU (bandwidth and the post-release probe need one)
    log: Callable[[str], None] = field(default=lambda _: None)


def _tmean(xs: Sequence[float], trim: float = 0.02) -> float:
    """The mean without the slowest ``trim`` of the values (at least none dropped).

    What the simulator sums must be a mean, not a median: a growth is the sum of thousands
    of calls and operations, and their costs are skewed (a garbage collection, an
    interrupt), so medians of the parts under-predict the whole. The slowest 2% are left
    out so that one 10 ms stall in 200 reps does not move a figure by 50 µs.
    """
    v = sorted(xs)
    keep = max(1, len(v) - int(len(v) * trim))
    return statistics.fmean(v[:keep])


def _us(xs: Sequence[float]) -> float:
    """µs, from seconds: the trimmed mean (:func:`_tmean`)."""
    return round(_tmean(xs) * 1e6, 3)


def _median_us(xs: Sequence[float]) -> float:
    return round(statistics.median(xs) * 1e6, 3)


def per_call(ctx: Ctx) -> dict[str, Any]:
    """µs per call by handle size, in ONE reservation (as an owner's calls are), each size at
    its own place in it; per rep, every size is created, mapped and given access, then every
    size unmapped, then every size released, each phase in a fresh seeded random order.

    One reservation: CudaDriver keeps the last reservation's range for its map check, so
    maps spread over several reservations (as before) timed a miss an owner never pays
    (9.3 µs against 1.8 µs). Phases: an owner's decommit and close unmap a run, then
    release, so a release is timed after other unmaps, not right after its own.
    """
    d = ctx.td.inner
    p = ctx.plan
    place: dict[int, int] = {}
    total = 0
    for s in p.call_sizes_mib:
        place[s] = total
        total += s * MiB
    base = d.reserve(total)
    vas = {s: base + off for s, off in place.items()}
    left = dict(zip(p.call_sizes_mib, p.call_reps, strict=True))
    t: dict[int, dict[str, list[float]]] = {
        s: {op: [] for op in ("create", "map", "set_access", "unmap", "release")}
        for s in p.call_sizes_mib}
    pc = time.perf_counter
    rng = random.Random(14)
    try:
        for _ in range(2):  # warm-up: the first calls of a size cost more
            for s in p.call_sizes_mib:
                h = d.create(s * MiB)
                d.map(vas[s], s * MiB, h)
                d.set_access(vas[s], s * MiB)
                d.unmap(vas[s], s * MiB)
                d.release(h)
        while any(left.values()):
            order = [s for s, n in left.items() if n > 0]
            handles: dict[int, int] = {}
            rng.shuffle(order)
            for s in order:
                left[s] -= 1
                size, va, row = s * MiB, vas[s], t[s]
                t0 = pc()
                h = d.create(size)
                t1 = pc()
                d.map(va, size, h)
                t2 = pc()
                d.set_access(va, size)
                t3 = pc()
                handles[s] = h
                row["create"].append(t1 - t0)
                row["map"].append(t2 - t1)
                row["set_access"].append(t3 - t2)
            rng.shuffle(order)
            for s in order:
                t0 = pc()
                d.unmap(vas[s], s * MiB)  # synchronizes first, as CudaDriver always does
                t[s]["unmap"].append(pc() - t0)
            rng.shuffle(order)
            for s in order:
                t0 = pc()
                d.release(handles.pop(s))
                t[s]["release"].append(pc() - t0)
    finally:
        d.free(base, total)
    return {f"{s}MiB": {op: _us(v) for op, v in row.items()} | {"reps": len(row["create"])}
            | {"median": {op: _median_us(v) for op, v in row.items()}}
            for s, row in t.items()}


def reserve_free(ctx: Ctx) -> dict[str, Any]:
    """µs per reserve and per free by reservation size (sizes in a seeded random order)."""
    d = ctx.td.inner
    p = ctx.plan
    t: dict[int, dict[str, list[float]]] = {g: {"reserve": [], "free": []} for g in p.reserve_gib}
    rng = random.Random(15)
    d.free(d.reserve(GiB), GiB)  # warm-up
    for _ in range(p.reserve_reps):
        order = list(p.reserve_gib)
        rng.shuffle(order)
        for g in order:
            t0 = time.perf_counter()
            va = d.reserve(g * GiB)
            t1 = time.perf_counter()
            d.free(va, g * GiB)
            t2 = time.perf_counter()
            t[g]["reserve"].append(t1 - t0)
            t[g]["free"].append(t2 - t1)
    mem = []
    for _ in range(200):
        t0 = time.perf_counter()
        d.mem_info()
        mem.append(time.perf_counter() - t0)
    return {"sizes": {f"{g}GiB": {k: _us(v) for k, v in row.items()} for g, row in t.items()},
            "mem_info_us": _us(mem)}


def access_multi(ctx: Ctx) -> dict[str, Any]:
    """One set_access over k mappings against k calls, one per mapping (fresh maps each rep)."""
    d = ctx.td.inner
    out: dict[str, Any] = {}
    for mib, k in ctx.plan.access_cases:
        size = mib * MiB
        va = d.reserve(size * k)
        hs = [d.create(size) for _ in range(k)]
        one: list[float] = []
        many: list[float] = []
        unmaps: list[float] = []
        try:
            for rep in range(ctx.plan.access_reps * 2):
                for i, h in enumerate(hs):
                    d.map(va + i * size, size, h)
                t0 = time.perf_counter()
                if rep % 2 == 0:
                    d.set_access(va, size * k)
                else:
                    for i in range(k):
                        d.set_access(va + i * size, size)
                dt = time.perf_counter() - t0
                (one if rep % 2 == 0 else many).append(dt)
                t0 = time.perf_counter()
                d.unmap(va, size * k)  # one call over the k mappings (synchronizes once)
                unmaps.append(time.perf_counter() - t0)
        finally:
            for h in hs:
                d.release(h)
            d.free(va, size * k)
        o, m = _tmean(one), _tmean(many)
        out[f"{mib}MiBx{k}"] = {"mapping_mib": mib, "mappings": k,
                                "one_call_us": round(o * 1e6, 2),
                                "one_call_per_mapping_us": round(o * 1e6 / k, 3),
                                "call_per_mapping_us": round(m * 1e6, 2),
                                "ratio_one_over_calls": round(o / m, 4),
                                "unmap_one_call_us": round(_tmean(unmaps) * 1e6, 2),
                                "unmap_per_mapping_us": round(
                                    _tmean(unmaps) * 1e6 / k, 3)}
    return out


def first_touch(ctx: Ctx) -> dict[str, Any]:
    """map and set_access of one granule handle into VA of a reservation that no mapping has
    touched yet (the first in its 1 GiB region) against one beside a mapping of the same
    region, and one half a region away (is the region smaller?). A fresh reservation each
    rep: whatever the driver sets up for a region may last until the reservation is freed.

    An owner's construction maps slot 0 of every buffer, each buffer in its own gigabytes
    of VA, and page commits far apart land in untouched regions too; decode growth mostly
    maps beside what it mapped before.
    """
    d = ctx.td.inner
    g = d.granularity()
    n, reps = 32, 3
    pc = time.perf_counter
    got: dict[str, dict[str, list[float]]] = {
        case: {"map": [], "set_access": []} for case in ("fresh", "beside", "half_away")}
    unmaps: list[float] = []
    for _ in range(reps):
        va0 = d.reserve(n * GiB, GiB)
        hs: list[int] = []
        try:
            for case, off in (("fresh", 0), ("beside", g), ("half_away", GiB // 2)):
                for i in range(n):
                    h = d.create(g)
                    hs.append(h)
                    va = va0 + i * GiB + off
                    t0 = pc()
                    d.map(va, g, h)
                    t1 = pc()
                    d.set_access(va, g)
                    t2 = pc()
                    got[case]["map"].append(t1 - t0)
                    got[case]["set_access"].append(t2 - t1)
            for case_off in (0, g, GiB // 2):
                for i in range(n):
                    t0 = pc()
                    d.unmap(va0 + i * GiB + case_off, g)
                    unmaps.append(pc() - t0)
        finally:
            for h in hs:
                d.release(h)
            d.free(va0, n * GiB)
    # A large mapping enters several regions: is the extra paid per region or per mapping?
    # The same 2 GiB handles mapped into fresh VA, then again where they were (touched).
    big = 2 * GiB
    big_t: dict[str, dict[str, list[float]]] = {
        case: {"map": [], "set_access": []} for case in ("fresh", "again")}
    for _ in range(reps):
        va0 = d.reserve(4 * big, GiB)
        hs = []
        try:
            hs = [d.create(big) for _ in range(2)]
            for case in ("fresh", "again"):
                for i, h in enumerate(hs):
                    va = va0 + 2 * i * big
                    t0 = pc()
                    d.map(va, big, h)
                    t1 = pc()
                    d.set_access(va, big)
                    t2 = pc()
                    big_t[case]["map"].append(t1 - t0)
                    big_t[case]["set_access"].append(t2 - t1)
                for i in range(len(hs)):
                    d.unmap(va0 + 2 * i * big, big)
        finally:
            for h in hs:
                d.release(h)
            d.free(va0, 4 * big)
    out: dict[str, Any] = {case: {op: _us(v) for op, v in row.items()}
                           for case, row in got.items()}
    out["unmap_us"] = _us(unmaps)
    out["samples_per_case"] = n * reps
    out["big_mib"] = big // MiB
    out["big"] = {case: {op: _us(v) for op, v in row.items()} for case, row in big_t.items()}
    return out


def _descs(plan: Plan) -> list[Any]:
    from kvvmm.layout import mha_token_major

    return mha_token_major(layers=plan.layers, kv_heads=8, head_dim=128,
                           reserved_tokens=plan.reserved_tokens, page_size=64,
                           dtype="bfloat16")


def _owner(drv: Driver, plan: Plan, policy: Any = None) -> Any:
    from kvvmm.owner import KvBufferOwner

    return KvBufferOwner(driver=drv, dtype="bfloat16", page_size=64,
                         reserved_tokens=plan.reserved_tokens, descs=_descs(plan), policy=policy)


def _steps(plan: Plan) -> range:
    return range(plan.step_tokens, plan.grow_to_tokens + 1, plan.step_tokens)


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``us = fixed + per_unit * units`` over ``(units, us)``; both >= 0."""
    xs = [float(u) for u, _ in points]
    ys = [float(v) for _, v in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope


def _creates(calls: Sequence[tuple[str, int, float]]) -> int:
    return sum(1 for c in calls if c[0] == "create")


#: The operations the arena and the owner tell the simulator, and their unit.
WORK_UNITS = {
    "arena.open": "none", "arena.commit": "handle made", "arena.decommit": "mapping given back",
    "arena.tensor": "view", "arena.close": "mapping given back",
    "owner.open": "buffer", "owner.ensure_prefix": "buffer", "owner.grow": "buffer",
    "owner.resize": "buffer", "owner.pages": "buffer", "owner.close": "buffer",
}


def library(ctx: Ctx) -> dict[str, Any]:
    """kvvmm's own work per arena and owner operation: wall time minus its driver calls.

    Each operation as the simulator is told it (:data:`WORK_UNITS`): the arena's by
    handles or mappings, the owner's per buffer *beyond* the arena operations it makes
    (those are the arena's to charge), fitted as ``fixed + per_unit * units``.
    """
    from kvvmm.arena import Arena

    td, plan = ctx.td, ctx.plan
    wrap_s = wrapper_cost_s(td)
    g = td.granularity()
    pc = time.perf_counter

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        """µs of ``fn``'s own work (its wall minus its driver calls), and its result."""
        us, r, _ = timed_calls(fn)
        return us, r

    def timed_calls(fn: Callable[[], Any]) -> tuple[float, Any, list[tuple[str, int, float]]]:
        """:func:`timed`, and the driver calls ``fn`` made."""
        with td.record() as calls:
            t0 = pc()
            r = fn()
            wall = pc() - t0
        return (wall - sum(c[2] for c in calls) - wrap_s * len(calls)) * 1e6, r, list(calls)

    reps = max(4, plan.commit_reps // 8)
    ks = (1, 8, 32)
    # Arena commit and decommit of k allocations, one granule each (given back each rep,
    # so memory stays at 32 granules).
    arena = Arena(td, reserve_bytes=max(ks) * g, name="calibrate")
    offs = [arena.allocate(g) for _ in range(max(ks))]
    commit: dict[int, list[float]] = {k: [] for k in ks}
    decommit: dict[int, list[float]] = {k: [] for k in ks}
    try:
        for _ in range(reps):
            for k in ks:
                us, _ = timed(functools.partial(arena.commit_many, [(o, g) for o in offs[:k]]))
                commit[k].append(us)
                us, _ = timed(functools.partial(arena.decommit_many,
                                                [(o, 0) for o in offs[:k]]))
                decommit[k].append(us)
    finally:
        arena.close()
    # Open, and close with m mappings (one allocation, m one-granule handles).
    opens: list[float] = []
    close: dict[int, list[float]] = {m: [] for m in (1, 8, 32)}
    for _ in range(max(3, reps // 4)):
        for m in close:
            us, a = timed(functools.partial(Arena, td, reserve_bytes=m * g,
                                            name="calibrate-close"))
            opens.append(us)
            off = a.allocate(m * g)
            for i in range(1, m + 1):
                a.commit(off, i * g)
            us, _ = timed(a.close)
            close[m].append(us)
    # Arena.tensor: one view and its pin, what owner construction makes once per buffer.
    arena = Arena(td, reserve_bytes=4 * MiB, name="calibrate-views")
    off = arena.allocate(4 * MiB)
    arena.commit(off, 2 * MiB)  # CUDA's array interface refuses VA not mapped yet
    views: list[Any] = []
    view_us: list[float] = []
    try:
        for _ in range(plan.commit_reps):
            us, v = timed(lambda: arena.tensor(off, (1024,), "bfloat16"))
            views.append(v)
            view_us.append(us)
        views.clear()
    finally:
        views.clear()
        arena.close()
    work: dict[str, tuple[float, float]] = {
        "arena.commit": _line([(k, _tmean(v)) for k, v in commit.items()]),
        "arena.decommit": _line([(k, _tmean(v)) for k, v in decommit.items()]),
        "arena.close": _line([(m, _tmean(v)) for m, v in close.items()]),
        "arena.open": (_tmean(opens), 0.0),
        "arena.tensor": (_tmean(view_us), 0.0),
    }

    def arena_us(op: str, units: int) -> float:
        f, u = work[op]
        return f + u * units

    # The owner, per buffer, beyond its arena's operations.
    buffers = 2 * plan.layers
    o_open, o_close = [], []
    _owner(td, plan).close()  # warm-up: the first owner pays for imports and first calls
    for _ in range(plan.owner_reps):
        us, owner = timed(lambda: _owner(td, plan))
        # open: arena open, a view per buffer, slot 0 (grow + one commit of every buffer)
        o_open.append(us - arena_us("arena.open", 0) - buffers * arena_us("arena.tensor", 1)
                      - arena_us("arena.commit", buffers))
        us, _ = timed(owner.close)
        o_close.append(us - arena_us("arena.close", buffers))
    # ensure_prefix: steps with nothing to back, and steps that extend every buffer.
    noop: list[float] = []
    grow: list[float] = []
    resize: list[float] = []
    pages: list[float] = []
    for spec in ("exact", "default"):
        time.sleep(plan.settle_s)
        owner = _owner(td, plan, parse_policy(spec))
        try:
            for n in _steps(plan):
                us, _, calls = timed_calls(functools.partial(owner.ensure_prefix, n))
                ctx.sync()
                made = _creates(calls)
                if not calls:
                    noop.append(us)
                elif made == buffers:
                    grow.append(us - arena_us("arena.commit", made))
            if spec == "default":
                fin = plan.finalize_tokens or min(plan.reserved_tokens,
                                                  plan.grow_to_tokens + 4 * plan.step_tokens)
                us, _, calls = timed_calls(functools.partial(owner.finalize, fin))
                resize.append(us - arena_us("arena.commit", _creates(calls)))
                far = owner.pages - 1
                for p in range(far, max(far - 8, 1), -1):
                    us, _, calls = timed_calls(functools.partial(owner.commit_pages, [p]))
                    pages.append(us - arena_us("arena.commit", _creates(calls)))
        finally:
            owner.close()
    noop_us = _tmean(noop) if noop else 0.0
    per_buffer = {
        "owner.open": o_open, "owner.close": o_close,
        "owner.ensure_prefix": [noop_us],
        # a growing step is an ensure_prefix (its check) plus the growth itself
        "owner.grow": [u - noop_us for u in grow] if grow else [],
        # finalize = its check + owner.grow + the arena's commit
        "owner.resize": ([u - _tmean(grow) + noop_us for u in resize]
                         if resize and grow else []),
        "owner.pages": pages,
    }
    for op, vals in per_buffer.items():
        if vals:
            work[op] = (0.0, max(0.0, _tmean(vals) / buffers))
    return {
        "wrapper_us_per_call": round(wrap_s * 1e6, 3),
        "buffers": buffers,
        "work": {op: {"fixed": round(f, 3), "per_unit": round(u, 4), "unit": WORK_UNITS[op]}
                 for op, (f, u) in sorted(work.items())},
        "samples": {
            "arena.commit_by_handles": {k: _us([x / 1e6 for x in v]) for k, v in commit.items()},
            "arena.decommit_by_mappings": {k: _us([x / 1e6 for x in v])
                                           for k, v in decommit.items()},
            "arena.close_by_mappings": {m: _us([x / 1e6 for x in v]) for m, v in close.items()},
            "noop_steps": len(noop), "growing_steps": len(grow),
        },
    }


def growth(ctx: Ctx) -> dict[str, Any]:
    """Decode growth per policy, settled rounds (order rotated), and each grown owner's close,
    every driver call timed inside them (``in_context``: what the profile's call costs are).

    The calls are timed through the wrapper driver in the same rounds whose walls are the
    measured growths (less the wrapper's own cost per call), so the call costs and the
    growths they must add up to come from the same minutes of the card: calibrating from one
    extra round instead let one slow round move a whole profile by 30%.
    """
    plan = ctx.plan
    td = ctx.td
    wrap_s = wrapper_cost_s(td)
    specs = list(plan.policies)
    out: dict[str, Any] = {s: {"policy": str(parse_policy(s)), "grow_us": [], "close_us": [],
                               "construct_us": []} for s in specs}
    rounds: list[dict[str, dict[int, list[float]]]] = []
    steps = list(_steps(plan))
    q = max(1, len(steps) // 4)
    drift: dict[str, dict[str, dict[str, list[float]]]] = {}

    def timed(fn: Callable[[], Any]) -> tuple[float, Any, list[tuple[str, int, float]]]:
        with td.record() as calls:
            t0 = time.perf_counter()
            r = fn()
            ctx.sync()
            wall = time.perf_counter() - t0
        return max(0.0, wall - wrap_s * len(calls)), r, list(calls)

    for r in range(plan.rounds):
        got: dict[str, dict[int, list[float]]] = {}
        rounds.append(got)

        def add(op: str, size: int, dt: float, got: dict[str, dict[int, list[float]]] = got
                ) -> None:
            got.setdefault(op, {}).setdefault(size // MiB, []).append(dt)

        for spec in specs[r % len(specs):] + specs[:r % len(specs)]:
            time.sleep(plan.settle_s)
            ctor_s, owner, _ = timed(functools.partial(_owner, td, plan, parse_policy(spec)))
            per_step: list[list[tuple[str, int, float]]] = []
            t0 = time.perf_counter()
            for n in steps:
                with td.record() as calls:
                    owner.ensure_prefix(n)
                per_step.append(list(calls))
            ctx.sync()
            grow_s = time.perf_counter() - t0 - wrap_s * sum(len(c) for c in per_step)
            if spec == specs[0] and plan.finalize_tokens:
                fin_s, _, _ = timed(functools.partial(owner.finalize, plan.finalize_tokens))
                out[spec].setdefault("finalize_us", []).append(round(fin_s * 1e6, 1))
            # run size -> its mapping sizes, for the unmaps of the close (one per buffer)
            runs: dict[int, list[int]] = {}
            by_alloc: dict[str, list[int]] = {}
            for m in owner.snapshot().arena.mappings:
                by_alloc.setdefault(m.allocation, []).append(m.size_bytes)
            for sizes in by_alloc.values():
                runs.setdefault(sum(sizes), sizes)
            close_s, _, closing = timed(owner.close)
            row = out[spec]
            row["construct_us"].append(round(ctor_s * 1e6, 1))
            row["grow_us"].append(round(grow_s * 1e6, 1))
            row["close_us"].append(round(close_s * 1e6, 1))
            # Construction's calls are not points: its maps are each the first in their
            # region (first_touch measures that extra on its own).
            for op, size, dt in (c for cs in per_step for c in cs):
                add(op, size, dt)
            for op, size, dt in closing:
                shape = runs.get(size) if op == "unmap" else None
                if shape is not None and len(shape) > 1:  # a buffer's run: per mapping
                    add("unmap_per_mapping", int(statistics.median(shape)), dt / len(shape))
                else:
                    add(op, size, dt)
            for op in ("create", "set_access"):
                d = drift.setdefault(spec, {}).setdefault(op, {"first": [], "last": []})
                d["first"] += [c[2] for cs in per_step[:q] for c in cs if c[0] == op]
                d["last"] += [c[2] for cs in per_step[-q:] for c in cs if c[0] == op]
        # A fresh owner closed at once: its unmaps are of one-page (granule) mappings, the
        # small end of the per-unmap cost (decommits of pages and holes are that size).
        time.sleep(plan.settle_s)
        owner = _owner(td, plan, parse_policy(specs[0]))
        ctx.sync()
        close_s, _, closing = timed(owner.close)
        for op, size, dt in closing:
            add(op, size, dt)
        fresh = out.setdefault("fresh", {"policy": "fresh owner, closed at once", "fresh": True,
                                         "close_us": []})
        fresh["close_us"].append(round(close_s * 1e6, 1))
    time.sleep(plan.settle_s)
    out["in_context"] = _in_context(rounds, drift)
    return out


def _in_context(rounds: Sequence[Mapping[str, Mapping[int, Sequence[float]]]],
                drift: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]],
                ) -> dict[str, Any]:
    """Per op and size, the median over rounds of each round's trimmed mean (one slow round
    does not move it), with the calls seen in all rounds; and the drift within a growth."""
    points: dict[str, list[list[float]]] = {}
    ops = sorted({op for got in rounds for op in got})
    for op in ops:
        sizes = sorted({mib for got in rounds for mib in got.get(op, {})})
        pts = []
        for mib in sizes:
            per_round = [_tmean(got[op][mib]) for got in rounds if got.get(op, {}).get(mib)]
            n = sum(len(got[op][mib]) for got in rounds if got.get(op, {}).get(mib))
            pts.append([mib, round(statistics.median(per_round) * 1e6, 3), n])
        points[op] = pts
    return {
        "unit": ("[[MiB, µs, calls], ...] per op by handle size (unmap_per_mapping: per "
                 "mapping covered): the median over rounds of each round's trimmed mean"),
        "points": points,
        "rounds": len(rounds),
        "drift": {spec: {op: {"first_quarter_us": _us(v["first"]) if v["first"] else None,
                              "last_quarter_us": _us(v["last"]) if v["last"] else None}
                         for op, v in row.items()}
                  for spec, row in drift.items()},
    }


def bandwidth(ctx: Ctx) -> dict[str, Any]:
    """TB/s of a bf16 copy by how the memory was mapped, two runs each (the shipped format)."""
    if not ctx.cuda:
        return {"skipped": "needs a GPU"}
    import torch

    from kvvmm.arena import Arena
    from kvvmm.measure.timer import _bandwidth

    plan, d = ctx.plan, ctx.td.inner
    nbytes = plan.bandwidth_bytes
    runs: dict[str, list[float]] = {}

    def plain() -> list[float]:
        a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{d.device}")
        b = torch.empty_like(a)
        a.normal_()
        out = [_bandwidth(b, a) for _ in range(2)]
        del a, b
        torch.cuda.empty_cache()
        return out

    def vmm(handle_mib: int, interleaved: bool) -> list[float]:
        step = nbytes if handle_mib == 0 else handle_mib * MiB
        with Arena(d, reserve_bytes=4 * nbytes, name="bandwidth") as arena:
            offs = [arena.allocate(nbytes) for _ in range(4 if interleaved else 2)]
            # Interleaved: handles created turn by turn for every allocation, as decode
            # growth of several buffers makes them (docs/MEASUREMENTS.md §4).
            groups = [offs] if interleaved else [[o] for o in offs]
            for group in groups:
                for done in range(step, nbytes + 1, step):
                    for o in group:
                        arena.commit(o, done)
            src = arena.tensor(offs[0], (nbytes // 2,), "bfloat16")
            dst = arena.tensor(offs[1], (nbytes // 2,), "bfloat16")
            src.normal_()
            out = [_bandwidth(dst, src) for _ in range(2)]
            del src, dst
            ctx.sync()
        return out

    runs["plain"] = plain()
    for h in plan.bandwidth_handles_mib:
        runs["vmm_1handle" if h == 0 else f"vmm_{h}MiB"] = vmm(h, False)
    for h in plan.bandwidth_handles_mib:
        if 0 < h <= 8:
            runs[f"vmm_{h}MiB_interleaved"] = vmm(h, True)
    runs["plain_again"] = plain()
    return {"tensor_bytes": nbytes, "runs": runs}


def post_release(ctx: Ctx) -> dict[str, Any]:
    """Creates right after releasing a lot of memory, against the same creates settled."""
    plan, d = ctx.plan, ctx.td.inner
    free, _ = d.mem_info()
    big = min(512 * MiB, plan.release_bytes)  # handles of the released memory
    release = max(big, min(plan.release_bytes, (free // 2) // big * big))
    size = plan.slow_create_mib * MiB
    n = min(plan.slow_creates, max(1, int(free // 4 // size)))

    def creates() -> list[float]:
        hs, ts = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            hs.append(d.create(size))
            ts.append(time.perf_counter() - t0)
        for h in hs:
            d.release(h)
        return ts

    reps = []
    for _ in range(plan.slow_repeats):
        time.sleep(plan.settle_s)
        settled = creates()
        time.sleep(plan.settle_s)
        # Backed and mapped as an owner's memory is, then given back as its close does.
        va = d.reserve(release)
        hs = [d.create(big) for _ in range(release // big)]
        for i, h in enumerate(hs):
            d.map(va + i * big, big, h)
        d.set_access(va, release)
        ctx.sync()
        for i, h in enumerate(hs):
            d.unmap(va + i * big, big)
            d.release(h)
        d.free(va, release)
        after = creates()
        reps.append({"settled_mean_us": round(statistics.fmean(settled) * 1e6, 3),
                     "after_mean_us": round(statistics.fmean(after) * 1e6, 3),
                     "settled_median_us": _median_us(settled), "after_median_us": _median_us(after),
                     "ratio_of_means": round(statistics.fmean(after) / statistics.fmean(settled),
                                             4)})
    time.sleep(plan.settle_s)
    return {"released_bytes": release, "create_bytes": size, "creates": n, "repeats": reps}


SECTIONS: tuple[tuple[str, Callable[[Ctx], dict[str, Any]]], ...] = (
    ("per_call", per_call), ("reserve_free", reserve_free), ("access_multi", access_multi),
    ("first_touch", first_touch), ("library", library), ("growth", growth),
    ("bandwidth", bandwidth), ("post_release", post_release),
)


# -- from measurements to a profile (pure: tests run these on CPU) ------------------------


def slowdown_verdict(m: Mapping[str, Any], *, min_ratio: float = 1.15,
                     max_spread: float = 0.5) -> dict[str, Any]:
    """Whether the post-release slowdown is real and stable enough to model, and its figures.

    Real: every repeat's ratio (mean create after the release / settled) is at least
    ``min_ratio``. Stable: the repeats' range is at most ``max_spread`` of their median.
    """
    ratios = [float(r["ratio_of_means"]) for r in m.get("repeats", [])]
    base = {"measured": dict(m), "ratios": ratios,
            "source": (f"kvvmm calibrate: mean of {m.get('creates')} creates of "
                       f"{int(m.get('create_bytes', 0)) // MiB} MiB right after releasing "
                       f"{int(m.get('released_bytes', 0)) / GiB:.0f} GiB, over the same "
                       f"creates after a {'settled'} pause, {len(ratios)} repeats")}
    if len(ratios) < 2:
        return base | {"modelled": False, "why_not_modelled": "fewer than 2 repeats"}
    med = statistics.median(ratios)
    if min(ratios) < min_ratio:
        return base | {"modelled": False, "why_not_modelled":
                       f"not in every repeat (ratios {ratios}, below {min_ratio} in some)"}
    if (max(ratios) - min(ratios)) > max_spread * med:
        return base | {"modelled": False, "why_not_modelled":
                       f"repeats disagree (ratios {ratios}: range over {max_spread:.0%} of "
                       f"the median)"}
    return base | {"modelled": True, "factor": round(med, 4), "creates": int(m["creates"]),
                   "min_released_bytes": int(m["released_bytes"]) // 2}


def _points(per_call_m: Mapping[str, Any], op: str) -> list[list[float]]:
    return sorted([[int(k.removesuffix("MiB")), float(row[op])] for k, row in per_call_m.items()])


#: In-context sizes with fewer calls than this are too noisy to be a point of their own.
MIN_CONTEXT_CALLS = 16


def with_context(isolated: Sequence[Sequence[float]], context: Sequence[Sequence[float]],
                 ) -> tuple[list[list[float]], float | None]:
    """One op's call costs: the in-context points (``[MiB, µs, calls]``, those with enough
    calls) where kvvmm's operations made calls of that size; elsewhere the isolated points
    (``[MiB, µs]``) times the median ratio in-context/isolated at the in-context sizes.

    Returns the points and that ratio (None: no usable in-context point).
    """
    ctx_pts = [[float(m), float(u)] for m, u, *n in context
               if (n[0] if n else MIN_CONTEXT_CALLS) >= MIN_CONTEXT_CALLS]
    if not ctx_pts:
        return [[float(m), float(u)] for m, u in isolated], None
    if not isolated:
        return sorted(ctx_pts), 1.0
    curve = Log2Curve.from_points([(int(m * MiB), float(u)) for m, u in isolated])
    ratios = [u / curve(int(m * MiB)) for m, u in ctx_pts if curve(int(m * MiB)) > 0]
    factor = statistics.median(ratios) if ratios else 1.0
    lo, hi = min(m for m, _ in ctx_pts), max(m for m, _ in ctx_pts)
    rest = [[float(m), round(float(u) * factor, 3)] for m, u in isolated
            if m < lo / 1.5 or m > hi * 1.5]
    return sorted(ctx_pts + rest), round(factor, 4)


def _sim_calls(data: Mapping[str, Any], plan: Plan, spec: str,
               grow: bool = True) -> dict[str, Any]:
    """The driver calls of one growth scenario (``grow=False``: an owner made and closed),
    replayed on the simulator: the same sequence as on the GPU."""
    from kvvmm.driver.sim import SimDriver

    prof = profile_from_data(data, where="calibration in progress")
    td = TimedDriver(SimDriver(prof))
    with td.record() as ctor_calls:
        owner = _owner(td, plan, parse_policy(spec))
    with td.record() as grow_calls:
        for n in _steps(plan) if grow else ():
            owner.ensure_prefix(n)
    fin_calls: list[tuple[str, int, float]] = []
    if grow and spec == plan.policies[0] and plan.finalize_tokens:
        with td.record() as fin_calls:
            owner.finalize(plan.finalize_tokens)
    with td.record() as close_calls:
        owner.close()
    return {"construct": list(ctor_calls), "grow": list(grow_calls),
            "finalize": list(fin_calls), "close": list(close_calls)}


def _charge(data: Mapping[str, Any], calls: Sequence[tuple[str, int, float]]) -> float:
    """µs the profile's call costs (no library overhead) charge for these calls."""
    costs = sim_costs(profile_from_data(data, where="calibration in progress")).calls
    return sum(costs.mem_info_us if op == "mem_info" else costs(op, size)
               for op, size, _ in calls if op in costs.curves or op == "mem_info")


def _merge_sizes(points: Mapping[float, Sequence[float]], within: float = 1.5
                 ) -> list[list[float]]:
    """``{MiB: [us, ...]}`` -> ``[[MiB, us], ...]``, sizes within ``within`` x merged (their
    geometric mean size, their mean µs): two policies whose handles are about one size
    (Chunked(32 MiB)'s 30 and 32 MiB) measure one point, not a cliff between two."""
    groups: list[list[tuple[float, float]]] = []
    for mib in sorted(points):
        for us in points[mib]:
            if groups and mib <= groups[-1][0][0] * within:
                groups[-1].append((mib, us))
            else:
                groups.append([(mib, us)])
    return [[round(statistics.geometric_mean([m for m, _ in g]), 3),
             round(statistics.fmean([u for _, u in g]), 3)] for g in groups]


def fit_library_overhead(data: Mapping[str, Any], growth_m: Mapping[str, Any],
                         library_m: Mapping[str, Any] | None, plan: Plan) -> dict[str, Any]:
    """``library_overhead_us``: µs per create and per unmap the sim adds for kvvmm's own work.

    Fitted per policy as (measured growth - what the profile's call costs charge for the
    same calls, replayed on the simulator) / creates, and likewise (measured close - calls)
    / unmaps; the median over the policies is what the sim charges. The arena's and owner's
    work per operation (``library_m``) is kept beside it as measured.
    """
    per_create, per_unmap, rows = [], [], {}
    by_size: dict[str, dict[float, list[float]]] = {"create": {}, "unmap": {}}
    for spec, row in growth_m.items():
        if row.get("fresh") and row.get("close_us"):
            sim = _sim_calls(data, plan, plan.policies[0], grow=False)
            sizes = [c[1] for c in sim["close"] if c[0] == "unmap"]
            if sizes:
                meas = statistics.median(row["close_us"])
                us = round((meas - _charge(data, sim["close"])) / len(sizes), 3)
                mib = statistics.median(sizes) / MiB
                rows[spec] = {"policy": row["policy"], "unmaps": len(sizes),
                              "close_measured_us": meas, "us_per_unmap": us,
                              "unmap_median_mib": mib}
                by_size["unmap"].setdefault(mib, []).append(us)
            continue
        if not row.get("grow_us"):
            continue
        sim = _sim_calls(data, plan, spec)
        create_sizes = [c[1] for c in sim["grow"] if c[0] == "create"]
        unmap_sizes = [c[1] for c in sim["close"] if c[0] == "unmap"]
        creates, unmaps = len(create_sizes), len(unmap_sizes)
        grow_pred = _charge(data, sim["grow"])
        close_pred = _charge(data, sim["close"])
        grow_meas = statistics.median(row["grow_us"])
        close_meas = statistics.median(row["close_us"])
        r: dict[str, Any] = {"policy": row["policy"], "creates": creates, "unmaps": unmaps,
                             "grow_measured_us": grow_meas, "grow_calls_us": round(grow_pred, 1),
                             "close_measured_us": close_meas,
                             "close_calls_us": round(close_pred, 1)}
        if creates:
            r["us_per_create"] = round((grow_meas - grow_pred) / creates, 3)
            r["create_median_mib"] = statistics.median(create_sizes) / MiB
            per_create.append(r["us_per_create"])
            by_size["create"].setdefault(r["create_median_mib"], []).append(r["us_per_create"])
        if unmaps:
            r["us_per_unmap"] = round((close_meas - close_pred) / unmaps, 3)
            r["unmap_median_mib"] = statistics.median(unmap_sizes) / MiB
            per_unmap.append(r["us_per_unmap"])
            by_size["unmap"].setdefault(r["unmap_median_mib"], []).append(r["us_per_unmap"])
        rows[spec] = r
    per_call: dict[str, float] = {}
    if per_create:
        per_call["create"] = round(statistics.median(per_create), 3)
    if per_unmap:
        per_call["unmap"] = round(statistics.median(per_unmap), 3)
    # Each policy's handles lie around one size (Exact: a step's bytes; Chunked: its chunk),
    # so the residuals give the overhead by handle size: what the calls cost more in a growth
    # than alone depends on the size, as the calls themselves do.
    merged = {op: _merge_sizes(pts) for op, pts in by_size.items()}
    curves = {op: pts for op, pts in merged.items() if len(pts) >= 2}
    return {
        "unit": "µs of kvvmm's own work charged with each call of that kind",
        "per_call": per_call,
        "by_size": curves,
        "by_size_unit": ("µs per call by the handle size in MiB, [[MiB, us], ...]: each "
                         "policy's residual at its median handle size; where present it "
                         "replaces per_call for that call"),
        "source": ("kvvmm calibrate: settled decode growth (and the close of the grown "
                   "owner) per policy on the measured driver, minus what this profile's call costs "
                   "charge for the same calls replayed on the simulator, per create (per "
                   "unmap); the median over the policies. It holds the arena's and owner's "
                   "work per extension and what the calls cost more in a growth than alone"),
        "fit": rows,
        "measured": dict(library_m) if library_m else {},
        "measured_source": ("kvvmm calibrate: wall time of each operation minus its driver "
                            "calls timed inside a wrapper driver, less the wrapper's own cost "
                            "per call; not charged by the sim where no driver call carries it "
                            "(owner construction's tensors, steps with nothing to back)"),
    }


def build_profile(meas: Mapping[str, Any], meta: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
    """The ``kvvmm-hardware-profile`` JSON from what has been measured so far.

    Sections not measured (yet) are left out: the sim then uses the H200's, and says so.
    """
    date = str(meta["date"])
    card = str(meta["card"])
    how = (f"measured by kvvmm calibrate on {card}, {date} (driver {meta.get('driver')}, "
           f"torch {meta.get('torch')}, cuda-bindings {meta.get('cuda_bindings')}, kvvmm "
           f"{meta.get('kvvmm')})")
    data: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "key": str(meta["key"]), "name": card,
        "capacity_bytes": int(meta["capacity_bytes"]),
        "granularity_bytes": int(meta["granularity_bytes"]),
        "source": f"{how}: capacity from cuMemGetInfo, granularity cuMemGetAllocationGranularity",
        "date": date[:10],
        "measured_on": dict(meta),
    }
    pc, rf = meas.get("per_call"), meas.get("reserve_free")
    if pc or rf:
        points: dict[str, Any] = {}
        if pc:
            for op in ("create", "map", "set_access", "unmap", "release"):
                points[op] = _points(pc, op)
        if rf:
            for op in ("reserve", "free"):
                points[op] = sorted([int(k.removesuffix("GiB")) * 1024, float(row[op])]
                                    for k, row in rf["sizes"].items())
        ic = (meas.get("growth") or {}).get("in_context") or {}
        ic_points = ic.get("points", {}) if isinstance(ic, Mapping) else {}
        factors: dict[str, float | None] = {}
        isolated = {op: list(pts) for op, pts in points.items()}
        if ic_points:
            for op in list(points):
                points[op], factors[op] = with_context(points[op], ic_points.get(op, []))
        reps = dict(zip(plan.call_sizes_mib, plan.call_reps, strict=True))
        source = (f"{how}: mean per call (slowest 2% left out) through the "
                  f"{meta.get('driver_kind')} driver (unmap with the synchronize CudaDriver "
                  f"does first), all sizes in one reservation, interleaved in a fresh seeded "
                  f"order each rep; reps per size {reps}")
        if ic_points:
            source += (f". Where kvvmm's own operations made calls of a size (an owner's "
                       f"construction, decode growth and close per policy, calls timed inside "
                       f"them, at least {MIN_CONTEXT_CALLS} per size), those are the points; "
                       f"other sizes are the isolated ones times the op's in-context ratio "
                       f"(context_factor)")
        cc: dict[str, Any] = {
            "unit": "microseconds per call by handle size in MiB: [[MiB, us], ...]",
            "source": source,
            "points": points,
            "isolated_points": isolated,
            "context_factor": factors,
        }
        if rf:
            cc["mem_info_us"] = float(rf["mem_info_us"])
            cc["mem_info_source"] = f"{how}: median of 200 mem_info calls"
        data["call_costs"] = cc
    am = meas.get("access_multi")
    if am:
        data["set_access_per_mapping"] = {
            "unit": "µs per mapping covered by one set_access call, by mapping size in MiB",
            "points": sorted([int(r["mapping_mib"]), float(r["one_call_per_mapping_us"])]
                             for r in am.values()),
            "source": (f"{how}: one set_access over k fresh mappings, divided by k (median of "
                       f"{plan.access_reps} reps), beside k calls of one mapping each"),
            "measured": dict(am),
        }
    if am and all("unmap_per_mapping_us" in r for r in am.values()):
        iso = sorted([int(r["mapping_mib"]), float(r["unmap_per_mapping_us"])]
                     for r in am.values())
        ic = (meas.get("growth") or {}).get("in_context") or {}
        ctx_pts = ic.get("points", {}).get("unmap_per_mapping", []) if ic else []
        pts, factor = with_context(iso, ctx_pts)
        data["unmap_per_mapping"] = {
            "unit": "µs per mapping covered by one unmap call, by mapping size in MiB",
            "points": pts,
            "isolated_points": iso,
            "context_factor": factor,
            "source": (f"{how}: one unmap (with CudaDriver's synchronize) over k fresh "
                       f"mappings, divided by k (mean of {2 * plan.access_reps} reps)"
                       + ("; where the closes of grown owners unmapped runs of one mapping "
                          "size, those per mapping, the other sizes times their ratio"
                          if factor is not None else "")),
        }
    ft = meas.get("first_touch")
    if ft and "fresh" in ft:
        extra = {op: round(ft["fresh"][op] - ft["beside"][op], 3) for op in ("map", "set_access")}
        half = sum(ft["half_away"][op] - ft["beside"][op] for op in extra)
        whole = sum(extra.values())
        region = GiB // 2 if whole > 0 and half > 0.5 * whole else GiB
        per = "region"
        if "big" in ft:  # per region entered, or once per mapping? the closer of the two
            big_extra = sum(ft["big"]["fresh"][op] - ft["big"]["again"][op] for op in extra)
            regions = ft["big_mib"] * MiB // region
            if abs(big_extra - whole) < abs(big_extra - whole * regions):
                per = "mapping"
        data["first_touch"] = {
            "unit": "µs more for a map (set_access) whose mapping is the first in its region",
            "region_mib": region // MiB,
            "per": per,
            "map_us": max(0.0, extra["map"]), "set_access_us": max(0.0, extra["set_access"]),
            "modelled": whole > 0.2 * sum(ft["beside"][op] for op in extra),
            "source": (f"{how}: one granule mapped into each of 32 untouched 1 GiB regions of a "
                       f"fresh reservation, then one beside each, then one half a region away "
                       f"({ft['samples_per_case']} per case, means); the extra is fresh minus "
                       f"beside; the region is 512 MiB when half a region away costs over half "
                       f"the extra; modelled when the extra is over 20% of the calls. Paid per "
                       f"region a mapping enters or once per mapping: whichever is closer to "
                       f"what 2 GiB handles cost more mapped into fresh VA than mapped again"),
            "measured": dict(ft),
        }
    lib = meas.get("library")
    if lib and isinstance(lib.get("work"), Mapping):
        data["library_work_us"] = {
            **{op: dict(row) for op, row in lib["work"].items()},
            "unit": ("µs of kvvmm's own work per arena/owner operation: fixed + per_unit x "
                     "units (the unit named per operation)"),
            "source": (f"{how}: wall time of each operation minus the driver calls it made "
                       f"(timed inside a wrapper driver, less the wrapper's cost per call), "
                       f"fitted over 1, 8 and 32 handles or mappings for the arena's; the "
                       f"owner's per buffer beyond the arena operations it makes (the arena "
                       f"charges those), median over reps"),
            "samples": dict(lib.get("samples", {})),
        }
    if meas.get("growth"):
        data["library_overhead_us"] = fit_library_overhead(data, meas["growth"],
                                                           meas.get("library"), plan)
        data["library_overhead_us"]["source"] = f"{how}. " + data["library_overhead_us"][
            "source"]
        data["growth_measured"] = dict(meas["growth"])
    elif meas.get("library"):
        data["library_overhead_us"] = {"per_call": {}, "measured": dict(meas["library"]),
                                       "source": f"{how}: growth not measured, nothing fitted"}
    bw = meas.get("bandwidth")
    if bw and "runs" in bw:
        data["bandwidth"] = {"unit": "TB/s of a 1 GiB bf16 copy, one entry per run",
                             "tensor_bytes": int(bw["tensor_bytes"]),
                             "source": (f"{how}: copy of a bf16 tensor by how its memory was "
                                        f"mapped (kvvmm.bench's timing: median of 30 copies "
                                        f"per run)"),
                             "runs": bw["runs"]}
    pr = meas.get("post_release")
    if pr and pr.get("repeats"):
        v = slowdown_verdict(pr)
        v["source"] = f"{how}: " + v["source"]
        data["post_release_slowdown"] = v
    return data


# -- running it --------------------------------------------------------------------------


def _card_key(card: str) -> str:
    return card.lower().replace("nvidia ", "").strip().replace(" ", "-") or "gpu"


def _nvidia_driver() -> str:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout else "?"


def _meta(driver: Driver, cuda: bool, key: str | None) -> dict[str, Any]:
    import importlib.metadata as md

    from kvvmm._version import __version__

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "none"

    torch_v, cuda_v = "none", None
    if cuda:
        import torch

        torch_v, cuda_v = torch.__version__, torch.version.cuda
        card = torch.cuda.get_device_name(driver.device)
    else:
        card = f"{driver.kind} driver ({driver.name})"
    free, total = driver.mem_info()
    gran = int(getattr(driver, "granularity_min", driver.granularity()))
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "card": card, "key": key or _card_key(card),
        "driver": _nvidia_driver() if cuda else "none", "cuda_runtime": cuda_v,
        "torch": torch_v, "cuda_bindings": version("cuda-bindings"), "kvvmm": __version__,
        "python": platform.python_version(), "capacity_bytes": total,
        "free_bytes_at_start": free, "granularity_bytes": gran, "driver_kind": driver.kind,
        # CudaDriver's hot calls in C (_cudafast) or Python: 0.4-0.6 µs a map apart (§2)
        "fast_path": getattr(driver, "fast_path", None),
    }


def measure(driver: Driver, plan: Plan, *, out: str, key: str | None = None,
            sections: Sequence[str] | None = None, cuda: bool = False,
            sync: Callable[[], None] = lambda: None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the sections on ``driver`` and write the profile to ``out`` after each one.

    A section that fails is recorded (``calibration.errors``) and the run goes on: one run on
    a borrowed GPU must leave every figure it could take. Works on any driver (the tests run
    it on the host driver with a tiny plan); the figures mean something only on CUDA.

    Returns:
        The profile as written (``calibration.complete`` true when every section ran).
    """
    td = TimedDriver(driver)
    ctx = Ctx(td, plan, sync, cuda)
    meta = _meta(driver, cuda, key)
    meas: dict[str, Any] = {}
    errors: dict[str, str] = {}
    names = [n for n, _ in SECTIONS if sections is None or n in sections]
    started = time.perf_counter()
    seconds: dict[str, float] = {}

    def write(complete: bool) -> dict[str, Any]:
        try:
            data = build_profile(meas, meta, plan)
        except Exception as e:  # a fit that fails must not lose the raw figures
            errors["build_profile"] = f"{type(e).__name__}: {e}"
            data = build_profile({k: v for k, v in meas.items() if k != "growth"}, meta, plan)
        data["calibration"] = {"complete": complete, "plan": plan_dict(plan),
                               "sections_done": list(meas), "errors": dict(errors),
                               "seconds": dict(seconds),
                               "wall_s": round(time.perf_counter() - started, 1),
                               "raw": meas}
        tmp = f"{out}.part"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, out)  # never a half-written profile at ``out``
        return data

    for name, fn in SECTIONS:
        if name not in names:
            continue
        if progress is not None:
            progress(name)
        t0 = time.perf_counter()
        try:
            meas[name] = fn(ctx)
        except Exception as e:  # recorded and reported; the other sections still run
            errors[name] = f"{type(e).__name__}: {str(e)[:500]}"
        seconds[name] = round(time.perf_counter() - t0, 2)
        write(False)
    return write(not errors)


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data (recorded in the profile: what was measured, how often)."""
    return dataclasses.asdict(plan)


def run(*, out: str | None, quick: bool, device: int = 0, key: str | None = None,
        sections: Sequence[str] | None = None) -> dict[str, Any]:
    """Calibrate the GPU ``device`` (CudaDriver) and write the profile; see the module docstring.

    Raises:
        DriverUnavailableError: no usable GPU.
    """
    from kvvmm.driver.cuda import CudaDriver

    try:
        import torch
    except ImportError as e:
        raise DriverUnavailableError(f"torch is not installed ({e})") from None
    if not torch.cuda.is_available():
        raise DriverUnavailableError("torch.cuda.is_available() is False")
    from kvvmm.measure.bench import _tqdm

    tqdm = _tqdm()
    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.empty(1, device=f"cuda:{device}")
    cd = CudaDriver(device=device)
    plan = QUICK if quick else FULL
    card = _card_key(torch.cuda.get_device_name(device))
    path = out or f"{key or card}-profile.json"
    names = [n for n, _ in SECTIONS if sections is None or n in sections]
    with tqdm(total=len(names), file=sys.stderr, unit="section", dynamic_ncols=True) as bar:
        started: list[str] = []

        def progress(label: str) -> None:  # called as each section starts
            if started:
                bar.update()
            started.append(label)
            bar.set_description_str(label)

        try:
            data = measure(cd, plan, out=path, key=key, sections=sections, cuda=True,
                           sync=lambda: torch.cuda.synchronize(device), progress=progress)
        finally:
            bar.update(len(names) - bar.n)
    try:
        cd.close()
    except KvvmmError as e:  # the profile is written; what the driver still holds goes at exit
        print(f"kvvmm calibrate: warning: closing the driver: {e}", file=sys.stderr)
    data["path"] = path
    return data


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvvmm calibrate``."""
    ap = argparse.ArgumentParser(prog="kvvmm calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None,
                    help="profile JSON to write (default: <card>-profile.json); rewritten "
                         "after every section")
    ap.add_argument("--quick", action="store_true", help="fewer sizes, one round (~1 min)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--key", default=None, help="the profile's key (default: from the card)")
    ap.add_argument("--sections", default=None,
                    help=f"comma-separated subset of {','.join(n for n, _ in SECTIONS)}")
    args = ap.parse_args(argv)
    sections = None if args.sections is None else [s.strip() for s in args.sections.split(",")]
    unknown = sorted(set(sections or ()) - {n for n, _ in SECTIONS})
    if unknown:
        print(f"kvvmm calibrate: error: unknown sections {unknown}", file=sys.stderr)
        return 2
    try:
        data = run(out=args.out, quick=args.quick, device=args.device, key=args.key,
                   sections=sections)
    except DriverUnavailableError as e:
        one = str(e).replace("\n", " ")
        print(f"kvvmm calibrate: needs a CUDA GPU; none is usable here ({one})",
              file=sys.stderr)
        return 2
    except ImportError as e:  # tqdm (a kvvmm dependency) or cuda-python missing
        print(f"kvvmm calibrate: error: {e} ({' '.join(getattr(e, '__notes__', []))})",
              file=sys.stderr)
        return 2
    cal = data["calibration"]
    lo = data.get("library_overhead_us", {}).get("per_call")
    print(json.dumps({"path": data["path"], "complete": cal["complete"],
                      "errors": cal["errors"], "seconds": cal["seconds"],
                      "library_overhead_per_call_us": lo,
                      "post_release_modelled": data.get("post_release_slowdown", {})
                      .get("modelled")}, indent=1))
    return 0 if cal["complete"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""``kvvmm calibrate``'s sections on kvvmm's own operations: the library's work per arena and
owner operation, decode growth per policy with every call timed inside it, and copy bandwidth
by how the memory was mapped."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvvmm.measure.fit import _in_context, _line
from kvvmm.measure.plan import Ctx
from kvvmm.measure.stats import mean_us, trimmed_mean
from kvvmm.measure.timer import TimedDriver, rotated, wrapper_cost_s
from kvvmm.policy import parse_policy
from kvvmm.units import MiB

__all__ = ["WORK_UNITS", "bandwidth", "growth", "library"]


def _creates(calls: Sequence[tuple[str, int, float]]) -> int:
    return sum(1 for c in calls if c[0] == "create")


#: The operations the arena and the owner tell the simulator, and their unit.
WORK_UNITS = {
    "arena.open": "none", "arena.commit": "handle made", "arena.decommit": "mapping given back",
    "arena.tensor": "view", "arena.close": "mapping given back",
    "owner.open": "buffer", "owner.ensure_prefix": "buffer", "owner.grow": "buffer",
    "owner.resize": "buffer", "owner.pages": "buffer", "owner.close": "buffer",
}


#: What :func:`_own_us` gives: µs of an operation's own work, its result, its driver calls.
Timed = Callable[[Callable[[], Any]], tuple[float, Any, list[tuple[str, int, float]]]]


def _own_us(td: TimedDriver, wrap_s: float, fn: Callable[[], Any],
            ) -> tuple[float, Any, list[tuple[str, int, float]]]:
    """µs of ``fn``'s own work (its wall less its driver calls and the wrapper's cost per
    call), its result and the driver calls it made."""
    with td.record() as calls:
        t0 = time.perf_counter()
        r = fn()
        wall = time.perf_counter() - t0
    return (wall - sum(c[2] for c in calls) - wrap_s * len(calls)) * 1e6, r, list(calls)


def _arena_samples(td: TimedDriver, timed: Timed, reps: int, views: int,
                   ) -> dict[str, dict[int, list[float]]]:
    """µs of the arena's own work by operation and units: commit and decommit of k
    allocations of one granule each (given back each rep, so memory stays at 32 granules),
    open, close with m mappings, and ``views`` tensors (what an owner makes per buffer)."""
    from kvvmm.arena import Arena

    g = td.granularity()
    ks = (1, 8, 32)
    got: dict[str, dict[int, list[float]]] = {
        "arena.commit": {k: [] for k in ks}, "arena.decommit": {k: [] for k in ks},
        "arena.close": {k: [] for k in ks}, "arena.open": {0: []}, "arena.tensor": {1: []}}
    arena = Arena(td, reserve_bytes=max(ks) * g, name="calibrate")
    offs = [arena.allocate(g) for _ in range(max(ks))]
    try:
        for _ in range(reps):
            for k in ks:
                got["arena.commit"][k].append(
                    timed(functools.partial(arena.commit_many, [(o, g) for o in offs[:k]]))[0])
                got["arena.decommit"][k].append(
                    timed(functools.partial(arena.decommit_many, [(o, 0) for o in offs[:k]]))[0])
    finally:
        arena.close()
    for _ in range(max(3, reps // 4)):  # open, and close with m one-granule handles
        for m in ks:
            us, a, _ = timed(functools.partial(Arena, td, reserve_bytes=m * g,
                                               name="calibrate-close"))
            got["arena.open"][0].append(us)
            off = a.allocate(m * g)
            for i in range(1, m + 1):
                a.commit(off, i * g)
            got["arena.close"][m].append(timed(a.close)[0])
    arena = Arena(td, reserve_bytes=4 * MiB, name="calibrate-views")
    off = arena.allocate(4 * MiB)
    arena.commit(off, 2 * MiB)  # CUDA's array interface refuses VA not mapped yet
    made: list[Any] = []  # kept alive while the others are timed, as an owner's are
    try:
        for _ in range(views):
            us, v, _ = timed(lambda: arena.tensor(off, (1024,), "bfloat16"))
            made.append(v)
            got["arena.tensor"][1].append(us)
    finally:
        made.clear()
        arena.close()
    return got


def _owner_steps(ctx: Ctx, timed: Timed, commit_us: Callable[[int], float],
                 ) -> dict[str, list[float]]:
    """µs of the owner's ensure_prefix steps with nothing to back (``noop``), steps that
    extend every buffer (``grow``, less the arena's commit), a finalize (``resize``) and far
    page commits (``pages``), on Exact's and the default policy's growths."""
    plan, w = ctx.plan, ctx.plan.workload
    got: dict[str, list[float]] = {"noop": [], "grow": [], "resize": [], "pages": []}
    for spec in ("exact", "default"):
        ctx.pause(plan.settle_s)
        owner = w.owner(ctx.td, parse_policy(spec))
        try:
            for n in w.decode_steps():
                us, _, calls = timed(functools.partial(owner.ensure_prefix, n))
                ctx.sync()
                if not calls:
                    got["noop"].append(us)
                elif _creates(calls) == w.buffers:
                    got["grow"].append(us - commit_us(w.buffers))
            if spec == "default":
                fin = plan.finalize_tokens or min(plan.reserved_tokens,
                                                  plan.grow_to_tokens + 4 * plan.step_tokens)
                us, _, calls = timed(functools.partial(owner.finalize, fin))
                got["resize"].append(us - commit_us(_creates(calls)))
                far = owner.pages - 1
                for p in range(far, max(far - 8, 1), -1):
                    us, _, calls = timed(functools.partial(owner.commit_pages, [p]))
                    got["pages"].append(us - commit_us(_creates(calls)))
        finally:
            owner.close()
    return got


def library(ctx: Ctx) -> dict[str, Any]:
    """kvvmm's own work per arena and owner operation: wall time minus its driver calls.

    Each operation as the simulator is told it (:data:`WORK_UNITS`): the arena's by
    handles or mappings, the owner's per buffer *beyond* the arena operations it makes
    (those are the arena's to charge), fitted as ``fixed + per_unit * units``.
    """
    td, plan, w = ctx.td, ctx.plan, ctx.plan.workload
    wrap_s = wrapper_cost_s(td)
    timed: Timed = functools.partial(_own_us, td, wrap_s)
    arena = _arena_samples(td, timed, max(4, plan.commit_reps // 8), plan.commit_reps)
    work = {op: _line([(k, trimmed_mean(v)) for k, v in by.items()]) for op, by in arena.items()}

    def arena_us(op: str, units: int) -> float:
        f, u = work[op]
        return f + u * units

    buffers = w.buffers
    o_open, o_close = [], []
    w.owner(td).close()  # warm-up: the first owner pays for imports and first calls
    for _ in range(plan.owner_reps):
        us, owner, _ = timed(lambda: w.owner(td))
        # open: arena open, a view per buffer, slot 0 (grow + one commit of every buffer)
        o_open.append(us - arena_us("arena.open", 0) - buffers * arena_us("arena.tensor", 1)
                      - arena_us("arena.commit", buffers))
        o_close.append(timed(owner.close)[0] - arena_us("arena.close", buffers))
    steps = _owner_steps(ctx, timed, functools.partial(arena_us, "arena.commit"))
    noop_us = trimmed_mean(steps["noop"]) if steps["noop"] else 0.0
    grow = steps["grow"]
    per_buffer = {
        "owner.open": o_open, "owner.close": o_close,
        "owner.ensure_prefix": [noop_us],
        # a growing step is an ensure_prefix (its check) plus the growth itself
        "owner.grow": [u - noop_us for u in grow],
        # finalize = its check + owner.grow + the arena's commit
        "owner.resize": ([u - trimmed_mean(grow) + noop_us for u in steps["resize"]]
                         if grow else []),
        "owner.pages": steps["pages"],
    }
    for op, vals in per_buffer.items():
        if vals:
            work[op] = (0.0, max(0.0, trimmed_mean(vals) / buffers))
    return {
        "wrapper_us_per_call": round(wrap_s * 1e6, 3),
        "buffers": buffers,
        "work": {op: {"fixed": round(f, 3), "per_unit": round(u, 4), "unit": WORK_UNITS[op]}
                 for op, (f, u) in sorted(work.items())},
        "samples": {
            f"{op}_by_{'handles' if op == 'arena.commit' else 'mappings'}":
                {k: mean_us([x / 1e6 for x in v]) for k, v in arena[op].items()}
            for op in ("arena.commit", "arena.decommit", "arena.close")}
        | {"noop_steps": len(steps["noop"]), "growing_steps": len(grow)},
    }


Calls = list[tuple[str, int, float]]


@dataclass(frozen=True, slots=True)
class _Grown:
    """One settled growth of a policy, every call timed inside it (seconds)."""

    construct_s: float
    grow_s: float  #: the steps' wall, less the wrapper's cost per call
    finalize_s: float | None  #: None: not finalized
    close_s: float
    steps: list[Calls]  #: each step's calls
    closing: Calls  #: the close's calls
    runs: dict[int, list[int]]  #: a buffer's run size -> its mapping sizes


def _grow_once(ctx: Ctx, spec: str, wrap_s: float, timed: Callable[..., Any]) -> _Grown:
    """``spec``'s decode growth after a settling pause: construction, the steps, a finalize
    (the first policy, if the plan finalizes) and the close."""
    plan, w, td = ctx.plan, ctx.plan.workload, ctx.td
    ctx.pause(plan.settle_s)
    ctor_s, owner, _ = timed(functools.partial(w.owner, td, parse_policy(spec)))
    steps: list[Calls] = []
    t0 = time.perf_counter()
    for n in w.decode_steps():
        with td.record() as calls:
            owner.ensure_prefix(n)
        steps.append(list(calls))
    ctx.sync()
    grow_s = time.perf_counter() - t0 - wrap_s * sum(len(c) for c in steps)
    fin_s = None
    if spec == plan.policies[0] and plan.finalize_tokens:
        fin_s, _, _ = timed(functools.partial(owner.finalize, plan.finalize_tokens))
    # run size -> its mapping sizes, for the unmaps of the close (one per buffer)
    runs: dict[int, list[int]] = {}
    by_alloc: dict[str, list[int]] = {}
    for m in owner.snapshot().arena.mappings:
        by_alloc.setdefault(m.allocation, []).append(m.size_bytes)
    for sizes in by_alloc.values():
        runs.setdefault(sum(sizes), sizes)
    close_s, _, closing = timed(owner.close)
    return _Grown(ctor_s, grow_s, fin_s, close_s, steps, closing, runs)


def _add(got: dict[str, dict[int, list[float]]], op: str, size: int, dt: float) -> None:
    got.setdefault(op, {}).setdefault(size // MiB, []).append(dt)


def _add_grown(add: Callable[[str, int, float], None], g: _Grown) -> None:
    """The calls of a growth's steps and its close as points (a buffer's run of several
    mappings unmapped at once: per mapping, as ``unmap_per_mapping``). Construction's calls
    are not points: its maps are each the first in their region (first_touch measures that
    extra on its own)."""
    for op, size, dt in (c for cs in g.steps for c in cs):
        add(op, size, dt)
    for op, size, dt in g.closing:
        shape = g.runs.get(size) if op == "unmap" else None
        if shape is not None and len(shape) > 1:
            add("unmap_per_mapping", int(statistics.median(shape)), dt / len(shape))
        else:
            add(op, size, dt)


def growth(ctx: Ctx) -> dict[str, Any]:
    """Decode growth per policy, settled rounds (order rotated), and each grown owner's close,
    every driver call timed inside them (``in_context``: what the profile's call costs are).

    The calls are timed (through the wrapper, less its cost per call) in the same rounds whose
    walls are the measured growths, so the call costs and the growths they must add up to come
    from the same minutes of the card.
    """
    plan, td = ctx.plan, ctx.td
    wrap_s = wrapper_cost_s(td)
    specs = list(plan.policies)
    out: dict[str, Any] = {s: {"policy": str(parse_policy(s)), "grow_us": [], "close_us": [],
                               "construct_us": []} for s in specs}
    rounds: list[dict[str, dict[int, list[float]]]] = []
    q = max(1, len(plan.workload.decode_steps()) // 4)
    drift: dict[str, dict[str, dict[str, list[float]]]] = {}

    def timed(fn: Callable[[], Any]) -> tuple[float, Any, Calls]:
        with td.record() as calls:
            t0 = time.perf_counter()
            r = fn()
            ctx.sync()
            wall = time.perf_counter() - t0
        return max(0.0, wall - wrap_s * len(calls)), r, list(calls)

    for r in range(plan.rounds):
        got: dict[str, dict[int, list[float]]] = {}
        rounds.append(got)
        add = functools.partial(_add, got)
        for spec in rotated(specs, r):
            g = _grow_once(ctx, spec, wrap_s, timed)
            row = out[spec]
            if g.finalize_s is not None:
                row.setdefault("finalize_us", []).append(round(g.finalize_s * 1e6, 1))
            for key, sec in (("construct_us", g.construct_s), ("grow_us", g.grow_s),
                             ("close_us", g.close_s)):
                row[key].append(round(sec * 1e6, 1))
            _add_grown(add, g)
            for op in ("create", "set_access"):
                d = drift.setdefault(spec, {}).setdefault(op, {"first": [], "last": []})
                d["first"] += [c[2] for cs in g.steps[:q] for c in cs if c[0] == op]
                d["last"] += [c[2] for cs in g.steps[-q:] for c in cs if c[0] == op]
        # A fresh owner closed at once: its unmaps are of one-page (granule) mappings, the
        # small end of the per-unmap cost (decommits of pages and holes are that size).
        ctx.pause(plan.settle_s)
        owner = plan.workload.owner(td, parse_policy(specs[0]))
        ctx.sync()
        close_s, _, closing = timed(owner.close)
        for op, size, dt in closing:
            add(op, size, dt)
        fresh = out.setdefault("fresh", {"policy": "fresh owner, closed at once", "fresh": True,
                                         "close_us": []})
        fresh["close_us"].append(round(close_s * 1e6, 1))
    ctx.pause(plan.settle_s)
    out["in_context"] = _in_context(rounds, drift)
    return out


def bandwidth(ctx: Ctx) -> dict[str, Any]:
    """TB/s of a bf16 copy by how the memory was mapped, two runs each (the shipped format)."""
    if not ctx.cuda:
        return {"skipped": "needs a GPU"}
    import torch

    from kvvmm.arena import Arena
    from kvvmm.measure.timer import copy_tb_s

    plan, d = ctx.plan, ctx.td.inner
    nbytes = plan.bandwidth_bytes
    runs: dict[str, list[float]] = {}

    def plain() -> list[float]:
        a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=f"cuda:{d.device}")
        b = torch.empty_like(a)
        a.normal_()
        out = [copy_tb_s(b, a) for _ in range(2)]
        del a, b
        torch.cuda.empty_cache()
        return out

    def vmm(handle_mib: int, interleaved: bool) -> list[float]:
        step = nbytes if handle_mib == 0 else handle_mib * MiB
        with Arena(d, reserve_bytes=4 * nbytes, name="bandwidth") as arena:
            offs = [arena.allocate(nbytes) for _ in range(4 if interleaved else 2)]
            # Interleaved: handles created turn by turn for every allocation, as decode
            # growth of several buffers makes them.
            groups = [offs] if interleaved else [[o] for o in offs]
            for group in groups:
                for done in range(step, nbytes + 1, step):
                    for o in group:
                        arena.commit(o, done)
            src = arena.tensor(offs[0], (nbytes // 2,), "bfloat16")
            dst = arena.tensor(offs[1], (nbytes // 2,), "bfloat16")
            src.normal_()
            out = [copy_tb_s(dst, src) for _ in range(2)]
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


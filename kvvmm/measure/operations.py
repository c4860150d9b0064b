"""``kvvmm calibrate``'s sections on kvvmm's own operations: the library's work per arena and
owner operation, decode growth per policy with every call timed inside it, and copy bandwidth
by how the memory was mapped."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvvmm.measure.fit import _in_context, _line
from kvvmm.measure.plan import Ctx
from kvvmm.measure.stats import mean_us, trimmed_mean
from kvvmm.measure.timer import rotated, wrapper_cost_s
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


def library(ctx: Ctx) -> dict[str, Any]:
    """kvvmm's own work per arena and owner operation: wall time minus its driver calls.

    Each operation as the simulator is told it (:data:`WORK_UNITS`): the arena's by
    handles or mappings, the owner's per buffer *beyond* the arena operations it makes
    (those are the arena's to charge), fitted as ``fixed + per_unit * units``.
    """
    from kvvmm.arena import Arena

    td, plan = ctx.td, ctx.plan
    w = plan.workload
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
        "arena.commit": _line([(k, trimmed_mean(v)) for k, v in commit.items()]),
        "arena.decommit": _line([(k, trimmed_mean(v)) for k, v in decommit.items()]),
        "arena.close": _line([(m, trimmed_mean(v)) for m, v in close.items()]),
        "arena.open": (trimmed_mean(opens), 0.0),
        "arena.tensor": (trimmed_mean(view_us), 0.0),
    }

    def arena_us(op: str, units: int) -> float:
        f, u = work[op]
        return f + u * units

    # The owner, per buffer, beyond its arena's operations.
    buffers = 2 * plan.layers
    o_open, o_close = [], []
    w.owner(td).close()  # warm-up: the first owner pays for imports and first calls
    for _ in range(plan.owner_reps):
        us, owner = timed(lambda: w.owner(td))
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
        owner = w.owner(td, parse_policy(spec))
        try:
            for n in w.decode_steps():
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
    noop_us = trimmed_mean(noop) if noop else 0.0
    per_buffer = {
        "owner.open": o_open, "owner.close": o_close,
        "owner.ensure_prefix": [noop_us],
        # a growing step is an ensure_prefix (its check) plus the growth itself
        "owner.grow": [u - noop_us for u in grow] if grow else [],
        # finalize = its check + owner.grow + the arena's commit
        "owner.resize": ([u - trimmed_mean(grow) + noop_us for u in resize]
                         if resize and grow else []),
        "owner.pages": pages,
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
            "arena.commit_by_handles": {k: mean_us([x / 1e6 for x in v])
                                        for k, v in commit.items()},
            "arena.decommit_by_mappings": {k: mean_us([x / 1e6 for x in v])
                                           for k, v in decommit.items()},
            "arena.close_by_mappings": {m: mean_us([x / 1e6 for x in v]) for m, v in close.items()},
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
    w = plan.workload
    td = ctx.td
    wrap_s = wrapper_cost_s(td)
    specs = list(plan.policies)
    out: dict[str, Any] = {s: {"policy": str(parse_policy(s)), "grow_us": [], "close_us": [],
                               "construct_us": []} for s in specs}
    rounds: list[dict[str, dict[int, list[float]]]] = []
    steps = list(w.decode_steps())
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

        for spec in rotated(specs, r):
            time.sleep(plan.settle_s)
            ctor_s, owner, _ = timed(functools.partial(w.owner, td, parse_policy(spec)))
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
        owner = w.owner(td, parse_policy(specs[0]))
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
            # growth of several buffers makes them (docs/MEASUREMENTS.md §4).
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


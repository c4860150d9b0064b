"""Property tests: random operation sequences, valid and invalid, keep every invariant.

Three levels, each against a small model written here, independently of the library:

- an :class:`Arena` (allocate / commit / commit_many / decommit / decommit_many): the model
  predicts which calls are refused and which handles each allocation holds;
- a :class:`KvBufferOwner` (ensure_prefix / finalize / shrink) over several layouts and
  growth policies: spans stay backed, shrink gives back only whole mappings beyond the span;
- the raw :class:`SimDriver` (a hypothesis state machine): refused exactly when the rules
  say, with the right CUDA error name, and its accounting equals the model's.

After every step: the snapshot's conservation check holds, the arena's backed bytes equal
the driver's physical and mapped bytes (one arena per driver), every map attaches a whole
handle, and a refused call changes nothing. At the end, ``close()`` leaves the driver clean.
Host-driver runs are fewer and shorter: their calls are real mmaps.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvvmm import (
    Arena,
    Chunked,
    Exact,
    Geometric,
    KvBufferDesc,
    KvBufferOwner,
    KvvmmError,
    TracingDriver,
    mha_token_major,
    mla,
    page_major,
)
from kvvmm.driver import Driver, SimDriver
from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
)
from kvvmm.errors import DriverError
from kvvmm.units import MiB, align_up

G = 2 * MiB
SIM = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HOST = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
host_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                               reason="the host driver needs Linux")


def whole_handle_maps(trace_driver: TracingDriver) -> None:
    """Every successful map in the trace attaches a handle of exactly the mapped size."""
    created: dict[int, int] = {}
    for ev in trace_driver.trace.driver_calls():
        if ev.error is not None:
            continue
        if ev.op == "create":
            assert ev.result is not None
            created[ev.result] = ev.args["size"]
        elif ev.op == "map":
            assert created[ev.args["handle"]] == ev.args["size"], ev


def driver_matches(arena: Arena, driver: Driver) -> None:
    snap = arena.snapshot()
    snap.check()
    s = driver.stats()
    assert arena.backed_bytes == snap.backed_bytes == s.physical_bytes == s.mapped_bytes
    assert s.mappings == s.handles == len(snap.mappings)
    assert s.reservations == 1 and s.reserved_bytes == snap.reserved_bytes


# -- Arena ------------------------------------------------------------------------------------

ARENA_RESERVE = 24 * G + 1  # rounded up to 25 granules
SIZES = st.one_of(
    st.integers(-1, 8).map(lambda k: k * G),  # whole granules, and the edge cases 0 and -G
    st.integers(-10, 9 * G),  # anything, mostly misaligned
    st.sampled_from([True, 1.5, "4096"]),  # not an int at all
)


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Pick a strategy by weight (hypothesis' one_of does not weigh its branches)."""
    table = [s for w, s in choices for _ in range(w)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


# An offset: mostly an allocation's (by index, modulo how many there are), else any int.
OFFSETS = weighted(
    (3, st.integers(0, 7).map(lambda i: ("alloc", i))),
    (1, st.one_of(st.integers(-G, 30 * G), st.integers(-2, 30).map(lambda k: k * G)).map(
        lambda o: ("raw", o))),
)
_RAW = SIZES.map(lambda v: ("raw", v))
# A commit's size: mostly a fraction of the allocation's size, or a few granules more than is
# backed now (so that allocations get several mappings); else any.
COMMITS = st.tuples(OFFSETS, weighted((3, st.floats(0, 1).map(lambda f: ("rel", f))),
                                      (3, st.integers(1, 3).map(lambda k: ("grow", k))),
                                      (1, _RAW)))
# A decommit's kept size: mostly a cut at or inside one of the allocation's mappings (so
# that it gives something back), or 0; else any.
_CUT = st.tuples(st.just("cut"), st.integers(0, 5), st.sampled_from([0.0, 0.0, 0.3, 0.99]))
DECOMMITS = st.tuples(OFFSETS, weighted((3, _CUT), (1, st.just(("raw", 0))), (1, _RAW)))
# Start with a few allocations, each backed part of the way, then anything goes.
ARENA_SETUP = st.lists(
    st.tuples(st.integers(1, 6 * G), st.floats(0, 1)).map(
        lambda nf: [("allocate", nf[0]), ("commit", (("alloc", -1), ("rel", nf[1])))]
    ),
    min_size=1, max_size=3,
).map(lambda pairs: [op for pair in pairs for op in pair])
ARENA_OPS = weighted(
    (1, st.tuples(st.just("allocate"), SIZES)),
    (3, st.tuples(st.just("commit"), COMMITS)),
    (2, st.tuples(st.just("decommit"), DECOMMITS)),
    (1, st.tuples(st.just("commit_many"), st.lists(COMMITS, max_size=3))),
    (1, st.tuples(st.just("decommit_many"), st.lists(DECOMMITS, max_size=3))),
)


class ArenaModel:
    """Allocations as (offset, size, [handle sizes]) and the rules that refuse a call."""

    def __init__(self, reserved: int) -> None:
        self.reserved = reserved
        self.cursor = 0
        self.allocs: dict[str, tuple[int, int, list[int]]] = {}  # name -> (offset, size, maps)

    def offset(self, spec: tuple[str, int]) -> int:
        kind, v = spec
        if kind == "raw":
            return v
        offsets = sorted(o for o, _, _ in self.allocs.values())
        return offsets[v % len(offsets)] if offsets else self.cursor + v * 4096

    def request(self, req: tuple[tuple[str, int], tuple[Any, ...]]) -> tuple[int, object]:
        """Resolve a drawn request against the allocations as they are now."""
        offset = self.offset(req[0])
        kind, *v = req[1]
        a = self.at(offset)
        if kind == "raw":
            return offset, v[0]
        if kind == "rel":
            return offset, int(v[0] * (a[1] if a is not None else 4 * G))
        if kind == "grow":
            return offset, min(self.backed(a), a[1] - G) + v[0] * G if a else v[0] * G
        maps = a[2] if a is not None else []
        if not maps:
            return offset, 0
        i = v[0] % len(maps)  # "cut": at mapping i, or a fraction into it
        return offset, sum(maps[:i]) + int(v[1] * maps[i])

    def at(self, offset: object) -> tuple[int, int, list[int]] | None:
        for a in self.allocs.values():
            if a[0] == offset and isinstance(offset, int) and not isinstance(offset, bool):
                return a
        return None

    @staticmethod
    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def backed(self, a: tuple[int, int, list[int]]) -> int:
        return sum(a[2])

    def valid_request(self, offset: object, n: object) -> bool:
        a = self.at(offset)
        return a is not None and self.is_int(n) and 0 <= n <= a[1]  # type: ignore[operator]

    def allocate(self, n: object) -> bool:
        if not self.is_int(n) or n <= 0:  # type: ignore[operator]
            return False
        size = align_up(n, G)  # type: ignore[arg-type]
        if size > self.reserved - self.cursor:
            return False
        self.allocs[f"alloc{len(self.allocs)}"] = (self.cursor, size, [])
        self.cursor += size
        return True

    def commit(self, reqs: list[tuple[int, object]]) -> int | None:
        if not all(self.valid_request(o, n) for o, n in reqs):
            return None
        added = 0
        for o, n in reqs:
            a = self.at(o)
            assert a is not None
            target = align_up(n, G)  # type: ignore[arg-type]
            if target > self.backed(a):
                added += target - self.backed(a)
                a[2].append(target - self.backed(a))
        return added

    def decommit(self, reqs: list[tuple[int, object]]) -> int | None:
        if not all(self.valid_request(o, n) for o, n in reqs):
            return None
        given = 0
        for o, keep in reqs:
            a = self.at(o)
            assert a is not None
            pos, kept = 0, []
            for size in a[2]:
                if pos < keep:  # type: ignore[operator]
                    kept.append(size)
                else:
                    given += size
                pos += size
            a[2][:] = kept
        return given

    def mappings(self) -> list[tuple[int, int, str]]:
        out = []
        for name, (off, _, maps) in self.allocs.items():
            pos = off
            for size in maps:
                out.append((pos, size, name))
                pos += size
        return sorted(out)


def run_arena_ops(driver: Driver, ops: list[tuple[Any, ...]]) -> None:
    tracer = TracingDriver(driver)
    arena = Arena(tracer, reserve_bytes=ARENA_RESERVE, name="prop", trace=tracer.trace)
    model = ArenaModel(arena.reserved_bytes)
    assert model.reserved == 25 * G
    try:
        for op in ops:
            before = arena.snapshot()
            stats_before = driver.stats()
            backed_before = {a.name: a.backed_bytes for a in before.allocations}
            kind = op[0]
            if kind == "allocate":
                expect: object = model.allocate(op[1]) or None
                call: Callable[[], object] = lambda op=op: arena.allocate(op[1])  # noqa: E731
            elif kind in ("commit", "decommit"):
                reqs = [model.request(op[1])]
                fn = model.commit if kind == "commit" else model.decommit
                expect = fn(reqs)
                meth = arena.commit if kind == "commit" else arena.decommit
                call = lambda meth=meth, r=reqs[0]: meth(*r)  # noqa: E731
            else:
                reqs = [model.request(r) for r in op[1]]
                expect = model.commit(reqs) if kind == "commit_many" else model.decommit(reqs)
                meth = arena.commit_many if kind == "commit_many" else arena.decommit_many
                call = lambda meth=meth, r=reqs: meth(r)  # noqa: E731
            if expect is None:
                with pytest.raises(KvvmmError):
                    call()
                assert arena.snapshot() == before, op
                assert driver.stats() == stats_before, op
                continue
            got = call()
            if kind != "allocate":
                assert got == expect, (op, got, expect)
            snap = arena.snapshot()
            driver_matches(arena, driver)
            assert [(m.offset, m.size_bytes, m.allocation) for m in snap.mappings] == (
                model.mappings()
            ), op
            after = {a.name: a.backed_bytes for a in snap.allocations}
            for name, was in backed_before.items():
                if kind.startswith("commit"):
                    assert after[name] >= was, (op, name)  # commit only grows
                elif kind.startswith("decommit"):
                    assert after[name] <= was, (op, name)  # decommit only shrinks
                else:
                    assert after[name] == was, (op, name)
        whole_handle_maps(tracer)
    finally:
        arena.close()
    assert driver.stats().clean
    assert arena.snapshot().backed_bytes == 0


def _names_one_allocation_twice(model: ArenaModel, reqs: list[tuple[int, object]]) -> bool:
    offsets = [o for o, _ in reqs if model.at(o) is not None]
    return len(offsets) != len(set(offsets))


def test_decommit_many_naming_one_allocation_twice_acts_once_or_is_refused_up_front(
    driver: Driver,
) -> None:
    # Found by test_random_arena_operations_on_sim_keep_every_invariant:
    # decommit_many([(a, 0), (a, 0)]) on an allocation with one mapping.
    d = driver
    arena = Arena(d, reserve_bytes=8 * G)
    a = arena.allocate(4 * G, "a")
    arena.commit(a, 2 * G)
    arena.commit(a, 4 * G)  # two mappings: [0, 2G) and [2G, 4G)
    before = arena.snapshot()
    try:
        given = arena.decommit_many([(a, 2 * G), (a, 2 * G)])
    except KvvmmError as e:
        assert not isinstance(e, DriverError), "refused only after driver calls were made"
        assert arena.snapshot() == before
        raise
    assert given == 2 * G
    assert arena.backed_of(a) == 2 * G
    driver_matches(arena, d)
    arena.close()


@SIM
@given(setup=ARENA_SETUP, ops=st.lists(ARENA_OPS, min_size=8, max_size=30))
def test_random_arena_operations_on_sim_keep_every_invariant(
    setup: list[tuple[Any, ...]], ops: list[tuple[Any, ...]]
) -> None:
    run_arena_ops(SimDriver(), setup + ops)


@host_only
@HOST
@given(setup=ARENA_SETUP, ops=st.lists(ARENA_OPS, min_size=2, max_size=12))
def test_random_arena_operations_on_host_keep_every_invariant(
    fresh_driver: Any, setup: list[tuple[Any, ...]], ops: list[tuple[Any, ...]]
) -> None:
    with fresh_driver("host") as d:
        run_arena_ops(d, setup + ops)


# -- KvBufferOwner ----------------------------------------------------------------------------

POLICIES = st.sampled_from([Exact(), Chunked(G), Chunked(3 * G), Geometric(2.0, 4 * G),
                            Geometric(1.5, G)])


@st.composite
def owner_setups(draw: st.DrawFn) -> tuple[int, int, list[KvBufferDesc], Any]:
    page = draw(st.sampled_from([1, 16, 64]))
    reserved = draw(st.sampled_from([page, 9000, 20000, 33333]))
    layout = draw(st.sampled_from(["mha", "page_major", "mla"]))
    if layout == "mla":
        descs = mla(layers=2, kv_lora_rank=256, qk_rope_head_dim=64, reserved_tokens=reserved,
                    page_size=page, dtype="bfloat16")
    else:
        preset = mha_token_major if layout == "mha" else page_major
        descs = preset(layers=1, kv_heads=4, head_dim=64, reserved_tokens=reserved,
                       page_size=page, dtype="float16")
    return page, reserved, descs, draw(POLICIES)


def token_counts(reserved: int, page: int) -> st.SearchStrategy[object]:
    return weighted(
        (4, st.integers(page, reserved)),
        (1, st.integers(-3, reserved + 3)),
        (2, st.sampled_from([0, page - 1, page, page + 1, reserved - 1, reserved, reserved + 1,
                             reserved + page, reserved + page + 1])),
        (1, st.sampled_from([2.5, True, None, "16"])),
    )


@st.composite
def owner_scenarios(draw: st.DrawFn) -> tuple[Any, list[tuple[str, object]]]:
    setup = draw(owner_setups())
    page, reserved = setup[0], setup[1]
    ops = draw(st.lists(st.tuples(st.sampled_from(["ensure_prefix", "finalize", "shrink"]),
                                  token_counts(reserved, page)), min_size=2, max_size=20))
    return setup, ops


def run_owner_ops(driver: Driver, setup: Any, ops: list[tuple[str, object]]) -> None:
    page, reserved, descs, policy = setup
    tracer = TracingDriver(driver)
    owner = KvBufferOwner(driver=tracer, dtype=descs_dtype(descs), page_size=page,
                          reserved_tokens=reserved, descs=descs, policy=policy,
                          trace=tracer.trace)
    try:
        check_owner(owner, driver)
        for name, n in ops:
            before = owner.snapshot()
            stats_before = driver.stats()
            is_int = isinstance(n, int) and not isinstance(n, bool)
            # ensure_prefix reaches the top page (reserved + page); the others stop at reserved
            lo, hi = (0, reserved + page) if name == "ensure_prefix" else (page, reserved)
            if not (is_int and lo <= n <= hi):  # type: ignore[operator]
                with pytest.raises(KvvmmError):
                    getattr(owner, name)(n)
                assert owner.snapshot() == before, (name, n)
                assert driver.stats() == stats_before, (name, n)
                continue
            assert isinstance(n, int)
            got = getattr(owner, name)(n)
            after = owner.snapshot()
            check_owner(owner, driver)
            old = {b.name: b.backed_bytes for b in before.buffers}
            delta = sum(b.backed_bytes for b in after.buffers) - sum(old.values())
            assert got == (delta if name != "shrink" else -delta), (name, n, got)
            for d, b in zip(descs, after.buffers, strict=True):
                if name == "ensure_prefix":
                    assert b.backed_bytes >= max(old[b.name], d.prefix_span_bytes(n, page))
                elif name == "finalize":  # exact: the final span, aligned, no more
                    want = align_up(d.final_span_bytes(n, page), G)
                    assert b.backed_bytes == max(old[b.name], min(want, b.aligned_bytes))
                else:  # shrink: only whole mappings that start at or beyond the span go
                    keep = d.final_span_bytes(n, page)
                    assert b.backed_bytes <= old[b.name]
                    assert b.backed_bytes >= min(old[b.name], keep)
                    maps_before = [m for m in before.arena.mappings if m.allocation == b.name]
                    maps_after = [m for m in after.arena.mappings if m.allocation == b.name]
                    assert maps_after == [m for m in maps_before if m.offset - b.offset < keep]
            if name == "finalize":
                assert after.final_tokens == n
            if name == "shrink":
                assert after.prefix_tokens == min(before.prefix_tokens, n)
        whole_handle_maps(tracer)
    finally:
        owner.close()
    assert driver.stats().clean
    assert owner.backed_bytes == 0


def descs_dtype(descs: list[KvBufferDesc]) -> str:
    return "bfloat16" if descs[0].name.startswith("kv") else "float16"


def check_owner(owner: KvBufferOwner, driver: Driver) -> None:
    snap = owner.snapshot()
    driver_matches(owner.arena, driver)
    for b in snap.buffers:
        assert b.backed_bytes <= b.aligned_bytes
        assert b.backed_bytes % G == 0 or b.backed_bytes == b.aligned_bytes
        assert b.backed_bytes >= b.page0_bytes  # slot 0 stays backed whatever happens
        assert b.backed_bytes >= b.prefix_bytes
        if b.final_bytes is not None:
            assert b.backed_bytes >= b.final_bytes
    assert owner.page_size <= snap.prefix_tokens <= snap.reserved_tokens + owner.page_size
    if snap.final_tokens is not None:
        assert snap.page_size <= snap.final_tokens <= snap.reserved_tokens


@SIM
@given(scenario=owner_scenarios())
def test_random_owner_operations_on_sim_keep_every_invariant(scenario: Any) -> None:
    setup, ops = scenario
    run_owner_ops(SimDriver(), setup, ops)


@host_only
@HOST
@given(scenario=owner_scenarios())
def test_random_owner_operations_on_host_keep_every_invariant(
    fresh_driver: Any, scenario: Any
) -> None:
    setup, ops = scenario
    with fresh_driver("host") as d:
        run_owner_ops(d, setup, ops[:10])


# -- the raw SimDriver against a model of the rules -------------------------------------------

CAPACITY = 12 * G
#: Mostly valid sizes (so that calls succeed and state builds up), sometimes not.
GRANULES = weighted((4, st.integers(1, 4).map(lambda k: k * G)),
                    (1, st.sampled_from([0, -G, 4096, G + 4096])))
#: How a call picks its target: mostly a live object, sometimes a stale or made-up one.
PICK = st.sampled_from(["live"] * 4 + ["any"])


class DriverRulesModel(RuleBasedStateMachine):
    """SimDriver vs. the rules written naively: sets of granules, linear scans."""

    def __init__(self) -> None:
        super().__init__()
        self.d = SimDriver(capacity_bytes=CAPACITY)
        self.res: dict[int, int] = {}  # live reservations: start -> size
        self.seen_res: list[tuple[int, int]] = [(0x1000_0000, G)]  # every one, freed or not
        self.handles: dict[int, dict[str, int]] = {}  # size, released (0/1), maps
        self.seen_handles: list[int] = [424242]
        self.maps: dict[int, tuple[int, int]] = {}  # start -> (size, handle)

    # -- the model's verdicts --

    @staticmethod
    def aligned(*vals: int) -> bool:
        return all(v % G == 0 for v in vals)

    def physical(self) -> int:
        return sum(h["size"] for h in self.handles.values())

    def overlapping(self, va: int, size: int) -> list[int]:
        return sorted(s for s, (z, _) in self.maps.items() if s < va + size and va < s + z)

    def pick_res(self, how: str, i: int) -> tuple[int, int]:
        live = sorted(self.res.items())
        pool = live if how == "live" and live else self.seen_res
        return pool[i % len(pool)]

    def pick_handle(self, how: str, i: int) -> int:
        live = [h for h, v in self.handles.items() if not v["released"]]
        pool = live if how == "live" and live else self.seen_handles
        return pool[i % len(pool)]

    def pick_range(self, how: str, i: int, shape: str) -> tuple[int, int]:
        """A range over mappings: one, two in a row, part of one, or one-hole-next."""
        starts = sorted(self.maps)
        if how != "live" or not starts:
            base, _ = self.pick_res("any", i)
            return base + (i % 5) * G, (i % 3) * G
        k = i % len(starts)
        s0, (z0, _) = starts[k], self.maps[starts[k]]
        if shape == "one":
            return s0, z0
        if shape == "part":
            return s0, z0 - G if z0 > G else 2 * z0
        # "two": this mapping and the next one, whether adjacent (ok) or not (a hole)
        nxt = starts[(k + 1) % len(starts)]
        end = nxt + self.maps[nxt][0]
        return (s0, end - s0) if end > s0 else (s0, z0 + G)

    def check(self, call: Callable[[], object], verdict: str) -> object:
        before = self.d.stats()
        try:
            got = call()
        except DriverError as e:
            assert e.cuda_error == verdict, (str(e), verdict)
            assert self.d.stats() == before
            return None
        assert verdict == "ok", f"expected {verdict}, the call succeeded"
        return got

    # -- rules --

    @initialize(granules=st.lists(st.integers(1, 3), min_size=1, max_size=4))
    def start_with_a_reservation_and_some_handles(self, granules: list[int]) -> None:
        self.reserve(16 * G, 0)
        for k in granules:
            self.create(k * G)

    @rule(size=GRANULES, align=st.sampled_from([0, 0, 0, G, 4 * G, 4096, -G]))
    def reserve(self, size: int, align: int) -> None:
        # As on an H200: an alignment is 0 or any power of two (4096 is fine).
        ok = self.aligned(size) and size > 0 and align >= 0 and not align & (align - 1)
        va = self.check(lambda: self.d.reserve(size, align),
                        "ok" if ok else CUDA_ERROR_INVALID_VALUE)
        if va is not None:
            assert isinstance(va, int) and va % max(align, G) == 0
            assert all(va + size <= s or s + z <= va for s, z in self.res.items())
            self.res[va] = size
            self.seen_res.append((va, size))

    @rule(how=PICK, i=st.integers(0, 50), dsize=st.sampled_from([0, 0, 0, G, -G]),
          dva=st.sampled_from([0, 0, 0, G]))
    def free(self, how: str, i: int, dsize: int, dva: int) -> None:
        va, size = self.pick_res(how, i)
        va, size = va + dva, size + dsize
        ok = self.res.get(va) == size and not self.overlapping(va, size)
        self.check(lambda: self.d.free(va, size), "ok" if ok else CUDA_ERROR_INVALID_VALUE)
        if ok:
            del self.res[va]

    @rule(size=GRANULES)
    def create(self, size: int) -> None:
        if not (self.aligned(size) and size > 0):
            verdict = CUDA_ERROR_INVALID_VALUE
        elif size > CAPACITY - self.physical():
            verdict = CUDA_ERROR_OUT_OF_MEMORY
        else:
            verdict = "ok"
        h = self.check(lambda: self.d.create(size), verdict)
        if h is not None:
            assert isinstance(h, int) and h not in self.handles
            self.handles[h] = {"size": size, "released": 0, "maps": 0}
            self.seen_handles.append(h)

    @rule(how=st.sampled_from(["live", "any"]), i=st.integers(0, 50))
    def release(self, how: str, i: int) -> None:
        h = self.pick_handle(how, i)
        live = h in self.handles and not self.handles[h]["released"]
        self.check(lambda: self.d.release(h), "ok" if live else CUDA_ERROR_INVALID_VALUE)
        if live:
            self.handles[h]["released"] = 1
            if not self.handles[h]["maps"]:
                del self.handles[h]

    @rule(how=PICK, r=st.integers(0, 50), at=st.floats(-0.1, 1.1), i=st.integers(0, 50),
          dsize=st.sampled_from([0, 0, 0, 0, G, -G, 4096]),
          dva=st.sampled_from([0, 0, 0, 0, 0, 4096]))
    def map(self, how: str, r: int, at: float, i: int, dsize: int, dva: int) -> None:
        base, rsize = self.pick_res(how, r)
        va = base + int(at * rsize / G) * G + dva  # at < 0 or > 1: outside it
        h = self.pick_handle(how, i)
        hs = self.handles.get(h)
        size = (hs["size"] if hs else G) + dsize
        inside = any(s <= va and va + size <= s + z for s, z in self.res.items())
        ok = (self.aligned(va, size) and size > 0 and hs is not None and not hs["released"]
              and size == hs["size"] and inside and not self.overlapping(va, size))
        verdict = "ok" if ok else CUDA_ERROR_INVALID_VALUE
        if (self.aligned(va, size) and size > 0 and hs is not None and not hs["released"]
                and size != hs["size"]):
            verdict = CUDA_ERROR_NOT_SUPPORTED  # part of a handle, as an H200 answers
        self.check(lambda: self.d.map(va, size, h), verdict)
        if ok:
            assert hs is not None
            self.maps[va] = (size, h)
            hs["maps"] += 1

    def _covers_whole_mappings(self, va: int, size: int) -> bool:
        if not (self.aligned(va, size) and size > 0):
            return False
        hit = self.overlapping(va, size)
        inside = all(va <= s and s + self.maps[s][0] <= va + size for s in hit)
        return inside and sum(self.maps[s][0] for s in hit) == size

    @rule(how=PICK, i=st.integers(0, 50), shape=st.sampled_from(["one", "one", "two", "part"]))
    def unmap(self, how: str, i: int, shape: str) -> None:
        va, size = self.pick_range(how, i, shape)
        ok = self._covers_whole_mappings(va, size)
        self.check(lambda: self.d.unmap(va, size), "ok" if ok else CUDA_ERROR_INVALID_VALUE)
        if ok:
            for s in self.overlapping(va, size):
                _, h = self.maps.pop(s)
                self.handles[h]["maps"] -= 1
                if self.handles[h]["released"] and not self.handles[h]["maps"]:
                    del self.handles[h]

    @rule(how=PICK, i=st.integers(0, 50), shape=st.sampled_from(["one", "two", "part"]))
    def set_access(self, how: str, i: int, shape: str) -> None:
        va, size = self.pick_range(how, i, shape)
        ok = self._covers_whole_mappings(va, size)
        self.check(lambda: self.d.set_access(va, size), "ok" if ok else CUDA_ERROR_INVALID_VALUE)

    # -- what must always hold --

    @invariant()
    def accounting_matches_the_model(self) -> None:
        s = self.d.stats()
        assert s.reservations == len(self.res)
        assert s.reserved_bytes == sum(self.res.values())
        assert s.handles == sum(1 for h in self.handles.values() if not h["released"])
        assert s.mappings == len(self.maps)
        assert s.mapped_bytes == sum(z for z, _ in self.maps.values())
        assert s.physical_bytes == self.physical()
        assert self.d.mem_info() == (CAPACITY - self.physical(), CAPACITY)


DriverRulesModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_sim_driver_refuses_exactly_what_the_rules_refuse = DriverRulesModel.TestCase

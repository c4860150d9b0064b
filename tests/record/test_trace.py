"""Traces: every driver call recorded, saved as versioned JSON, replayed onto a SimDriver.

Record on one driver, look at it on another: a trace recorded on the host driver (real
mmaps, real addresses) replays onto the simulator with every call's outcome the same,
refused calls included, and the arena operations it noted rebuild the same arena snapshot.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvvmm import (
    Chunked,
    Exact,
    Fault,
    FaultyDriver,
    KvBufferOwner,
    SimDriver,
    Trace,
    TraceFormatError,
    TracingDriver,
    mha_token_major,
    replay_arenas,
)
from kvvmm.arena import Arena
from kvvmm.driver import Driver
from kvvmm.errors import DriverError, KvvmmError
from kvvmm.record import FORMAT, VERSION
from kvvmm.replay import replay
from kvvmm.snapshot import ArenaSnapshot
from kvvmm.units import MiB

MakeDriver = Callable[..., Driver]
G = 2 * MiB
INVALID = "CUDA_ERROR_INVALID_VALUE"
NOT_SUPPORTED = "CUDA_ERROR_NOT_SUPPORTED"  # a map of part of a handle, as an H200 answers


def refuse(call: Any, *args: int) -> str:
    with pytest.raises(DriverError) as info:
        call(*args)
    return info.value.cuda_error


def raw_session(t: TracingDriver) -> list[tuple[str, str | None]]:
    """Driver calls, some refused; returns the (op, error) each should record."""
    g = t.granularity()
    va = t.reserve(8 * g)
    h = t.create(2 * g)
    t.map(va, 2 * g, h)
    t.set_access(va, 2 * g)
    refuse(t.map, va + 2 * g, g, h)  # part of a handle
    refuse(t.unmap, va, g)  # part of a mapping
    refuse(t.free, va, 8 * g)  # mappings inside
    t.mem_info()
    h2 = t.create(g)
    t.map(va + 4 * g, g, h2)
    t.release(h2)  # released while mapped
    refuse(t.release, h2)
    refuse(t.set_access, va + 6 * g, g)  # unmapped
    t.unmap(va + 4 * g, g)
    t.unmap(va, 2 * g)
    t.release(h)
    refuse(t.map, va, 2 * g, h)  # released handle
    t.free(va, 8 * g)
    refuse(t.free, va, 8 * g)  # twice
    refuse(t.reserve, g + 4096)
    refuse(t.create, 0)
    return [
        ("reserve", None), ("create", None), ("map", None), ("set_access", None),
        ("map", NOT_SUPPORTED), ("unmap", INVALID), ("free", INVALID), ("mem_info", None),
        ("create", None), ("map", None), ("release", None), ("release", INVALID),
        ("set_access", INVALID), ("unmap", None), ("unmap", None), ("release", None),
        ("map", INVALID), ("free", None), ("free", INVALID), ("reserve", INVALID),
        ("create", INVALID),
    ]


def test_tracing_driver_records_every_call_with_its_arguments_result_and_error(
    driver: Driver,
) -> None:
    t = TracingDriver(driver)
    want = raw_session(t)
    events = t.trace.events
    assert [(e.op, e.error) for e in events] == want
    assert [e.seq for e in events] == list(range(len(events)))
    g = driver.granularity()
    reserve, create, map_ = events[0], events[1], events[2]
    assert reserve.args == {"size": 8 * g, "align": 0} and isinstance(reserve.result, int)
    va = reserve.result
    assert create.args == {"size": 2 * g} and isinstance(create.result, int)
    assert map_.args == {"va": va, "size": 2 * g, "handle": create.result}
    assert map_.result is None
    assert events[4].args == {"va": va + 2 * g, "size": g, "handle": create.result}
    assert all(e.result is None for e in events if e.error is not None)
    assert all(e.wall_us >= 0 for e in events)
    if driver.kind == "sim":  # the cost model's time, for calls that did something
        assert all(e.sim_us > 0 for e in events if e.error is None and e.op != "mem_info")
    else:
        assert all(e.sim_us == 0 for e in events)
    assert t.trace.meta["driver"] == driver.kind
    assert t.trace.meta["granularity"] == g
    assert t.trace.meta["device_name"] == driver.name
    assert driver.stats().clean
    assert t.stats() == driver.stats()


def test_a_trace_round_trips_through_json_unchanged(tmp_path: Path, driver: Driver) -> None:
    t = TracingDriver(driver)
    raw_session(t)
    with Arena(t, reserve_bytes=4 * G, name="notes", trace=t.trace) as arena:
        arena.commit(arena.allocate(3 * G, "x"), G)
    path = tmp_path / "run.json"
    t.trace.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION
    loaded = Trace.load(path)
    assert loaded.to_json() == t.trace.to_json()
    assert loaded.meta == t.trace.meta
    assert [(e.seq, e.op, e.args, e.result, e.error) for e in loaded] == [
        (e.seq, e.op, e.args, e.result, e.error) for e in t.trace
    ]
    again = tmp_path / "again.json"
    loaded.save(again)
    assert json.loads(again.read_text()) == data


def _doc(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION, "meta": {}, "events": [
        {"seq": 0, "op": "reserve", "args": {"size": G, "align": 0}, "result": 1 << 40,
         "error": None, "wall_us": 1.0, "sim_us": 7.0},
    ]}
    doc.update(over)
    return doc


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        (_doc(format="chrome-trace"), "format"),
        ({k: v for k, v in _doc().items() if k != "format"}, "format"),
        (_doc(version=3), "version 3"),
        (_doc(version="1"), "version '1'"),
        (_doc(version=None), "version None"),
        ([_doc()], "format"),
        (_doc(events={"0": {}}), "'events' list"),
        (_doc(meta=[]), "'meta' object"),
    ],
    ids=["wrong-format", "no-format", "newer-version", "version-a-str", "no-version",
         "not-an-object", "events-not-a-list", "meta-not-an-object"],
)
def test_a_trace_of_the_wrong_format_or_version_is_refused(doc: object, fragment: str) -> None:
    with pytest.raises(TraceFormatError) as info:
        Trace.from_json(doc)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "event",
    [
        3,
        "reserve",
        None,
        [],
        {"args": {"size": G, "align": 0}},
        {"op": "reserve"},
        {"op": 7, "args": {}},
        {"op": "reserve", "args": [G, 0]},
        {"op": "cuMemAlloc", "args": {"size": G}},
        {"op": "reserve", "args": {"size": G, "align": 0}, "wall_us": "fast"},
        {"op": "reserve", "args": {"size": G, "align": 0}, "sim_us": [1]},
    ],
    ids=["an-int", "a-str", "null", "a-list", "no-op", "no-args", "op-not-a-str",
         "args-not-an-object", "unknown-op", "wall-time-not-a-number", "sim-time-a-list"],
)
def test_a_malformed_event_is_refused_naming_its_index(event: object) -> None:
    doc = _doc()
    doc["events"].append(event)
    with pytest.raises(TraceFormatError) as info:
        Trace.from_json(doc)
    assert "event 1" in str(info.value)


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        (_doc(version=True), "version true passes the check because True == 1"),
        (_doc(events=[{"op": "map", "args": {}}]),
         "a driver call without its arguments loads; replay() then dies with KeyError"),
        (_doc(events=[{"op": "reserve", "args": {"size": "big", "align": 0}}]),
         "a driver call with a non-int argument loads; replay() then dies with TypeError"),
    ],
    ids=["version-true", "driver-call-without-arguments", "driver-call-with-a-str-argument"],
)
def test_a_trace_that_cannot_be_replayed_is_refused_at_load(doc: object, why: str) -> None:
    with pytest.raises(TraceFormatError):
        Trace.from_json(doc)


def test_a_file_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"format": "kvvmm-trace", "version": 1, "events": [')
    with pytest.raises(TraceFormatError) as info:
        Trace.load(path)
    assert str(path) in str(info.value)
    assert issubclass(TraceFormatError, KvvmmError)


def test_a_host_trace_replays_on_the_simulator_with_the_same_outcomes(
    make_driver: MakeDriver,
) -> None:
    t = TracingDriver(make_driver("host"))
    # The owner's arena first, then the raw calls: no reservation here reuses freed VA (see
    # test_a_replay_translates_addresses_of_a_reservation_that_reuses_freed_va).
    owner_session(t)
    raw_session(t)
    calls = t.trace.driver_calls()
    assert any(e.error for e in calls) and len(calls) > 30
    sim = SimDriver()
    assert replay(t.trace, sim) == []
    assert sim.stats() == t.stats()  # the owner left one arena open on both


def test_a_replay_onto_a_smaller_device_reports_the_calls_that_now_differ(
    make_driver: MakeDriver,
) -> None:
    t = TracingDriver(make_driver("sim", capacity_bytes=8 * G))
    handles = [t.create(2 * G) for _ in range(4)]
    assert refuse(t.create, G) == "CUDA_ERROR_OUT_OF_MEMORY"
    for h in handles:
        t.release(h)
    assert replay(t.trace, SimDriver(capacity_bytes=8 * G)) == []
    bigger = replay(t.trace, SimDriver(capacity_bytes=16 * G))
    assert [(m.seq, m.op, m.recorded, m.replayed) for m in bigger] == [
        (4, "create", "CUDA_ERROR_OUT_OF_MEMORY", "ok")
    ]
    smaller = replay(t.trace, SimDriver(capacity_bytes=4 * G))
    assert [(m.op, m.recorded, m.replayed) for m in smaller][:1] == [
        ("create", "ok", "CUDA_ERROR_OUT_OF_MEMORY")
    ]


def test_injected_faults_never_reach_the_trace_and_the_replay_agrees(
    driver: Driver,
) -> None:
    t = TracingDriver(driver)
    faulty = FaultyDriver(t, fail=Fault(call="map", nth=2))
    arena = Arena(faulty, reserve_bytes=8 * G)
    a = arena.allocate(4 * G)
    b = arena.allocate(4 * G)
    arena.commit(a, G)
    with pytest.raises(DriverError):
        arena.commit(b, G)  # the 2nd map fails; the create before it is undone
    assert faulty.injected == ["map"]
    assert all(e.error is None for e in t.trace.driver_calls())
    assert replay(t.trace, SimDriver()) == []
    arena.close()


def test_a_replay_translates_addresses_of_a_reservation_that_reuses_freed_va() -> None:
    # As recorded on the host driver: munmap'd VA comes back in the next, larger mmap.
    first, second = 0x7F9F_2BA0_0000, 0x7F9F_2B20_0000  # second covers [first, first + 8M)
    trace = Trace(meta={"driver": "host", "granularity": G})
    trace.add("reserve", {"size": 4 * G, "align": 0}, first)
    trace.add("free", {"va": first, "size": 4 * G})
    trace.add("reserve", {"size": 8 * G, "align": 0}, second)
    trace.add("create", {"size": G}, 1)
    trace.add("map", {"va": first, "size": G, "handle": 1})
    trace.add("set_access", {"va": first, "size": G})
    trace.add("unmap", {"va": first, "size": G})
    assert replay(trace, SimDriver()) == []


# -- arena snapshots from a trace -------------------------------------------------------------

DESCS = mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=4096, page_size=16,
                        dtype="bfloat16")


def owner_session(t: TracingDriver, *, close: bool = False) -> KvBufferOwner:
    owner = KvBufferOwner(driver=t, dtype="bfloat16", page_size=16, reserved_tokens=4096,
                          descs=DESCS, policy=Chunked(4 * G), name="kv", trace=t.trace)
    owner.ensure_prefix(300)
    owner.ensure_prefix(2500)
    with pytest.raises(KvvmmError):
        owner.finalize(5000)  # refused: nothing noted
    owner.finalize(3000)
    owner.shrink(1000)
    owner.ensure_prefix(1200)
    if close:
        owner.close()
    return owner


def comparable(snap: ArenaSnapshot) -> ArenaSnapshot:
    """Everything but where the arena lives and on what."""
    return dataclasses.replace(snap, base=0, driver="", device_name="")


@pytest.mark.parametrize("close", [False, True], ids=["open", "closed"])
def test_replaying_an_owner_session_rebuilds_the_same_arena_on_sim_and_host(
    make_driver: MakeDriver, close: bool
) -> None:
    recorded: dict[str, ArenaSnapshot] = {}
    replayed: dict[str, list[ArenaSnapshot]] = {}
    for kind in ("sim", "host"):
        t = TracingDriver(make_driver(kind))
        owner = owner_session(t, close=close)
        recorded[kind] = owner.arena.snapshot()
        replayed[kind] = replay_arenas(t.trace)
        assert [s.closed for s in replayed[kind]] == [close]
        ops = [o.op for o in t.trace.ops]
        assert ops[:2] == ["open", "allocate"]
        assert ("close" in ops) is close
        if not close:
            owner.close()
    assert comparable(recorded["sim"]) == comparable(recorded["host"])
    for kind in ("sim", "host"):
        snap = replayed[kind][0]
        assert comparable(snap) == comparable(recorded[kind])
        assert snap.driver == "sim" and snap.granularity == G
    if not close:
        assert recorded["sim"].backed_bytes > 0 and len(recorded["sim"].mappings) > 4


def test_replaying_two_arenas_gives_one_snapshot_each_in_order(make_driver: MakeDriver) -> None:
    t = TracingDriver(make_driver("host"))
    owner_session(t, close=True)
    second = Arena(t, reserve_bytes=6 * G, name="second", trace=t.trace)
    second.commit(second.allocate(5 * G, "only"), 3 * G)
    snaps = replay_arenas(t.trace)
    assert [s.name for s in snaps] == ["kv", "second"]
    assert comparable(snaps[1]) == comparable(second.snapshot())
    second.close()


def test_a_traced_arena_notes_its_operations_apart_from_driver_calls(driver: Driver) -> None:
    t = TracingDriver(driver)
    with Arena(t, reserve_bytes=4 * G, name="a", trace=t.trace) as arena:
        off = arena.allocate(3 * G, "x")
        arena.commit(off, 2 * G)
        arena.decommit(off, 0)
    notes = t.trace.ops
    assert [o.op for o in notes] == ["open", "allocate", "commit", "decommit", "close"]
    assert notes[1].arena == 0
    assert notes[1].args == {"name": "x", "nbytes": 3 * G, "offset": 0}
    seqs = sorted([e.seq for e in t.trace.events] + [o.seq for o in t.trace.ops])
    assert seqs == list(range(len(seqs)))  # one sequence over both lists
    assert [e.op for e in t.trace.driver_calls()] == [
        "reserve", "create", "map", "set_access", "unmap", "release", "free"]  # b1e73e2
    assert replay_arenas(t.trace)[0].closed


def test_the_recorded_policy_shapes_the_replayed_handles(make_driver: MakeDriver) -> None:
    # Exact: one handle per extension, so the replay has as many handles as the session.
    t = TracingDriver(make_driver("sim"))
    owner = KvBufferOwner(driver=t, dtype="bfloat16", page_size=16, reserved_tokens=4096,
                          descs=DESCS, policy=Exact(), trace=t.trace)
    for n in (100, 1100, 2100, 4096):
        owner.ensure_prefix(n)
    snap = replay_arenas(t.trace)[0]
    assert len(snap.mappings) == len(owner.snapshot().arena.mappings)
    assert [m.handle_id for m in snap.mappings] == [
        m.handle_id for m in owner.snapshot().arena.mappings]
    owner.close()

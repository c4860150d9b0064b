"""Hostile and broken traces: refused with a TraceFormatError.

A trace comes from elsewhere: another machine, another version, a person with an editor, or
someone who means harm. Loading one checks it against the format; every malformed input ends
in a :class:`TraceFormatError` whose one-line message names the record (its index and seq) or
the field, never in a RecursionError, OverflowError, KeyError, TypeError or AssertionError.
A trace that loaded replays without raising anything but kvvmm errors, and a trace built in
memory gets the same checks when it is replayed.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvvmm.driver import SimDriver
from kvvmm.errors import KvvmmError, TraceFormatError
from kvvmm.record import Trace
from kvvmm.record.validate import ARENA_OPS, CALL_ARGS, OP_ARGS
from kvvmm.replay import replay, replay_arenas
from kvvmm.units import MiB

G = 2 * MiB
VA = 0x7F00_0000_0000  # where a fresh SimDriver reserves first
INVALID = "CUDA_ERROR_INVALID_VALUE"

Doc = dict[str, Any]


def valid_doc() -> Doc:
    """A version-2 trace that loads and replays cleanly: every call and arena operation once."""
    calls: list[tuple[str, dict[str, Any], int | None, str | None]] = [
        ("reserve", {"size": 8 * G, "align": 0}, VA, None),
        ("create", {"size": 2 * G}, 1, None),
        ("map", {"va": VA, "size": 2 * G, "handle": 1}, None, None),
        ("set_access", {"va": VA, "size": 2 * G}, None, None),
        ("mem_info", {}, None, None),
        ("export_handle", {"handle": 1}, 7, None),
        ("import_handle", {"fd": 7, "size": 2 * G}, 2, None),
        ("unmap", {"va": VA, "size": 2 * G}, None, None),
        ("release", {"handle": 1}, None, None),
        ("release", {"handle": 2}, None, None),
        ("free", {"va": VA, "size": 8 * G}, None, None),
        ("create", {"size": 0}, None, INVALID),
    ]
    events = [{"seq": i, "op": op, "args": args, "result": result, "error": error,
               "wall_us": 1.5, "sim_us": 2.0}
              for i, (op, args, result, error) in enumerate(calls)]
    ops: list[tuple[str, dict[str, Any]]] = [
        ("open", {"name": "kv", "reserve_bytes": 8 * G, "base": VA}),
        ("allocate", {"name": "x", "nbytes": 4 * G, "offset": 0}),
        ("commit", {"offset": 0, "nbytes": 2 * G}),
        ("decommit", {"offset": 0, "keep_bytes": G}),
        ("commit_range", {"offset": 0, "start": 2 * G, "nbytes": G}),
        ("decommit_range", {"offset": 0, "start": 2 * G, "nbytes": G}),
        ("grant_access", {"devices": [1]}),
        ("adopt", {"offset": 0, "nbytes": G}),
        ("sleep", {"backup": "none", "nbytes": G}),  # sleep/wake are recorded
        ("wake", {"nbytes": G}),
        ("close", {}),
    ]
    arena_ops = [{"seq": len(events) + j, "arena": 0, "op": op, "args": args}
                 for j, (op, args) in enumerate(ops)]
    return {"format": "kvvmm-trace", "version": 2,
            "meta": {"driver": "sim", "device_name": "H200", "device": 0, "granularity": G},
            "events": events, "arena_ops": arena_ops}


def ev_index(op: str) -> int:
    return next(i for i, e in enumerate(valid_doc()["events"]) if e["op"] == op)


def op_index(op: str) -> int:
    return ARENA_OPS.index(op)  # valid_doc has one of each, in this order


# -- building hostile documents ---------------------------------------------------------------

Mutation = Callable[[Doc], object]


def top(**fields: Any) -> Mutation:
    def f(d: Doc) -> Doc:
        d.update(fields)
        return d
    return f


def drop_top(key: str) -> Mutation:
    def f(d: Doc) -> Doc:
        del d[key]
        return d
    return f


def event(i: int, **fields: Any) -> Mutation:
    def f(d: Doc) -> Doc:
        d["events"][i].update(fields)
        return d
    return f


def drop_event_field(i: int, key: str) -> Mutation:
    def f(d: Doc) -> Doc:
        del d["events"][i][key]
        return d
    return f


def arg(i: int, key: str, value: Any) -> Mutation:
    def f(d: Doc) -> Doc:
        d["events"][i]["args"][key] = value
        return d
    return f


def drop_arg(i: int, key: str) -> Mutation:
    def f(d: Doc) -> Doc:
        del d["events"][i]["args"][key]
        return d
    return f


def op(j: int, **fields: Any) -> Mutation:
    def f(d: Doc) -> Doc:
        d["arena_ops"][j].update(fields)
        return d
    return f


def drop_op_field(j: int, key: str) -> Mutation:
    def f(d: Doc) -> Doc:
        del d["arena_ops"][j][key]
        return d
    return f


def op_arg(j: int, key: str, value: Any) -> Mutation:
    def f(d: Doc) -> Doc:
        d["arena_ops"][j]["args"][key] = value
        return d
    return f


def drop_op_arg(j: int, key: str) -> Mutation:
    def f(d: Doc) -> Doc:
        del d["arena_ops"][j]["args"][key]
        return d
    return f


def meta(**fields: Any) -> Mutation:
    def f(d: Doc) -> Doc:
        d["meta"].update(fields)
        return d
    return f


def append_op(**rec: Any) -> Mutation:
    def f(d: Doc) -> Doc:
        d["arena_ops"].append({"seq": 100, "arena": 0, "op": "close", "args": {}, **rec})
        return d
    return f


def delete_op(j: int) -> Mutation:
    def f(d: Doc) -> Doc:
        del d["arena_ops"][j]
        return d
    return f


def nested(depth: int, leaf: Any = 0) -> Any:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def nested_obj(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = {"a": v}
    return v


def text(raw: str | bytes) -> Mutation:
    """Not a document: the raw text of the file."""
    return lambda d: raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")


def text_of(mutation: Mutation, old: str, new: str) -> Mutation:
    """The JSON of a mutated document with one piece of its text replaced."""
    def f(d: Doc) -> bytes:
        out = json.dumps(mutation(d))
        assert old in out, (old, out[:200])
        return out.replace(old, new, 1).encode("utf-8", "surrogatepass")
    return f


def same(d: Doc) -> Doc:
    return d


BIG = 10**400  # past every int a trace can hold, and past float's range
CASES: list[tuple[str, Mutation, tuple[str, ...]]] = []


def case(name: str, mutation: Mutation, *fragments: str) -> None:
    CASES.append((name, mutation, fragments))


# syntax: not JSON, not UTF-8, repeated keys, literals Python's json cannot hold
for name, raw in [
    ("empty", b""), ("whitespace", b"  \n "), ("unclosed-object", b'{"format": "kvvmm-trace"'),
    ("unclosed-list", b'{"format": "kvvmm-trace", "version": 2, "events": ['),
    ("single-quotes", b"{'format': 'kvvmm-trace'}"), ("trailing-comma", b'{"a": 1,}'),
    ("bare-word", b"nul"), ("two-documents", b"{} {}"), ("comment", b'// trace\n{}'),
    ("python-repr", b"{'events': [], 'meta': None}"), ("bom", "\ufeff{}".encode()),
    ("control-char-in-string", b'{"a": "\x01"}'), ("bad-escape", b'{"a": "\\x41"}'),
    ("hex-int", b'{"a": 0x10}'), ("leading-plus", b'{"a": +1}'),
]:
    case(f"syntax-{name}", text(raw), "not JSON")
for name, raw in [
    ("latin-1", '{"format": "kvvmm-trace", "meta": {"n": "caf\xe9"}}'.encode("latin-1")),
    ("lone-continuation", b'{"a": "\x80"}'), ("utf-16", '{"a": 1}'.encode("utf-16")),
    ("truncated-sequence", b'{"a": "\xe2\x82"}'), ("ff-byte", b"\xff\xfe{}"),
    ("overlong-slash", b'{"a": "\xc0\xaf"}'),
]:
    case(f"syntax-{name}", text(raw), "not UTF-8")
case("syntax-repeated-top-key", text('{"format": "kvvmm-trace", "format": "kvvmm-trace"}'),
     "'format' appears twice")
case("syntax-repeated-event-key", text_of(same, '"seq": 0,', '"seq": 0, "seq": 1,'),
     "'seq' appears twice")
case("syntax-repeated-arg-key", text_of(same, '"align": 0', '"align": 0, "align": 1'),
     "'align' appears twice")
case("syntax-int-of-5000-digits", text_of(same, '"align": 0', '"align": ' + "9" * 5000),
     "not JSON")
case("syntax-lone-surrogate-in-a-name", text_of(same, '"kv"', '"\\ud800"'),
     "arena op 0", "args.name", "Unicode")
case("syntax-lone-surrogate-in-an-error", text_of(same, f'"{INVALID}"', '"\\udfff"'),
     "event 11", "error", "Unicode")
case("syntax-lone-surrogate-in-meta", text_of(same, '"H200"', '"\\ud83d"'),
     "meta.device_name", "Unicode")

# nesting: json.loads recurses per level; meta is walked without recursion
for depth in (10_000, 100_000, 1_000_000):
    case(f"nesting-list-{depth}", text("[" * depth + "]" * depth), "nested too deeply")
    case(f"nesting-object-{depth}", text('{"a":' * depth + "0" + "}" * depth),
         "nested too deeply")
case("nesting-in-meta", meta(x=nested(40)), "meta.x", "deeper than 32")
case("nesting-objects-in-meta", meta(x=nested_obj(40)), "meta.x.a", "deeper than 32")
case("nesting-in-args", arg(0, "size", nested(50)), "event 0", "args.size")
case("nesting-as-an-event", lambda d: {**d, "events": [nested(50)]}, "event 0")
case("nesting-in-op-args", op_arg(0, "name", nested_obj(50)), "arena op 0", "args.name")
case("nesting-in-the-events-list", text_of(same, '"events": [', '"events": [' + "[" * 20_000),
     "nested too deeply")

# the document: its shape, format and version
for name, doc in [("a-list", []), ("a-str", "trace"), ("an-int", 2), ("null", None),
                  ("true", True), ("a-float", 2.0)]:
    case(f"top-{name}", lambda d, doc=doc: doc, "not a kvvmm trace")
case("top-no-format", drop_top("format"), "format")
case("top-other-format", top(format="chrome-trace"), "format", "'chrome-trace'")
case("top-format-not-a-str", top(format=["kvvmm-trace"]), "format")
for bad in (0, 3, -1, "2", 2.0, True, None, [2], BIG):
    case(f"top-version-{bad!r:.20}", top(version=bad), "version")
case("top-no-version", drop_top("version"), "version None")
case("top-unknown-field", top(extra=1), "no field 'extra'")
case("top-v1-with-arena-ops", top(version=1), "version 1", "'arena_ops'")
case("top-no-events", drop_top("events"), "'events' list")
case("top-events-an-object", top(events={"0": {}}), "'events' list")
case("top-events-null", top(events=None), "'events' list")
case("top-arena-ops-an-object", top(arena_ops={}), "'arena_ops'")
case("top-arena-ops-a-str", top(arena_ops="open"), "'arena_ops'")
case("top-meta-a-list", top(meta=[]), "'meta' object")
case("top-meta-a-str", top(meta="sim"), "'meta' object")
case("top-meta-null", top(meta=None), "'meta' object")

# records: objects with known fields
for name, rec in [("an-int", 3), ("a-str", "reserve"), ("null", None), ("a-list", []),
                  ("true", True)]:
    case(f"record-event-{name}", lambda d, rec=rec: {**d, "events": [*d["events"], rec]},
         "event 12", "must be an object")
    case(f"record-op-{name}", lambda d, rec=rec: {**d, "arena_ops": [rec]},
         "arena op 0", "must be an object")
for key in ("seq", "op", "args"):
    case(f"record-event-without-{key}", drop_event_field(2, key), "event 2", f"'{key}'",
         "missing")
for key in ("seq", "arena", "op", "args"):
    case(f"record-op-without-{key}", drop_op_field(1, key), "arena op 1", f"'{key}'",
         "missing")
case("record-event-unknown-field", event(3, handle=1), "event 3 (seq 3)", "'handle'")
case("record-op-unknown-field", op(2, result=None), "arena op 2 (seq 14)", "'result'")

# driver calls: each field's type and range
for bad in ("0", 0.0, True, None, -1, 1 << 63, BIG, [0]):
    case(f"call-seq-{bad!r:.20}", event(4, seq=bad), "event 4", "seq")
for bad in (7, None, "cuMemAlloc", "RESERVE", "arena.open", "open", ["map"], ""):
    case(f"call-op-{bad!r:.20}", event(1, op=bad), "event 1 (seq 1)", "op must be a driver")
for bad in ([G, 0], "size", None, 1, True):
    case(f"call-args-{bad!r:.20}", event(0, args=bad), "event 0 (seq 0, reserve)",
         "args must be an object")
for bad in ("big", 1.5, float(G), True, False, None, [G], {"n": G}, -1, 1 << 64, BIG,
            math.nan):
    case(f"call-size-{bad!r:.20}", arg(1, "size", bad), "event 1 (seq 1, create)",
         "args.size")
for key in ("va", "size", "handle"):
    for bad in (-G, 1 << 64, "0x7f", 1.0):
        case(f"call-map-{key}-{bad!r:.20}", arg(2, key, bad), "event 2 (seq 2, map)",
             f"args.{key}")
for bad in ("x", 1.5, True, -1, 1 << 64, BIG, [1], {"va": 1}):
    case(f"call-result-{bad!r:.20}", event(0, result=bad), "event 0 (seq 0, reserve)",
         "result")
for bad in (5, "", True, ["CUDA"], {"name": "x"}, "E" * 5000):
    case(f"call-error-{bad!r:.20}", event(11, error=bad), "event 11 (seq 11, create)",
         "error")
for fieldname in ("wall_us", "sim_us"):
    for bad in ("fast", math.nan, math.inf, -math.inf, -1.0, -1, True, None, BIG, [1.0]):
        case(f"call-{fieldname}-{bad!r:.20}", event(5, **{fieldname: bad}),
             "event 5 (seq 5, export_handle)", fieldname)
for literal in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400"):
    case(f"call-wall-us-literal-{literal}",
         text_of(same, '"wall_us": 1.5', f'"wall_us": {literal}'), "event 0", "wall_us")
case("call-a-refused-call-with-a-result", event(11, result=3), "event 11",
     "refused call has no result")
case("call-a-negative-size-that-succeeded", arg(1, "size", -G), "event 1", "args.size")

# driver calls: every argument a call needs, and nothing else
for opname, keys in CALL_ARGS.items():
    for key in keys:
        case(f"call-{opname}-without-{key}", drop_arg(ev_index(opname), key),
             f"event {ev_index(opname)}", f"args.{key} is missing")
for opname, extra in [("map", "offset"), ("mem_info", "device"), ("reserve", "devices"),
                      ("create", "handle"), ("free", "align")]:
    case(f"call-{opname}-with-{extra}", arg(ev_index(opname), extra, 0),
         f"event {ev_index(opname)}", f"unknown field '{extra}'")
for opname in ("reserve", "create", "export_handle", "import_handle"):
    case(f"call-{opname}-that-succeeded-without-a-result",
         event(ev_index(opname), result=None), f"event {ev_index(opname)}",
         "result is missing")
for name, bad in [("a-str", "0"), ("bools", [True]), ("negative", [-1]), ("too-high", [1024]),
                  ("floats", [0.0]), ("too-many", [0] * 2000), ("nested", [[0]]),
                  ("an-object", {"0": 0}), ("huge", [BIG])]:
    case(f"call-devices-{name}", arg(3, "devices", bad), "event 3 (seq 3, set_access)",
         "args.devices")

# arena operations: each field's type and range
for bad in ("0", -1, True, None, 1.5, 1 << 32, BIG, [0]):
    case(f"op-arena-{bad!r:.20}", op(1, arena=bad), "arena op 1 (seq 13, allocate)", "arena")
for bad in ("bogus", 3, None, "OPEN", "arena.open", "reserve", ["open"]):
    case(f"op-op-{bad!r:.20}", op(0, op=bad), "arena op 0 (seq 12)", "op must be an arena")
for bad in ("-1", -1, 1 << 63, None):
    case(f"op-seq-{bad!r:.20}", op(0, seq=bad), "arena op 0", "seq")
for bad in ([], "x", None):
    case(f"op-args-{bad!r:.20}", op(2, args=bad), "arena op 2 (seq 14, commit)",
         "args must be an object")
for opname, kinds in OP_ARGS.items():
    j = op_index(opname)
    for key, kind in kinds.items():
        bads: list[Any] = (
            [5, "", None, ["kv"], "n" * 5000] if kind == "str"
            else [-1, 1 << 64, BIG, "8", 1.0, True, None] if kind == "int"
            else [1, "1", [-1], ["1"], [1.0], [True], [1024], None])
        for bad in bads:
            case(f"op-{opname}-{key}-{bad!r:.20}", op_arg(j, key, bad),
                 f"arena op {j} (seq {12 + j}, {opname})", f"args.{key}")

# arena operations: every argument each needs, and nothing else
for opname, kinds in OP_ARGS.items():
    for key in kinds:
        case(f"op-{opname}-without-{key}", drop_op_arg(op_index(opname), key),
             f"arena op {op_index(opname)}", f"args.{key} is missing")
for opname in ARENA_OPS:
    case(f"op-{opname}-with-an-unknown-argument", op_arg(op_index(opname), "extra", 1),
         f"arena op {op_index(opname)}", "unknown field 'extra'")

# arena references: open before use, none after close, one open per number (an appended op
# is number len(ARENA_OPS): valid_doc has one of each)
case("arena-never-opened", op(2, arena=5), "arena op 2", "arena 5 was never opened")
case("arena-used-before-its-open", delete_op(0), "arena op 0", "arena 0 was never opened")
case("arena-opened-twice", op(1, op="open", args={"name": "a", "reserve_bytes": G,
                                                  "base": 0}),
     "arena op 1 (seq 13, open)", "opened again")
case("arena-used-after-its-close", append_op(op="commit", args={"offset": 0, "nbytes": G}),
     f"arena op {len(ARENA_OPS)} (seq 100, commit)", "after its close")
case("arena-closed-twice", append_op(), f"arena op {len(ARENA_OPS)} (seq 100, close)",
     "after its close")
case("arena-granted-after-its-close", append_op(op="grant_access", args={"devices": [1]}),
     f"arena op {len(ARENA_OPS)}", "after its close")
case("arena-a-second-arena-never-opened", append_op(arena=1), "arena 1 was never opened")
case("arena-the-close-moved-first", op(op_index("close"), seq=11.5),
     f"arena op {op_index('close')}", "seq")

# ordering: one sequence over both lists, each list in recorded order
case("order-seq-repeated-in-events", event(3, seq=2), "event 3 (seq 2, set_access)",
     "repeats event 2")
case("order-seq-repeated-across-lists", op(0, seq=4), "arena op 0 (seq 4, open)",
     "repeats event 4")
case("order-events-out-of-order", event(0, seq=50), "event 1", "comes after seq 50")
case("order-ops-out-of-order", op(3, seq=2), "arena op 3 (seq 2, decommit)", "repeats")
case("order-ops-decreasing", op(4, seq=14), "arena op 4", "repeats")
case("order-ops-swapped", op(1, seq=20), "arena op 2", "comes after seq 20")
case("order-events-swapped",
     lambda d: {**d, "events": [d["events"][1], d["events"][0], *d["events"][2:]]},
     "event 1 (seq 0, reserve)", "comes after seq 1")

# meta: free-form, but what a replay reads is typed, and all of it is plain finite JSON
for bad in ("2M", 0, 3, 1 << 41, True, 1.5, -G, None, BIG):
    case(f"meta-granularity-{bad!r:.20}", meta(granularity=bad), "meta.granularity")
for bad in (-1, "0", 1024, True, 0.0, None):
    case(f"meta-device-{bad!r:.20}", meta(device=bad), "meta.device")
for key in ("driver", "device_name", "profile", "recorded"):
    case(f"meta-{key}-not-a-str", meta(**{key: 5}), f"meta.{key}")
case("meta-nan", meta(clock=math.nan), "meta.clock", "finite")
case("meta-infinity-deep-inside", meta(x={"y": [1, math.inf]}), "meta.x.y[1]", "finite")
case("meta-huge-int", meta(n=BIG), "meta.n")
case("meta-nan-literal", text_of(same, '"device": 0', '"device": 0, "t": NaN'), "meta.t")

# version 1: arena operations were "arena.*" events, their number among the arguments
V1_OPEN = {"seq": 12, "op": "arena.open", "args": {"arena": 0, "name": "kv",
                                                   "reserve_bytes": 8 * G, "base": VA}}


def v1(*extra: dict[str, Any]) -> Mutation:
    def f(d: Doc) -> Doc:
        return {"format": "kvvmm-trace", "version": 1, "meta": d["meta"],
                "events": [*d["events"], *extra]}
    return f


case("v1-arena-op-without-its-arena", v1({**V1_OPEN, "args": {"name": "kv"}}),
     "event 12", "'arena' is missing")
case("v1-arena-op-args-not-an-object", v1({**V1_OPEN, "args": [0]}), "event 12")
case("v1-unknown-arena-op", v1({**V1_OPEN, "op": "arena.explode"}), "event 12",
     "op must be an arena")
case("v1-arena-op-on-a-never-opened-arena",
     v1({"seq": 12, "op": "arena.commit", "args": {"arena": 0, "offset": 0, "nbytes": G}}),
     "event 12 (seq 12, commit)", "never opened")
case("v1-arena-op-repeating-a-seq", v1({**V1_OPEN, "seq": 3}), "event 12", "repeats event 3")


@pytest.mark.parametrize(("mutation", "fragments"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_hostile_trace_is_refused_with_a_one_line_message_naming_the_record_or_field(
    mutation: Mutation, fragments: tuple[str, ...], tmp_path: Path,
) -> None:
    doc = mutation(valid_doc())
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode("utf-8", "surrogatepass")
    path = tmp_path / "hostile.json"
    path.write_bytes(raw)
    with pytest.raises(TraceFormatError) as info:
        Trace.load(path)
    msg = str(info.value)
    assert msg.startswith(str(path) + ": ")
    assert "\n" not in msg and len(msg) < 400, msg
    for fragment in fragments:
        assert fragment in msg
    if not isinstance(doc, bytes):  # the parsed document is refused the same way
        with pytest.raises(TraceFormatError) as again:
            Trace.from_json(json.loads(raw))
        assert str(again.value) == msg.removeprefix(str(path) + ": ")


def test_the_table_of_hostile_traces_covers_every_class_with_150_cases() -> None:
    assert len(CASES) >= 150
    assert len({c[0] for c in CASES}) == len(CASES)
    classes = {c[0].split("-")[0] for c in CASES}
    assert {"syntax", "nesting", "top", "record", "call", "op", "arena", "order", "meta",
            "v1"} <= classes


def test_the_valid_document_loads_and_replays_with_the_same_outcomes() -> None:
    trace = Trace.from_json(valid_doc())
    assert replay(trace, SimDriver()) == []
    [snap] = replay_arenas(trace)
    assert snap.name == "kv" and snap.closed
    v1_doc = v1(V1_OPEN)(valid_doc())
    assert Trace.from_json(v1_doc).ops[0].args["name"] == "kv"


def test_a_file_that_cannot_be_read_is_a_trace_format_error_naming_it(tmp_path: Path) -> None:
    for path in (tmp_path / "missing.json", tmp_path):
        with pytest.raises(TraceFormatError) as info:
            Trace.load(path)
        assert str(info.value).startswith(f"{path}: cannot read it")


# -- loaded, but the arena refuses: replay_arenas names the operation -------------------------

REFUSED: list[tuple[str, Mutation, str]] = [
    ("commit-beyond-the-allocation", op_arg(2, "nbytes", 5 * G), "arena op 2 (seq 14, commit)"),
    ("allocate-beyond-the-reservation", op_arg(1, "nbytes", 9 * G), "arena op 1"),
    ("open-of-nothing", op_arg(0, "reserve_bytes", 0), "arena op 0 (seq 12, open)"),
    ("open-of-more-va-than-any-device", op_arg(0, "reserve_bytes", 1 << 60), "arena op 0"),
    ("allocate-of-nothing", op_arg(1, "nbytes", 0), "arena op 1 (seq 13, allocate)"),
    ("allocate-at-another-offset", op_arg(1, "offset", 2 * G), "arena op 1"),
    ("commit-at-no-allocation", op_arg(2, "offset", 6 * G), "arena op 2"),
    ("decommit-at-no-allocation", op_arg(3, "offset", 6 * G), "arena op 3"),
    ("decommit-keeping-more-than-backed", op_arg(3, "keep_bytes", 8 * G), "arena op 3"),
    ("adopt-at-no-allocation", op_arg(7, "offset", 2 * G), "arena op 7 (seq 19, adopt)"),
    ("adopt-beyond-the-allocation", op_arg(7, "nbytes", 8 * G), "arena op 7"),
    ("commit-range-at-no-allocation", op_arg(4, "offset", 6 * G),
     "arena op 4 (seq 16, commit_range)"),
    ("decommit-range-at-no-allocation", op_arg(5, "offset", 6 * G), "arena op 5"),
    ("commit-at-an-offset-past-every-allocation", lambda d: {**d, "arena_ops": [
        *d["arena_ops"][:2], {"seq": 30, "arena": 0, "op": "commit",
                              "args": {"offset": 4 * G, "nbytes": G}}]}, "arena op 2"),
]


@pytest.mark.parametrize(("mutation", "where"), [r[1:] for r in REFUSED],
                         ids=[r[0] for r in REFUSED])
def test_replaying_arena_operations_the_arena_refuses_names_the_operation(
    mutation: Mutation, where: str,
) -> None:
    doc = mutation(valid_doc())
    assert isinstance(doc, dict)
    trace = Trace.from_json(doc)
    with pytest.raises(KvvmmError) as info:
        replay_arenas(trace)
    msg = str(info.value)
    assert isinstance(info.value, TraceFormatError) and where in msg, msg
    assert "cannot be replayed" in msg


def test_driver_calls_the_replay_driver_refuses_are_mismatches_not_exceptions() -> None:
    doc = valid_doc()
    doc["events"][2]["args"]["size"] = 3 * G  # a map of more than the handle
    doc["events"][3]["args"]["devices"] = []  # a refusal that is not CUDA's
    mismatches = replay(Trace.from_json(doc), SimDriver())
    assert [(m.seq, m.op, m.recorded) for m in mismatches][:2] == [
        (2, "map", "ok"), (3, "set_access", "ok")]
    assert mismatches[1].replayed == "ArgumentError"


# -- traces built in memory get the same checks -----------------------------------------------


def built(*calls: tuple[str, Any, Any, Any]) -> Trace:
    t = Trace()
    for name, args, result, error in calls:
        t.add(name, args, result, error)
    return t


IN_MEMORY: list[tuple[str, Callable[[], Trace], str]] = [
    ("a-reserve-without-its-result",
     lambda: built(("reserve", {"size": G, "align": 0}, None, None)), "result is missing"),
    ("args-not-a-dict", lambda: built(("create", [G], None, None)), "args must be an object"),
    ("a-str-size", lambda: built(("create", {"size": "G"}, 1, None)), "args.size"),
    ("a-huge-size", lambda: built(("create", {"size": BIG}, 1, None)), "args.size"),
    ("an-unknown-call", lambda: built(("cuMemAlloc", {}, None, None)), "op must be"),
    ("a-missing-argument", lambda: built(("map", {"va": VA}, None, None)), "args.size"),
    ("nan-wall-time", lambda: _with(built(("mem_info", {}, None, None)), wall_us=math.nan),
     "wall_us"),
    ("an-op-on-no-arena", lambda: _op(Trace(), 3, "commit", offset=0, nbytes=G),
     "never opened"),
    ("meta-not-json", lambda: Trace(meta={"x": object()}), "meta.x"),
    ("meta-that-holds-itself", lambda: _loop(), "deeper than 32"),
]


def _with(t: Trace, **fields: Any) -> Trace:
    import dataclasses
    t.events[0] = dataclasses.replace(t.events[0], **fields)
    return t


def _op(t: Trace, arena: int, name: str, **args: Any) -> Trace:
    t.add_op(arena, name, **args)
    return t


def _loop() -> Trace:
    m: dict[str, Any] = {}
    m["self"] = m
    return Trace(meta=m)


@pytest.mark.parametrize(("make", "fragment"), [c[1:] for c in IN_MEMORY],
                         ids=[c[0] for c in IN_MEMORY])
def test_a_trace_built_in_memory_is_checked_before_it_is_replayed(
    make: Callable[[], Trace], fragment: str,
) -> None:
    for run in (lambda t: replay(t, SimDriver()), replay_arenas):
        with pytest.raises(TraceFormatError) as info:
            run(make())
        assert fragment in str(info.value)


# -- properties: random damage to a valid trace ---------------------------------------------

JSON_LEAVES = (st.none() | st.booleans()
               | st.integers(min_value=-(1 << 70), max_value=1 << 70)
               | st.sampled_from([0, 1, G, 8 * G, VA, 1 << 63, (1 << 64) - 1, 1 << 64, BIG])
               | st.floats(allow_nan=True, allow_infinity=True)
               | st.text(max_size=8)
               | st.sampled_from(["open", "commit", "reserve", "map", "arena.open", "kv"]))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=6)


def _slots(doc: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) of ``doc``, so a mutation can reach any field at any depth."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(
        doc, list) else ()
    for k, v in items:
        out.append((doc, k))
        _slots(v, out)
    return out


@st.composite
def damaged(draw: st.DrawFn) -> Any:
    doc: Any = valid_doc()
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(doc, [])
        if not slots:
            break
        container, key = slots[draw(st.integers(0, len(slots) - 1))]
        how = draw(st.sampled_from(["replace", "delete", "insert", "copy"]))
        if how == "replace":
            container[key] = draw(JSON_VALUES)
        elif how == "delete":
            del container[key]
        elif how == "insert" and isinstance(container, dict):
            container[draw(st.sampled_from(["seq", "op", "args", "x", "arena", "result",
                                            "devices", "size"]))] = draw(JSON_VALUES)
        elif how == "insert":
            container.insert(key, draw(JSON_VALUES))
        elif isinstance(container, list):  # copy: a record or value repeated
            container.insert(key, copy.deepcopy(container[key]))
    return doc


def _load_and_replay(load: Callable[[], Trace]) -> None:
    try:
        trace = load()
    except TraceFormatError as e:
        assert "\n" not in str(e)
        return
    try:
        replay(trace, SimDriver())
        replay_arenas(trace)
    except KvvmmError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged())
def test_a_damaged_trace_either_loads_and_replays_or_is_refused(doc: Any) -> None:
    _load_and_replay(lambda: Trace.from_json(doc))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_damaged_bytes_either_load_and_replay_or_are_refused(data: st.DataObject) -> None:
    raw = bytearray(json.dumps(valid_doc()).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        how = data.draw(st.sampled_from(["flip", "delete", "insert"]))
        if how == "flip":
            raw[i] = data.draw(st.integers(0, 255))
        elif how == "delete":
            del raw[i]
        else:
            raw[i:i] = data.draw(st.sampled_from([b"[", b"{", b"9" * 30, b"-", b"\xff",
                                                  b'"', b",", b"NaN", b"null", b"1e999"]))
    _load_and_replay(lambda: Trace.loads(bytes(raw)))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "create", "map", "free", "release",
                                           "unmap", "set_access", "bogus"]),
                          st.dictionaries(st.sampled_from(["size", "align", "va", "handle",
                                                           "devices"]), JSON_VALUES,
                                          max_size=4),
                          JSON_VALUES, st.none() | st.text(max_size=5)), max_size=6))
def test_a_random_trace_built_in_memory_replays_or_is_refused(
    calls: list[tuple[str, Any, Any, Any]],
) -> None:
    _load_and_replay(lambda: built(*calls))

"""Hostile and broken GPU profiles (profile hardening, items 4 to 7): one ProfileError each.

A profile is a JSON file a user passes (``SimDriver(profile=path)``, ``kvvmm replay --gpu
PATH``). Loading one reads only a regular file of bounded size, parses strict JSON (no NaN,
no Infinity) and checks every field the library reads against one declared schema, so every
bad profile ends in one :class:`ProfileError` naming the file, the field, its value and what
it must be, never in a hang, a RecursionError, an OverflowError or "math domain error", and a
profile that loads never fails later or runs the sim clock negative, NaN or infinite.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvvmm import cli
from kvvmm.driver.sim import SimDriver
from kvvmm.errors import ArgumentError, KvvmmError, ProfileError
from kvvmm.hardware import get_profile, load_profile, profile_data, profile_from_data, sim_costs
from kvvmm.hardware.profiles import MAX_PROFILE_BYTES, shipped_data
from kvvmm.hardware.schema import MAX_DEPTH
from kvvmm.units import GiB, MiB

DATA = Path(__file__).resolve().parents[2] / "kvvmm" / "hardware" / "data"
#: Longest message a refusal may print (file, field and value are each clipped to ~200).
MAX_MESSAGE = 1200
DELETE = object()


def _h200() -> dict[str, Any]:
    """The shipped h200 profile (every section the sim reads), as a private copy."""
    return copy.deepcopy(dict(shipped_data()["h200"]))


def _with(data: dict[str, Any], path: tuple[str | int, ...], value: object) -> dict[str, Any]:
    node: Any = data
    for seg in path[:-1]:
        node = node[seg]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


def _refused(fn: Callable[[], object], *fields: str) -> ProfileError:
    """``fn()`` raises exactly one ProfileError whose bounded message names each of ``fields``.

    Run in a daemon thread: a loader that blocks (a FIFO) fails the test instead of hanging it.
    """
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # collected, checked below
            out.append(e)
        else:
            out.append(None)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert out, "the loader blocked (it must never open a FIFO or read /dev/zero)"
    err = out[0]
    assert isinstance(err, ProfileError), f"{type(err).__name__}: {err}"
    text = str(err)
    assert len(text) <= MAX_MESSAGE and "\n" not in text, text
    for f in fields:
        assert f in text, (f, text)
    return err


# -- item 7 and 5: every declared field typed and bounded, at load ------------------------

NAN, INF = math.nan, math.inf
A_LOT = 10**30

#: (id, path, value, what the message must name): each a field the library reads.
BAD_FIELDS: list[tuple[str, tuple[str | int, ...], object, str]] = [
    ("capacity-true", ("capacity_bytes",), True, "capacity_bytes=true"),
    ("capacity-string", ("capacity_bytes",), "150109106995", "capacity_bytes='150109106995'"),
    ("capacity-zero", ("capacity_bytes",), 0, "capacity_bytes=0"),
    ("capacity-negative", ("capacity_bytes",), -1, "capacity_bytes=-1"),
    ("capacity-float", ("capacity_bytes",), 1.5e11, "capacity_bytes"),
    ("capacity-null", ("capacity_bytes",), None, "capacity_bytes=null"),
    ("capacity-past-size_t", ("capacity_bytes",), 1 << 64, "capacity_bytes"),
    ("capacity-missing", ("capacity_bytes",), DELETE, "capacity_bytes"),
    ("granularity-3MiB", ("granularity_bytes",), 3 * MiB, "power of two"),
    ("granularity-6MiB", ("granularity_bytes",), 6 * MiB, "granularity_bytes=6291456"),
    ("granularity-1MiB", ("granularity_bytes",), 1 * MiB, "granularity_bytes=1048576"),
    ("granularity-zero", ("granularity_bytes",), 0, "granularity_bytes=0"),
    ("granularity-true", ("granularity_bytes",), True, "granularity_bytes=true"),
    ("granularity-string", ("granularity_bytes",), "2097152", "granularity_bytes"),
    ("key-int", ("key",), 5, "key=5"),
    ("key-empty", ("key",), "", "key=''"),
    ("name-missing", ("name",), DELETE, "name"),
    ("source-null", ("source",), None, "source=null"),
    ("version-true", ("version",), True, "version=true"),
    ("version-99", ("version",), 99, "version=99"),
    ("format-other", ("format",), "something-else", "format='something-else'"),
    ("cost-negative", ("call_costs", "points", "create", 0, 1), -1.0, "create[0][1]=-1.0"),
    ("cost-nan", ("call_costs", "points", "create", 0, 1), NAN, "create[0][1]"),
    ("cost-inf", ("call_costs", "points", "create", 0, 1), INF, "create[0][1]"),
    ("cost-bool", ("call_costs", "points", "map", 0, 1), True, "map[0][1]=true"),
    ("cost-string", ("call_costs", "points", "map", 0, 1), "2.1", "map[0][1]='2.1'"),
    ("cost-huge", ("call_costs", "points", "map", 0, 1), 1e300, "map[0][1]=1e+300"),
    ("size-zero-log2", ("call_costs", "points", "create", 0, 0), 0, "create[0][0]=0"),
    ("size-negative", ("call_costs", "points", "create", 0, 0), -2.0, "create[0][0]=-2.0"),
    ("size-under-a-byte", ("call_costs", "points", "create", 0, 0), 1e-30, "create[0][0]"),
    ("size-overflow", ("call_costs", "points", "create", 0, 0), 1e308, "create[0][0]"),
    ("point-one-entry", ("call_costs", "points", "create", 0), [2.0], "create[0]"),
    ("point-number", ("call_costs", "points", "create", 0), 5, "create[0]=5"),
    ("points-not-object", ("call_costs", "points"), [], "call_costs.points=[]"),
    ("section-not-object", ("call_costs",), "fast", "call_costs='fast'"),
    ("mem-info-negative", ("call_costs", "mem_info_us"), -8.5, "mem_info_us=-8.5"),
    ("context-factor-zero", ("call_costs", "context_factor", "map"), 0, "context_factor.map"),
    ("bandwidth-empty-runs", ("bandwidth", "runs", "vmm_2MiB"), [], "vmm_2MiB=[]"),
    ("bandwidth-zero", ("bandwidth", "runs", "vmm_2MiB"), [0.0], "vmm_2MiB[0]=0.0"),
    ("bandwidth-negative", ("bandwidth", "runs", "plain"), [-4.2], "plain[0]=-4.2"),
    ("bandwidth-string", ("bandwidth", "runs", "plain"), ["4.2"], "plain[0]='4.2'"),
    ("bandwidth-label", ("bandwidth", "runs", "vmm_xMiB"), [4.0], "vmm_xMiB"),
    ("bandwidth-tensor-zero", ("bandwidth", "tensor_bytes"), 0, "tensor_bytes=0"),
    ("region-zero", ("first_touch", "region_mib"), 0, "first_touch.region_mib=0"),
    ("region-negative", ("first_touch", "region_mib"), -512, "region_mib=-512"),
    ("region-float", ("first_touch", "region_mib"), 512.5, "region_mib=512.5"),
    ("region-true", ("first_touch", "region_mib"), True, "region_mib=true"),
    ("region-string", ("first_touch", "region_mib"), "512", "region_mib='512'"),
    ("region-missing-modelled", ("first_touch", "region_mib"), DELETE, "region_mib"),
    ("first-touch-negative", ("first_touch", "map_us"), -0.354, "first_touch.map_us=-0.354"),
    ("first-touch-inf", ("first_touch", "set_access_us"), INF, "set_access_us"),
    ("first-touch-per", ("first_touch", "per"), "sometimes", "first_touch.per='sometimes'"),
    ("modelled-string", ("first_touch", "modelled"), "true", "modelled='true'"),
    ("modelled-int", ("first_touch", "modelled"), 1, "first_touch.modelled=1"),
    ("work-negative", ("library_work_us", "arena.commit", "fixed"), -1.0, "['arena.commit']"),
    ("work-null", ("library_work_us", "arena.commit", "fixed"), None, "fixed=null"),
    ("work-missing", ("library_work_us", "arena.open", "fixed"), DELETE, "['arena.open'].fixed"),
    ("work-string", ("library_work_us", "arena.commit", "per_unit"), "9.3", "per_unit='9.3'"),
    ("work-row-number", ("library_work_us", "arena.close"), 15.4, "['arena.close']=15.4"),
    ("access-negative", ("set_access_per_mapping", "points", 0, 1), -27.6, "points[0][1]"),
    ("unmap-past-max", ("unmap_per_mapping", "points", 0, 1), 1e10, "points[0][1]=10000000000.0"),
    ("overhead-nan", ("library_overhead_us",), {"per_call": {"create": NAN}},
     "per_call.create"),
    ("overhead-size-zero", ("library_overhead_us",), {"by_size": {"create": [[0, 1.0]]}},
     "by_size.create[0][0]=0"),
    ("slowdown-missing-factor", ("post_release_slowdown", "modelled"), True, "factor"),
    ("slowdown-below-one", ("post_release_slowdown",),
     {"modelled": True, "factor": 0.5, "creates": 256, "min_released_bytes": GiB}, "factor=0.5"),
    ("slowdown-creates-negative", ("post_release_slowdown",),
     {"modelled": True, "factor": 2.0, "creates": -1, "min_released_bytes": GiB}, "creates=-1"),
    ("slowdown-bytes-bool", ("post_release_slowdown",),
     {"modelled": True, "factor": 2.0, "creates": 1, "min_released_bytes": True},
     "min_released_bytes=true"),
    ("record-nan", ("calibration",), {"raw": [1.0, NAN]}, "calibration.raw[1]"),
    ("record-inf", ("measured_on",), {"free_bytes_at_start": INF}, "free_bytes_at_start"),
]


def _bad(path: tuple[str | int, ...], value: object) -> dict[str, Any]:
    return _with(_h200(), path, value)


def _write(tmp_path: Path, text: str, name: str = "bad.json") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize(("path", "value", "names"), [c[1:] for c in BAD_FIELDS],
                         ids=[c[0] for c in BAD_FIELDS])
def test_a_bad_field_is_refused_at_load_naming_the_file_the_field_and_the_bound(
    tmp_path: Path, path: tuple[str | int, ...], value: object, names: str,
) -> None:
    # json.dumps writes NaN and Infinity literals: the file holds what a hand edit would.
    f = _write(tmp_path, json.dumps(_bad(path, value)))
    err = _refused(lambda: load_profile(f), "bad.json", names, "must be")
    assert isinstance(err, ArgumentError) and isinstance(err, ValueError)
    assert err.where == str(f) and err.field and err.limit


def test_built_data_gets_the_same_checks_as_a_file() -> None:
    for case, path, value, names in BAD_FIELDS:
        err = _refused(lambda p=path, v=value: profile_from_data(_bad(p, v), where="built"),
                       "built", names)
        assert err.field, case


def test_granularity_past_the_capacity_is_refused() -> None:
    data = dict(_h200(), capacity_bytes=2 * MiB, granularity_bytes=4 * MiB)
    _refused(lambda: profile_from_data(data), "granularity_bytes=4194304", "capacity_bytes")


@pytest.mark.parametrize("gran", [2 * MiB, 4 * MiB, 64 * MiB, GiB])
def test_a_power_of_two_multiple_of_2_mib_is_a_granularity_every_reserve_can_use(
    gran: int,
) -> None:
    sim = SimDriver(profile_from_data(dict(_h200(), key="g", granularity_bytes=gran)))
    va = sim.reserve(4 * gran)
    h = sim.create(gran)
    sim.map(va, gran, h)
    sim.set_access(va, gran)
    sim.unmap(va, gran)
    assert sim.granularity() == gran and 0 < sim.clock_us < math.inf


# -- item 5 and 6: strict JSON: no NaN or Infinity literals, no overflow, bounded depth ---

LITERALS = {
    "nan": "NaN", "infinity": "Infinity", "minus-infinity": "-Infinity",
    "overflowing-float": "1e999", "5000-digit-int": "9" * 5000,
}


@pytest.mark.parametrize(("field", "where"), [
    ("capacity_bytes", ("capacity_bytes",)),
    ("mem_info_us", ("call_costs", "mem_info_us")),
    ("calibration", ("calibration",)),  # a record the library keeps but never reads
], ids=["capacity", "cost", "record"])
@pytest.mark.parametrize("literal", list(LITERALS.values()), ids=list(LITERALS))
def test_nan_infinity_and_overflowing_literals_are_refused_by_field(
    tmp_path: Path, literal: str, field: str, where: tuple[str, ...],
) -> None:
    text = json.dumps(_bad(where, "@LITERAL@")).replace('"@LITERAL@"', literal)
    err = _refused(lambda: load_profile(_write(tmp_path, text)), "bad.json", field)
    assert "NaN" in str(err) or "Infinity" in str(err) or "finite" in str(err)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 2000, 200_000])
def test_deep_nesting_is_refused_not_a_recursion_error(tmp_path: Path, depth: int) -> None:
    inner = json.dumps(dict(_h200(), calibration="@DEEP@")).replace('"@DEEP@"', _nested(depth))
    _refused(lambda: load_profile(_write(tmp_path, inner)), "bad.json", "nested")
    _refused(lambda: load_profile(_write(tmp_path, _nested(depth), "whole.json")),
             "whole.json")


@pytest.mark.parametrize(("text", "says"), [
    ("{not json", "JSON"), ("", "JSON"), ("[1, 2]", "JSON object"), ("null", "JSON object"),
    ('{"format": "kvvmm-hardware-profile", "version": 1}', "key"),
], ids=["broken", "empty", "array", "null", "no-fields"])
def test_what_is_not_a_profile_says_so(tmp_path: Path, text: str, says: str) -> None:
    _refused(lambda: load_profile(_write(tmp_path, text)), "bad.json", says)


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "latin1.json"
    p.write_bytes(b'{"format": "\xff"}')
    _refused(lambda: load_profile(p), "latin1.json", "UTF-8")


# -- item 6: bounded messages ------------------------------------------------------------


def test_huge_values_and_keys_give_a_bounded_message(tmp_path: Path) -> None:
    huge = "x" * 1_000_000
    for data in (dict(_h200(), capacity_bytes=huge),
                 dict(_h200(), library_work_us={huge: {"fixed": huge}}),
                 dict(_h200(), calibration={"a" * 5000: {huge: [INF]}})):
        _refused(lambda d=data: load_profile(_write(tmp_path, json.dumps(d))), "bad.json")
    long_dir = tmp_path / ("p" * 200)
    long_dir.mkdir()
    f = _write(long_dir, json.dumps(dict(_h200(), key=7)), "q" * 200 + ".json")
    _refused(lambda: load_profile(f), "q" * 150 + ".json", "key=7")  # the name's end kept


def test_a_profile_error_survives_pickling_with_its_fields() -> None:
    err = ProfileError("/x/y.json", "first_touch.region_mib", 0, "an integer >= 1", "why")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ProfileError and str(back) == str(err)
    assert (back.where, back.field, back.value, back.limit) == (
        "/x/y.json", "first_touch.region_mib", 0, "an integer >= 1")


# -- item 4: regular files only, of bounded size -----------------------------------------


def _fifo(tmp_path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    p = tmp_path / "fifo.json"
    os.mkfifo(p)
    return p


def _dev_zero(tmp_path: Path) -> Path:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    return Path("/dev/zero")


def _directory(tmp_path: Path) -> Path:
    p = tmp_path / "dir.json"
    p.mkdir()
    return p


def _oversize(tmp_path: Path) -> Path:
    p = tmp_path / "big.json"
    with open(p, "wb") as f:
        f.truncate(MAX_PROFILE_BYTES + 1)  # sparse: no 16 MiB written
    return p


def _link_to_fifo(tmp_path: Path) -> Path:
    link = tmp_path / "link.json"
    link.symlink_to(_fifo(tmp_path))
    return link


SPECIAL: dict[str, tuple[Callable[[Path], Path], str]] = {
    "fifo": (_fifo, "a FIFO"),
    "dev-zero": (_dev_zero, "a character device"),
    "directory": (_directory, "a directory"),
    "oversize": (_oversize, f"{MAX_PROFILE_BYTES + 1} bytes"),
    "symlink-to-fifo": (_link_to_fifo, "a FIFO"),
}


@pytest.mark.parametrize("kind", list(SPECIAL))
def test_only_a_regular_file_of_bounded_size_is_read(tmp_path: Path, kind: str) -> None:
    make, says = SPECIAL[kind]
    path = make(tmp_path)
    for load in (load_profile, get_profile, lambda p: SimDriver(profile=str(p))):
        err = _refused(lambda f=load: f(path), str(path), says, "regular file",
                       str(MAX_PROFILE_BYTES))
        assert err.field == ""


def test_a_path_with_a_nul_byte_is_a_profile_error() -> None:
    _refused(lambda: load_profile("bad\0name.json"), "NUL")


def test_a_missing_file_is_still_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_profile(tmp_path / "missing.json")


# -- what loads, works -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.json")))
def test_every_shipped_profile_loads_from_its_file_and_keeps_the_clock_finite(
    name: str,
) -> None:
    prof = load_profile(DATA / name)
    assert profile_data(prof) == shipped_data()[prof.key]
    sim = SimDriver(profile=str(DATA / name))
    g = sim.granularity()
    va = sim.reserve(64 * g)
    handles = [sim.create(g * 2**i) for i in range(3)]
    off = 0
    for i, h in enumerate(handles):
        sim.map(va + off, g * 2**i, h)
        off += g * 2**i
    sim.set_access(va, off)
    sim.unmap(va, off)
    for h in handles:
        sim.release(h)
    sim.free(va, 64 * g)
    assert 0 < sim.clock_us < math.inf
    assert math.isfinite(sim_costs(prof).work_us("arena.commit", 8))


# -- the CLI: exit 2 with one line ------------------------------------------------------

CLI_CASES: dict[str, Callable[[Path], Path]] = {
    "fifo": _fifo,
    "dev-zero": _dev_zero,
    "directory": _directory,
    "oversize": _oversize,
    "nan": lambda t: _write(t, json.dumps(_bad(("call_costs", "mem_info_us"), NAN))),
    "infinity": lambda t: _write(t, json.dumps(_bad(("first_touch", "map_us"), INF))),
    "negative": lambda t: _write(t, json.dumps(_bad(("call_costs", "points", "map", 0, 1),
                                                    -2.0))),
    "bool": lambda t: _write(t, json.dumps(_bad(("capacity_bytes",), True))),
    "string": lambda t: _write(t, json.dumps(_bad(("granularity_bytes",), "2097152"))),
    "region-zero": lambda t: _write(t, json.dumps(_bad(("first_touch", "region_mib"), 0))),
    "granularity-3MiB": lambda t: _write(t, json.dumps(_bad(("granularity_bytes",), 3 * MiB))),
    "deep": lambda t: _write(t, _nested(100_000)),
    "huge-int": lambda t: _write(t, json.dumps(_bad(("capacity_bytes",), "@")).replace(
        '"@"', "9" * 5000)),
}


@pytest.mark.parametrize("kind", list(CLI_CASES))
def test_kvvmm_replay_with_a_bad_gpu_profile_exits_2_with_one_line(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str],
) -> None:
    path = CLI_CASES[kind](tmp_path)
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(cli.main(
        ["replay", "generated", "--seconds", "5", "--json", "--gpu", str(path)])), daemon=True)
    t.start()
    t.join(20)
    assert rc == [2], "kvvmm replay blocked or did not refuse the profile"
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith("kvvmm replay: ProfileError: profile ") and str(path) in lines[0]
    assert len(lines[0]) <= MAX_MESSAGE + 40


def test_a_profile_error_is_a_kvvmm_error_exported_at_the_top() -> None:
    import kvvmm

    assert kvvmm.ProfileError is ProfileError and issubclass(ProfileError, KvvmmError)

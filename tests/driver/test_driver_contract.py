"""The driver contract: one table of rules, proven on every driver, and checked against the H200.

DESIGN.md's Drivers section states the rules once; :data:`RULES` writes each down once, as a
sentence, the calls that exercise it (``tests/drivers.py`` describes the little script
language) and the outcome every driver must give: ``ok``, or the name CUDA uses for the
refusal. ``test_every_driver_keeps_the_rule`` runs each row on the simulator (H200 profile),
the host driver, and the CUDA driver with its hot calls in C and in Python (the CUDA ones run
on a GPU machine and skip elsewhere). Every refusal must also name the call, its arguments
(addresses in hex) and the CUDA error, be a ``DriverOutOfMemoryError`` exactly when out of
memory, and leave the driver's own accounting (``stats()``) as it was; after every row,
``close()`` leaves the driver clean.

Two recordings from an H200 are read on every run, so the table cannot drift from the
hardware without a test failing:

- ``bench/results/h200-kvvmm-rule-errors.json``: what kvvmm's CudaDriver
  answered there. A row naming one of its cases (``h200=``) must expect that answer, and
  every case it recorded has a row.
- ``bench/results/h200-cuda-rules.json``: what raw CUDA (cuda-python, no kvvmm) answered to
  each probe of ``bench/cuda_rules/probe_cuda_rules.py`` (``git show 5543154:PATH`` brings it
  back). :data:`PROBES` replays each probe on the simulator: it must answer as the H200 did,
  except where kvvmm deliberately refuses more than raw CUDA (:data:`STRICTER`: each of those
  is a refusal the CudaDriver itself made on the H200, by its recording). Probes the simulator
  cannot express are listed with the reason (:data:`NOT_EXPRESSIBLE`).

Below the table: rules about capacity (which only the simulator and host driver let a test
set), what mem_info shows and what handles are shared as (``handle_type``) on every driver,
and what only the simulator or the host driver
promises (deterministic addresses, profiles, the cost clock; real bytes, real faults).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
from drivers import (
    OK,
    ROOT,
    Recorder,
    Script,
    close_driver,
    driver_params,
    find_result,
    open_driver_kind,
    parse,
)

from kvvmm import PROFILES, DriverError, DriverOutOfMemoryError, SimDriver
from kvvmm.driver import FaultyDriver
from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    HANDLE_TYPES,
    Driver,
)

INVALID = CUDA_ERROR_INVALID_VALUE
NOT_SUPPORTED = CUDA_ERROR_NOT_SUPPORTED
OOM = CUDA_ERROR_OUT_OF_MEMORY
MiB = 1 << 20
GiB = 1 << 30
MakeDriver = Callable[..., Driver]
host_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                               reason="the host driver needs Linux")


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the contract."""

    name: str  #: the rule, as a sentence
    script: str  #: the calls; every one but the last must be accepted (setup)
    expect: str  #: what the last call gives on every driver: OK or a CUDA error name
    then: str = ""  #: after an accepted call: ``x == y; ...`` over script names and stats
    says: str = ""  #: a fragment every driver's refusal contains (``{expr}`` filled in)
    #: a fragment of the words of the rule book the simulator and host driver share
    #: (VmmBook); CUDA's own refusals word it otherwise
    book_says: str = ""
    h200: str = ""  #: this case's name in the H200 recording of the CudaDriver's answers

    def param(self) -> Any:
        return pytest.param(self, id=self.name.replace(" ", "-"))


# The same VA shapes recur: a reservation ``a`` and mappings in it at granule offsets.
R8 = "a = reserve(8G)\n"
R4 = "a = reserve(4G)\n"
MAPPED_1_3 = R8 + "mapped(a + G, 2G)\n"  # [G, 3G) mapped
MAPPED_1_4 = R8 + "mapped(a + G, 3G)\n"  # [G, 4G) mapped
TWO_MAPS_RELEASED = R8 + "h = create(2G)\nmap(a, 2G, h)\nmap(a + 4G, 2G, h)\nrelease(h)\n"

RULES: list[Rule] = [
    # -- reserve: sizes and alignments are multiples of the granularity -----------------------
    Rule("a reserve of 4 KiB, less than a granule, is refused", "reserve(4K)", INVALID),
    Rule("a reserve of a granule less 4 KiB is refused", "reserve(G - 4K)", INVALID),
    Rule("a reserve of a granule and 4 KiB is refused", "reserve(G + 4K)", INVALID,
         h200="reserve: size not a multiple"),
    Rule("a reserve of a negative size is refused", "reserve(-G)", INVALID),
    Rule("a reserve of zero bytes is refused", "reserve(0)", INVALID, says="size",
         h200="reserve: size 0"),
    Rule("a reserve aligned to one and a half granules is refused",
         "reserve(G, align=G + G // 2)", INVALID, h200="reserve: align not a multiple (1.5 gran)"),
    Rule("a reserve aligned to three granules, not a power of two, is refused",
         "reserve(G, align=3G)", INVALID, h200="reserve: align not a power of two (3 gran)"),
    Rule("a reserve with a negative alignment is refused", "reserve(G, align=-G)", INVALID),
    # As an H200 answers: a power of two below the granularity is accepted, and the VA is
    # aligned to the granularity anyway.
    Rule("a reserve aligned to 4 KiB is accepted and aligned to a granule",
         "a = reserve(G, align=4K)", OK, then="a % G == 0"),
    Rule("a reserve aligned to half a granule is accepted and aligned to a granule",
         "a = reserve(G, align=G // 2)", OK, then="a % G == 0"),
    Rule("a reserve honours an alignment that is a multiple of the granularity",
         "reserve(G)\na = reserve(2G, align=8G)", OK,
         then="a % 8G == 0; reservations == 2; reserved_bytes == 3G"),
    # -- free: exactly one whole reservation, with nothing mapped in it -----------------------
    Rule("a free of the exact reservation leaves the driver clean",
         "a = reserve(2G, align=8G)\nfree(a, 2G)", OK, then="clean == True"),
    Rule("a free that starts inside a reservation is refused", R4 + "free(a + G, 3G)", INVALID,
         h200="free: not the start"),
    Rule("a free of an address in no reservation is refused", R4 + "free(a + 64G, 4G)",
         INVALID),
    Rule("a free of less than the whole reservation is refused", R4 + "free(a, 3G)", INVALID,
         says="is {4G} bytes", h200="free: smaller size"),
    Rule("a free of one granule of a four-granule reservation is refused", R4 + "free(a, G)",
         INVALID, says="is {4G} bytes"),
    Rule("a free of more than the reservation is refused", R4 + "free(a, 5G)", INVALID,
         says="is {4G} bytes", h200="free: larger size"),
    Rule("a free of two adjacent reservations as one is refused",
         "a = reserve(4G)\nb = reserve(4G)\nfree(min(a, b), 8G)", INVALID),
    Rule("a free of a reservation with a mapping inside is refused",
         R4 + "mapped(a + G, G)\nfree(a, 4G)", INVALID, says="mappings are still in it",
         h200="free: with a mapping inside"),
    Rule("a free once the mappings inside are gone is accepted",
         R4 + "h = mapped(a + G, G)\nunmap(a + G, G)\nrelease(h)\nfree(a, 4G)", OK,
         then="clean == True"),
    Rule("a second free of a reservation is refused", "a = reserve(2G)\nfree(a, 2G)\nfree(a, 2G)",
         INVALID, h200="free: twice"),
    # -- create: a positive multiple of the granularity, within the free memory ---------------
    Rule("a create of 4 KiB is refused", "create(4K)", INVALID),
    Rule("a create of 100 pages is refused", "create(100 * 4K)", INVALID),
    Rule("a create of a granule and 4 KiB is refused", "create(G + 4K)", INVALID,
         h200="create: size not a multiple"),
    Rule("a create of zero bytes is refused", "create(0)", INVALID, says="size",
         h200="create: size 0"),
    Rule("a create of a negative size is refused", "create(-G)", INVALID),
    Rule("a create of a granule more than the free memory is out of memory",
         "f = mem_free()\ncreate((f // G + 1) * G)", OOM,
         book_says="{(f // G + 1) * G} bytes asked, {f} free", h200="create: free + granularity"),
    Rule("a create larger than the whole device is out of memory",
         "t = mem_total()\ncreate((t // G + 1) * G)", OOM, h200="create: capacity + granularity"),
    # -- map: a whole handle at offset 0, inside one reservation, over unmapped VA ------------
    Rule("a map of part of a handle is refused as not supported",
         R4 + "h = create(2G)\nmap(a, G, h)", NOT_SUPPORTED, says="whole handles",
         h200="map: size < the handle's (partial handle)"),
    Rule("a map of more than the handle is refused as not supported",
         R4 + "h = create(2G)\nmap(a, 3G, h)", NOT_SUPPORTED, says="whole handles",
         h200="map: size > the handle's"),
    # The map and unmap first make the reservation the CudaDriver's "last one" (its fast test).
    Rule("a map just past a reservation's end is refused",
         R4 + "h = create(2G)\nmap(a, 2G, h)\nunmap(a, 2G)\nmap(a + 4G, 2G, h)", INVALID,
         says="reservation", h200="map: just past the reservation's end"),
    Rule("a map straddling a reservation's end is refused",
         R4 + "h = create(2G)\nmap(a, 2G, h)\nunmap(a, 2G)\nmap(a + 3G, 2G, h)", INVALID,
         says="reservation", h200="map: straddling the reservation's end"),
    Rule("a map straddling a reservation's start is refused",
         R4 + "h = create(2G)\nmap(a - G, 2G, h)", INVALID, says="reservation"),
    Rule("a map well past a reservation's end is refused",
         R4 + "h = create(G)\nmap(a + 1028G, G, h)", INVALID),
    Rule("a map well before a reservation's start is refused",
         R4 + "h = create(G)\nmap(a - 1024G, G, h)", INVALID),
    Rule("a map into a freed reservation is refused",
         R4 + "h = create(G)\nfree(a, 4G)\nmap(a, G, h)", INVALID,
         h200="map: into a freed reservation"),
    # CUDA may place the second reservation right after the first (the simulator always
    # does); a map across both is refused either way: one reservation per map.
    Rule("a map across two adjacent reservations is refused",
         "a = reserve(2G)\nb = reserve(2G)\nh = create(2G)\nmap(min(a, b) + G, 2G, h)", INVALID,
         h200="map: across two adjacent reservations"),
    Rule("a map into another reservation than the last one used is accepted",
         "a = reserve(4G)\nb = reserve(4G)\nh = create(2G)\nmap(a, 2G, h)\nunmap(a, 2G)\n"
         "map(b, 2G, h)", OK, then="mappings == 1; mapped_bytes == 2G"),
    Rule("a map exactly over a mapping is refused",
         MAPPED_1_3 + "h = create(2G)\nmap(a + G, 2G, h)", INVALID,
         book_says="already mapped", h200="map: exactly over a mapping"),
    Rule("a map overlapping a mapping's end is refused",
         MAPPED_1_3 + "h = create(2G)\nmap(a + 2G, 2G, h)", INVALID, book_says="already mapped",
         h200="map: overlapping the end of a mapping"),
    Rule("a map overlapping a mapping's start is refused",
         MAPPED_1_3 + "h = create(2G)\nmap(a, 2G, h)", INVALID, book_says="already mapped"),
    Rule("a map inside a mapping is refused", MAPPED_1_3 + "h = create(G)\nmap(a + G, G, h)",
         INVALID, book_says="already mapped"),
    Rule("a map around a mapping is refused", MAPPED_1_3 + "h = create(4G)\nmap(a, 4G, h)",
         INVALID, book_says="already mapped"),
    Rule("a map over a mapping's last granule is refused",
         MAPPED_1_3 + "h = create(G)\nmap(a + 2G, G, h)", INVALID, book_says="already mapped"),
    Rule("a map of a handle again over its own mapping is refused",
         R8 + "h = mapped(a, 2G)\nmap(a, 2G, h)", INVALID, book_says="already mapped"),
    Rule("maps right before and right after a mapping are accepted",
         MAPPED_1_3 + "mapped(a + 3G, G)\nh = create(G)\nmap(a, G, h)", OK,
         then="mappings == 3; mapped_bytes == 4G"),
    Rule("a map of a released handle is refused", R4 + "h = create(G)\nrelease(h)\nmap(a, G, h)",
         INVALID, says="handle {h}"),
    Rule("a map of a handle never created is refused", R4 + "h = create(G)\nmap(a, G, h + 1000)",
         INVALID, says="handle {h + 1000}"),
    Rule("a map at an address 4 KiB past a granule is refused",
         R4 + "h = create(G)\nmap(a + 4K, G, h)", INVALID, h200="map: va not a multiple"),
    Rule("a map of zero bytes is refused", R4 + "h = create(G)\nmap(a, 0, h)", INVALID),
    Rule("one handle may be mapped at two addresses and given access at both",
         R8 + "h = create(2G)\nmap(a, 2G, h)\nmap(a + 4G, 2G, h)\nset_access(a, 2G)\n"
         "set_access(a + 4G, 2G)", OK,
         then="mappings == 2; handles == 1; mapped_bytes == 4G; physical_bytes == 2G"),
    # -- unmap: whole mappings only (several at once), never part of one ----------------------
    Rule("an unmap of a mapping's first half is refused", R8 + "mapped(a, 2G)\nunmap(a, G)",
         INVALID, h200="unmap: first half of a mapping"),
    Rule("an unmap of a mapping's second half is refused", R8 + "mapped(a, 2G)\nunmap(a + G, G)",
         INVALID, h200="unmap: second half of a mapping"),
    Rule("an unmap of a mapping's first granule of three is refused",
         MAPPED_1_4 + "unmap(a + G, G)", INVALID),
    Rule("an unmap of a mapping's last granule of three is refused",
         MAPPED_1_4 + "unmap(a + 3G, G)", INVALID),
    Rule("an unmap of a mapping's middle is refused", MAPPED_1_4 + "unmap(a + 2G, G)", INVALID),
    Rule("an unmap of a whole mapping and the unmapped VA after it is refused",
         MAPPED_1_4 + "unmap(a + G, 4G)", INVALID,
         h200="unmap: a mapping and unmapped VA after it"),
    Rule("an unmap of part of a mapping and the VA after it is refused",
         MAPPED_1_4 + "unmap(a + 2G, 3G)", INVALID),
    Rule("an unmap from before a mapping into it is refused", MAPPED_1_4 + "unmap(a, 2G)",
         INVALID),
    Rule("an unmap of VA with nothing mapped is refused", R4 + "unmap(a, G)", INVALID,
         h200="unmap: VA with nothing mapped"),
    Rule("an unmap outside any reservation is refused", R4 + "unmap(a + 64G, G)", INVALID),
    Rule("an unmap of two adjacent whole mappings in one call is accepted",
         R8 + "mapped(a, G)\nmapped(a + G, 2G)\nunmap(a, 3G)", OK,
         then="mappings == 0; mapped_bytes == 0; handles == 2; physical_bytes == 3G"),
    Rule("an unmap over two mappings with a hole between is refused",
         R8 + "mapped(a, G)\nmapped(a + 2G, G)\nunmap(a, 3G)", INVALID, book_says="not mapped",
         h200="unmap: two mappings with a hole between"),
    Rule("an unmap at an address 4 KiB past a granule is refused",
         R4 + "mapped(a, G)\nunmap(a + 4K, G - 4K)", INVALID),
    Rule("an unmap of zero bytes is refused", R4 + "mapped(a, G)\nunmap(a, 0)", INVALID),
    Rule("an unmap of 4 KiB of a mapping is refused", R4 + "mapped(a, G)\nunmap(a, 4K)", INVALID,
         h200="unmap: size not a multiple"),
    Rule("an unmap of a whole mapping is accepted and the handle keeps its memory",
         R4 + "h = mapped(a, 2G)\nunmap(a, 2G)", OK,
         then="mappings == 0; handles == 1; physical_bytes == 2G"),
    # -- set access: mapped VA only, whole mappings only --------------------------------------
    Rule("set access of VA with nothing mapped is refused", R4 + "set_access(a, G)", INVALID,
         h200="set_access: unmapped VA"),
    Rule("set access running past a mapping into unmapped VA is refused",
         R4 + "mapped(a, G)\nset_access(a, 2G)", INVALID),
    Rule("set access of a mapping's first half is refused",
         R4 + "h = create(2G)\nmap(a, 2G, h)\nset_access(a, G)", INVALID,
         h200="set_access: first half of a mapping"),
    Rule("set access of a mapping's second half is refused",
         R4 + "h = create(2G)\nmap(a, 2G, h)\nset_access(a + G, G)", INVALID),
    Rule("set access of a whole mapping is accepted",
         R4 + "h = create(2G)\nmap(a, 2G, h)\nset_access(a, 2G)", OK, then="mappings == 1"),
    Rule("set access of two adjacent mappings in one call is accepted",
         R4 + "h1 = create(G)\nh2 = create(G)\nmap(a, G, h1)\nmap(a + G, G, h2)\n"
         "set_access(a, 2G)", OK, then="mappings == 2; mapped_bytes == 2G; handles == 2"),
    Rule("set access over two mappings with a hole between is refused",
         R8 + "mapped(a, G)\nmapped(a + G, G)\nmapped(a + 3G, G)\nset_access(a, 4G)", INVALID,
         h200="set_access: a range with a hole"),
    Rule("set access of 4 KiB of a mapping is refused", R4 + "mapped(a, G)\nset_access(a, 4K)",
         INVALID, h200="set_access: size not a multiple"),
    # -- release: legal while mapped; the memory goes with the last mapping -------------------
    Rule("a second release of a handle is refused", "h = create(G)\nrelease(h)\nrelease(h)",
         INVALID, says="handle {h}", h200="release: twice"),
    Rule("a release of a handle never created is refused", "release(987654)", INVALID,
         says="handle 987654", h200="release: unknown handle"),
    Rule("a release of an unmapped handle gives its memory back", "h = create(2G)\nrelease(h)",
         OK, then="handles == 0; physical_bytes == 0; clean == True"),
    Rule("a release while mapped is legal and keeps the memory", TWO_MAPS_RELEASED.strip(), OK,
         then="handles == 0; mappings == 2; physical_bytes == 2G"),
    Rule("a release of a released handle that is still mapped is refused",
         TWO_MAPS_RELEASED + "release(h)", INVALID, says="handle {h}"),
    Rule("a map of a released handle that is still mapped elsewhere is refused",
         R8 + "h = create(2G)\nmap(a, 2G, h)\nrelease(h)\nmap(a + 4G, 2G, h)", INVALID,
         says="handle {h}", h200="map: released-but-mapped handle at another VA"),
    Rule("the memory of a released handle stays while one of its mappings is left",
         TWO_MAPS_RELEASED + "unmap(a, 2G)", OK, then="physical_bytes == 2G; mappings == 1"),
    Rule("the memory of a released handle goes with its last mapping",
         TWO_MAPS_RELEASED + "unmap(a, 2G)\nunmap(a + 4G, 2G)", OK,
         then="physical_bytes == 0; mappings == 0; handles == 0"),
    Rule("a reservation whose last mapping went can be freed, leaving the driver clean",
         TWO_MAPS_RELEASED + "unmap(a, 2G)\nunmap(a + 4G, 2G)\nfree(a, 8G)", OK,
         then="clean == True"),
    # -- the accounting that goes with the rules ----------------------------------------------
    Rule("a commit counts one reservation, handle and mapping, and its memory",
         "a = reserve(64G)\nh = create(4G)\nmap(a + 8G, 4G, h)\nset_access(a + 8G, 4G)", OK,
         then="reservations == 1; reserved_bytes == 64G; handles == 1; mappings == 1; "
              "mapped_bytes == 4G; physical_bytes == 4G"),
    Rule("a teardown in order leaves nothing held",
         "a = reserve(64G)\nh = create(4G)\nmap(a + 8G, 4G, h)\nset_access(a + 8G, 4G)\n"
         "unmap(a + 8G, 4G)\nrelease(h)\nfree(a, 64G)", OK, then="clean == True"),
]

#: Cases of the H200 recording of the CudaDriver that are not rows here, and why.
NOT_ROWS = {
    "unmap: during CUDA graph capture":
        "needs a CUDA graph capture: tests/gpu/test_cuda_driver.py",
}

CUDA_ANSWERS = Recorder("driver_contract_cuda.json")


@pytest.fixture(params=driver_params())
def kind(request: pytest.FixtureRequest) -> str:
    """``sim``, ``host``, ``cuda-c`` or ``cuda-python``."""
    return str(request.param)


@pytest.fixture
def driver(kind: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Driver]:
    """A fresh driver of each kind; closed after the test, which must leave it clean."""
    d = open_driver_kind(kind, monkeypatch)
    yield d
    close_driver(d)
    if kind != "sim":  # every driver has close(); the simulator's holds nothing real to give
        assert d.stats().clean, f"{kind}: close() left {d.stats()}"


def stats_names(d: Driver) -> dict[str, Any]:
    s = d.stats()
    return {**dataclasses.asdict(s), "clean": s.clean}


def _shown(args: dict[str, int]) -> str:
    return ", ".join(f"{k}={v:#x}" if k == "va" else f"{k}={v}" for k, v in args.items())


def check_refusal(d: Driver, kind: str, op: str, err: DriverError, call_args: dict[str, int]
                  ) -> None:
    """What every refusal carries: the call, its arguments, the error name, the reason."""
    assert isinstance(err, DriverOutOfMemoryError) == (err.cuda_error == OOM), repr(err)
    assert err.call == op, err
    text = str(err)
    assert text.startswith(f"{op}({_shown(err.call_args)}) failed: {err.cuda_error}"), text
    assert err.reason and err.reason in text, text
    if kind in ("sim", "host"):
        assert err.call_args == call_args, (err.call_args, call_args)
    else:
        # CudaDriver leaves an argument out of two refusals (align of a bad reserve size,
        # handle of a misaligned map); what it carries must be the call's.
        assert err.call_args.items() <= call_args.items(), (err.call_args, call_args)


@pytest.mark.parametrize("rule", [r.param() for r in RULES])
def test_every_driver_keeps_the_rule(driver: Driver, kind: str, rule: Rule) -> None:
    run = Script(driver)
    steps = parse(rule.script)
    for step in steps[:-1]:
        run.must(step)
    last = steps[-1]
    before = driver.stats()
    got = run.step(last)
    if kind.startswith("cuda"):
        CUDA_ANSWERS.add(kind, rule.name, got.error)
    if rule.expect == OK:
        assert got.error is None, f"{last.text!r} was refused: {got.error}"
        broken = run.holds(rule.then, stats_names(driver))
        assert not broken, f"after {last.text!r}: " + "; ".join(broken)
        return
    assert got.error is not None, f"{last.text!r} was accepted; the rule says {rule.expect}"
    err = got.error
    assert err.cuda_error == rule.expect, f"{err.cuda_error}, expected {rule.expect}: {err}"
    check_refusal(driver, kind, last.op, err, got.args)
    assert driver.stats() == before, "a refused call changed the driver's accounting"
    if rule.says:
        assert run.fill(rule.says) in str(err), (run.fill(rule.says), str(err))
    if rule.book_says and kind in ("sim", "host"):
        assert run.fill(rule.book_says) in str(err), (run.fill(rule.book_says), str(err))


def test_the_table_has_one_row_per_rule_and_every_script_parses() -> None:
    names = [r.name for r in RULES]
    assert len(names) == len(set(names)), "two rows share a name"
    for r in RULES:
        assert parse(r.script), r.name
        assert r.expect == OK or r.expect.startswith("CUDA_ERROR_"), r.name
        assert not (r.then and r.expect != OK), f"{r.name}: 'then' is for accepted calls"


# -- the H200's recorded answers --------------------------------------------------------------


@cache
def kvvmm_on_h200() -> dict[str, Any]:
    """What kvvmm's CudaDriver answered per case on an H200 (tests/gpu, C fast path run)."""
    data: dict[str, Any] = json.loads(
        find_result("h200-kvvmm-rule-errors.json").read_text())
    return data


@cache
def raw_cuda_on_h200() -> dict[str, Any]:
    """What raw CUDA answered per probe on an H200 (probe_cuda_rules.py of 5543154)."""
    data: dict[str, Any] = json.loads(find_result("h200-cuda-rules.json").read_text())
    return data


def test_every_row_the_h200_answered_expects_what_the_h200_answered() -> None:
    recorded = kvvmm_on_h200()
    wrong = []
    for r in RULES:
        if not r.h200:
            continue
        got = recorded[r.h200]
        answer = got["cuda_error"] if got["refused"] else OK
        if answer != r.expect:
            wrong.append(f"{r.name}: expects {r.expect}, the H200 answered {answer}")
    assert not wrong, wrong


def test_every_case_the_h200_answered_has_a_row() -> None:
    named = {r.h200 for r in RULES if r.h200}
    missing = set(kvvmm_on_h200()) - named - set(NOT_ROWS)
    assert not missing, f"recorded on the H200 but in no row: {sorted(missing)}"
    assert not set(NOT_ROWS) & named


def test_the_h200_profile_holds_the_memory_the_h200_reported() -> None:
    total = raw_cuda_on_h200()["rules"]["create_bad_sizes_and_oom"]["total_bytes"]
    profile = PROFILES["h200"]
    # The profile is rounded to 0.1 GiB (139.8 GiB): within 0.01% of what cuMemGetInfo said.
    assert abs(profile.capacity_bytes - total) <= total // 10_000, (profile.capacity_bytes, total)
    assert SimDriver(profile="h200").mem_info()[1] == profile.capacity_bytes


#: Each probe of bench/cuda_rules/probe_cuda_rules.py (of 5543154), as the same calls for the sim. A
#: comment after a call names the answer it recorded; calls without one are setup (the probe's
#: ``must_*``) and must be accepted. Sizes in granules (G), as the probe's keys are.
PROBES: dict[str, str] = {
    "reserve_misaligned_size": """
        reserve(G + 4K, align=G)        # reserve(G+4KiB)
        reserve(0)                      # reserve(0)
    """,
    "reserve_align_not_multiple": """
        reserve(4G, align=G + G // 2)   # reserve(4G, align=1.5G)
        reserve(4G, align=3G)           # reserve(4G, align=3G)
        v = reserve(4G, align=4K)       # reserve(4G, align=4KiB)
        value(v % 4K)                   # va % align (4KiB)
        free(v, 4G)
        w = reserve(4G, align=G // 2)   # reserve(4G, align=G/2)
        value(w % (G // 2))             # va % align (G/2)
        free(w, 4G)
    """,
    "free_wrong_size_or_address": """
        va = reserve(8G, align=G)
        free(va, 4G)                    # free(va, 4G) of an 8G reservation
        free(va, 16G)                   # free(va, 16G)
        free(va + G, 7G)                # free(va+G, 7G)
        free(va, 8G)                    # free(va, 8G) after those
        free(va, 8G)                    # free(va, 8G) twice
    """,
    "free_with_mapping_inside": """
        va = reserve(8G, align=G)
        h = create(G)
        map(va + 2G, G, h)
        set_access(va + 2G, G)
        free(va, 8G)                    # free(va, 8G) with [va+2G, va+3G) mapped
        unmap(va + 2G, G)               # then unmap(va+2G, G)
        release(h)                      # then release
        free(va, 8G)                    # then free(va, 8G)
    """,
    "unmap_hole_between_two_mappings": """
        va = reserve(8G, align=G)
        h1 = create(G)
        h2 = create(G)
        map(va, G, h1)
        map(va + 2G, G, h2)
        unmap(va, 3G)                   # unmap(va, 3G) over [map][hole][map]
        unmap(va, G)                    # then unmap(va, G)
        unmap(va + 2G, G)               # then unmap(va+2G, G)
    """,
    "unmap_two_adjacent_whole_mappings": """
        va = reserve(8G, align=G)
        h1 = create(G)
        h2 = create(2G)
        map(va, G, h1)
        map(va + G, 2G, h2)
        unmap(va, 3G)                   # unmap(va, 3G) over [G map][2G map]
        map(va, G, h1)                  # then map(va, G, h1) again
        unmap(va, G)                    # then unmap(va, G)
    """,
    "unmap_part_of_a_mapping": """
        va = reserve(8G, align=G)
        h = create(2G)
        map(va, 2G, h)
        unmap(va, G)                    # unmap(va, G) of a 2G mapping
        unmap(va + G, G)                # unmap(va+G, G) of a 2G mapping
        unmap(va, 4G)                   # unmap(va, 4G) mapping + unmapped tail
        unmap(va + 4G, G)               # unmap(va+4G, G) nothing mapped
        unmap(va, 2G)                   # unmap(va, 2G) whole
    """,
    "set_access_cases": """
        va = reserve(16G, align=G)
        h1 = create(G)
        h2 = create(G)
        h3 = create(2G)
        map(va, G, h1)
        map(va + G, G, h2)
        map(va + 4G, 2G, h3)
        set_access(va, 2G)              # set_access(va, 2G) over two adjacent mappings
        set_access(va + 4G, G)          # set_access(va+4G, G) first half of a 2G mapping
        set_access(va, 6G)              # set_access(va, 6G) with a hole
        set_access(va + 8G, G)          # set_access(va+8G, G) unmapped
        set_access(va, 4K)              # set_access(va, 4096) misaligned size
    """,
    "map_partial_handle": """
        va = reserve(8G, align=G)
        h = create(2G)
        map(va, G, h)                   # map(va, G, 2G handle)
        h1 = create(G)
        map(va, 2G, h1)                 # map(va, 2G, G handle) larger than handle
        map(va + 4K, G, h1)             # map(va+4096, G, G handle) misaligned va
    """,
    "map_over_mapped_va": """
        va = reserve(8G, align=G)
        h1 = create(2G)
        h2 = create(2G)
        h3 = create(2G)
        map(va, 2G, h1)
        map(va, 2G, h2)                 # map(va, 2G) exactly over a mapping
        map(va + G, 2G, h3)             # map(va+G, 2G) overlapping a mapping's end
        map(va, 2G, h1)                 # map(va, 2G, same handle) again
    """,
    "map_outside_a_reservation": """
        va = reserve(4G, align=G)
        h = create(2G)
        map(va + 4G, 2G, h)             # map(end, 2G) just past the reservation
        map(va + 3G, 2G, h)             # map(end-G, 2G) straddling the end
        free(va, 4G)
        map(va, 2G, h)                  # map(va, 2G) into a freed reservation
    """,
    # The simulator places reservations back to back: no address hint is needed.
    "map_spanning_two_adjacent_reservations": """
        a = reserve(4G, align=G)
        b = reserve(4G, align=G)        # reserve(hint=a+4G)
        value(b == a + 4G)              # adjacent
        h = create(2G)
        map(a + 3G, 2G, h)              # map(a+3G, 2G) across both
        free(a, 8G)                     # reserve 8G at a (merged pair)? free(a, 8G)
    """,
    "create_bad_sizes_and_oom": """
        create(G + 4K)                  # create(G+4KiB)
        create(0)                       # create(0)
        t = mem_total()
        create((t // G + 1) * G)        # create(total+G)
        f = mem_free()
        create((f // G + 1) * G)        # create(free+G)
    """,
    "release_twice": """
        h = create(G)
        release(h)                      # release
        release(h)                      # release again (stale handle)
    """,
    "release_while_mapped_then_unmap": """
        va = reserve(2 * GiB, align=G)
        f0 = mem_free()
        h = create(GiB)
        map(va, GiB, h)
        set_access(va, GiB)
        f1 = mem_free()
        release(h)                      # release while mapped
        f2 = mem_free()
        unmap(va, GiB)                  # unmap
        f3 = mem_free()
        value((f0 - f1) / MiB)          # MiB taken by create+map
        value((f2 - f1) / MiB)          # MiB given back by the release
        value((f3 - f2) / MiB)          # MiB given back by the unmap
    """,
    "map_released_but_mapped_handle_elsewhere": """
        va = reserve(8G, align=G)
        h = create(2G)
        map(va, 2G, h)
        release(h)                      # release while mapped
        map(va + 4G, 2G, h)             # map(va+4G, 2G, released handle)
        unmap(va, 2G)                   # unmap(va, 2G)
    """,
    "map_one_handle_at_two_addresses": """
        va = reserve(8G, align=G)
        h = create(2G)
        map(va, 2G, h)                  # map(va)
        map(va + 4G, 2G, h)             # map(va+4G) same handle
        set_access(va, 2G)              # set_access both
        set_access(va + 4G, 2G)         # set_access both
        release(h)                      # release
        unmap(va, 2G)                   # unmap first
        unmap(va + 4G, 2G)              # unmap second
    """,
    # No current context: the simulator has none, so the VMM calls are accepted as on CUDA.
    "vmm_calls_without_a_current_context": """
        va = reserve(4G, align=G)       # reserve
        h = create(G)                   # create
        map(va, G, h)                   # map
        set_access(va, G)               # set_access
        unmap(va, G)                    # unmap
        release(h)                      # release
        free(va, 4G)                    # free
    """,
}

#: Where kvvmm refuses what raw CUDA accepts, on purpose: probe answer -> the case of the
#: H200 recording of the CudaDriver that shows kvvmm itself refusing the same call there.
STRICTER: dict[tuple[str, str], str] = {
    # CUDA unmaps whatever is mapped in the range, holes and all; kvvmm unmaps whole
    # mappings that tile the range, as the rules say (a hole is a caller's bug).
    ("unmap_hole_between_two_mappings", "unmap(va, 3G) over [map][hole][map]"):
        "unmap: two mappings with a hole between",
    ("unmap_part_of_a_mapping", "unmap(va, 4G) mapping + unmapped tail"):
        "unmap: a mapping and unmapped VA after it",
    ("unmap_part_of_a_mapping", "unmap(va+4G, G) nothing mapped"): "unmap: VA with nothing mapped",
    ("set_access_cases", "set_access(va, 6G) with a hole"): "set_access: a range with a hole",
    # CUDA does not check that a map lies inside one live reservation; kvvmm does.
    ("map_outside_a_reservation", "map(end-G, 2G) straddling the end"):
        "map: straddling the reservation's end",
    ("map_outside_a_reservation", "map(va, 2G) into a freed reservation"):
        "map: into a freed reservation",
    ("map_spanning_two_adjacent_reservations", "map(a+3G, 2G) across both"):
        "map: across two adjacent reservations",
    # CUDA maps a released handle that is still mapped elsewhere; kvvmm takes live ones only.
    ("map_released_but_mapped_handle_elsewhere", "map(va+4G, 2G, released handle)"):
        "map: released-but-mapped handle at another VA",
}

#: Recorded answers the simulator cannot give, and why (counted, never silently dropped).
NOT_EXPRESSIBLE: dict[tuple[str, str], str] = {
    ("reserve_align_not_multiple", "reserve(4G, hint misaligned)"):
        "the protocol's reserve takes no address hint",
    ("map_partial_handle", "map(va, G, 2G handle, offset=G)"):
        "the protocol's map has no handle offset (it is always 0)",
    ("vmm_calls_without_a_current_context", "cuMemGetInfo"):
        "a raw context call: kvvmm's mem_info makes the device's context current itself",
    ("vmm_calls_without_a_current_context", "cuCtxSynchronize"):
        "a raw context call, not in the protocol",
}
#: The steps that ran on the H200 only because a map kvvmm refuses (STRICTER) succeeded.
AFTER_A_STRICTER_MAP = {
    ("map_spanning_two_adjacent_reservations", "  set_access across both"),
    ("map_spanning_two_adjacent_reservations", "  free(a, 4G) while the mapping spans it"),
    ("map_spanning_two_adjacent_reservations", "  unmap(a+3G, 2G)"),
    ("map_released_but_mapped_handle_elsewhere", "  set_access"),
    ("map_released_but_mapped_handle_elsewhere", "  unmap(va+4G)"),
}
#: Whole probes about CUDA streams and graph capture, which the simulator does not have
#: (kvvmm's answer to them is tested on the GPU: tests/gpu/test_cuda_driver.py).
CAPTURE_PROBES = {
    "ctx_sync_during_capture_thread_mode_global", "ctx_sync_during_capture_thread_mode_relaxed",
    "ctx_sync_during_relaxed_capture", "unmap_during_capture_without_sync",
    "legacy_stream_query_during_capture",
}
#: Keys that record no answer to a call: timings and the device's memory figures.
NOT_ANSWERS = {"case_s", "create(total+G) ms", "create(free+G) ms", "free_bytes", "total_bytes"}


def answer_keys(case: str) -> list[str]:
    """The recorded answers of one probe (nested records flattened as ``outer/inner``)."""
    out = []
    for k, v in raw_cuda_on_h200()["rules"][case].items():
        if k in NOT_ANSWERS:
            continue
        if isinstance(v, dict):
            out.extend(f"{k}/{inner}" for inner in v)
        else:
            out.append(k)
    return out


def probe_tally() -> dict[str, int]:
    """How many recorded answers are checked, stricter by design, or not expressible."""
    tally = {"checked": 0, "stricter": 0, "not expressible": 0, "after a stricter map": 0,
             "capture": 0}
    for case in raw_cuda_on_h200()["rules"]:
        for key in answer_keys(case):
            if case in CAPTURE_PROBES:
                tally["capture"] += 1
            elif (case, key) in STRICTER:
                tally["stricter"] += 1
            elif (case, key) in NOT_EXPRESSIBLE:
                tally["not expressible"] += 1
            elif (case, key) in AFTER_A_STRICTER_MAP:
                tally["after a stricter map"] += 1
            else:
                tally["checked"] += 1
    return tally


def _answer(got: Any) -> Any:
    return OK if got == "CUDA_SUCCESS" else got


@pytest.mark.parametrize("case", sorted(raw_cuda_on_h200()["rules"]))
def test_the_simulator_answers_each_probe_as_the_h200_did(case: str) -> None:
    if case in CAPTURE_PROBES:
        pytest.skip("CUDA streams and graph capture: the simulator has neither")
    recorded = raw_cuda_on_h200()["rules"][case]
    run = Script(SimDriver(profile="h200"))
    seen: dict[str, list[Any]] = {}
    for step, got in run.run(textwrap.dedent(PROBES[case])):
        if not step.label:
            assert got.error is None, f"setup {step.text!r} was refused: {got.error}"
            continue
        seen.setdefault(step.label, []).append(got.value if step.op == "value" else got.name)
    wrong = []
    for key, answers in seen.items():
        want = recorded[key]
        if (case, key) in STRICTER:
            by_kvvmm = kvvmm_on_h200()[STRICTER[(case, key)]]
            assert by_kvvmm["by"] == "kvvmm", f"{key}: the CudaDriver left it to CUDA"
            want = by_kvvmm["cuda_error"]
        # Two calls recorded under one key: "CUDA_SUCCESS / CUDA_SUCCESS".
        wants = want.split(" / ") if isinstance(want, str) else [want]
        if [_answer(w) for w in wants] != answers:
            wrong.append(f"{key}: the simulator gave {answers}, the H200 {wants}")
    assert not wrong, "\n".join(wrong)


def test_every_recorded_probe_answer_is_checked_or_has_a_stated_reason() -> None:
    rules = raw_cuda_on_h200()["rules"]
    labelled = {(case, s.label) for case, script in PROBES.items()
                for s in parse(textwrap.dedent(script)) if s.label}
    answered = {(case, key) for case in rules for key in answer_keys(case)}
    unknown = labelled - answered
    assert not unknown, f"labels with no recorded answer (typos?): {sorted(unknown)}"
    reasons = set(STRICTER) | set(NOT_EXPRESSIBLE) | AFTER_A_STRICTER_MAP
    assert set(STRICTER) <= labelled
    left = {(c, k) for c, k in answered - labelled - reasons if c not in CAPTURE_PROBES}
    assert not left, f"recorded answers neither replayed nor explained: {sorted(left)}"
    assert set(PROBES) | CAPTURE_PROBES == set(rules)
    tally = probe_tally()
    assert sum(tally.values()) == len(answered)
    assert tally["checked"] >= 60, tally


# -- capacity: rules a test can only set up where it sets the capacity (sim, host) ------------

small = pytest.mark.parametrize("small_kind", driver_params(("sim", "host")))


@small
def test_a_create_past_what_is_left_is_out_of_memory_and_exactly_what_is_left_fits(
    small_kind: str, make_driver: MakeDriver
) -> None:
    g = 2 * MiB
    d = make_driver(small_kind, capacity_bytes=4 * g)
    h = d.create(3 * g)
    with pytest.raises(DriverOutOfMemoryError) as info:
        d.create(2 * g)
    assert f"{2 * g} bytes asked, {g} free" in str(info.value)
    h2 = d.create(g)  # exactly what is left still fits
    with pytest.raises(DriverOutOfMemoryError):
        d.create(g)
    d.release(h)
    d.release(h2)
    assert d.stats().clean
    d.release(d.create(4 * g))  # the memory came back


@small
def test_a_handle_released_while_mapped_still_counts_against_the_capacity(
    small_kind: str, make_driver: MakeDriver
) -> None:
    g = 2 * MiB
    d = make_driver(small_kind, capacity_bytes=2 * g)
    va = d.reserve(2 * g)
    h = d.create(2 * g)
    d.map(va, 2 * g, h)
    d.release(h)
    with pytest.raises(DriverOutOfMemoryError):
        d.create(g)
    d.unmap(va, 2 * g)
    d.release(d.create(2 * g))


def test_a_sim_device_counts_memory_used_by_others() -> None:
    g = 2 * MiB
    d = SimDriver(capacity_bytes=8 * g, used_bytes=6 * g)
    assert d.mem_info() == (2 * g, 8 * g)
    with pytest.raises(DriverOutOfMemoryError):
        d.create(3 * g)
    d.release(d.create(2 * g))


def test_sim_mem_info_is_capacity_less_used_less_held() -> None:
    g = 2 * MiB
    d = SimDriver(capacity_bytes=64 * g, used_bytes=10 * g)
    va = d.reserve(8 * g)
    h = d.create(4 * g)
    d.map(va, 4 * g, h)
    d.release(h)  # released but mapped: still held
    assert d.stats().physical_bytes == 4 * g
    assert d.mem_info() == (64 * g - 10 * g - 4 * g, 64 * g)


# -- mem_info, on every driver ----------------------------------------------------------------

#: How far mem_info may move for reasons of its own: none on the simulator; on the host it
#: is also capped by what the machine has available now; on a GPU the driver's own pools.
SLACK_BYTES = {"sim": 0, "host": 64 * MiB, "cuda-c": 64 * MiB, "cuda-python": 64 * MiB}


def test_mem_info_agrees_with_stats(driver: Driver, kind: str) -> None:
    g = driver.granularity()
    free0, total = driver.mem_info()
    assert 0 < free0 <= total
    h = driver.create(4 * g)
    free1, total1 = driver.mem_info()
    assert total1 == total
    assert driver.stats().physical_bytes == 4 * g
    assert free1 <= total - driver.stats().physical_bytes
    assert abs((free0 - free1) - 4 * g) <= SLACK_BYTES[kind], (free0, free1)
    driver.release(h)


def test_mem_info_sees_a_handle_released_while_mapped_hold_its_memory_until_the_unmap(
    driver: Driver, kind: str
) -> None:
    g = driver.granularity()
    size = (256 * MiB if kind == "host" else GiB) // g * g
    slack = SLACK_BYTES[kind]
    va = driver.reserve(2 * size)
    free0, _ = driver.mem_info()
    h = driver.create(size)
    driver.map(va, size, h)
    driver.set_access(va, size)
    free1, _ = driver.mem_info()
    assert abs((free0 - free1) - size) <= slack, "create + map takes the memory"
    driver.release(h)
    free2, _ = driver.mem_info()
    assert abs(free2 - free1) <= slack, "released but mapped: the memory is still held"
    driver.unmap(va, size)
    free3, _ = driver.mem_info()
    assert abs((free3 - free2) - size) <= slack, "the last unmap gives the memory back"
    driver.free(va, 2 * size)


# -- what handles can be shared as, on every driver --------------------------------------------

#: ``handle_type`` of each kind as the contract opens it: the simulator's and the host
#: driver's exports are file descriptors; a plain ``CudaDriver()`` asks CUDA for no
#: shareable handle (``handle_type="none"``, its default).
HANDLE_TYPE = {"sim": "posix_fd", "host": "posix_fd", "cuda-c": "none", "cuda-python": "none"}


def test_every_driver_names_its_handle_type_and_exports_a_descriptor_only_as_posix_fd(
    driver: Driver, kind: str
) -> None:
    assert driver.handle_type in HANDLE_TYPES
    assert driver.handle_type == HANDLE_TYPE[kind]
    assert FaultyDriver(driver).handle_type == driver.handle_type  # a wrapper says the same
    h = driver.create(driver.granularity())
    try:
        if driver.handle_type == "posix_fd":
            fd = driver.export_handle(h)
            try:
                assert os.fstat(fd) is not None  # a live descriptor, the caller's
            finally:
                os.close(fd)
        else:
            before = driver.stats()
            with pytest.raises(DriverError) as info:
                driver.export_handle(h)
            check_refusal(driver, kind, "export_handle", info.value, {"handle": h})
            assert driver.stats() == before
    finally:
        driver.release(h)


# -- what only the simulator promises ---------------------------------------------------------


def _script(d: Driver) -> list[object]:
    g = d.granularity()
    out: list[object] = []
    a = d.reserve(16 * g)
    b = d.reserve(8 * g, 4 * g)
    out += [a, b]
    for i in range(3):
        h = d.create((i + 1) * g)
        d.map(a + 4 * i * g, (i + 1) * g, h)
        out.append(h)
    try:
        d.map(a, g, 999)
    except DriverError as e:
        out.append(str(e))
    d.unmap(a, g)
    out.append(d.create(g))
    out.append(d.reserve(2 * g))
    out.append(d.mem_info())
    out.append(d.stats())
    return out


def test_two_fresh_sim_drivers_give_identical_addresses_and_handles() -> None:
    one, two = SimDriver(), SimDriver()
    assert _script(one) == _script(two)
    assert one.clock_us == two.clock_us


def test_the_sim_hands_reservations_out_back_to_back() -> None:
    d = SimDriver()
    g = d.granularity()
    a = d.reserve(2 * g)
    assert d.reserve(2 * g) == a + 2 * g


@pytest.mark.parametrize("key", ["h100", "h200", "b200", "gb300"])
def test_sim_profiles_exist_with_capacity_granularity_and_a_source(key: str) -> None:
    p = PROFILES[key]
    assert p.key == key
    assert p.capacity_bytes > 64 * GiB
    assert p.granularity_bytes > 0 and p.granularity_bytes % 4096 == 0
    assert p.source.strip() and p.name.strip()
    d = SimDriver(profile=key)
    assert d.granularity() == p.granularity_bytes
    assert d.mem_info() == (p.capacity_bytes, p.capacity_bytes)
    assert SimDriver(profile=key.upper()).name == p.name  # looked up case-insensitively


def test_sim_cost_clock_advances_with_every_call() -> None:
    d = SimDriver()
    g = d.granularity()
    seen = [d.clock_us]

    def tick() -> None:
        assert d.clock_us > seen[-1]
        seen.append(d.clock_us)

    va = d.reserve(64 * g)
    tick()
    h = d.create(g)
    tick()
    d.map(va, g, h)
    tick()
    d.set_access(va, g)
    tick()
    d.mem_info()
    tick()
    d.unmap(va, g)
    tick()
    d.release(h)
    tick()
    d.free(va, 64 * g)
    tick()
    big, small_one = SimDriver(), SimDriver()
    big.create(2048 * g)
    small_one.create(g)
    assert big.clock_us > small_one.clock_us  # a 4 GiB create costs more than a 2 MiB one


# -- what only the host driver promises: real bytes, real faults ------------------------------


def _mapped(d: Driver, va: int, size: int) -> int:
    h = d.create(size)
    d.map(va, size, h)
    d.set_access(va, size)
    return h


@host_only
def test_host_bytes_written_through_a_mapping_read_back(make_driver: MakeDriver) -> None:
    d = make_driver("host")
    g = d.granularity()
    va = d.reserve(4 * g)
    _mapped(d, va + g, 2 * g)
    payload = bytes(range(256)) * 64
    ctypes.memmove(va + g, payload, len(payload))
    ctypes.memmove(va + 3 * g - len(payload), payload, len(payload))
    assert ctypes.string_at(va + g, len(payload)) == payload
    assert ctypes.string_at(va + 3 * g - len(payload), len(payload)) == payload
    assert ctypes.string_at(va + g + len(payload), 16) == bytes(16)  # fresh memory is zero


@host_only
def test_host_a_handle_mapped_twice_shows_the_same_bytes_at_both_addresses(
    make_driver: MakeDriver,
) -> None:
    d = make_driver("host")
    g = d.granularity()
    va = d.reserve(8 * g)
    h = _mapped(d, va, g)
    d.map(va + 4 * g, g, h)
    d.set_access(va + 4 * g, g)
    ctypes.memmove(va + 100, b"kvvmm", 5)
    assert ctypes.string_at(va + 4 * g + 100, 5) == b"kvvmm"


@host_only
def test_host_memory_belongs_to_the_handle_across_unmap_and_map(make_driver: MakeDriver) -> None:
    d = make_driver("host")
    g = d.granularity()
    va = d.reserve(4 * g)
    h = _mapped(d, va, g)
    ctypes.memmove(va + g - 8, b"lastword", 8)
    d.unmap(va, g)
    d.map(va + 3 * g, g, h)
    d.set_access(va + 3 * g, g)
    d.release(h)  # released while mapped: the bytes stay
    assert ctypes.string_at(va + 4 * g - 8, 8) == b"lastword"


def _run_touch(body: str) -> subprocess.CompletedProcess[str]:
    prelude = textwrap.dedent(
        """
        import ctypes
        from kvvmm.driver.host import HostDriver
        d = HostDriver(capacity_bytes=64 << 20)
        g = d.granularity()
        va = d.reserve(4 * g)
        def touch(addr):
            ctypes.c_uint8.from_address(addr).value = 7
            return ctypes.c_uint8.from_address(addr).value
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONFAULTHANDLER", None)
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )


@host_only
@pytest.mark.parametrize(
    "body",
    [
        "touch(va + g)",  # reserved, never mapped
        "h = d.create(g); d.map(va, g, h); touch(va)",  # mapped, no set_access yet
        "h = d.create(g); d.map(va, g, h); d.set_access(va, g); touch(va); d.unmap(va, g); "
        "touch(va)",  # accessible once, then unmapped
    ],
    ids=["reserved-unmapped", "mapped-without-access", "after-unmap"],
)
def test_host_touching_va_with_no_accessible_memory_dies_by_sigsegv(body: str) -> None:
    proc = _run_touch(body + "\nprint('survived')")
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)
    assert "survived" not in proc.stdout


@host_only
def test_host_touching_mapped_accessible_va_in_a_subprocess_works() -> None:
    # The control for the SIGSEGV tests: the same harness survives when memory is there.
    proc = _run_touch(
        "h = d.create(g); d.map(va + g, g, h); d.set_access(va + g, g)\n"
        "assert touch(va + g) == 7 and touch(va + 2 * g - 1) == 7\nprint('survived')"
    )
    assert proc.returncode == 0, proc.stderr
    assert "survived" in proc.stdout

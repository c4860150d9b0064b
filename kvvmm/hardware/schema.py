"""The one declared schema of a GPU profile, and the strict JSON reader every profile goes through.

Every field the library reads is declared in :data:`SCHEMA`: its path, its type and its
bounds. A profile is checked once, when it is loaded or built, so nothing accepted fails later
(a zero divisor, a granularity no reserve meets). Fields not declared (raw measurements,
notes) are kept as records: any JSON, its numbers finite.

A table in code rather than JSON Schema: ``import kvvmm`` needs nothing beyond the standard
library, and a refusal is one :class:`~kvvmm.errors.ProfileError` naming the file, the field,
the value and the bound.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvvmm.errors import ProfileError
from kvvmm.units import MiB

__all__ = ["COLD_CALLS", "COLD_SECTION", "FORMAT", "MAX_DEPTH", "SCHEMA", "VERSIONS", "parse",
           "validate"]

FORMAT = "kvvmm-hardware-profile"
#: Format versions this reader understands: 1 (the first format), 2 (``kvvmm calibrate``'s, which
#: adds sections; a version-1 reader never needed them).
VERSIONS = (1, 2)

#: Deepest nesting of objects and arrays a profile may have (the shipped ones reach 9): past
#: it a file is refused by name instead of exhausting Python's recursion limit.
MAX_DEPTH = 64
#: Longest integer literal read (2**64 has 20 digits): longer ones are refused, not parsed
#: (``int()`` of a 5000-digit string raises, and nothing here needs such a number).
MAX_INT_DIGITS = 40
#: Most µs one call, operation or extra may cost (1000 s): past it a figure is not a
#: measurement, and sums of such figures could overflow the sim clock to infinity.
MAX_COST_US = 1e9
#: Largest byte count (a CUDA ``size_t``).
MAX_BYTES = (1 << 64) - 1
#: The smallest VMM granularity of NVIDIA data-center GPUs, and what every granularity is a
#: power-of-two multiple of; the largest one accepted.
MIN_GRANULARITY_BYTES = 2 * MiB
MAX_GRANULARITY_BYTES = 1 << 40
#: Handle sizes of measured points, in MiB: at least one byte (``log2`` of 0 is undefined),
#: at most 2**64 bytes.
MIN_SIZE_MIB = 1 / MiB
MAX_SIZE_MIB = float(1 << 44)
#: Fastest copy accepted, TB/s (nothing copies at a petabyte per second).
MAX_TB_S = 1e3


class _Literal:
    """A number literal the parser kept as text: NaN, Infinity, one beyond a double's range or
    an integer of more than :data:`MAX_INT_DIGITS` digits. :func:`validate` refuses it by its
    field's path (the parser alone could not say where it was)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        n = len(self.text)
        return self.text if n <= 40 else f"<a number literal of {n} characters>"


def _float(text: str) -> float | _Literal:
    value = float(text)
    return value if math.isfinite(value) else _Literal(text)  # 1e999 parses to inf


def _int(text: str) -> int | _Literal:
    return int(text) if len(text) <= MAX_INT_DIGITS else _Literal(text)


def parse(text: str) -> Any:
    """Parse a profile's JSON text, keeping NaN, Infinity and out-of-range numbers as
    literals :func:`validate` refuses (``json.loads`` alone accepts NaN and Infinity and turns
    ``1e999`` into ``inf``).

    Raises:
        json.JSONDecodeError: not JSON.
        RecursionError: nested deeper than the parser can go.
    """
    return json.loads(text, parse_constant=_Literal, parse_float=_float, parse_int=_int)


# -- the rules ---------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _kind(value: object) -> str:
    """What a refused value is, in JSON's words."""
    if isinstance(value, bool):
        return "a JSON true/false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, _Literal):
        return "not a finite JSON number (NaN, Infinity, beyond a double's range or too long)"
    if isinstance(value, Mapping):
        return "a JSON object"
    if isinstance(value, (list, tuple)):
        return "a JSON array"
    if isinstance(value, float):
        return "not finite" if not math.isfinite(value) else "a number"
    if isinstance(value, int):
        return "an integer"
    return f"a {type(value).__name__}, not a JSON value"


@dataclass(frozen=True, slots=True)
class Num:
    """A JSON number in ``[lo, hi]`` (``(lo, hi]`` with ``above``); never a bool or a string."""

    lo: float
    hi: float
    unit: str  #: what the number counts, for messages
    integer: bool = False  #: an integer literal (``512``, not ``512.0``)
    above: bool = False  #: ``lo`` itself is refused (a divisor, a rate)
    pow2: bool = False  #: a power of two
    nullable: bool = False  #: ``null`` means "not measured"
    required: bool = False
    text: str = ""  #: what :meth:`expects` says, where the bounds read better in words

    def expects(self) -> str:
        if self.text:
            return self.text
        kind = ("a power-of-two integer" if self.pow2 else
                "an integer" if self.integer else "a finite number")
        rng = (f"> {_fmt(self.lo)} and <= {_fmt(self.hi)}" if self.above
               else f"in [{_fmt(self.lo)}, {_fmt(self.hi)}]")
        return f"{kind} {rng}{' or null' if self.nullable else ''} ({self.unit})"

    def refuse(self, value: object) -> str | None:
        """None when ``value`` is fine, else what it is (``""``: only out of bounds)."""
        if value is None and self.nullable:
            return None
        if isinstance(value, bool):
            return "it is a JSON true/false, and a bool is never a number"
        if isinstance(value, str):
            return "it is a string, and a number in quotes is not a number"
        if not isinstance(value, (int, float)):
            return f"it is {_kind(value)}"
        if isinstance(value, float) and not math.isfinite(value):
            return "it is not finite"
        if self.integer and not isinstance(value, int):
            return "it is not an integer"
        if value < self.lo or value > self.hi or (self.above and value == self.lo):
            return ""
        if self.pow2 and int(value) & (int(value) - 1):
            return "it is not a power of two"
        return None


@dataclass(frozen=True, slots=True)
class Str:
    """A JSON string (``choices``: one of them)."""

    choices: tuple[str, ...] = ()
    nonempty: bool = False
    required: bool = False

    def expects(self) -> str:
        if len(self.choices) == 1:
            return repr(self.choices[0])
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return "a non-empty string" if self.nonempty else "a string"

    def refuse(self, value: object) -> str | None:
        if not isinstance(value, str):
            return f"it is {_kind(value)}"
        if self.choices and value not in self.choices:
            return ""
        if self.nonempty and not value.strip():
            return "it is empty"
        return None


@dataclass(frozen=True, slots=True)
class Bool:
    """A JSON ``true`` or ``false``."""

    required: bool = False

    def expects(self) -> str:
        return "true or false"

    def refuse(self, value: object) -> str | None:
        return None if isinstance(value, bool) else f"it is {_kind(value)}"


@dataclass(frozen=True, slots=True)
class Section:
    """A JSON object whose fields are declared by the paths below it.

    ``needs``: ``(flag, fields)``, those fields are required when ``flag`` is ``true`` (a
    modelled effect needs its figures).
    """

    needs: tuple[str, tuple[str, ...]] | None = None
    required: bool = False

    def expects(self) -> str:
        return "a JSON object"


@dataclass(frozen=True, slots=True)
class Pairs:
    """Measured points: ``[[size, value], ...]`` (possibly empty)."""

    size: Num
    value: Num
    required: bool = False

    def expects(self) -> str:
        return f"an array of [size, value] pairs: size {self.size.expects()}, value " \
               f"{self.value.expects()}"


@dataclass(frozen=True, slots=True)
class Numbers:
    """An array of numbers, at least ``min_len``; ``label`` checks the field's own name."""

    item: Num
    min_len: int = 0
    label: Callable[[str], str | None] | None = None
    required: bool = False

    def expects(self) -> str:
        least = f"at least {self.min_len} " if self.min_len > 1 else (
            "a non-empty " if self.min_len == 1 else "an ")
        return f"{least}array of numbers, each {self.item.expects()}"


@dataclass(frozen=True, slots=True)
class Record:
    """Kept, not read: any JSON whose numbers are finite, nested at most :data:`MAX_DEPTH`."""

    required: bool = False

    def expects(self) -> str:
        return "JSON with finite numbers"


Rule = Num | Str | Bool | Section | Pairs | Numbers | Record


def _bandwidth_label(key: str) -> str | None:
    """What a run label must be when it names a handle size (``vmm_<N>MiB``), else None."""
    core = key.removesuffix("_interleaved")
    if core == "vmm_1handle" or not (core.startswith("vmm_") and core.endswith("MiB")):
        return None  # a reference point without a handle size ("plain", ...)
    n = core[4:-3]
    if n.isascii() and n.isdigit() and len(n) <= 12 and int(n) >= 1:
        return None
    return "a run label vmm_<N>MiB or vmm_<N>MiB_interleaved with N an integer >= 1 (MiB)"


_COST = Num(0, MAX_COST_US, "µs")
#: Library overheads are residuals of a fit: a negative one is legitimate (calls cost less
#: in context); the simulator never lets a call's total go below 0.
_RESIDUAL = Num(-MAX_COST_US, MAX_COST_US, "µs; a fitted residual may be negative")
_SIZE = Num(MIN_SIZE_MIB, MAX_SIZE_MIB, "MiB",
            text="a finite number of MiB from 1/1048576 (one byte) to 2**44 (2**64 bytes)")
_POINTS = Pairs(_SIZE, _COST)
_RATIO = Num(0, 1e6, "a ratio", above=True, nullable=True)
_TEXT = Str()
#: A spread's factor: a multiple of the profile's figure (0.5: half of it).
_FACTOR = Num(0, 1e3, "times the profile's figure", above=True, required=True)

#: The section of the cold-call premium (the first call of each kind after a pause costs
#: more): the one name every reader and writer of it goes through.
COLD_SECTION = "cold_calls"
#: The driver calls a cold premium may name.
COLD_CALLS = ("reserve", "create", "map", "set_access", "unmap", "release", "free")


def _under(section: str, rule: Section, fields: Mapping[str, Rule]) -> dict[str, Rule]:
    """A section's rule and its fields' rules, their paths under the section's."""
    return {section: rule} | {f"{section}.{path}": r for path, r in fields.items()}


#: Every field of a profile the library reads: path (``*``: any key) -> rule. Keys of the
#: data may themselves hold dots (``library_work_us["arena.close"]``); the paths here never.
SCHEMA: dict[str, Rule] = {
    "": Section(),
    "format": Str(choices=(FORMAT,), required=True),
    "version": Num(min(VERSIONS), max(VERSIONS), "a format version this reader knows",
                   integer=True),
    "key": Str(nonempty=True, required=True),
    "name": Str(nonempty=True, required=True),
    "source": Str(required=True),
    "date": _TEXT,
    "note": _TEXT,
    "calibrated_from": _TEXT,
    "capacity_bytes": Num(1, MAX_BYTES, "bytes", integer=True, required=True),
    "granularity_bytes": Num(MIN_GRANULARITY_BYTES, MAX_GRANULARITY_BYTES,
                             "bytes: 2 MiB, 4 MiB, 8 MiB, ...; every reservation, handle and "
                             "mapping is a multiple of it", integer=True, pow2=True,
                             required=True),
    "measured_on": Record(),
    "calibration": Record(),
    "growth_measured": Record(),
    # µs per driver call by handle size (kvvmm/hardware/cost.py)
    "call_costs": Section(),
    "call_costs.points": Section(),
    "call_costs.points.*": _POINTS,
    "call_costs.isolated_points": Section(),
    "call_costs.isolated_points.*": _POINTS,
    "call_costs.context_factor": Section(),
    "call_costs.context_factor.*": _RATIO,
    "call_costs.mem_info_us": Num(0, MAX_COST_US, "µs", nullable=True),
    "call_costs.unit": _TEXT,
    "call_costs.source": _TEXT,
    "call_costs.mem_info_source": _TEXT,
    # copy bandwidth by handle size (kvvmm/hardware/bandwidth.py)
    "bandwidth": Section(),
    "bandwidth.tensor_bytes": Num(1, MAX_BYTES, "bytes", integer=True),
    "bandwidth.runs": Section(),
    "bandwidth.runs.*": Numbers(Num(0, MAX_TB_S, "TB/s", above=True), min_len=1,
                                label=_bandwidth_label),
    "bandwidth.unit": _TEXT,
    "bandwidth.source": _TEXT,
    # the owner's copy bandwidth after decode growth, by policy: what the interleaved curve
    # is fitted to (bench/collect_growth_bandwidth.py writes it)
    "bandwidth.growth": Section(),
    "bandwidth.growth.unit": _TEXT,
    "bandwidth.growth.source": _TEXT,
    "bandwidth.growth.workload": _TEXT,
    "bandwidth.growth.points": Section(),
    "bandwidth.growth.points.*": Section(),
    "bandwidth.growth.points.*.copied_mib": Pairs(_SIZE, Num(0, MAX_SIZE_MIB, "MiB copied",
                                                             above=True), required=True),
    "bandwidth.growth.points.*.ratios": Numbers(Num(0, 1e3, "a ratio to cudaMalloc",
                                                    above=True), min_len=1, required=True),
    # what the simulator adds (kvvmm/hardware/overhead.py)
    "library_overhead_us": Section(),
    "library_overhead_us.per_call": Section(),
    "library_overhead_us.per_call.*": _RESIDUAL,
    "library_overhead_us.by_size": Section(),
    "library_overhead_us.by_size.*": Pairs(_SIZE, _RESIDUAL),
    "library_overhead_us.unit": _TEXT,
    "library_overhead_us.source": _TEXT,
    "library_overhead_us.measured": Record(),
    "library_overhead_us.fit": Record(),
    "library_work_us": Section(),
    "library_work_us.*": Section(),  # one operation: fixed + per_unit x units
    "library_work_us.*.fixed": Num(0, MAX_COST_US, "µs per operation", required=True),
    "library_work_us.*.per_unit": Num(0, MAX_COST_US, "µs per unit"),
    "library_work_us.*.unit": _TEXT,
    "library_work_us.unit": _TEXT,
    "library_work_us.source": _TEXT,
    "library_work_us.samples": Record(),
    "set_access_per_mapping": Section(),
    "set_access_per_mapping.points": _POINTS,
    "set_access_per_mapping.isolated_points": _POINTS,
    "set_access_per_mapping.context_factor": _RATIO,
    "set_access_per_mapping.unit": _TEXT,
    "set_access_per_mapping.source": _TEXT,
    "set_access_per_mapping.measured": Record(),
    "unmap_per_mapping": Section(),
    "unmap_per_mapping.points": _POINTS,
    "unmap_per_mapping.isolated_points": _POINTS,
    "unmap_per_mapping.context_factor": _RATIO,
    "unmap_per_mapping.unit": _TEXT,
    "unmap_per_mapping.source": _TEXT,
    "unmap_per_mapping.measured": Record(),
    "first_touch": Section(needs=("modelled", ("region_mib",))),
    # the sim divides addresses by the region: 0 would divide by zero inside map
    "first_touch.region_mib": Num(1, 1 << 24, "MiB of VA per region", integer=True),
    "first_touch.map_us": _COST,
    "first_touch.set_access_us": _COST,
    "first_touch.per": Str(choices=("region", "mapping")),
    "first_touch.modelled": Bool(),
    "first_touch.unit": _TEXT,
    "first_touch.source": _TEXT,
    "first_touch.measured": Record(),
    **_under(COLD_SECTION, Section(needs=("modelled", ("premium_us",))), {
        "premium_us": Section(),
        "premium_us.*": _COST,
        "gap_ms": Num(0, 1e9, "ms of pause that makes calls cold again"),
        "partial": Section(),
        "partial.*": Pairs(Num(0, 1e9, "ms of pause"),
                           Num(0, 1, "the share of the premium paid after it")),
        "partial_source": _TEXT,
        "second": Section(),
        "second.*": Num(0, 1, "the share of a cold call's premium the next call pays"),
        "second_source": _TEXT,
        "modelled": Bool(),
        "unit": _TEXT,
        "source": _TEXT,
        "measured": Record(),
    }),
    "idle_release": Section(needs=("modelled", ("create_us_per_gib",))),
    "idle_release.create_us_per_gib": _COST,
    "idle_release.pause_s": Num(0, 1e6, "s of pause that sets it off"),
    "idle_release.min_released_gib": Num(0, 1 << 30, "GiB released that sets it off"),
    "idle_release.modelled": Bool(),
    "idle_release.unit": _TEXT,
    "idle_release.source": _TEXT,
    "idle_release.measured": Record(),
    "post_release_slowdown": Section(needs=("modelled",
                                            ("factor", "creates", "min_released_bytes"))),
    "post_release_slowdown.factor": Num(1, 1e6, "times a settled create's cost: a slowdown"),
    "post_release_slowdown.creates": Num(0, 1 << 32, "creates", integer=True),
    "post_release_slowdown.min_released_bytes": Num(0, MAX_BYTES, "bytes", integer=True),
    "post_release_slowdown.ratios": Numbers(Num(0, 1e6, "a ratio")),
    "post_release_slowdown.modelled": Bool(),
    "post_release_slowdown.why_not_modelled": _TEXT,
    "post_release_slowdown.source": _TEXT,
    "post_release_slowdown.measured": Record(),
    # each cost figure's spread over rounds and calibrations (kvvmm/hardware/spread.py)
    "spread": Section(),
    "spread.unit": _TEXT,
    "spread.source": _TEXT,
    "spread.figures": Section(),
    "spread.figures.*": Section(),
    "spread.figures.*.p10": _FACTOR,
    "spread.figures.*.p50": _FACTOR,
    "spread.figures.*.p90": _FACTOR,
    "spread.figures.*.samples": Num(1, 1 << 32, "samples", integer=True),
    "spread.history": Record(),  # its shape is checked by _check_spread
    # the session level: per scenario group, quantiles over sessions (spread.py)
    "spread.level": Section(),
    "spread.level.unit": _TEXT,
    "spread.level.source": _TEXT,
    "spread.level.groups": Section(),
    "spread.level.groups.*": Section(),
    "spread.level.groups.*.p10": _FACTOR,
    "spread.level.groups.*.p50": _FACTOR,
    "spread.level.groups.*.p90": _FACTOR,
    "spread.level.groups.*.sessions": Num(1, 1 << 32, "sessions", integer=True),
    "spread.level.sessions": Record(),  # its shape is checked by _check_level
    "refreshed": Record(),  # what kvvmm calibrate --quick --profile did
}

_PATTERNS: dict[int, list[tuple[tuple[str, ...], Rule]]] = {}
for _path, _rule in SCHEMA.items():
    _pat = tuple(_path.split(".")) if _path else ()
    _PATTERNS.setdefault(len(_pat), []).append((_pat, _rule))


def _lookup(path: tuple[str, ...]) -> tuple[tuple[str, ...], Rule] | None:
    """The declared rule of a field, the most specific one (``a.b`` before ``a.*``)."""
    best: tuple[tuple[bool, ...], tuple[str, ...], Rule] | None = None
    for pat, rule in _PATTERNS.get(len(path), ()):
        if all(p == "*" or p == k for p, k in zip(pat, path, strict=True)):
            score = tuple(p != "*" for p in pat)
            if best is None or score > best[0]:
                best = (score, pat, rule)
    return None if best is None else (best[1], best[2])


def _children(pat: tuple[str, ...]) -> list[tuple[str, Rule]]:
    """The named (not ``*``) fields declared directly under a section's pattern."""
    return [(p[-1], r) for p, r in _PATTERNS.get(len(pat) + 1, ())
            if p[:-1] == pat and p[-1] != "*"]


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


# -- the walk ----------------------------------------------------------------------------

Path = tuple[str | int, ...]


def _show_path(path: Path) -> str:
    out = ""
    for seg in path:
        if isinstance(seg, int):
            out += f"[{seg}]"
        elif seg.isidentifier() and seg.isascii() and len(seg) <= 40:
            out += f".{seg}" if out else seg
        else:
            shown = repr(seg) if len(seg) <= 40 else repr(seg[:37] + "...")
            out += f"[{shown}]"
    return out


class _Walk:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: Path, value: object, limit: str, detail: str = "") -> ProfileError:
        return ProfileError(self.where, _show_path(path), value, limit, detail)

    def check(self, rule: Rule, pat: tuple[str, ...], path: Path, value: object) -> None:
        if isinstance(rule, Section):
            self.section(rule, pat, path, value)
        elif isinstance(rule, Record):
            self.record(path, value)
        elif isinstance(rule, Pairs):
            self.pairs(rule, path, value)
        elif isinstance(rule, Numbers):
            self.numbers(rule, path, value)
        else:
            why = rule.refuse(value)
            if why is not None:
                raise self.fail(path, value, rule.expects(), why)

    def section(self, rule: Section, pat: tuple[str, ...], path: Path, value: object) -> None:
        if not isinstance(value, Mapping):
            raise self.fail(path, value, rule.expects(), f"it is {_kind(value)}")
        for k, v in value.items():
            key = str(k)
            found = _lookup((*pat, key))
            if found is None:  # not read by kvvmm: kept as a record
                self.record((*path, key), v)
            else:
                self.check(found[1], found[0], (*path, key), v)
        needed = [name for name, r in _children(pat) if r.required]
        if rule.needs is not None and value.get(rule.needs[0]) is True:
            needed += list(rule.needs[1])
        for name in needed:
            if name not in value:
                found = _lookup((*pat, name))
                limit = found[1].expects() if found else "present"
                why = (f"needed: {rule.needs[0]} is true" if rule.needs and name in rule.needs[1]
                       else "")
                raise self.fail((*path, name), ProfileError.MISSING, limit, why)

    def pairs(self, rule: Pairs, path: Path, value: object) -> None:
        if not isinstance(value, (list, tuple)):
            raise self.fail(path, value, rule.expects(), f"it is {_kind(value)}")
        for i, pt in enumerate(value):
            if not isinstance(pt, (list, tuple)) or len(pt) != 2:
                raise self.fail((*path, i), pt, "a [size, value] pair",
                                f"it is {_kind(pt)}" if not isinstance(pt, (list, tuple))
                                else f"it holds {_entries(len(pt))}")
            for j, (num, x) in enumerate(((rule.size, pt[0]), (rule.value, pt[1]))):
                why = num.refuse(x)
                if why is not None:
                    raise self.fail((*path, i, j), x, num.expects(), why)

    def numbers(self, rule: Numbers, path: Path, value: object) -> None:
        if rule.label is not None and path and isinstance(path[-1], str):
            bad = rule.label(path[-1])
            if bad is not None:
                raise self.fail(path, path[-1], bad, "the field's name")
        if not isinstance(value, (list, tuple)) or len(value) < rule.min_len:
            raise self.fail(path, value, rule.expects(),
                            f"it is {_kind(value)}" if not isinstance(value, (list, tuple))
                            else f"it holds {_entries(len(value))}")
        for i, x in enumerate(value):
            why = rule.item.refuse(x)
            if why is not None:
                raise self.fail((*path, i), x, rule.item.expects(), why)

    def record(self, path: Path, value: object) -> None:
        if len(path) > MAX_DEPTH:
            raise self.fail(path[:MAX_DEPTH], "...", f"nested at most {MAX_DEPTH} levels deep")
        if isinstance(value, Mapping):
            for k, v in value.items():
                self.record((*path, str(k)), v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                self.record((*path, i), v)
        elif isinstance(value, _Literal) or (isinstance(value, float)
                                             and not math.isfinite(value)):
            raise self.fail(path, value, "a finite JSON number", f"it is {_kind(value)}")
        elif not (value is None or isinstance(value, (str, int, float))):
            raise self.fail(path, value, "a JSON value", f"it is {_kind(value)}")


def validate(data: object, where: str) -> None:
    """Check parsed profile data against :data:`SCHEMA`; return quietly when it holds.

    Args:
        data: what :func:`parse` returned (or data built in Python).
        where: the file (or what made the data), named in the error.
    Raises:
        ProfileError: the first field that breaks its rule: file, field path, value, bound.
    """
    walk = _Walk(where)
    if not isinstance(data, Mapping):
        raise ProfileError(where, "", data, f"a {FORMAT!r} JSON object",
                           f"it is {_kind(data)}")
    # Format and version first: a file that is not a profile says so, not its first field.
    for name in ("format", "version"):
        if name in data:
            walk.check(SCHEMA[name], (name,), (name,), data[name])
    walk.section(Section(), (), (), data)
    gran, cap = data["granularity_bytes"], data["capacity_bytes"]
    if gran > cap:
        raise walk.fail(("granularity_bytes",), gran,
                        f"at most capacity_bytes ({cap}): one granule must fit the device")
    spread = data.get("spread")
    if isinstance(spread, Mapping):
        _check_spread(walk, spread)
    cold = data.get(COLD_SECTION)
    for part in ("premium_us", "second"):
        named = cold.get(part) if isinstance(cold, Mapping) else None
        if isinstance(named, Mapping):
            for call in named:
                if call not in COLD_CALLS:
                    raise walk.fail((COLD_SECTION, part, str(call)), call,
                                    "one of " + ", ".join(COLD_CALLS),
                                    "not a driver call the simulator charges")


#: The figure groups a spread may name (kvvmm.hardware.spread.GROUPS; spelled here so the
#: schema imports nothing of the models it checks).
SPREAD_GROUPS = ("call_costs.create", "call_costs.map", "call_costs.set_access",
                 "call_costs.unmap", "call_costs.release", "call_costs.reserve",
                 "call_costs.free", "set_access_per_mapping", "unmap_per_mapping",
                 "first_touch", COLD_SECTION, "idle_release", "library_work_us",
                 "library_overhead_us")


def _check_quantiles(walk: _Walk, rows: Mapping[str, Any], path: Path,
                     groups: tuple[str, ...], what: str) -> None:
    """Each row's group is one of ``groups``, and its p10 <= p50 <= p90."""
    for group, row in rows.items():
        at: Path = (*path, str(group))
        if group not in groups:
            raise walk.fail(at, group, "one of " + ", ".join(groups), what)
        if not row["p10"] <= row["p50"] <= row["p90"]:
            raise walk.fail((*at, "p10"), row["p10"],
                            f"p10 <= p50 ({row['p50']}) <= p90 ({row['p90']})",
                            "the quantiles are out of order")


def _entries_of(walk: _Walk, section: Mapping[str, Any], path: Path, inner: str,
                array: str, inner_is: str) -> list[tuple[Path, Mapping[str, Any]]]:
    """The entries of the list ``section[path[-1]]`` (default empty), each an object whose
    ``inner`` is an object: each one's path to ``inner``, and ``inner``."""
    entries = section.get(str(path[-1]), [])
    if not isinstance(entries, list):
        raise walk.fail(path, entries, array, f"it is {_kind(entries)}")
    out: list[tuple[Path, Mapping[str, Any]]] = []
    for i, entry in enumerate(entries):
        got = entry.get(inner) if isinstance(entry, Mapping) else None
        if not isinstance(got, Mapping):
            raise walk.fail((*path, i, inner), ProfileError.MISSING if isinstance(
                entry, Mapping) else entry, inner_is)
        out.append(((*path, i, inner), got))
    return out


def _check_spread(walk: _Walk, spread: Mapping[str, Any]) -> None:
    """What the table cannot say of a spread: known groups, p10 <= p50 <= p90, and a
    history of ``{"figures": {group: {label: number}}}`` entries."""
    _check_quantiles(walk, spread.get("figures") or {}, ("spread", "figures"), SPREAD_GROUPS,
                     "not a figure group the simulator reads")
    level = spread.get("level")
    if isinstance(level, Mapping):
        _check_level(walk, level)
    for path, figs in _entries_of(walk, spread, ("spread", "history"), "figures",
                                  "a JSON array of calibrations' figures",
                                  "an object {group: {label: number}}"):
        for group, vals in figs.items():
            if group not in SPREAD_GROUPS:
                raise walk.fail((*path, str(group)), group, "one of " + ", ".join(SPREAD_GROUPS))
            if not isinstance(vals, Mapping):
                raise walk.fail((*path, str(group)), vals, "an object {label: number}",
                                f"it is {_kind(vals)}")
            for label, x in vals.items():
                at = (*path, str(group), str(label))
                if group not in ("first_touch", COLD_SECTION, "idle_release",
                                 "library_work_us", "library_overhead_us"):
                    try:  # a curve's labels are handle sizes in MiB
                        mib: object = float(label)
                    except ValueError:
                        mib = label
                    bad = _SIZE.refuse(mib)
                    if bad is not None:
                        raise walk.fail(at, label, "a handle size label: " + _SIZE.expects(), bad)
                why = _HISTORY_VALUE.refuse(x)
                if why is not None:
                    raise walk.fail(at, x, _HISTORY_VALUE.expects(), why)


#: The scenario groups a session level may name (kvvmm.hardware.spread.LEVEL_GROUPS).
LEVEL_GROUPS = ("construct", "growth", "finalize", "close", "elastic", "startup", "decode")


def _check_level(walk: _Walk, level: Mapping[str, Any]) -> None:
    """What the table cannot say of a session level: known groups, p10 <= p50 <= p90, and
    sessions ``[{"session", "runs", "factors": {group: factor}}]``."""
    _check_quantiles(walk, level.get("groups") or {}, ("spread", "level", "groups"),
                     LEVEL_GROUPS, "not a scenario group a level is fitted for")
    for path, factors in _entries_of(walk, level, ("spread", "level", "sessions"), "factors",
                                     "a JSON array of sessions' factors",
                                     "an object {group: factor}"):
        for group, f in factors.items():
            if group not in LEVEL_GROUPS:
                raise walk.fail((*path, str(group)), group, "one of " + ", ".join(LEVEL_GROUPS))
            why = _FACTOR.refuse(f)
            if why is not None:
                raise walk.fail((*path, str(group)), f, _FACTOR.expects(), why)


#: A figure of a calibration kept (a fitted residual may be negative).
_HISTORY_VALUE = Num(-MAX_COST_US, MAX_COST_US, "µs, or µs per unit")

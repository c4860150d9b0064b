"""What the simulator charges per driver call on a profile: the call, the library's own work
around it, and the effects ``kvvmm calibrate`` measured (:func:`sim_costs`, :class:`CallClock`).

The profile's sections beside ``call_costs``, each declared in :mod:`kvvmm.hardware.schema`:

- ``library_work_us``: µs of kvvmm's own work per arena or owner operation, ``fixed`` plus
  ``per_unit`` per unit; the arena and the owner report each operation they make
  (:meth:`kvvmm.driver.sim.SimDriver.library_work`). Where present, nothing is charged per call.
- ``library_overhead_us`` (older profiles): µs of library work charged with each call of a
  kind (``per_call``), or by handle size (``by_size``, which replaces ``per_call`` for that call).
- ``set_access_per_mapping``, ``unmap_per_mapping``: µs per mapping one call covers, by size.
- ``first_touch``: a map, and the set_access after it, cost more when the mapping is the first
  in its region of VA since the reservation was made.
- the cold premium (:data:`~kvvmm.hardware.schema.COLD_SECTION`, :class:`ColdCalls`): the
  first call of each kind after a pause costs more; after a shorter pause, a share of it.
- ``idle_release`` (:class:`IdleRelease`): the first create after a pause costs more by the
  GiB released before it.
- ``post_release_slowdown`` (:class:`PostReleaseSlowdown`): creates right after a large
  release run slower.

An effect is charged only where its section says ``modelled: true``. A profile without a
section borrows the H200's figures where the H200 has them and charges nothing extra where it
has none; :attr:`SimCosts.notes` says which.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvvmm.hardware.cost import CostModel, default_cost_model
from kvvmm.hardware.interp import LinearCurve, Log2Curve
from kvvmm.hardware.profiles import DeviceProfile, profile_data
from kvvmm.hardware.schema import COLD_SECTION
from kvvmm.units import MiB

__all__ = ["CallClock", "ColdCalls", "IdleRelease", "PostReleaseSlowdown", "SimCosts", "sim_costs"]

@dataclass(frozen=True, slots=True)
class PostReleaseSlowdown:
    """Creates after a large release cost ``factor`` times as much, for ``creates`` creates."""

    factor: float  #: measured ratio of a create's cost right after the release to settled
    creates: int  #: how many creates the measurement covered after the release
    min_released_bytes: int  #: released since the last create, at least, to set it off
    source: str


@dataclass(frozen=True, slots=True)
class ColdCalls:
    """The first call of each kind after a pause costs ``premium_us[call]`` more; after a
    shorter pause, the share of it ``partial[call]`` gives."""

    premium_us: Mapping[str, float]  #: µs more for a call that is the first of its kind
    gap_us: float  #: a pause at least this long (µs) makes every call kind cold again
    source: str
    #: per call, the share of the premium by pause (µs): the shares measured below
    #: ``gap_us``, with ``(0, 0)`` and ``(gap_us, 1)`` at the ends. A call with none pays
    #: nothing below ``gap_us`` (the step model).
    partial: Mapping[str, LinearCurve] = field(default_factory=dict)
    #: per call, the share of what a cold call paid that the next call of its kind pays
    #: too (the call after a cold one is not warm yet); a call with none: nothing (the
    #: first pays it all)
    second: Mapping[str, float] = field(default_factory=dict)

    def share(self, op: str, paused_us: float) -> float:
        """The share of ``op``'s premium a call pays after ``paused_us`` of pauses since the
        last call of its kind (a device's first call of a kind: pass ``math.inf``)."""
        if paused_us >= self.gap_us:
            return 1.0
        curve = self.partial.get(op)
        return curve(paused_us) if curve is not None and paused_us > 0.0 else 0.0


@dataclass(frozen=True, slots=True)
class IdleRelease:
    """The first create after a pause of ``pause_us`` costs more by the GiB released before."""

    create_us_per_gib: float  #: µs more per GiB released since the create before the pause
    pause_us: float  #: a pause at least this long (µs) sets it off
    min_released_bytes: int  #: released since that create, at least, to set it off
    source: str


@dataclass(frozen=True, slots=True)
class SimCosts:
    """A profile's per-call costs as the simulator charges them (see the module docstring)."""

    profile: str  #: the profile's key
    calls: CostModel  #: µs per driver call by size
    per_call_overhead_us: Mapping[str, float]  #: library work charged with each call, µs
    #: library work by handle size, where calibrate fitted it per size (replaces the flat
    #: ``per_call_overhead_us`` for that call)
    overhead_curves: Mapping[str, Log2Curve]
    access_per_mapping: Log2Curve | None  #: µs per mapping one set_access covers, by size
    slowdown: PostReleaseSlowdown | None  #: None: not modelled on this profile
    notes: tuple[str, ...]  #: what this profile borrows from the H200 or does not model
    overhead_source: str  #: where ``per_call_overhead_us`` comes from
    #: library work per arena/owner operation: op -> (µs fixed, µs per unit)
    work: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    unmap_per_mapping: Log2Curve | None = None  #: µs per mapping one unmap covers, by size
    #: (region bytes, µs more per map, µs more per set_access, paid once per mapping rather
    #: than per region entered) for a mapping that enters a region of VA no mapping touched
    #: since the reservation; None: not modelled
    first_touch: tuple[int, float, float, bool] | None = None
    cold: ColdCalls | None = None  #: None: not modelled on this profile
    idle: IdleRelease | None = None  #: None: not modelled on this profile

    def work_us(self, op: str, units: int = 1) -> float:
        """µs of the library's own work for one ``op`` over ``units`` units (0 if unknown)."""
        w = self.work.get(op)
        return 0.0 if w is None else w[0] + w[1] * units

    def unmap_us(self, mapping_sizes: Sequence[int]) -> float:
        """µs of one ``unmap`` over whole mappings of these sizes (library work included): the sum
        of ``unmap_per_mapping`` over several mappings where measured, else the call's cost by size.
        """
        sizes = list(mapping_sizes)
        if len(sizes) > 1 and self.unmap_per_mapping is not None:
            curve = self.unmap_per_mapping
            us = sum(curve(s) for s in sizes)
        else:
            us = self.calls("unmap", sum(sizes))
        return max(0.0, us + self.overhead_us("unmap", sum(sizes)))

    def overhead_us(self, op: str, size: int) -> float:
        """µs of the library's own work charged with one call of ``op`` over ``size`` bytes."""
        curve = self.overhead_curves.get(op)
        return curve(size) if curve is not None else self.per_call_overhead_us.get(op, 0.0)

    def call_us(self, op: str, size: int) -> float:
        """µs of one call of ``op`` over ``size`` bytes, the library's work included
        (never below 0: a fitted overhead may be negative where calls cost less in context)."""
        return max(0.0, self.calls(op, size) + self.overhead_us(op, size))

    def access_us(self, mapping_sizes: Sequence[int]) -> float:
        """µs of one ``set_access`` over whole mappings of these sizes (library work included): the
        sum of ``set_access_per_mapping`` over several mappings where measured, else
        :meth:`CostModel.access_us`.
        """
        sizes = list(mapping_sizes)
        if len(sizes) <= 1 or self.access_per_mapping is None:
            us = self.calls.access_us(sizes)
        else:
            curve = self.access_per_mapping
            us = sum(curve(s) for s in sizes)
        return us + (self.overhead_us("set_access", sizes[0]) if sizes else 0.0)


def _curve(points: object) -> Log2Curve:
    pts = [(int(float(mib) * MiB), float(us)) for mib, us in points]  # type: ignore[attr-defined]
    return Log2Curve.from_points(pts)


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    sec = data.get(name)
    return sec if isinstance(sec, Mapping) else None


@functools.cache
def sim_costs(profile: DeviceProfile) -> SimCosts:
    """The costs the simulator charges on ``profile`` (read once per profile). Raises nothing:
    a profile that loaded met :data:`kvvmm.hardware.schema.SCHEMA` (every figure typed, finite
    and bounded, every divisor > 0).
    """
    data = profile_data(profile)
    h200 = default_cost_model()
    notes: list[str] = []
    cc = _section(data, "call_costs")
    if cc is None or not isinstance(cc.get("points"), Mapping):
        calls = h200
        if profile.key != "h200":
            notes.append(f"call costs: none measured on {profile.key}; the H200's")
    else:
        curves = dict(h200.curves)
        own = {op: _curve(pts) for op, pts in cc["points"].items() if pts}
        missing = sorted(set(curves) - set(own))
        if missing:
            notes.append(f"call costs of {', '.join(missing)}: not measured on "
                         f"{profile.key}; the H200's")
        curves.update(own)
        mem = cc.get("mem_info_us")
        calls = CostModel(curves, h200.mem_info_us if mem is None else float(mem),
                          str(cc.get("source", "")))
    lo = _section(data, "library_overhead_us")
    per_call: dict[str, float] = {}
    over_curves: dict[str, Log2Curve] = {}
    lo_source = ""
    if lo is not None and isinstance(lo.get("per_call"), Mapping):
        per_call = {str(k): float(v) for k, v in lo["per_call"].items() if float(v) != 0.0}
        by_size = lo.get("by_size")
        if isinstance(by_size, Mapping):
            over_curves = {str(op): _curve(pts) for op, pts in by_size.items() if pts}
        lo_source = str(lo.get("source", ""))
    lw = _section(data, "library_work_us")
    work: dict[str, tuple[float, float]] = {}
    if lw is not None:
        for op, row in lw.items():
            if isinstance(row, Mapping) and "fixed" in row:
                work[str(op)] = (float(row["fixed"]), float(row.get("per_unit", 0.0)))
        if work:  # measured per operation: replaces the per-call residuals
            per_call, over_curves = {}, {}
            lo_source = str(lw.get("source", ""))
    if not work and lo is None:
        notes.append(f"library overhead: not measured on {profile.key}; driver calls only")
    ftd = _section(data, "first_touch")
    first = None
    if ftd is not None and ftd.get("modelled") is True:
        first = (int(ftd["region_mib"]) * MiB, float(ftd.get("map_us", 0.0)),
                 float(ftd.get("set_access_us", 0.0)), ftd.get("per", "region") == "mapping")
    upm = _section(data, "unmap_per_mapping")
    unmap_pm = _curve(upm["points"]) if upm is not None and upm.get("points") else None
    apm = _section(data, "set_access_per_mapping")
    access = _curve(apm["points"]) if apm is not None and apm.get("points") else None
    if access is None:
        notes.append("set_access over several mappings: the H200's factor "
                     f"({h200.multi_access_factor}) times one call per mapping")
    cd = _section(data, COLD_SECTION)
    cold = None
    if cd is not None and cd.get("modelled") is True:
        gap_us = float(cd.get("gap_ms", 50.0)) * 1e3
        # the schema keeps each share in [0, 1]; a pause at or past the gap pays all of it
        partial = {str(op): LinearCurve.from_points(
                       [(0.0, 0.0), *((float(ms) * 1e3, float(f)) for ms, f in pts
                                      if float(ms) * 1e3 < gap_us), (gap_us, 1.0)])
                   for op, pts in (cd.get("partial") or {}).items()}
        cold = ColdCalls({str(k): float(v) for k, v in cd["premium_us"].items()}, gap_us,
                         str(cd.get("source", "")), partial,
                         {str(k): float(v) for k, v in (cd.get("second") or {}).items()})
    elif cd is None:
        notes.append("cold calls: not measured on this profile; every call costs as warm")
    idd = _section(data, "idle_release")
    idle = None
    if idd is not None and idd.get("modelled") is True:
        idle = IdleRelease(float(idd["create_us_per_gib"]), float(idd.get("pause_s", 0.25)) * 1e6,
                           int(float(idd.get("min_released_gib", 0.0)) * (1 << 30)),
                           str(idd.get("source", "")))
    prs = _section(data, "post_release_slowdown")
    slow = None
    if prs is not None and prs.get("modelled") is True:
        slow = PostReleaseSlowdown(float(prs["factor"]), int(prs["creates"]),
                                   int(prs["min_released_bytes"]), str(prs.get("source", "")))
    elif prs is not None:
        notes.append("post-release slowdown: measured, not modelled ("
                     + str(prs.get("why_not_modelled", "not stable across repeats")) + ")")
    return SimCosts(profile.key, calls, per_call, over_curves, access, slow, tuple(notes),
                    lo_source, work, unmap_pm, first, cold, idle)


#: runs of mapping sizes a clock keeps the cost of (a bound on its memory; the few call sizes
#: are kept without one)
_CACHED = 4096


class CallClock:
    """One simulated device's charge per call: :class:`SimCosts` plus the state the
    post-release slowdown needs (bytes released since the last create, slow creates left).

    ``clock(op, size)`` returns the µs to add to the device's clock; the driver calls it once
    per call, under its own lock. Where the profile models cold calls, a call pays the share
    of its kind's premium that the pauses since the last call of its kind give
    (:meth:`ColdCalls.share`), and the next call of its kind :attr:`ColdCalls.second` of what
    it paid; where it models idle releases, the first create after a long enough pause pays
    for the GiB released since the create before.
    """

    __slots__ = ("_access", "_call", "_freed", "_idle_us", "_next", "_over", "_paused",
                 "_released", "_slow_left", "_unmap", "calls", "costs", "mem_info_us")

    def __init__(self, costs: SimCosts) -> None:
        self.costs = costs
        self.calls = costs.calls  #: the bare call costs (for the sim's guessed calls)
        self.mem_info_us = costs.calls.mem_info_us
        self._released = 0
        self._slow_left = 0
        self._paused: dict[str, float] = {}  # µs paused since each kind's last call
        self._next: dict[str, float] = {}  # share of its premium each kind's next call owes
        self._freed = 0  # bytes released since the last create
        self._idle_us = 0.0  # µs the next create pays for an idle pause after releases
        # The pure lookups, by their arguments: a replay makes the same few calls (a handle
        # size, a run of mappings) hundreds of thousands of times, and each lookup is an
        # interpolation; the values are the ones the costs give, so nothing charged changes.
        self._call: dict[tuple[str, int], float] = {}  # costs.calls(op, size)
        self._over: dict[tuple[str, int], float] = {}  # costs.overhead_us(op, size)
        self._access: dict[tuple[int, ...], float] = {}  # costs.access_us(sizes)
        self._unmap: dict[tuple[int, ...], float] = {}  # costs.unmap_us(sizes)

    def _cold(self, op: str) -> float:
        cold = self.costs.cold
        if cold is None:
            return 0.0
        paused = self._paused.get(op, math.inf)  # never called: as cold as it gets
        self._paused[op] = 0.0
        share = cold.share(op, paused) if paused else 0.0
        if share > 0.0:  # a cold call: the next of its kind still pays part of what it paid
            self._next[op] = share * cold.second.get(op, 0.0)
        else:  # the call right after a cold one (once), or a warm one
            share = self._next.pop(op, 0.0)
        return cold.premium_us.get(op, 0.0) * share

    def pause(self, us: float) -> None:
        """``us`` of time passed outside the driver: it adds to every call kind's pauses
        since its last call (the next one pays the share of its premium they give)."""
        cold = self.costs.cold
        if cold is not None and us > 0.0:
            paused = self._paused
            for op in paused:
                paused[op] += us
        idle = self.costs.idle
        if (idle is not None and us >= idle.pause_us and self._freed
                and self._freed >= idle.min_released_bytes):
            self._idle_us = idle.create_us_per_gib * self._freed / (1 << 30)

    @property
    def idle_premium_us(self) -> float:
        """µs the next create pays for the releases before an idle pause (0: none armed)."""
        return self._idle_us

    def __call__(self, op: str, size: int) -> float:
        c = self.costs
        key = (op, size)
        base = self._call.get(key)
        if base is None:
            base = self._call[key] = c.calls(op, size)
        us = base + self._cold(op)
        if c.per_call_overhead_us or c.overhead_curves:
            over = self._over.get(key)
            if over is None:
                over = self._over[key] = c.overhead_us(op, size)
            us = max(0.0, us + over)
        if op == "release":
            self._freed += size
        elif op == "create":
            us += self._idle_us
            self._idle_us, self._freed = 0.0, 0
        slow = c.slowdown
        if slow is not None:
            if op == "release":
                self._released += size
            elif op == "create":
                if self._released >= slow.min_released_bytes:
                    self._slow_left = slow.creates
                self._released = 0
                if self._slow_left > 0:
                    self._slow_left -= 1
                    us += base * (slow.factor - 1.0)
        return us

    def access(self, mapping_sizes: Sequence[int]) -> float:
        """µs of one set_access over whole mappings of these sizes."""
        key = tuple(mapping_sizes)
        us = self._access.get(key)
        if us is None:
            us = self.costs.access_us(key)
            if len(self._access) < _CACHED:
                self._access[key] = us
        return us + self._cold("set_access")

    def unmap(self, mapping_sizes: Sequence[int]) -> float:
        """µs of one unmap over whole mappings of these sizes."""
        key = tuple(mapping_sizes)
        us = self._unmap.get(key)
        if us is None:
            us = self.costs.unmap_us(key)
            if len(self._unmap) < _CACHED:
                self._unmap[key] = us
        return us + self._cold("unmap")

    def work(self, op: str, units: int) -> float:
        """µs of the library's own work for one arena/owner operation."""
        return self.costs.work_us(op, units)

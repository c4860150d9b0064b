"""Bands: every simulated time as [low, mid, high], from a profile's measured spread.

The simulator is deterministic: one profile, one number. A card is not (docs/FIDELITY.md):
its costs move by tens of percent between rounds, runs and days. A profile with a ``spread``
(:mod:`kvvmm.hardware.spread`) says how far each cost figure moved; a band runs the same
thing three times, through the existing runners, on

- ``low``: the profile with every figure at its p10 (:meth:`DeviceProfile.at` ``(0.1)``),
- ``mid``: the profile as it is (what a point prediction always was),
- ``high``: every figure at its p90 (``at(0.9)``),

and reports the three. All figures move to their quantile together (comonotone), which is
how the card moved between the runs measured (the whole card faster or slower); the band is
therefore wider than a p10-p90 of independent per-call noise would be, and it is not a joint
distribution: a run may land outside it when figures move apart. ``low <= mid <= high``
always (a figure the sim does not charge monotonically, a negative fitted residual, is
bounded by ``mid``). A profile without a spread gives a band of no width, said by
:func:`band_notes`.

A workload run on the sim can price its bands in the same pass (``run_workload(...,
band_prices=True)``, what ``kvvmm replay`` runs): every driver call is made again on a sim
at the band's low and high profiles (:class:`QuantilePrices`), so each call has its three
prices. For a strategy whose every call after its start is on the decode path (static,
finalize, the prefix and page-elastic strategies) a boundary's stall is the sum of its
calls, and so is each quantile's: the costs enter the figures linearly, one pass gives all
three. What the pass leaves out is a stall's feedback on the schedule: a slower step
admits some arrivals a boundary later, and the calls that follow differ (a run served
again at p10 or p90 makes about a percent more or fewer of them). The band's ends move by
about that much: sums by well under a percent, the max stall (one step) by more. A strategy
with a backing thread (the range strategies: a decode step waits only for what a commit
has left, an admission is put off until it ends) is served again instead, as below.

Otherwise a workload band serves the trace again at p10 and p90 only for the strategies
whose calls can move it: a call on the decode path stalls the step after it, the
boundaries move, and so which arrivals a step admits and which calls follow (page-elastic
and the range strategies make other calls at other quantiles). A strategy whose run at the
profile made every call before serving (static, finalize, vllm-extensible) serves the same
way at any cost: its p10 and p90 are its start's alone, priced by running the start (a run
of no requests) on those profiles, exactly what the full run would give.

A profile whose spread has a **session level** (``spread.level``, per scenario group: how far
the card's whole level moved between sessions, :mod:`kvvmm.hardware.spread`) widens the
bands of the figures it covers (growth: ``growth``; the workload's startup and decode
driver time: ``startup``, ``decode``): low times the group's p10, high times its p90
(:meth:`Band.with_level`). ``level=False`` gives the per-call band alone; a profile without
a level gives exactly that.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvvmm.driver.base import Driver
from kvvmm.driver.sim import SimDriver
from kvvmm.driver.wrapper import DriverWrapper
from kvvmm.errors import ArgumentError
from kvvmm.hardware import DeviceProfile, get_profile, profile_data
from kvvmm.hardware.spread import (
    WORKLOAD_LEVEL,
    compose_level,
    level_notes,
    level_of,
    spread_notes,
)
from kvvmm.workload.requests import RequestStream

__all__ = ["BAND_QUANTILES", "PARALLEL_REQUESTS", "WORKLOAD_TIMES", "Band", "QuantilePrices",
           "band_notes", "band_profiles", "banded", "growth_bands", "workload_bands"]

#: The quantiles a band's low and high ends are run at.
BAND_QUANTILES = (0.1, 0.9)
#: The timed figures of a workload replay that carry a band (their ``summary()`` keys).
WORKLOAD_TIMES = ("startup_driver_ms", "decode_driver_ms", "background_driver_ms",
                  "p99_stall_us", "stalled_p99_us", "max_stall_us")


@dataclass(frozen=True, slots=True)
class Band:
    """A simulated figure at the profile's p10, as it is, and at its p90."""

    low: float
    mid: float
    high: float

    @classmethod
    def of(cls, low: float, mid: float, high: float) -> Band:
        """The band of three runs, ordered around ``mid`` (``low <= mid <= high``)."""
        return cls(min(low, mid, high), mid, max(low, mid, high))

    @property
    def width(self) -> float:
        """``(high - low) / mid``: the band's width relative to the point (0 for mid 0)."""
        return (self.high - self.low) / self.mid if self.mid > 0 else 0.0

    def contains(self, x: float) -> bool:
        """Whether ``x`` lies in ``[low, high]``."""
        return self.low <= x <= self.high

    def with_level(self, row: Mapping[str, float] | None) -> Band:
        """This band composed with a session level row (``{"p10", "p50", "p90"}``): low
        times p10, high times p90, ``mid`` kept inside; None: this band."""
        return self if not row else Band(*compose_level(self.low, self.mid, self.high, row))

    def as_list(self, digits: int = 3) -> list[float]:
        """``[low, mid, high]`` rounded, for JSON."""
        return [round(self.low, digits), round(self.mid, digits), round(self.high, digits)]


class QuantilePrices(DriverWrapper):
    """A sim driver whose every call is made again on a sim at each band quantile's
    profile (:data:`BAND_QUANTILES`): the same calls, the same answers, each also priced
    there. :attr:`us` holds each quantile's µs of calls so far (the wrapped driver's are
    its own clock's, as ever).

    The quantile sims get the same calls in the same order, so they hand out the same
    addresses and handles; one that answers otherwise raises (a cost model that refused
    what the wrapped one allowed would make the prices meaningless). A call the wrapped
    driver refuses is not made on them.

    Args:
        inner: the sim the run uses (its profile is the band's mid, at its capacity).
    Raises:
        ArgumentError: ``inner`` is not a :class:`SimDriver`.
    """

    def __init__(self, inner: Driver) -> None:
        if not isinstance(inner, SimDriver):
            raise ArgumentError("inner", inner, "a SimDriver (bands are priced on the sim)")
        super().__init__(inner)
        lo, _, hi = band_profiles(inner.profile)
        cap = inner.profile.capacity_bytes  # the mid's, as a run at the quantile has it
        self.quantiles: tuple[SimDriver, ...] = tuple(
            SimDriver(p, capacity_bytes=cap) for p in (lo, hi))
        self.us = [0.0] * len(self.quantiles)  #: µs of calls at each quantile, so far

    def _call(self, call: str, fn: Any, *a: Any) -> Any:
        got = fn(*a)
        if call == "pin" or call == "unpin":
            return got
        us = self.us
        for i, d in enumerate(self.quantiles):
            c0 = d.clock_us
            other = getattr(d, call)(*a)
            us[i] += d.clock_us - c0
            if other != got:
                raise ArgumentError(f"{call} on the p{BAND_QUANTILES[i] * 100:.0f} sim",
                                    other, f"{got!r}, the run's own answer")
        return got

    def pause(self, seconds: float) -> None:
        """Host time passed between calls, told to every quantile's sim too."""
        self.inner.pause(seconds)  # type: ignore[attr-defined]
        for d in self.quantiles:
            d.pause(seconds)


def band_profiles(profile: str | DeviceProfile) -> tuple[DeviceProfile, DeviceProfile,
                                                         DeviceProfile]:
    """The (low, mid, high) profiles of a band: ``at(0.1)``, the profile, ``at(0.9)``."""
    prof = get_profile(profile)
    lo, hi = BAND_QUANTILES
    return prof.at(lo), prof, prof.at(hi)


def band_notes(profile: str | DeviceProfile, *, level: bool = True) -> list[str]:
    """What the bands made from ``profile`` cover (a profile without a spread: no width;
    with ``level`` and a profile that has one, what the session level adds)."""
    prof = get_profile(profile)
    lo, hi = BAND_QUANTILES
    data = profile_data(prof)
    return [f"band: every cost figure at its p{lo * 100:.0f} and p{hi * 100:.0f} at once "
            f"(not a joint distribution)", *spread_notes(data),
            *(level_notes(data) if level and level_of(data) else ())]


def banded(run: Callable[[DeviceProfile], Mapping[str, float]],
           profile: str | DeviceProfile, *,
           mid: Mapping[str, float] | None = None,
           groups: Callable[[str], str | None] | None = None) -> dict[str, Band]:
    """Run ``run(profile)`` at the band's three profiles; a band per figure it returns.

    Args:
        run: a profile -> {figure: value} function (one of the runners, wrapped).
        profile: the profile the band is around.
        mid: ``run(profile)`` when the caller has it already (not run again).
        groups: each figure's session level group (None: no level); with it, every
            figure whose group the profile's ``spread.level`` holds is composed with it.
            Without it (or a profile without a level), the per-call bands as they are.
    """
    lo_p, mid_p, hi_p = band_profiles(profile)
    m = dict(run(mid_p) if mid is None else mid)
    lo = run(lo_p) if lo_p is not mid_p else m
    hi = run(hi_p) if hi_p is not mid_p else m
    return _bands_of(lo, m, hi, mid_p, groups)


def _bands_of(lo: Mapping[str, float], m: Mapping[str, float], hi: Mapping[str, float],
              mid_p: DeviceProfile,
              groups: Callable[[str], str | None] | None) -> dict[str, Band]:
    """:func:`banded`'s bands of the three runs' figures."""
    out = {k: Band.of(float(lo[k]), float(v), float(hi[k])) for k, v in m.items()}
    rows = level_of(profile_data(mid_p)) if groups is not None else {}
    if rows and groups is not None:
        out = {k: b.with_level(rows.get(g) if (g := groups(k)) else None)
               for k, b in out.items()}
    return out


def growth_bands(policies: Sequence[Any], *, profile: str | DeviceProfile = "h200",
                 mid: Sequence[Any] | None = None, level: bool = True,
                 **growth: Any) -> list[Band]:
    """The band of each policy's simulated growth time (µs), :func:`kvvmm.growth.decode_growth`.

    Args:
        policies: the growth policies (as ``decode_growth`` takes them).
        profile: the sim's profile.
        mid: the results of the run at ``profile`` itself, if the caller has them (a lab
            that just ran), so only the low and high runs are made.
        level: compose with the profile's session level of ``growth`` (if it has one);
            False: the per-call band alone.
        growth: the rest of ``decode_growth``'s arguments (model, layers, tokens, ...).
    """
    from kvvmm.growth import decode_growth

    growth.pop("driver", None)
    growth.pop("progress", None)

    def run(p: DeviceProfile) -> dict[str, float]:
        res = decode_growth(policies, driver=lambda: SimDriver(p), **growth)
        return {str(i): r.sim_us for i, r in enumerate(res)}

    have = None if mid is None else {str(i): r.sim_us for i, r in enumerate(mid)}
    got = banded(run, profile, mid=have, groups=(lambda _: "growth") if level else None)
    return [got[str(i)] for i in range(len(policies))]


def workload_bands(workload: Any, strategies: Sequence[str], *, gpu: str = "h200",
                   mid: Any | None = None, level: bool = True,
                   progress: Callable[[float, float], None] | None = None,
                   workers: int | None = None,
                   **kw: Any) -> dict[str, dict[str, Band]]:
    """Per strategy, a band of each timed figure (:data:`WORKLOAD_TIMES`) of
    :func:`kvvmm.workload.run_workload` on the sim.

    Args:
        workload, strategies: as ``run_workload`` takes them; strategies by name (each band
            runs them three times).
        gpu: the sim's profile (a key or a path).
        mid: the :class:`~kvvmm.workload.run.WorkloadComparison` of the run at ``gpu`` itself,
            when the caller has it: only the low and high runs are made, and none for a
            strategy whose result has its ``band_times`` (a run with ``band_prices``).
            None: that run is made here, with ``band_prices``.
        level: compose the startup and decode driver times with the profile's session
            level (``startup``, ``decode``; other figures have none); False: per-call only.
        progress: ``progress(done, total)`` in serving seconds over the runs still to make
            (as ``run_workload`` reports them), for a progress bar.
        workers: processes the low and high runs are spread over (1: both here, one after
            the other; 2: the high run in a second process while the low one runs here).
            None: 2 when the machine has two cores or more and the runs are long enough
            to pay for starting a process (:data:`PARALLEL_REQUESTS` requests times
            strategies), else 1. Each run is the same deterministic replay either way.
        kw: the rest of ``run_workload``'s arguments (model, tp, config, ...; not ``driver``:
            a band is a prediction, always on the sim).
    Raises:
        ArgumentError: a strategy that is not a name (an object runs once only), or
            ``workers`` not 1, 2 or None.
    """
    for s in strategies:
        if not isinstance(s, str):
            raise ArgumentError("strategies", s, "strategy names (a band runs each three "
                                                 "times; an object runs once)")
    if workers is not None and (type(workers) is not int or workers not in (1, 2)):
        raise ArgumentError("workers", workers, "1, 2 or None")
    kw.pop("driver", None)
    kw.pop("progress", None)
    kw.pop("band_prices", None)
    prof = get_profile(gpu)
    names = list(strategies)
    lo_p, mid_p, hi_p = band_profiles(prof)
    # the runs to make, by quantile (None: the profile as it is); a profile without a
    # spread is its own low and high: nothing to run for them
    qs: list[float | None] = [q for q, p in zip(BAND_QUANTILES, (lo_p, hi_p), strict=True)
                              if p is not mid_p]
    if mid is None:  # the run at the profile, its calls priced at the quantiles too
        from kvvmm.workload.run import run_workload

        mid = run_workload(workload, names, gpu=gpu, band_prices=bool(qs),
                           progress=_part(progress, 0, 2), **kw)
        progress = _part(progress, 1, 2)
    priced = {r.strategy: r.band_times for r in mid.results if r.band_times} if qs else {}
    started = [n for n in _startup_only(mid, names) if n not in priced]
    served = [n for n in names if n not in started and n not in priced]
    if workers is None:  # a stream that does not know its count is long
        n = workload.count if isinstance(workload, RequestStream) else len(workload)
        workers = 2 if (os.cpu_count() or 1) >= 2 and len(qs) > 1 and \
            (n is None or n * len(served) >= PARALLEL_REQUESTS) else 1
    done = _quantile_runs(workload, served, started, gpu, qs, kw, progress, workers) \
        if served or started else {}
    for q in qs:
        assert q is not None
        at_q = done.setdefault(q, {})
        for name, times in priced.items():
            at_q.update({f"{name}|{k}": float(v) for k, v in times[q].items()})
    m = _flat(mid)
    lo = done.get(BAND_QUANTILES[0], m)
    hi = done.get(BAND_QUANTILES[1], m)

    def group(key: str) -> str | None:
        return WORKLOAD_LEVEL.get(key.split("|", 1)[1])

    got = _bands_of(lo, m, hi, mid_p, group if level else None)
    out: dict[str, dict[str, Band]] = {}
    for key, band in got.items():
        strategy, fig = key.split("|", 1)
        out.setdefault(strategy, {})[fig] = band
    return out


def _startup_only(mid: Any | None, names: Sequence[str]) -> list[str]:
    """The strategies of ``names`` whose run at the profile itself (``mid``) made every
    driver call before serving: none on the decode path, none off it, no range allocator.

    Their serving does not depend on what a call costs: with no call after the start, no
    step stalls, so every boundary comes at the same time, every decision (admissions, the
    pages handed out, a strategy's update) is the same, and a run at another quantile makes
    the same calls. Their band figures at a quantile are the start's (what the owner's
    construction, ``prepare`` and ``start`` cost there; decode and background time and the
    stalls are 0), priced by making the start alone on that quantile's profile: a run of
    no requests. The others' later calls move the boundaries (a stall delays the step
    after it, and so which arrivals it admits), so their calls differ between quantiles
    and each quantile is served again.
    """
    if mid is None:
        return []
    by_name = {r.strategy: r for r in mid.results}
    return [n for n in names if n in by_name and by_name[n].decode_driver_calls == 0
            and by_name[n].background_driver_s == 0.0 and not by_name[n].ranges]


def _quantile_runs(workload: Any, served: list[str], started: list[str], gpu: str,
                   qs: list[float | None], kw: dict[str, Any],
                   progress: Callable[[float, float], None] | None,
                   workers: int) -> dict[float | None, dict[str, float]]:
    """The timed figures at each quantile of ``qs``: ``served`` over the workload,
    ``started`` over no requests (see :func:`_startup_only`)."""
    done: dict[float | None, dict[str, float]] = {}
    if workers == 2 and len(qs) > 1:
        # The last run in a second process (a fresh interpreter: nothing this one holds,
        # threads or a GPU context, is forked), the others here meanwhile.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            far = pool.submit(_flat_runs, workload, served, started, gpu, qs[-1], kw)
            for i, q in enumerate(qs[:-1]):
                done[q] = _flat_runs(workload, served, started, gpu, q, kw,
                                     _part(progress, i, len(qs) - 1))
            done[qs[-1]] = far.result()
    else:
        for i, q in enumerate(qs):
            done[q] = _flat_runs(workload, served, started, gpu, q, kw,
                                 _part(progress, i, len(qs)))
    return done


#: requests times strategies from which :func:`workload_bands` runs its low and high
#: replays side by side on a machine with two cores (below it, a second process costs
#: more to start, about 3 s to import, than it saves)
PARALLEL_REQUESTS = 20_000


def _part(progress: Callable[[float, float], None] | None, i: int,
          n: int) -> Callable[[float, float], None] | None:
    """``progress`` for the ``i``-th of ``n`` runs made one after the other."""
    if progress is None:
        return None
    report = progress

    def part(done: float, total: float) -> None:
        report(i * total + done, n * total)

    return part


def _flat(cmp: Any) -> dict[str, float]:
    return {f"{r.strategy}|{k}": float(r.summary()[k]) for r in cmp.results
            for k in WORKLOAD_TIMES}


def _flat_runs(workload: Any, served: list[str], started: list[str], gpu: str,
               q: float | None, kw: dict[str, Any],
               progress: Callable[[float, float], None] | None = None) -> dict[str, float]:
    """:func:`_flat_run` of ``served`` over ``workload`` and of ``started`` over no
    requests, in one dict (a module-level function, so a second process can run it)."""
    from kvvmm.workload.requests import Workload

    out = _flat_run(workload, served, gpu, q, kw, progress) if served else {}
    if started:
        none = Workload((), getattr(workload, "source", "no requests"))
        out.update(_flat_run(none, started, gpu, q, kw))
    return out


def _flat_run(workload: Any, names: list[str], gpu: str, q: float | None,
              kw: dict[str, Any],
              progress: Callable[[float, float], None] | None = None) -> dict[str, float]:
    """The timed figures of ``run_workload`` on the sim at ``gpu``'s profile at quantile
    ``q`` (None: as it is); a module-level function, so a second process can run it."""
    from kvvmm.workload.run import run_workload

    prof = get_profile(gpu)
    p = prof if q is None else prof.at(q)
    cap = prof.capacity_bytes
    return _flat(run_workload(workload, names, gpu=gpu, progress=progress,
                              driver=lambda: SimDriver(p, capacity_bytes=cap), **kw))

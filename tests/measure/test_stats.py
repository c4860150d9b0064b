"""One measurement record, one percentile, one call-timing loop: what each gives, and that the
loop gives back what a failed call leaves."""

from __future__ import annotations

import random
import statistics

import pytest

from kvvmm.driver.faults import Fault, FaultyDriver
from kvvmm.driver.sim import SimDriver
from kvvmm.errors import ArgumentError, DriverError
from kvvmm.measure.stats import Measurement, percentile, quantiles
from kvvmm.measure.timer import HANDLE_CALLS, CallTimes, time_handle_calls
from kvvmm.units import MiB


def test_the_nearest_rank_p99_of_122_steps_is_the_second_largest() -> None:
    xs = list(range(1, 123))
    random.Random(1).shuffle(xs)
    assert percentile(xs, 0.99) == 121
    assert percentile(xs, 0.5) == 61 and percentile(xs, 0.0) == 1 and percentile(xs, 1.0) == 122


def test_the_interpolated_percentile_is_what_a_spread_stores() -> None:
    xs = [1.0, 1.2, 0.9, 1.1, 1.4]
    q = quantiles(xs)
    assert q == {name: round(percentile(xs, p, interpolate=True), 4)
                 for name, p in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))}
    assert q["p50"] == 1.1


@pytest.mark.parametrize(("xs", "q"), [([], 0.5), ([1.0], -0.1), ([1.0], 1.5),
                                       ([1.0, float("nan")], 0.5), ([1.0], float("nan"))])
def test_a_percentile_of_nothing_or_outside_0_to_1_is_refused(xs: list[float], q: float) -> None:
    with pytest.raises(ArgumentError):
        percentile(xs, q)


def test_a_measurement_keeps_every_sample_and_computes_its_figures_from_them() -> None:
    xs = [1e-6 * v for v in [*range(10, 59), 10_000]]  # one 10 ms stall in 50 samples
    m = Measurement.of(xs)
    assert m.samples == tuple(xs)
    assert m.median == statistics.median(xs)
    assert m.trimmed_mean() == pytest.approx(statistics.fmean(sorted(xs)[:-1]))  # stall left out
    assert m.trimmed_mean(high=0.1, low=0.1) == pytest.approx(statistics.fmean(sorted(xs)[5:-5]))
    assert m.p99 == max(xs) and m.median_us() == round(m.median * 1e6, 3)
    assert m.mean_us() == round(m.trimmed_mean() * 1e6, 3)
    with pytest.raises(ArgumentError):
        Measurement.of([])


def test_the_timing_loop_times_every_call_of_every_size_once_a_rep() -> None:
    d = SimDriver("h200")
    sizes = (2 * MiB, 8 * MiB)
    base = d.reserve(16 * MiB)
    places = {2 * MiB: base, 8 * MiB: base + 8 * MiB}
    got = CallTimes(sizes)
    rng = random.Random(3)
    time_handle_calls(d, places, lambda: float(d.clock_us), rng, None)  # a warm-up keeps none
    for _ in range(3):
        time_handle_calls(d, places, lambda: float(d.clock_us), rng, got)
    d.free(base, 16 * MiB)
    assert all(len(got.samples[op][s]) == 3 for op in HANDLE_CALLS for s in sizes)
    assert got.reps(8 * MiB) == 3 and got.measurement("map", 2 * MiB).median > 0
    assert d.stats().clean


@pytest.mark.parametrize("call", ["map", "set_access", "unmap", "release"])
def test_a_failed_call_in_the_timing_loop_gives_back_what_the_rep_made(call: str) -> None:
    sim = SimDriver("h200")
    d = FaultyDriver(sim, Fault(call=call, nth=2))
    base = d.reserve(16 * MiB)
    places = {2 * MiB: base, 8 * MiB: base + 8 * MiB}
    with pytest.raises(DriverError):
        time_handle_calls(d, places, lambda: 0.0, random.Random(4), CallTimes(places))
    d.free(base, 16 * MiB)
    assert sim.stats().clean, sim.stats()

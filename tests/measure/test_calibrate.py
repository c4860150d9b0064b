"""kvvmm calibrate's pure parts, profiles by name or path, and the sim charging a profile's
costs, all on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvvmm import cli
from kvvmm.driver.sim import SimDriver
from kvvmm.errors import ArgumentError
from kvvmm.hardware import (
    get_profile,
    load_profile,
    profile_data,
    profile_from_data,
    profile_label,
    sim_costs,
)
from kvvmm.hardware.cost import default_cost_model
from kvvmm.measure.calibrate import FULL, QUICK, build_profile, measure, slowdown_verdict
from kvvmm.units import GiB, MiB

ROOT = Path(__file__).resolve().parents[2]

#: A calibration small enough for a test: seconds on the host driver.
TINY = replace(FULL, call_sizes_mib=(2, 4), call_reps=(3, 3), reserve_gib=(1, 2), reserve_reps=2,
               access_cases=((2, 4),), access_reps=2, layers=1, reserved_tokens=16384,
               step_tokens=4096, grow_to_tokens=16384, finalize_tokens=16384,
               policies=("default", "exact"), rounds=1, settle_s=0.0, commit_reps=3,
               owner_reps=1, bandwidth_handles_mib=(0,), bandwidth_bytes=8 * MiB,
               release_bytes=16 * MiB, slow_creates=2, slow_create_mib=2, slow_repeats=2,
               cold_rounds=2, cold_gap_s=0.01)

META = {"date": "2026-12-01T12:00:00+00:00", "card": "NVIDIA Test GPU", "key": "testgpu",
        "driver": "580.1", "torch": "2.11", "cuda_bindings": "13.3.1", "kvvmm": "0.2",
        "capacity_bytes": 80 * GiB, "granularity_bytes": 2 * MiB}


def _meas(create_us: float = 10.0) -> dict[str, Any]:
    row = {"create": create_us, "map": 1.5, "set_access": 20.0, "unmap": 15.0,
           "release": 11.0}
    return {
        "per_call": {"2MiB": row, "512MiB": {k: v * 2 for k, v in row.items()}},
        "reserve_free": {"sizes": {"64GiB": {"reserve": 30.0, "free": 20.0}}, "mem_info_us": 0.5},
        "access_multi": {"2MiBx64": {"mapping_mib": 2, "mappings": 64, "one_call_us": 2200.0,
                                     "one_call_per_mapping_us": 34.4,
                                     "call_per_mapping_us": 37.0,
                                     "ratio_one_over_calls": 0.93}},
        "post_release": {"released_bytes": 64 * GiB, "create_bytes": 32 * MiB, "creates": 256,
                         "repeats": [{"ratio_of_means": 2.1}, {"ratio_of_means": 2.3},
                                     {"ratio_of_means": 2.2}]},
    }


def _write(tmp_path: Path, data: dict[str, Any], name: str = "my-card.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# -- profiles ----------------------------------------------------------------------------


def test_a_built_profile_round_trips_through_its_file_with_a_source_on_every_section(
    tmp_path: Path,
) -> None:
    data = build_profile(_meas(), META, FULL)
    prof = load_profile(_write(tmp_path, data))
    assert (prof.key, prof.name, prof.date) == ("testgpu", "NVIDIA Test GPU", "2026-12-01")
    assert prof.capacity_bytes == 80 * GiB and prof.granularity_bytes == 2 * MiB
    back = profile_data(prof)
    for section in ("call_costs", "set_access_per_mapping", "post_release_slowdown"):
        assert "kvvmm calibrate on NVIDIA Test GPU" in back[section]["source"], section
    assert back["call_costs"]["points"]["create"] == [[2, 10.0], [512, 20.0]]
    assert back["call_costs"]["points"]["reserve"] == [[65536, 30.0]]


def test_profiles_load_by_key_by_path_string_and_by_pathlike(tmp_path: Path) -> None:
    path = _write(tmp_path, build_profile(_meas(), META, FULL))
    assert get_profile("h200").key == get_profile("H-200").key == "h200"
    assert get_profile(str(path)).path == str(path.resolve())
    assert get_profile(path).key == "testgpu"
    assert SimDriver(profile=str(path)).profile.key == "testgpu"
    with pytest.raises(ArgumentError, match="a path to a profile"):
        get_profile("no-such-card")
    with pytest.raises(OSError):
        get_profile(tmp_path / "missing.json")


def test_a_file_that_is_not_a_profile_is_refused_naming_the_file(tmp_path: Path) -> None:
    bad = _write(tmp_path, {"format": "something-else"}, "bad.json")
    with pytest.raises(ArgumentError, match=r"bad\.json"):
        load_profile(bad)
    (tmp_path / "broken.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ArgumentError, match=r"broken\.json"):
        load_profile(tmp_path / "broken.json")
    newer = _write(tmp_path, dict(build_profile({}, META, FULL), version=99), "newer.json")
    with pytest.raises(ArgumentError, match="version"):
        load_profile(newer)


def test_a_profile_names_its_card_date_and_file_for_figures(tmp_path: Path) -> None:
    assert profile_label("h200") == "h200 (NVIDIA H200, 2026-12-01)"
    path = _write(tmp_path, build_profile({}, META, FULL))
    assert profile_label(path) == "testgpu (NVIDIA Test GPU, 2026-12-01, my-card.json)"


# -- the sim charges the profile's costs -------------------------------------------------


def test_the_sim_charges_a_loaded_profiles_call_costs_not_the_h200s(tmp_path: Path) -> None:
    prof = get_profile(_write(tmp_path, build_profile(_meas(create_us=100.0), META, FULL)))
    sim, h200 = SimDriver(prof), SimDriver("h200")
    for d in (sim, h200):
        d.clock_us = 0.0
        d.create(2 * MiB)
    assert sim.clock_us == pytest.approx(100.0)
    cold = sim_costs(h200.profile).cold
    assert cold is not None  # the shipped H200 profile models the first call's premium
    assert h200.clock_us == pytest.approx(default_cost_model()("create", 2 * MiB)
                                          + cold.premium_us["create"])


def test_a_profile_without_call_costs_borrows_the_h200s_and_says_so() -> None:
    b200 = sim_costs(get_profile("b200"))
    assert b200.calls("map", 2 * MiB) == default_cost_model()("map", 2 * MiB)
    assert any("H200" in n for n in b200.notes)
    partial = profile_from_data(build_profile({"reserve_free": _meas()["reserve_free"]}, META,
                                              FULL))
    costs = sim_costs(partial)
    assert costs.calls("reserve", 64 * GiB) == 30.0
    assert costs.calls("create", 2 * MiB) == default_cost_model()("create", 2 * MiB)
    assert any("create" in n and "H200" in n for n in costs.notes)


def test_library_overhead_is_added_to_every_call_of_its_kind() -> None:
    data = build_profile(_meas(), META, FULL)
    data["library_overhead_us"] = {"per_call": {"create": 7.0, "unmap": 3.0},
                                   "source": "test"}
    sim = SimDriver(profile_from_data(data))
    va = sim.reserve(2 * MiB)
    t0 = sim.clock_us
    h = sim.create(2 * MiB)
    assert sim.clock_us - t0 == pytest.approx(10.0 + 7.0)
    sim.map(va, 2 * MiB, h)
    t0 = sim.clock_us
    sim.unmap(va, 2 * MiB)
    assert sim.clock_us - t0 == pytest.approx(15.0 + 3.0)


def test_library_overhead_fitted_by_handle_size_replaces_the_flat_figure_for_its_call() -> None:
    data = build_profile(_meas(), META, FULL)
    data["library_overhead_us"] = {"per_call": {"create": 7.0}, "source": "test",
                                   "by_size": {"create": [[8, 20.0], [128, 40.0]]}}
    costs = sim_costs(profile_from_data(data))
    assert costs.overhead_us("create", 8 * MiB) == 20.0
    assert costs.overhead_us("create", 32 * MiB) == pytest.approx(30.0)
    assert costs.overhead_us("create", 2 * MiB) == 20.0  # flat past the measured ends
    sim = SimDriver(profile_from_data(data))
    sim.create(8 * MiB)
    assert sim.clock_us == pytest.approx(costs.calls("create", 8 * MiB) + 20.0)
    data["library_overhead_us"]["by_size"] = {"create": [[8, -1e6], [128, -1e6]]}
    neg = SimDriver(profile_from_data(data))
    neg.create(8 * MiB)
    assert neg.clock_us == 0.0  # a call never runs the clock backwards


def test_the_shipped_h200_profile_charges_its_call_costs_and_the_first_touch_once() -> None:
    sim, model = SimDriver("h200"), default_cost_model()
    first = sim_costs(sim.profile).first_touch
    cold = sim_costs(sim.profile).cold
    assert first is not None  # measured on the H200 (calibrate, 2026-12-01)
    assert cold is not None  # each call kind's first call costs its premium, once
    va = sim.reserve(64 * GiB)
    expected = model("reserve", 64 * GiB) + first[1] + first[2]  # one region touched
    expected += sum(cold.premium_us[op] for op in ("reserve", "create", "map", "set_access",
                                                   "unmap", "release"))
    # the second call of each kind pays its share of that (the cold premium's second share), once
    expected += sum(cold.premium_us[op] * cold.second.get(op, 0.0)
                    for op in ("create", "map", "set_access", "unmap", "release"))
    for size in (2 * MiB, 6 * MiB, 512 * MiB):
        h = sim.create(size)
        sim.map(va, size, h)
        sim.set_access(va, size)
        sim.unmap(va, size)
        sim.release(h)
        expected += sum(model(op, size) for op in ("create", "map", "set_access", "unmap",
                                                   "release"))
    assert sim.clock_us == pytest.approx(expected)


def test_creates_after_a_large_release_are_slowed_when_calibrate_found_it_stable() -> None:
    data = build_profile(_meas(), META, FULL)
    slow = data["post_release_slowdown"]
    assert slow["modelled"] is True and slow["factor"] == 2.2 and slow["creates"] == 256
    slow["creates"], slow["min_released_bytes"] = 2, 4 * MiB
    sim = SimDriver(profile_from_data(data))
    hs = [sim.create(2 * MiB) for _ in range(3)]
    for h in hs:
        sim.release(h)  # 6 MiB released: past the threshold
    costs = []
    for _ in range(3):
        t0 = sim.clock_us
        sim.create(2 * MiB)
        costs.append(sim.clock_us - t0)
    assert costs == pytest.approx([22.0, 22.0, 10.0])


def test_a_slowdown_that_is_not_in_every_repeat_or_disagrees_is_not_modelled() -> None:
    def reps(*ratios: float) -> dict[str, Any]:
        return {"creates": 8, "create_bytes": 32 * MiB, "released_bytes": 64 * GiB,
                "repeats": [{"ratio_of_means": r} for r in ratios]}

    assert slowdown_verdict(reps(2.0, 2.1, 1.9))["modelled"] is True
    assert "every repeat" in slowdown_verdict(reps(2.0, 1.0, 2.0))["why_not_modelled"]
    assert "disagree" in slowdown_verdict(reps(1.3, 3.0, 2.0))["why_not_modelled"]
    assert slowdown_verdict(reps(2.0))["modelled"] is False
    data = build_profile({"post_release": reps(2.0, 1.0, 2.0)}, META, FULL)
    costs = sim_costs(profile_from_data(data))
    assert costs.slowdown is None and any("not modelled" in n for n in costs.notes)


# -- calibrate's run, on the host driver --------------------------------------------------


def test_calibrate_on_the_host_driver_writes_a_complete_profile_the_sim_loads(
    tmp_path: Path,
) -> None:
    from kvvmm.driver.host import HostDriver

    out = tmp_path / "host.json"
    seen: list[str] = []
    data = measure(HostDriver(), TINY, out=str(out), key="hosttest", progress=seen.append)
    assert data["calibration"]["complete"], data["calibration"]["errors"]
    assert seen == [n for n in data["calibration"]["sections_done"]]
    prof = get_profile(out)
    costs = sim_costs(prof)
    # Measured per operation: nothing is charged per call any more.
    assert costs.per_call_overhead_us == {} and costs.overhead_curves == {}
    assert costs.access_per_mapping is not None and costs.unmap_per_mapping is not None
    from kvvmm.measure.operations import WORK_UNITS

    lw = profile_data(prof)["library_work_us"]
    assert lw["source"] and set(costs.work) == set(WORK_UNITS)
    for op, (fixed, per_unit) in costs.work.items():
        assert fixed >= 0 and per_unit >= 0, op
        assert lw[op]["unit"] == WORK_UNITS[op]
    assert lw["samples"]["growing_steps"] >= 1 and lw["samples"]["noop_steps"] >= 1
    lo = profile_data(prof)["library_overhead_us"]
    assert lo["source"] and lo["measured_source"] and lo["fit"]
    assert "bandwidth" not in data  # a GPU-only section: skipped on the host driver
    assert not list(tmp_path.glob("*.part"))
    SimDriver(prof).create(2 * MiB)


def test_a_section_that_fails_is_recorded_and_the_profile_still_loads(tmp_path: Path) -> None:
    from kvvmm.driver.host import HostDriver

    broken = replace(TINY, call_sizes_mib=(3,), call_reps=(2,))  # 3 MiB: off the granularity
    out = tmp_path / "partial.json"
    data = measure(HostDriver(), broken, out=str(out), sections=["per_call", "reserve_free"])
    assert data["calibration"]["complete"] is False
    assert "per_call" in data["calibration"]["errors"]
    assert data["calibration"]["sections_done"] == ["reserve_free"]
    costs = sim_costs(get_profile(out))
    assert any("create" in n for n in costs.notes)


def test_the_quick_plan_measures_the_same_sections_with_less() -> None:
    assert len(QUICK.call_sizes_mib) < len(FULL.call_sizes_mib)
    assert QUICK.rounds == 1 and FULL.rounds >= 3


@pytest.mark.skipif("torch" in sys.modules and __import__("torch").cuda.is_available(),
                    reason="a GPU is usable here: calibrate would run")
def test_calibrate_without_a_gpu_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvvmm", "calibrate", "--quick", "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_calibrate_is_a_subcommand_whose_help_needs_no_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["calibrate", "--help"])
    assert e.value.code == 0
    assert "--quick" in capsys.readouterr().out


# -- the lab names what it predicts from -------------------------------------------------


def _growth(driver: str = "sim", profile: str = "h200") -> list[Any]:
    from kvvmm.growth import decode_growth
    from kvvmm.policy import Chunked, Exact

    return decode_growth([Exact(), Chunked(8 * MiB)], driver=driver, profile=profile,
                         layers=1, tokens=4096, step_tokens=1024)


def test_growth_text_and_figure_name_the_profile_their_sim_times_come_from() -> None:
    from kvvmm.viz import format_growth, growth_figure

    results = _growth()
    text = format_growth(results, profile="h200")
    assert text.splitlines()[-1] == ("driver time: simulated with profile h200 "
                                     "(NVIDIA H200, 2026-12-01); costs: h200, measured on "
                                     "an H200; capacity: h200")
    title = growth_figure(results, profile="h200").layout.title.text
    assert "h200 (NVIDIA H200, 2026-12-01)" in title
    assert format_growth(results) == "\n".join(text.splitlines()[:-1])  # unchanged without


def test_measured_growth_shows_next_to_the_sims_prediction() -> None:
    from kvvmm.viz import format_growth, growth_figure

    predicted = _growth()
    measured = [replace(r, driver="cuda", sim_us=0.0, wall_s=r.sim_us / 1e6 * 2)
                for r in predicted]
    text = format_growth(measured, profile="h200", predicted=predicted)
    assert "measured" in text and "predicted" in text and "pred/meas" in text
    assert " 0.50" in text.splitlines()[3]
    assert text.splitlines()[-1].startswith("predicted: simulated with profile h200")
    title = growth_figure(measured, profile="h200", predicted=predicted).layout.title.text
    assert "measured / predicted" in title and "Exact()" in title


def test_describe_stats_and_the_timeline_name_the_sims_profile() -> None:
    from kvvmm.record import TracingDriver
    from kvvmm.viz import describe_stats, timeline

    sim = SimDriver("h200")
    sim.reserve(2 * MiB)
    assert describe_stats(sim.stats(), profile=sim.profile).endswith(
        "(sim profile h200 (NVIDIA H200, 2026-12-01); costs: h200, measured on an H200; "
        "capacity: h200)")
    drv = TracingDriver(SimDriver("h200"))
    drv.reserve(2 * MiB)
    fig = timeline(drv.trace, profile="h200")
    assert "profile h200 (NVIDIA H200, 2026-12-01)" in fig.layout.title.text


def test_growth_lab_takes_a_calibrated_profile_by_path_and_names_it(tmp_path: Path) -> None:
    from kvvmm.lab import GrowthLab

    path = _write(tmp_path, build_profile(_meas(), META, FULL))
    lab = GrowthLab(profile=str(path), layers=1, tokens=4096, step_tokens=1024)
    assert ("my-card.json", str(path)) in lab.profile.options
    assert lab.run(), lab.error_text
    assert lab.predicted is None  # the sim is the prediction itself
    assert "testgpu (NVIDIA Test GPU, 2026-12-01, my-card.json)" in lab.table.value


def test_the_fitted_overhead_makes_the_sim_reproduce_the_growth_it_was_fitted_to() -> None:
    from kvvmm.measure.fit import _charge, _merge_sizes, _sim_calls

    base = build_profile(_meas(), META, TINY)
    growth: dict[str, Any] = {}
    for spec in TINY.policies:  # "measured": the calls as charged, plus 5 µs per create
        sim = _sim_calls(base, TINY, spec)
        creates = sum(1 for c in sim["grow"] if c[0] == "create")
        unmaps = sum(1 for c in sim["close"] if c[0] == "unmap")
        growth[spec] = {"policy": spec, "construct_us": [1.0],
                        "grow_us": [_charge(base, sim["grow"]) + 5.0 * creates],
                        "close_us": [_charge(base, sim["close"]) + 3.0 * unmaps]}
    data = build_profile(_meas() | {"growth": growth}, META, TINY)
    lo = data["library_overhead_us"]
    assert lo["per_call"] == {"create": 5.0, "unmap": 3.0}
    assert "kvvmm calibrate on NVIDIA Test GPU" in lo["source"]
    prof = profile_from_data(data)
    for spec in TINY.policies:
        replay = _sim_calls(data, TINY, spec)
        costs = sim_costs(prof)
        predicted = sum(costs.call_us(op, size) for op, size, _ in replay["grow"])
        assert predicted == pytest.approx(growth[spec]["grow_us"][0])
    assert _merge_sizes({30.0: [10.0], 32.0: [20.0], 128.0: [40.0]}) == [
        [30.984, 15.0], [128.0, 40.0]]


def _work_profile(**over: float) -> Any:
    from kvvmm.measure.operations import WORK_UNITS

    data = build_profile(_meas(), META, FULL)
    data["library_overhead_us"] = {"per_call": {"create": 7.0}, "source": "replaced"}
    work = {op: {"fixed": 0.0, "per_unit": 0.0, "unit": u} for op, u in WORK_UNITS.items()}
    for key, v in over.items():
        op, part = key.rsplit("__", 1)
        work[op.replace("_", ".", 1)][part] = v
    data["library_work_us"] = work | {"source": "test"}
    return profile_from_data(data)


def test_library_work_is_charged_per_operation_and_replaces_the_per_call_overhead() -> None:
    from kvvmm.arena import Arena
    from kvvmm.layout import mha_token_major
    from kvvmm.owner import KvBufferOwner

    prof = _work_profile(arena_commit__fixed=100.0, arena_commit__per_unit=10.0,
                         owner_ensure_prefix__per_unit=1000.0)
    costs = sim_costs(prof)
    assert costs.per_call_overhead_us == {}  # per operation now: nothing per call
    bare = sim_costs(profile_from_data(
        {k: v for k, v in profile_data(prof).items() if k != "library_work_us"}))
    sim = SimDriver(prof)
    a = Arena(sim, reserve_bytes=8 * MiB, name="w")
    offs = [a.allocate(2 * MiB) for _ in range(3)]
    t0 = sim.clock_us
    a.commit_many([(o, 2 * MiB) for o in offs])  # three handles
    calls = 3 * (costs.calls("create", 2 * MiB) + costs.calls("map", 2 * MiB)
                 + costs.access_us([2 * MiB]))
    assert sim.clock_us - t0 == pytest.approx(calls + 100.0 + 3 * 10.0)
    a.close()
    # An owner's decode step with nothing to back makes no driver call, yet costs its check.
    descs = mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=4096,
                            page_size=64, dtype="bfloat16")
    owner = KvBufferOwner(driver=sim, dtype="bfloat16", page_size=64, reserved_tokens=4096,
                          descs=descs)
    t0 = sim.clock_us
    owner.ensure_prefix(1)
    assert sim.clock_us - t0 == pytest.approx(1000.0 * len(descs))
    owner.close()
    assert bare.per_call_overhead_us == {"create": 7.0}  # older profiles: as they were


def test_one_unmap_over_several_mappings_costs_one_per_mapping_where_measured() -> None:
    prof = _work_profile()
    data = dict(profile_data(prof))
    data["unmap_per_mapping"] = {"points": [[2, 5.0], [8, 9.0]], "source": "test"}
    sim = SimDriver(profile_from_data(data))
    va = sim.reserve(8 * MiB)
    for i in range(4):
        h = sim.create(2 * MiB)
        sim.map(va + i * 2 * MiB, 2 * MiB, h)
        sim.release(h)
    t0 = sim.clock_us
    sim.unmap(va, 8 * MiB)
    assert sim.clock_us - t0 == pytest.approx(4 * 5.0)


def test_wrappers_pass_the_library_work_on_to_the_simulator() -> None:
    from kvvmm.driver.faults import FaultyDriver
    from kvvmm.record.tracing import TracingDriver

    sim = SimDriver(_work_profile(arena_open__fixed=42.0))
    for wrapped in (TracingDriver(sim), FaultyDriver(sim, {})):
        t0 = sim.clock_us
        wrapped.library_work("arena.open", 0)
        assert sim.clock_us - t0 == pytest.approx(42.0)
    TracingDriver(SimDriver()).library_work("arena.open", 0)  # no such figure: nothing


def test_the_first_mapping_in_a_region_costs_its_extra_once_until_the_reservation_is_freed(
) -> None:
    data = dict(profile_data(_work_profile()))
    data["first_touch"] = {"region_mib": 1024, "map_us": 50.0, "set_access_us": 200.0,
                           "modelled": True, "source": "test"}
    sim = SimDriver(profile_from_data(data))
    costs = sim_costs(profile_from_data(data))
    base = costs.calls("map", 2 * MiB) + costs.access_us([2 * MiB])

    def back(va: int) -> float:
        h = sim.create(2 * MiB)
        t0 = sim.clock_us
        sim.map(va, 2 * MiB, h)
        sim.set_access(va, 2 * MiB)
        return sim.clock_us - t0

    va = sim.reserve(4 * GiB, GiB)
    assert back(va) == pytest.approx(base + 250.0)  # the region's first mapping
    assert back(va + 2 * MiB) == pytest.approx(base)  # beside it
    assert back(va + GiB) == pytest.approx(base + 250.0)  # the next region
    for off in (0, 2 * MiB, GiB):
        sim.unmap(va + off, 2 * MiB)
    assert back(va) == pytest.approx(base)  # still set up: an unmap does not undo it
    sim.unmap(va, 2 * MiB)
    sim.free(va, 4 * GiB)
    va = sim.reserve(4 * GiB, GiB)
    assert back(va) == pytest.approx(base + 250.0)  # a new reservation starts afresh


@pytest.mark.parametrize(("per", "times"), [("region", 4), ("mapping", 1)])
def test_a_large_first_mapping_pays_per_region_it_enters_or_once_as_calibrate_found(
    per: str, times: int,
) -> None:
    data = dict(profile_data(_work_profile()))
    data["first_touch"] = {"region_mib": 512, "map_us": 5.0, "set_access_us": 20.0,
                           "per": per, "modelled": True, "source": "test"}
    prof = profile_from_data(data)
    sim, costs = SimDriver(prof), sim_costs(prof)
    va = sim.reserve(4 * GiB, GiB)
    h = sim.create(2 * GiB)
    t0 = sim.clock_us
    sim.map(va, 2 * GiB, h)
    sim.set_access(va, 2 * GiB)
    calls = costs.calls("map", 2 * GiB) + costs.access_us([2 * GiB])
    assert sim.clock_us - t0 == pytest.approx(calls + times * 25.0)


class _ArgCountingSim(SimDriver):
    """The sim driver, noting how many arguments each set_access got."""

    def __init__(self) -> None:
        super().__init__("h200")
        self.set_access_args: list[int] = []

    def set_access(self, *args: Any) -> None:
        self.set_access_args.append(len(args))
        super().set_access(*args)


def test_the_timed_driver_passes_set_access_on_with_the_arguments_it_got() -> None:
    # Calibrate's wrapper passed devices=None on as a third argument, and
    # CudaDriver's C fast path hands any third argument to the slower Python path, so the
    # library and growth sections timed a set_access that owners never pay.
    from kvvmm.measure.calibrate import TimedDriver

    inner = _ArgCountingSim()
    td = TimedDriver(inner)
    g = td.granularity()
    va = td.reserve(2 * g)
    h = td.create(g)
    td.map(va, g, h)
    with td.record() as calls:
        td.set_access(va, g)
        td.set_access(va, g, [0])
    assert inner.set_access_args == [2, 3]
    assert [c[0] for c in calls] == ["set_access", "set_access"]


@pytest.mark.parametrize(("spec", "expected"), [
    ("default", "Geometric(2, 256.0 MiB, min 8.0 MiB)"),
    ("exact", "Exact()"),
    ("chunked:128", "Chunked(128.0 MiB)"),
    ("geometric:2:1024", "Geometric(2, 1.0 GiB)"),
])
def test_a_policy_is_read_from_its_short_spelling(spec: str, expected: str) -> None:
    from kvvmm.policy import parse_policy

    assert str(parse_policy(spec)) == expected


@pytest.mark.parametrize("spec", ["", "chunked", "chunked:1:2", "geometric:2", "fixed:3"])
def test_an_unknown_policy_spelling_is_refused_by_name(spec: str) -> None:
    from kvvmm.policy import parse_policy

    with pytest.raises(ArgumentError) as e:  # a ValueError, as it always was
        parse_policy(spec)
    assert str(e.value) == (f"spec={spec!r} is invalid: must be 'default', 'exact', "
                            f"'chunked:MiB' or 'geometric:factor:max MiB'")


@pytest.mark.parametrize("spec", ["chunked:two", "geometric:x:256", "geometric:2:1.5"])
def test_a_policy_spelling_whose_number_does_not_parse_is_refused_naming_the_spec(
    spec: str,
) -> None:
    from kvvmm.policy import parse_policy

    with pytest.raises(ArgumentError, match=rf"^spec={spec!r} is invalid: .* \(a number does "
                                            r"not parse\)$"):
        parse_policy(spec)


def test_a_policy_spelling_out_of_the_policys_bounds_names_the_bound_and_the_spec() -> None:
    from kvvmm.policy import parse_policy

    with pytest.raises(ArgumentError, match=r"factor=0.5 is invalid: must be a number in") as e:
        parse_policy("geometric:0.5:256")
    assert e.value.__notes__ == ["from the policy spec 'geometric:0.5:256'"]


def test_the_full_calibration_grows_what_kvvmm_bench_grows() -> None:
    # One workload definition; calibrate's plan only picks tokens and steps.
    from kvvmm.measure.workload import BENCH_WORKLOAD

    assert FULL.workload == BENCH_WORKLOAD
    assert list(TINY.workload.decode_steps()) == [4096, 8192, 12288, 16384]
    assert len(TINY.workload.descs()) == 2 * TINY.layers


def test_in_context_points_are_net_of_the_first_touch_the_sim_charges_on_its_own() -> None:
    """A growth call entering fresh VA pays the first-touch extra inside its in-context time;
    the sim charges that extra separately, so the fit takes it out of the points
    (Geometric(2, 1 GiB)'s 512 MiB chunks, each the first in its 512 MiB region)."""
    from kvvmm.hardware import profile_data
    from kvvmm.measure.fit import first_touch_in_context, net_first_touch

    data = dict(profile_data(get_profile("h200")))
    plan = replace(FULL, policies=("geometric:2:1024", "exact"))
    extra = first_touch_in_context(data, plan)
    ft = data["first_touch"]
    assert extra["set_access"][512] == pytest.approx(ft["set_access_us"])  # every one fresh
    assert extra["map"][512] == pytest.approx(ft["map_us"])
    # Exact's 8 MiB steps enter a fresh region 1 in 64: under the 2% the points leave out
    # (the slowest), so the point has none of the extra and none is taken out of it.
    assert 8 not in extra["set_access"] and 8 not in extra["map"]
    assert 0 < extra["set_access"][16] < 0.05 * ft["set_access_us"]
    pts = net_first_touch([[512, 80.0, 64], [6, 38.0, 128]], extra["set_access"])
    assert pts == [[512, pytest.approx(80.0 - ft["set_access_us"]), 64], [6, 38.0, 128]]
    assert first_touch_in_context(data | {"first_touch": ft | {"modelled": False}}, plan) == {}


def test_the_shipped_points_are_its_calibration_net_of_first_touch() -> None:
    """h200's map and set_access points and context factors are what net_calibration makes
    of the calibration it carries (h200-calibrated.json: its in-context points as recorded),
    with the shipped first-touch model (once per mapping); the other ops are untouched."""
    from kvvmm.hardware import profile_data
    from kvvmm.measure.fit import net_calibration

    ship = dict(profile_data(get_profile("h200")))
    path = Path(__file__).resolve().parents[2] / "kvvmm/hardware/data/h200-calibrated.json"
    cal = json.loads(path.read_text(encoding="utf-8"))
    got = net_calibration(cal, ship["first_touch"])["call_costs"]
    for op in ("map", "set_access"):
        assert got["points"][op] == ship["call_costs"]["points"][op], op
        assert got["context_factor"][op] == ship["call_costs"]["context_factor"][op], op
        assert got["context_factor"][op] < cal["call_costs"]["context_factor"][op], op
    for op in ("create", "unmap", "release"):
        assert got["points"][op] == cal["call_costs"]["points"][op], op
    no_raw = {k: v for k, v in cal.items() if k != "calibration"}
    assert net_calibration(no_raw) == no_raw


def test_a_recorded_plan_reads_back_as_the_plan_that_made_it() -> None:
    """What calibrate records (plan_dict, through JSON) reads back as the same Plan; keys
    an older plan had that Plan no longer has are dropped, fields it lacked are FULL's."""
    from kvvmm.measure.plan import plan_dict, plan_from_dict

    for plan in (FULL, QUICK, TINY):
        assert plan_from_dict(json.loads(json.dumps(plan_dict(plan)))) == plan
    old = {k: v for k, v in plan_dict(QUICK).items() if not k.startswith("cold_")}
    got = plan_from_dict(old | {"gone_field": 1})
    assert got.policies == QUICK.policies and got.cold_rounds == FULL.cold_rounds
    assert plan_from_dict(None) == FULL

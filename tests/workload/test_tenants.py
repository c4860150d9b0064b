"""Tenants sharing one simulated GPU's budget (kvvmm.workload.tenants), with
scripted demands. Small workloads, so the file runs in seconds."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvvmm.cli import main
from kvvmm.cli.replay import parse_tenants
from kvvmm.errors import ArgumentError
from kvvmm.viz.tenants import format_tenants, tenants_figure
from kvvmm.workload import Request, Workload, generate
from kvvmm.workload.tenants import (
    ANSWERS,
    TENANT_STRATEGIES,
    Demand,
    Tenant,
    TenantsRun,
    compare_tenants,
    run_tenants,
    shifted,
)

MiB = 1 << 20


def _wl(seed: int, seconds: float = 30.0, offset: float = 0.0) -> Workload:
    return shifted(generate(seed=seed, duration_s=seconds), offset)


def _assert_conserved(run: TenantsRun) -> None:
    assert run.over_budget == 0
    assert all(sum(row) <= run.rules.budget_bytes for row in run.held_bytes)
    assert list(run.t_s) == sorted(run.t_s)  # one clock, advancing
    for t in run.tenants:  # every request accounted for: served or rejected, none lost
        assert t.served + t.rejected == t.serving.requests


requests = st.lists(
    st.builds(Request, st.floats(0, 20), st.integers(1, 3000), st.integers(1, 400)),
    min_size=1, max_size=40).map(lambda rs: Workload(
        requests=tuple(sorted(rs, key=lambda r: r.arrival_s)), source="hypothesis"))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=requests, b=requests, budget_mib=st.integers(40, 400),
       strategies=st.tuples(st.sampled_from(TENANT_STRATEGIES),
                            st.sampled_from(TENANT_STRATEGIES)),
       answers=st.tuples(st.sampled_from(ANSWERS), st.sampled_from(ANSWERS)),
       reserve_mib=st.integers(0, 64), demand=st.none() | st.tuples(
           st.floats(0, 20), st.integers(1, 200)))
def test_the_tenants_backing_never_exceeds_the_budget_at_any_sample(
        a: Workload, b: Workload, budget_mib: int, strategies: tuple[str, str],
        answers: tuple[str, str], reserve_mib: int, demand: tuple[float, int] | None) -> None:
    budget = budget_mib * MiB
    share = budget // 2
    tenants = [Tenant(name=n, model=m, workload=w, strategy=s, answer=ans,
                      reserve_bytes=reserve_mib * MiB,
                      limit_bytes=share if s == "static" else None)
               for n, m, w, s, ans in zip(("a", "b"), ("llama-3.1-8b", "qwen2.5-7b"), (a, b),
                                          strategies, answers, strict=True)]
    demands = [] if demand is None else [Demand("d", demand[0], demand[1] * MiB)]
    _assert_conserved(run_tenants(tenants, budget_bytes=budget, demands=demands))


def test_a_static_split_serves_each_tenant_exactly_as_alone_on_its_share() -> None:
    budget = 512 * MiB
    a = Tenant("a", "llama-3.1-8b", _wl(1), strategy="static", limit_bytes=budget // 2)
    b = Tenant("b", "qwen2.5-7b", _wl(2, offset=10), strategy="static",
               limit_bytes=budget // 2)
    together = run_tenants([a, b], budget_bytes=budget)
    _assert_conserved(together)
    for t in (a, b):
        alone = run_tenants([t], budget_bytes=budget).tenant(t.name)
        assert together.tenant(t.name).serving == alone.serving


def test_elastic_sharing_serves_at_least_what_a_static_split_does_when_contended() -> None:
    # One contended scenario, pinned: it does not hold for every one (seed 3 at this budget
    # serves 337 elastic against 349 static: qwen takes what llama's large prompts wait for;
    # docs/TENANTS.md), so this guards the measured case, not a law.
    seed = 1
    runs = compare_tenants([Tenant("a", "llama-3.1-8b", _wl(seed, 60)),
                            Tenant("b", "qwen2.5-7b", _wl(seed + 1, 60, offset=30))],
                           budget_bytes=512 * MiB)
    for r in runs.values():
        _assert_conserved(r)
    static = sum(t.served for t in runs["static"].tenants)
    alone = sum(runs[f"alone {n}"].tenants[0].served for n in ("a", "b"))
    assert static < alone  # contended: the split costs requests
    assert sum(t.served for t in runs["elastic"].tenants) >= static


def test_a_mid_trace_step_is_answered_by_refusal_giving_back_idle_or_preempting() -> None:
    wl = _wl(1, 60)
    step = Demand("newcomer", at_s=20.0, nbytes=256 * MiB, patience_s=1.0)
    runs = compare_tenants([Tenant("a", "llama-3.1-8b", wl)], budget_bytes=512 * MiB,
                           demand=step)
    assert set(runs) == set(ANSWERS)
    base = run_tenants([Tenant("a", "llama-3.1-8b", wl)], budget_bytes=512 * MiB).tenants[0]
    for r in runs.values():
        _assert_conserved(r)
    reject, shed, preempt = (runs[k] for k in ANSWERS)
    # refusal: nothing is taken from the tenant, the newcomer gets nothing it did not find
    assert not reject.demands[0].granted and reject.tenants[0].serving == base.serving
    # shedding gives idle backing only: the tenant loses no work to the newcomer
    assert shed.demands[0].peak_held_bytes > 0
    # preemption makes room within the patience, at the tenant's cost
    assert preempt.demands[0].granted
    assert preempt.demands[0].wait_s is not None and preempt.demands[0].wait_s <= 1.0
    assert preempt.tenants[0].preempted > base.preempted
    i = preempt.names.index("newcomer")
    held = [row[i] for t, row in zip(preempt.t_s, preempt.held_bytes, strict=True)
            if t >= 20.0 + preempt.demands[0].wait_s]
    assert held and all(h == step.nbytes for h in held)  # held from the grant on


def test_the_table_fits_100_columns_and_the_chart_has_the_budget_line() -> None:
    runs = compare_tenants([Tenant("llama-3.1-8b", "llama-3.1-8b", _wl(1, 20)),
                            Tenant("qwen2.5-7b#2", "qwen2.5-7b", _wl(2, 20, offset=10))],
                           budget_bytes=256 * MiB)
    text = format_tenants(runs)
    assert max(len(line) for line in text.splitlines()) <= 100
    fig = tenants_figure(runs["elastic"])
    assert [tr.name for tr in fig.data] == ["llama-3.1-8b", "qwen2.5-7b#2", "budget"]
    assert fig.data[-1].y[0] == pytest.approx(256 * MiB / (1 << 30))


@pytest.mark.parametrize("kwargs", [
    {"strategy": "dynamic"}, {"answer": "sleep"}, {"limit_bytes": 0},
    {"reserve_bytes": -1}, {"chunk_bytes": 0}, {"name": ""}])
def test_a_bad_tenant_is_refused_naming_the_value(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"name": "a", "model": "llama-3.1-8b", "workload": _wl(1, 5)}
    args.update(kwargs)
    with pytest.raises(ArgumentError) as e:
        Tenant(**args)  # type: ignore[arg-type]
    assert next(iter(kwargs)) in str(e.value)


def test_bad_runs_are_refused_naming_the_value() -> None:
    t = Tenant("a", "llama-3.1-8b", _wl(1, 5))
    with pytest.raises(ArgumentError, match="tenants"):
        run_tenants([], budget_bytes=MiB)
    with pytest.raises(ArgumentError, match="unique"):
        run_tenants([t, t], budget_bytes=256 * MiB)
    with pytest.raises(ArgumentError, match="limit_bytes"):
        run_tenants([t], budget_bytes=4 * MiB)  # no room for three pages
    with pytest.raises(ArgumentError, match="budget"):
        run_tenants([Tenant("a", "llama-3.1-8b", _wl(1, 5), strategy="static",
                            limit_bytes=200 * MiB),
                     Tenant("b", "llama-3.1-8b", _wl(1, 5), strategy="static",
                            limit_bytes=200 * MiB)], budget_bytes=256 * MiB)
    with pytest.raises(ArgumentError, match="nbytes"):
        Demand("d", 1.0, 0)


def test_the_tenant_flag_parses_models_traces_and_offsets() -> None:
    ts = parse_tenants("llama-3.1-8b:generated,llama-3.1-8b:generated@7.5", seconds=5)
    assert [t.name for t in ts] == ["llama-3.1-8b", "llama-3.1-8b#2"]
    first = min(r.arrival_s for r in ts[1].workload.requests)
    assert first >= 7.5


@pytest.mark.parametrize("argv, says", [
    (["--tenants", "llama-3.1-8b:generated"], "--budget"),
    (["--tenants", "llama-3.1-8b", "--budget", "1GiB"], "MODEL:TRACE"),
    (["--tenants", "nosuch-model:generated", "--budget", "1GiB"], "nosuch-model"),
    (["--tenants", "llama-3.1-8b:generated@soon", "--budget", "1GiB"], "offset"),
    (["--tenants", "llama-3.1-8b:generated@-3", "--budget", "1GiB"], "offset"),
    (["--tenants", "llama-3.1-8b:nosuch.csv", "--budget", "1GiB"], "nosuch.csv"),
    (["--tenants", "llama-3.1-8b:generated", "--budget", "lots"], "lots"),
    (["--tenants", "llama-3.1-8b:generated", "--budget", "1GiB", "--demand", "1GiB"],
     "BYTES@SECONDS"),
    (["--tenants", ",", "--budget", "1GiB"], "MODEL:TRACE"),
    (["generated", "--tenants", "llama-3.1-8b:generated", "--budget", "1GiB"], "not both"),
    ([], "TRACE"),
])
def test_bad_tenant_input_exits_2_with_one_line(argv: list[str], says: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", *argv, "--seconds", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvvmm replay: ") and says in err


def test_the_tenant_replay_prints_strict_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--tenants", "llama-3.1-8b:generated,qwen2.5-7b:generated@5",
            "--budget", "256MiB", "--seconds", "10", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["runs"]) == {"alone llama-3.1-8b", "alone qwen2.5-7b", "static", "elastic"}
    assert all(r["over_budget"] == 0 for r in out["runs"].values())
    assert main([*argv, "--demand", "64MiB@3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["runs"]) == set(ANSWERS)


def test_range_tenants_answer_a_demand_by_trimming_cache_and_reserve_first_within_the_deadline(
) -> None:
    wl = _wl(1, 60)
    step = Demand("newcomer", at_s=20.0, nbytes=128 * MiB, patience_s=1.0)
    tenant = Tenant("a", "llama-3.1-8b", wl, strategy="request-ranges+deferred",
                    reserve_bytes=64 * MiB)
    shed = run_tenants([tenant], budget_bytes=512 * MiB, demands=[step], deadline_s=0.005)
    _assert_conserved(shed)
    d, t = shed.demands[0], shed.tenants[0]
    # the cache and reserve went first, at once, and the demand holds them
    assert d.trim_bytes > 0 and d.peak_held_bytes >= d.trim_bytes
    assert t.trim_bytes >= d.trim_bytes and t.trims >= 1
    # each give-back stops before the unit that would pass the deadline (the sim's clock)
    assert 0 < t.trim_max_s <= 0.005 + t.trim_max_s / max(1, t.trims) + 0.005
    s = shed.summary()["demands"][0]  # type: ignore[index]
    assert s["trim_bytes"] == d.trim_bytes and "request_bytes" in s
    alone = run_tenants([tenant], budget_bytes=512 * MiB).tenants[0]
    assert alone.trim_bytes == 0 and alone.shed_bytes == 0  # nobody asked: nothing trimmed
    text = format_tenants({"shed": shed})
    assert "by trimming its cache and reserve" in text and "trimmed for it at once" in text
    assert max(len(line) for line in text.splitlines()) <= 100

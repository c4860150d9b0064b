"""vLLM 0.34's KV sizing (its extensible KV cache) in the planner and as a lab strategy.

Every expected figure is worked out by hand from the constants in vLLM 0.34's
``vllm/v1/worker/extensible_kv_cache.py`` (on CUDA): ``KV_CACHE_MARGIN_FLOOR_BYTES = 1 GiB``,
``KV_CACHE_MARGIN_FRACTION = 0.75``, ``KV_CACHE_WARMUP_RESERVE_FRACTION = 0.1``; its
``measure_kv_cache_bytes`` (final size), ``committable_blocks`` (what warmup may commit) and
``blocks_within`` / ``physical_bytes_for`` (blocks counted by granule-rounded segments). The
requested memory is the device's total times ``gpu_memory_utilization`` (default 1.0).
"""

from __future__ import annotations

import pytest

from kvvmm.errors import ArgumentError
from kvvmm.hardware import get_profile
from kvvmm.layout import plan, vllm_kv_bytes, vllm_warmup_bytes
from kvvmm.viz import format_plan
from kvvmm.workload import generate, run_workload
from kvvmm.workload.engines import VllmExtensible, VllmMemory
from kvvmm.workload.strategies import STRATEGIES, make_strategy

GiB = 1 << 30
MiB = 1 << 20


def test_the_final_size_is_the_headroom_less_margin_and_peak_when_the_device_binds() -> None:
    # total 80 GiB at utilization 1.0: requested 80 GiB. Started with 79 GiB free; after
    # warmup 30 GiB free with 1 GiB committed: 79 - 30 - 1 = 48 GiB held beside the KV.
    # Peak 4 GiB: margin max(1 GiB floor, 0.75 x 4 = 3 GiB) = 3 GiB.
    # min(80 - 48 = 32, 30 + 1 - 3 = 28) - max(4, 0) = 24 GiB.
    assert vllm_kv_bytes(init_free_bytes=79 * GiB, free_bytes=30 * GiB, committed_bytes=GiB,
                         requested_bytes=80 * GiB, transient_peak_bytes=4 * GiB) == 24 * GiB


def test_a_small_peak_keeps_the_one_gib_floor() -> None:
    # peak 1 GiB: margin max(1 GiB, 0.75 GiB) = 1 GiB (the floor); min(32, 31 - 1) - 1 = 29 GiB.
    assert vllm_kv_bytes(init_free_bytes=79 * GiB, free_bytes=30 * GiB, committed_bytes=GiB,
                         requested_bytes=80 * GiB, transient_peak_bytes=GiB) == 29 * GiB


def test_a_lower_utilization_binds_before_the_device() -> None:
    # utilization 0.7 of 80 GiB: requested 56 GiB; 56 - 48 = 8 GiB < 28 GiB; 8 - 4 = 4 GiB.
    assert vllm_kv_bytes(init_free_bytes=79 * GiB, free_bytes=30 * GiB, committed_bytes=GiB,
                         requested_bytes=56 * GiB, transient_peak_bytes=4 * GiB) == 4 * GiB


def test_torchs_reservation_growth_is_kept_free_when_it_exceeds_the_peak() -> None:
    # growth 6 GiB > peak 4 GiB: the margin stays 3 GiB (from the peak), 28 - 6 = 22 GiB.
    assert vllm_kv_bytes(init_free_bytes=79 * GiB, free_bytes=30 * GiB, committed_bytes=GiB,
                         requested_bytes=80 * GiB, transient_peak_bytes=4 * GiB,
                         torch_reserve_growth_bytes=6 * GiB) == 22 * GiB


def test_a_device_too_full_for_the_margin_gets_nothing_and_bad_figures_are_refused() -> None:
    # 2 GiB free, nothing committed, peak 4 GiB: 2 - 3 - 4 < 0, so 0.
    assert vllm_kv_bytes(init_free_bytes=79 * GiB, free_bytes=2 * GiB, committed_bytes=0,
                         requested_bytes=80 * GiB, transient_peak_bytes=4 * GiB) == 0
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ArgumentError):
            vllm_kv_bytes(init_free_bytes=bad, free_bytes=0, committed_bytes=0,  # type: ignore[arg-type]
                          requested_bytes=0)


def test_warmup_keeps_back_a_tenth_of_the_headroom_or_the_peak_and_a_margin_of_that() -> None:
    # 30 GiB free + 1 GiB committed: headroom 31 GiB = 33285996544 bytes. Peak 2 GiB is below
    # a tenth of it: reserve int(33285996544 x 0.1) = 3328599654; margin max(1 GiB,
    # int(3328599654 x 0.75) = 2496449740) = 2496449740.
    # 33285996544 - 2496449740 - 3328599654 = 27460947150.
    assert vllm_warmup_bytes(free_bytes=30 * GiB, committed_bytes=GiB,
                             transient_peak_bytes=2 * GiB) == 27460947150
    # Peak 8 GiB above the tenth: reserve 8 GiB, margin 6 GiB: 31 - 6 - 8 = 17 GiB.
    assert vllm_warmup_bytes(free_bytes=30 * GiB, committed_bytes=GiB,
                             transient_peak_bytes=8 * GiB) == 17 * GiB


def test_the_planner_sizes_vllms_default_beside_sglangs() -> None:
    # free 40 GiB after weights and capture, nothing committed, peak 4 GiB, on a device that
    # started with all of it free (init_free = capacity): beside KV = capacity - 40 GiB;
    # min(capacity - (capacity - 40), 40 - 3) - 4 = 37 - 4 = 33 GiB.
    p = plan(gpu="h100", model="qwen2.5-7b", engine="vllm", free_bytes=40 * GiB,
             activation_peak_bytes=4 * GiB)
    assert p.engine == "vllm" and p.budget_bytes == 33 * GiB and p.headroom_bytes == 7 * GiB
    assert p.gpu_memory_utilization == 1.0 and p.mem_fraction_static is None
    assert p.tokens == 33 * GiB // p.bytes_per_token // 16 * 16
    # utilization 0.6: requested int(capacity x 0.6), less capacity - 40 GiB beside the KV.
    cap = get_profile("h100").capacity_bytes
    half = plan(gpu="h100", model="qwen2.5-7b", engine="vllm", free_bytes=40 * GiB,
                activation_peak_bytes=4 * GiB, gpu_memory_utilization=0.6)
    assert half.budget_bytes == min(int(cap * 0.6) - (cap - 40 * GiB), 37 * GiB) - 4 * GiB
    sglang = plan(gpu="h100", model="qwen2.5-7b", free_bytes=40 * GiB)
    assert sglang.engine == "sglang" and sglang.gpu_memory_utilization is None
    # The plan's text names vLLM's rule, not SGLang's formula, and its 4 GiB peak.
    text = format_plan(p)
    assert "vLLM's extensible KV cache" in text and "peak 4.0 GiB" in text
    assert "mem_fraction_static" not in text and "max(0, free - headroom)" not in text


@pytest.mark.parametrize("options", [
    {"engine": "tgi"},
    {"engine": "vllm", "headroom_bytes": GiB},
    {"engine": "vllm", "mem_fraction_static": 0.9},
    {"activation_peak_bytes": GiB},
    {"gpu_memory_utilization": 0.9},
    {"engine": "vllm", "gpu_memory_utilization": 0},
    {"engine": "vllm", "gpu_memory_utilization": 1.5},
    {"engine": "vllm", "activation_peak_bytes": -1},
    {"engine": "vllm", "budget_bytes": GiB, "activation_peak_bytes": GiB},
])
def test_an_option_of_the_other_engines_rule_or_out_of_range_is_refused(
        options: dict[str, object]) -> None:
    with pytest.raises(ArgumentError):
        plan(gpu="h100", model="qwen2.5-7b", **options)  # type: ignore[arg-type]


# -- the lab strategy --------------------------------------------------------------------------

#: qwen2.5-7b at TP 1 in bf16: 28 layers x (K, V) = 56 buffers; a page of 16 tokens is
#: 16 x 4 KV heads x 128 x 2 bytes = 16 KiB per buffer, 128 pages per 2 MiB granule.
SETUP = {"model": "qwen2.5-7b", "tp": 1, "pool_tokens": 4096 * 16}
#: total 80 GiB, started with all of it free, 70 GiB beside the KV, peak 4 GiB: headroom
#: 10 GiB, margin 3 GiB; min(80 - 70, 10 - 3) - 4 = 3 GiB for the KV.
MEMORY = VllmMemory(total_bytes=80 * GiB, init_free_bytes=80 * GiB,
                    beside_kv_bytes=70 * GiB, transient_peak_bytes=4 * GiB)
#: The most pages in 3 GiB = 3072 MiB, each of 56 buffers rounded to 2 MiB granules:
#: 56 x ceil(n / 128) x 2 MiB <= 3072 MiB gives ceil(n / 128) <= 27, so n = 27 x 128 = 3456.
FINAL_PAGES = 3456


def test_the_strategy_extends_once_to_vllms_measured_size_and_serves_within_it() -> None:
    assert "vllm-extensible" in STRATEGIES
    assert isinstance(make_strategy("vllm-extensible"), VllmExtensible)
    wl = generate(seed=3, duration_s=5.0, rate_scale=2.0)
    strat = VllmExtensible(MEMORY, warmup_pages=256)
    cmp = run_workload(wl, [strat, "request-ranges", "prefix"], **SETUP)  # type: ignore[arg-type]
    assert strat.warmup_committed_pages == 256 and strat.final_pages == FINAL_PAGES
    v = cmp.result("vllm-extensible")
    assert v.used_over_backed == 0 and v.conservation_errors == 0
    assert max(v.timeline.high_water_pages) <= FINAL_PAGES
    # Held from the extend on, unchanged while serving: 3456 pages, 27 granules in each of
    # the 56 buffers, what vLLM counts.
    assert set(v.timeline.backed_bytes) == {56 * 27 * 2 * MiB}
    assert v.decode_driver_calls == 0
    for other in ("request-ranges", "prefix"):  # kvvmm's elastic ones hold less
        assert cmp.result(other).mean_backed_bytes < v.mean_backed_bytes


def test_warmup_that_committed_past_the_measured_size_is_cut_back_to_it() -> None:
    # No peak, torch's reservation grew 8 GiB. Warmup: headroom 10 GiB, reserve
    # max(0, 0.1 x 10 GiB) = 1 GiB, margin max(1 GiB, 0.75 GiB) = 1 GiB: 8 GiB, and
    # 56 x ceil(n / 128) x 2 MiB <= 8192 MiB allows 73 x 128 = 9344 pages: the pool's 4096.
    # Final: margin 1 GiB (floor), min(80 - 70, 10 - 1) - max(0, 8) = 1 GiB, and
    # 56 x ceil(n / 128) x 2 MiB <= 1024 MiB gives ceil(n / 128) <= 9: n = 1152.
    small = VllmMemory(total_bytes=80 * GiB, init_free_bytes=80 * GiB,
                       beside_kv_bytes=70 * GiB, torch_reserve_growth_bytes=8 * GiB)
    strat = VllmExtensible(small)
    wl = generate(seed=3, duration_s=5.0, rate_scale=2.0)
    (r,) = run_workload(wl, [strat], **SETUP).results  # type: ignore[arg-type]
    assert strat.warmup_committed_pages == 4096 and strat.final_pages == 1152
    assert r.used_over_backed == 0 and max(r.timeline.high_water_pages) <= 1152
    assert set(r.timeline.backed_bytes) == {56 * 9 * 2 * MiB}  # 1152 pages: 9 granules each


def test_bad_memory_figures_are_refused() -> None:
    for bad in ({"total_bytes": 0, "init_free_bytes": 0},
                {"total_bytes": GiB, "init_free_bytes": 2 * GiB},
                {"total_bytes": GiB, "init_free_bytes": GiB, "beside_kv_bytes": 2 * GiB},
                {"total_bytes": GiB, "init_free_bytes": GiB, "gpu_memory_utilization": 0.0},
                {"total_bytes": GiB, "init_free_bytes": GiB, "transient_peak_bytes": -1}):
        with pytest.raises(ArgumentError):
            VllmMemory(**bad)  # type: ignore[arg-type]
    for kw in ({"warmup_pages": 0}, {"warmup_pages": True}, {"memory": 80 * GiB}):
        with pytest.raises(ArgumentError):
            VllmExtensible(**kw)  # type: ignore[arg-type]

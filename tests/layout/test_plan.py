"""kvvmm.plan: the capacity planner's invariants, its arithmetic, its report, bad options."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvvmm.errors import ArgumentError, KvvmmError, OutOfRangeError, UnknownDtypeError
from kvvmm.hardware import PROFILES
from kvvmm.layout import (
    DEFAULT_MEM_FRACTION_STATIC,
    LARGE_TOKENS,
    TP_SIZES,
    Plan,
    PlanOptions,
    PoolPlan,
    default_policies,
    hybrid_swa_descs,
    list_models,
    load_model,
    model_descs,
    plan,
    plan_smallest_tp,
    weights_bytes_per_rank,
)
from kvvmm.policy import Chunked, Exact, Geometric
from kvvmm.units import GiB, MiB, TiB, align_up
from kvvmm.viz import format_plan


def _final_backed(p: Plan, pool: PoolPlan, tokens: int) -> int:
    """What finalize(tokens) backs in ``pool``, recomputed from the layout presets."""
    m = load_model(p.model)
    kw: dict[str, Any] = dict(page_size=p.page_size, dtype=p.dtype, tp=p.tp, layout=p.layout)
    if m.is_hybrid_swa:
        full, swa = hybrid_swa_descs(
            m, reserved_tokens=max(tokens, pool.tokens), swa_reserved_tokens=p.pools[1].tokens,
            **kw,
        )  # fmt: skip
        descs = full if pool.name == "full" else swa
    else:
        descs = model_descs(m, reserved_tokens=tokens, **kw)
    gran = p.granularity_bytes
    return sum(align_up(d.final_span_bytes(tokens, p.page_size), gran) for d in descs)


# -- the invariant -----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpu=st.sampled_from(sorted(PROFILES)),
    model=st.sampled_from(list_models()),
    page=st.sampled_from([1, 2, 16, 32, 64, 100, 256]),
    tp=st.sampled_from([1, 2, 4, 8]),
    layout=st.sampled_from(["token_major", "page_major"]),
    count_overhead=st.booleans(),
    fraction=st.floats(0.0, 1.0),
)
def test_tokens_fill_the_budget_to_within_one_page_on_every_gpu(
    gpu: str, model: str, page: int, tp: int, layout: str, count_overhead: bool, fraction: float
) -> None:
    budget = int(PROFILES[gpu].capacity_bytes * fraction)
    try:
        p = plan(gpu=gpu, model=model, page_size=page, tp=tp, budget_bytes=budget,
                 layout=layout, count_overhead=count_overhead)  # fmt: skip
    except OutOfRangeError as e:
        # Only a budget too small for one page (or for the sliding pool) is refused.
        assert e.name in ("budget_bytes", "swa_reserved_tokens")
        assert budget < 2 * GiB
        return
    full = p.pools[0]
    bpt, tokens = full.bytes_per_token, full.tokens
    assert tokens > 0 and tokens % page == 0
    assert (p.tokens, p.bytes_per_token) == (tokens, bpt)
    if count_overhead:
        assert full.final_backed_bytes <= full.budget_bytes
        assert _final_backed(p, full, tokens + page) > full.budget_bytes
        assert p.over_budget_bytes == 0 and p.final_backed_bytes <= p.budget_bytes
    else:
        assert tokens * bpt <= full.budget_bytes < (tokens + page) * bpt
        assert p.over_budget_bytes == max(0, p.final_backed_bytes - p.budget_bytes)
    if len(p.pools) == 1:
        assert full.budget_bytes == p.budget_bytes
        # non-hybrid, token slots only: the invariant holds on the plan's own budget
        if not count_overhead:
            assert p.tokens * p.bytes_per_token <= p.budget_bytes
            assert p.budget_bytes < (p.tokens + p.page_size) * p.bytes_per_token
    else:
        swa = p.pools[1]
        assert full.budget_bytes + swa.budget_bytes == p.budget_bytes
        assert swa.tokens <= tokens
    for pool in p.pools:
        assert pool.final_backed_bytes == _final_backed(p, pool, pool.tokens)
        assert pool.final_backed_bytes % p.granularity_bytes == 0
        assert pool.va_reserve_bytes % p.granularity_bytes == 0
        assert pool.va_reserve_bytes >= pool.final_backed_bytes >= pool.final_span_bytes
        assert pool.final_span_bytes >= pool.logical_bytes == pool.tokens * pool.bytes_per_token
        assert 0 <= pool.granularity_waste_bytes < pool.num_buffers * p.granularity_bytes
        assert 0 <= pool.va_slack_bytes < pool.num_buffers * p.granularity_bytes
        for h in pool.handles:
            # reserved == tokens: every policy ends exactly at what finalize backs
            assert h.backed_bytes == pool.final_backed_bytes
            assert h.handles >= pool.num_buffers


# -- arithmetic --------------------------------------------------------------------------------


def test_80_gib_holds_655360_llama_8b_tokens() -> None:
    p = plan(gpu="h200", model="llama-3.1-8b", budget_bytes=80 * GiB, page_size=16)
    assert p.bytes_per_token == 131072
    assert p.tokens == 80 * GiB // 131072 == 655_360


def test_the_budget_is_free_minus_headroom_plus_backed_as_sglang_sizes_after_capture() -> None:
    p = plan(gpu="h100", model="llama-3.1-8b", free_bytes=60 * GiB, headroom_bytes=5 * GiB,
             backed_bytes=2 * MiB)  # fmt: skip
    assert p.budget_bytes == 60 * GiB - 5 * GiB + 2 * MiB
    assert (p.free_bytes, p.headroom_bytes, p.backed_bytes) == (60 * GiB, 5 * GiB, 2 * MiB)


def test_free_defaults_to_the_device_less_the_weights_and_headroom_to_mem_fraction() -> None:
    p = plan(gpu="h200", model="qwen2.5-7b")
    cap = PROFILES["h200"].capacity_bytes
    weights = weights_bytes_per_rank("qwen2.5-7b", "bfloat16", 1)
    assert weights is not None and p.weights_bytes == weights and p.weights_dtype == "bfloat16"
    assert p.free_bytes == cap - weights and p.capacity_bytes == cap
    assert p.mem_fraction_static == DEFAULT_MEM_FRACTION_STATIC == 0.9
    assert p.headroom_bytes == round(cap * (1 - 0.9))
    assert p.budget_bytes == p.memory_budget_bytes == cap - weights - p.headroom_bytes
    assert p.warnings == ()


# Published parameter counts (model cards / HF "Model size"), text decoder only:
# Llama-3.1-8B 8.03B, Llama-3.1-70B 70.6B (Meta's model cards), Mistral-7B-v0.3 7.25B,
# Qwen2.5-7B 7.61B (Qwen2.5 report: 7.61B), DeepSeek-V3 671B without its 14B MTP module
# (DeepSeek-V3 technical report), gpt-oss-120b 117B (OpenAI's model card: 116.8B),
# Gemma-3-27B's text part ~27.0B (27.4B with the 0.4B SigLIP vision tower).
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "mistral-7b": 7.25e9,
    "qwen2.5-7b": 7.61e9,
    "deepseek-v3": 671e9,
    "gpt-oss-120b": 116.8e9,
    "gemma-3-27b": 27.0e9,
}


@pytest.mark.parametrize("key", sorted(PUBLISHED_PARAMETERS))
def test_weights_of_every_shipped_model_are_within_2_percent_of_the_published_size(
    key: str,
) -> None:
    assert sorted(PUBLISHED_PARAMETERS) == list_models()
    count = load_model(key).parameter_count
    assert count is not None
    assert abs(count / PUBLISHED_PARAMETERS[key] - 1) < 0.02, count
    assert weights_bytes_per_rank(key, "bfloat16", 1) == 2 * count
    assert weights_bytes_per_rank(key, "float8_e4m3fn", 4) == -(-count // 4)


def test_llama_70b_on_eight_h200s_leaves_room_for_weights_and_headroom() -> None:
    # Not the whole card less 4 GiB (3.56M tokens), which leaves no room for the weights.
    p = plan(gpu="h200", model="llama-3.1-70b", tp=8)
    cap = PROFILES["h200"].capacity_bytes
    assert p.weights_bytes is not None and 16 * GiB < p.weights_bytes < 17 * GiB
    assert p.headroom_bytes == round(cap * (1 - 0.9))
    assert p.budget_bytes == cap - p.weights_bytes - p.headroom_bytes
    assert p.bytes_per_token == 80 * 2 * 1 * 128 * 2  # one KV head per rank
    assert p.tokens == 2_867_664
    assert p.tokens * p.bytes_per_token <= p.budget_bytes < (p.tokens + 16) * p.bytes_per_token


def test_a_lower_mem_fraction_keeps_more_headroom_and_fewer_tokens() -> None:
    high = plan(gpu="h200", model="llama-3.1-8b", mem_fraction_static=0.9)
    low = plan(gpu="h200", model="llama-3.1-8b", mem_fraction_static=0.7)
    assert low.headroom_bytes is not None and high.headroom_bytes is not None
    assert low.headroom_bytes > high.headroom_bytes and low.tokens < high.tokens


def test_measured_free_memory_already_excludes_the_weights() -> None:
    p = plan(gpu="h200", model="llama-3.1-8b", free_bytes=100 * GiB, headroom_bytes=10 * GiB)
    assert p.budget_bytes == 90 * GiB and p.mem_fraction_static is None
    assert p.weights_bytes is not None  # reported, not subtracted again


def test_fp8_weights_take_half_the_memory_and_leave_more_for_kv() -> None:
    bf16 = plan(gpu="h200", model="llama-3.1-70b", tp=4)
    fp8 = plan(gpu="h200", model="llama-3.1-70b", tp=4, weights_dtype="float8_e4m3fn")
    assert bf16.weights_bytes == 2 * (fp8.weights_bytes or 0)
    assert fp8.tokens > bf16.tokens


def test_the_token_cap_caps_the_budget_as_sglang_max_total_tokens_does() -> None:
    p = plan(gpu="h200", model="llama-3.1-8b", max_total_tokens=100_003)
    assert p.tokens == 100_000 and p.max_total_tokens == 100_003
    assert p.budget_bytes == 100_000 * 131072 < p.memory_budget_bytes
    strict = plan(gpu="h200", model="llama-3.1-8b", max_total_tokens=100_000,
                  count_overhead=True)  # fmt: skip
    assert strict.tokens == 100_000 and strict.over_budget_bytes == 0


def test_a_config_without_sizes_plans_on_the_whole_device_with_a_warning() -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}
    p = plan(gpu="h100", model=cfg)
    assert p.weights_bytes is None and p.free_bytes == p.capacity_bytes
    assert len(p.warnings) == 1 and "weights are not counted" in p.warnings[0]


def test_absurd_reservations_warn_in_the_plan_and_the_report() -> None:
    # 2**35 slots of 40 KiB (70B at tp 8) reserve 1280 TiB of VA: both limits are crossed.
    p = plan(gpu="h200", model="llama-3.1-70b", tp=8, reserved_tokens=16 * LARGE_TOKENS)
    assert p.va_reserve_bytes > 1024 * TiB and len(p.warnings) == 2
    assert "VA reservation" in p.warnings[0] and "2**31" in p.warnings[1]
    text = format_plan(p)
    assert all(f"warning: {w}" in text for w in p.warnings)
    assert plan(gpu="h200", model="llama-3.1-70b", tp=8).warnings == ()


def test_weights_larger_than_the_device_ask_for_more_tensor_parallel_ranks() -> None:
    with pytest.raises(OutOfRangeError) as e:
        plan(gpu="h200", model="deepseek-v3")
    assert e.value.name == "tp" and "weights" in str(e.value)


def test_an_explicit_budget_reports_no_free_or_headroom() -> None:
    p = plan(gpu="h200", model="qwen2.5-7b", budget_bytes=10 * GiB)
    assert p.budget_bytes == 10 * GiB and p.free_bytes is None and p.headroom_bytes is None


def test_granularity_rounding_comes_on_top_unless_counted() -> None:
    # 64 buffers of 2 KiB rows: 8192 + 16 tokens -> 16.03 MiB each -> 18 MiB backed each.
    loose = plan(gpu="h200", model="llama-3.1-8b", budget_bytes=8192 * 131072, page_size=16)
    assert loose.tokens == 8192
    assert loose.final_backed_bytes == 64 * 18 * MiB
    assert loose.padding_bytes == 64 * 16 * 2048
    assert loose.granularity_waste_bytes == 64 * (18 * MiB - (8192 + 16) * 2048)
    assert loose.over_budget_bytes == 64 * 18 * MiB - 8192 * 131072
    strict = plan(gpu="h200", model="llama-3.1-8b", budget_bytes=8192 * 131072, page_size=16,
                  count_overhead=True)  # fmt: skip
    # 1 GiB over 64 buffers is 16 MiB each; with the padded page, (t + 16) * 2 KiB <= 16 MiB
    assert strict.tokens == 8192 - 16 and strict.over_budget_bytes == 0
    assert strict.final_backed_bytes <= strict.budget_bytes


def test_va_covers_a_larger_upper_bound_without_changing_the_tokens() -> None:
    base = plan(gpu="h200", model="llama-3.1-8b", budget_bytes=20 * GiB)
    wide = plan(gpu="h200", model="llama-3.1-8b", budget_bytes=20 * GiB, reserved_tokens=10**6)
    assert wide.tokens == base.tokens and wide.pools[0].reserved_tokens == 10**6
    assert wide.va_reserve_bytes == 64 * align_up((10**6 + 16) * 2048, 2 * MiB)
    assert wide.final_backed_bytes == base.final_backed_bytes


def test_handle_counts_follow_each_policy_for_decode_growth() -> None:
    # 8192 tokens in 4096-token steps, 2 KiB per token per buffer, 2 MiB granularity:
    # Exact makes 2 MiB (slot-0 page), 6 MiB (to 8 MiB), 8 MiB (to 16 MiB), 2 MiB (final
    # padded page -> 18 MiB): 4 handles per buffer. Chunked(64 MiB) backs the whole 18 MiB
    # buffer at once.
    p = plan(gpu="h200", model="llama-3.1-8b", budget_bytes=8192 * 131072, page_size=16,
             policy=[Exact(), Chunked(64 * MiB)], decode_step_tokens=4096)  # fmt: skip
    exact, chunked = p.handles
    assert (exact.policy, exact.handles, exact.min_handle_bytes, exact.max_handle_bytes) == (
        "Exact()", 4 * 64, 2 * MiB, 8 * MiB)  # fmt: skip
    assert (chunked.handles, chunked.min_handle_bytes, chunked.max_handle_bytes) == (
        64, 18 * MiB, 18 * MiB)  # fmt: skip
    assert exact.backed_bytes == chunked.backed_bytes == 64 * 18 * MiB


def test_bigger_handles_mean_fewer_handles() -> None:
    policies = [Exact(), Chunked(64 * MiB), Chunked(128 * MiB), Geometric(2.0, 256 * MiB)]
    p = plan(gpu="h200", model="llama-3.1-70b", tp=8, policy=policies)
    by = {h.policy: h.handles for h in p.handles}
    assert list(by) == ["Exact()", "Chunked(64.0 MiB)", "Chunked(128.0 MiB)",
                        "Geometric(2, 256.0 MiB)"]
    assert by["Exact()"] > by["Chunked(64.0 MiB)"] > by["Chunked(128.0 MiB)"]
    assert by["Chunked(64.0 MiB)"] > by["Geometric(2, 256.0 MiB)"]


def test_the_default_policies_are_reported_in_their_order() -> None:
    p = plan(gpu="h200", model="llama-3.1-70b", tp=8)
    assert [h.policy for h in p.handles] == [str(x) for x in default_policies()]


def test_a_single_policy_is_reported_alone() -> None:
    p = plan(gpu="h100", model="mistral-7b", policy=Geometric(4.0, 512 * MiB))
    assert [h.policy for h in p.handles] == ["Geometric(4, 512.0 MiB)"]


def test_hybrid_models_report_a_full_pool_and_a_sliding_pool() -> None:
    p = plan(gpu="h200", model="gpt-oss-120b", budget_bytes=50 * GiB, page_size=16)
    full, swa = p.pools
    assert (full.name, full.num_layers, full.num_buffers) == ("full", 18, 36)
    assert (swa.name, swa.num_layers, swa.tokens) == ("swa", 18, 144)
    assert swa.budget_bytes == 144 * 36864
    assert full.tokens == (50 * GiB - 144 * 36864) // 36864 // 16 * 16
    assert p.num_buffers == 72


def test_a_sliding_pool_for_many_sequences_leaves_less_for_the_full_pool() -> None:
    one = plan(gpu="h200", model="gemma-3-27b", budget_bytes=60 * GiB)
    many = plan(gpu="h200", model="gemma-3-27b", budget_bytes=60 * GiB,
                swa_reserved_tokens=64 * 1040)  # fmt: skip
    assert many.pools[1].tokens == 64 * 1040
    assert many.tokens < one.tokens


def test_the_report_names_the_model_the_pools_and_the_policies() -> None:
    p = plan(gpu="h200", model="gemma-3-27b", tp=2, layout="page_major")
    text = format_plan(p)
    for part in ("gemma-3-27b", "NVIDIA H200", "page_major", "full", "swa", "Exact()",
                 "Chunked(64.0 MiB)", "GiB", f"{p.tokens:,}"):  # fmt: skip
        assert part in text, part


def test_the_plan_converts_to_json_and_keeps_its_figures() -> None:
    p = plan(gpu="b200", model="deepseek-v3", dtype="float8_e4m3fn", tp=8,
             weights_dtype="float8_e4m3fn")  # fmt: skip
    d = json.loads(json.dumps(p.to_dict()))
    assert d["weights_bytes"] == p.weights_bytes and d["warnings"] == []
    assert d["tokens"] == p.tokens and d["bytes_per_token"] == 61 * 576
    assert d["pools"][0]["handles"][0]["policy"] == "Exact()"
    assert isinstance(d["handles"], list)


def test_torch_dtype_objects_plan_like_their_names() -> None:
    torch = pytest.importorskip("torch")
    assert plan(gpu="h200", model="llama-3.1-8b", dtype=torch.float16) == plan(
        gpu="h200", model="llama-3.1-8b", dtype="float16"
    )


# -- bad options -------------------------------------------------------------------------------

_OK: dict[str, Any] = dict(gpu="h200", model="llama-3.1-8b")
_CAP = PROFILES["h200"].capacity_bytes

BAD_PLANS: list[tuple[str, dict[str, Any], type[KvvmmError], str]] = [
    ("unknown gpu", {"gpu": "a100"}, ArgumentError, "profile"),
    ("unknown model", {"model": "llama-9"}, ArgumentError, "model"),
    ("unknown dtype", {"dtype": "float64"}, UnknownDtypeError, "dtype"),
    ("zero page size", {"page_size": 0}, ArgumentError, "page_size"),
    ("bool page size", {"page_size": True}, ArgumentError, "page_size"),
    ("zero tp", {"tp": 0}, ArgumentError, "tp"),
    ("tp not fitting 8 KV heads", {"tp": 3}, ArgumentError, "tp"),
    ("negative budget", {"budget_bytes": -1}, ArgumentError, "budget_bytes"),
    ("budget beyond the device", {"budget_bytes": _CAP + 1}, OutOfRangeError, "budget_bytes"),
    ("budget and free together", {"budget_bytes": GiB, "free_bytes": GiB}, ArgumentError,
     "budget_bytes"),
    ("budget and headroom together", {"budget_bytes": GiB, "headroom_bytes": 0}, ArgumentError,
     "budget_bytes"),
    ("budget and mem fraction together", {"budget_bytes": GiB, "mem_fraction_static": 0.8},
     ArgumentError, "budget_bytes"),
    ("headroom and mem fraction together", {"headroom_bytes": GiB, "mem_fraction_static": 0.8},
     ArgumentError, "headroom_bytes"),
    ("mem fraction above one", {"mem_fraction_static": 1.5}, ArgumentError,
     "mem_fraction_static"),
    ("mem fraction zero", {"mem_fraction_static": 0.0}, ArgumentError, "mem_fraction_static"),
    ("mem fraction as a string", {"mem_fraction_static": "0.9"}, ArgumentError,
     "mem_fraction_static"),
    ("unknown weights dtype", {"weights_dtype": "int3"}, UnknownDtypeError, "dtype"),
    ("zero token cap", {"max_total_tokens": 0}, ArgumentError, "max_total_tokens"),
    ("token cap under a page", {"max_total_tokens": 15}, OutOfRangeError, "max_total_tokens"),
    ("free beyond the device", {"free_bytes": _CAP + 1}, OutOfRangeError, "free_bytes"),
    ("negative free", {"free_bytes": -1}, ArgumentError, "free_bytes"),
    ("negative headroom", {"headroom_bytes": -1}, ArgumentError, "headroom_bytes"),
    ("negative backed", {"backed_bytes": -1}, ArgumentError, "backed_bytes"),
    ("free plus backed beyond the device", {"free_bytes": _CAP, "backed_bytes": 2 * MiB},
     OutOfRangeError, "backed_bytes"),
    ("headroom eating the device", {"headroom_bytes": _CAP}, OutOfRangeError, "budget_bytes"),
    ("budget under one page", {"budget_bytes": 16 * 131072 - 1}, OutOfRangeError,
     "budget_bytes"),
    ("unknown layout", {"layout": "nhd"}, ArgumentError, "layout"),
    ("policy by name", {"policy": "exact"}, ArgumentError, "policy"),
    ("no policies", {"policy": []}, ArgumentError, "policy"),
    ("zero decode step", {"decode_step_tokens": 0}, ArgumentError, "decode_step_tokens"),
    ("reservation below the tokens", {"budget_bytes": GiB, "reserved_tokens": 16},
     OutOfRangeError, "reserved_tokens"),
    ("count_overhead as a string", {"count_overhead": "yes"}, ArgumentError, "count_overhead"),
    ("sliding pool for a dense model", {"swa_reserved_tokens": 1024}, ArgumentError,
     "swa_reserved_tokens"),
    ("zero sliding pool", {"model": "gpt-oss-120b", "swa_reserved_tokens": 0}, ArgumentError,
     "swa_reserved_tokens"),
    ("sliding pool beyond the full pool", {"model": "gpt-oss-120b", "budget_bytes": GiB,
                                           "swa_reserved_tokens": 20_000}, OutOfRangeError,
     "swa_reserved_tokens"),
    ("an option plan does not have", {"pages": 16}, ArgumentError, "option"),
    ("vLLM's option under SGLang's rule", {"activation_peak_bytes": GiB}, ArgumentError,
     "activation_peak_bytes"),
    ("every layer sliding", {"model": {"num_hidden_layers": 2, "num_attention_heads": 4,
                                       "head_dim": 8, "sliding_window": 8,
                                       "layer_types": ["sliding_attention"] * 2}},
     ArgumentError, "model"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [pytest.param(o, e, n, id=i) for i, o, e, n in BAD_PLANS],
)
def test_bad_plan_options_raise_a_typed_error_naming_the_option(
    options: dict[str, Any], error: type[KvvmmError], name: str
) -> None:
    with pytest.raises(error) as e:
        plan(**{**_OK, **options})
    assert isinstance(e.value, ArgumentError) and e.value.name == name
    assert "must be" in str(e.value)


@pytest.mark.parametrize(("options", "name"), [
    ({"page_size": 0}, "page_size"), ({"dtype": "float64"}, "dtype"),
    ({"budget_bytes": GiB, "backed_bytes": 1}, "budget_bytes"),
    ({"engine": "vllm", "mem_fraction_static": 0.8}, "mem_fraction_static"),
])
def test_the_options_record_refuses_a_bad_option_before_any_device_or_model_is_read(
    options: dict[str, Any], name: str
) -> None:
    with pytest.raises(ArgumentError) as e:
        PlanOptions(**options)
    assert e.value.name == name


def test_keywords_change_the_options_record_plan_is_given() -> None:
    base = PlanOptions(page_size=32, tp=2)
    assert base.policy == default_policies() and base.dtype == "bfloat16"
    p = plan(gpu="h200", model="llama-3.1-70b", options=base, tp=4)
    assert (p.page_size, p.tp) == (32, 4)
    assert p == plan(gpu="h200", model="llama-3.1-70b", page_size=32, tp=4)
    assert base.tp == 2  # the record given is not changed


def test_a_budget_too_small_says_how_it_was_computed() -> None:
    with pytest.raises(OutOfRangeError) as e:
        plan(gpu="h100", model="llama-3.1-70b", free_bytes=3 * GiB, headroom_bytes=3 * GiB)
    msg = str(e.value)
    assert "free 3.0 GiB - headroom 3.0 GiB" in msg and "327680 bytes per token" in msg


def test_weights_are_counted_in_the_dtype_the_models_config_ships_them_in() -> None:
    """DeepSeek-V3's config quantizes its weights to fp8 (e4m3): 8 x H200 hold them, as they
    do in practice; counted in bf16 they would not."""
    from kvvmm.layout import load_model

    assert load_model("deepseek-v3").weights_dtype == "float8_e4m3fn"
    assert load_model("llama-3.1-8b").weights_dtype == "bfloat16"
    p = plan(gpu="h200", model="deepseek-v3", tp=8)
    assert p.weights_dtype == "float8_e4m3fn"
    assert p.weights_bytes == plan(gpu="h200", model="deepseek-v3", tp=8,
                                   weights_dtype="float8_e4m3fn").weights_bytes
    with pytest.raises(OutOfRangeError):
        plan(gpu="h200", model="deepseek-v3", tp=8, weights_dtype="bfloat16")
    assert plan(gpu="h200", model="llama-3.1-8b").weights_dtype == "bfloat16"
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
           "quantization_config": {"quant_method": "mxfp4"}}
    assert load_model(cfg, name="four-bit").weights_dtype is None  # not a dtype kvvmm counts


@pytest.mark.parametrize("kw", [{}, {"budget_bytes": 10 * GiB}, {"model": "deepseek-v3", "tp": 8},
                                {"model": "gemma-3-27b"}])
def test_the_plan_table_fits_100_columns_and_says_where_over_budget_bytes_come_from(
        kw: dict[str, object]) -> None:
    from kvvmm.viz import format_plan

    args: dict[str, object] = {"gpu": "h200", "model": "llama-3.1-8b", **kw}
    p = plan(**args)  # type: ignore[arg-type]
    text = format_plan(p)
    wide = [line for line in text.splitlines() if len(line) > 100]
    assert not wide, wide
    if p.over_budget_bytes:
        assert "padded page and granule rounding" in text
        assert ("safe: it comes out of" in text) if p.headroom_bytes is not None \
            else ("on top of the explicit budget" in text)


# -- plan_smallest_tp: the smallest TP at which a model fits (notebook 02's) -------


def test_a_model_that_fits_one_gpu_is_planned_at_tp_one_as_plan_plans_it() -> None:
    got = plan_smallest_tp(gpu="h200", model="llama-3.1-8b", page_size=64)
    assert got == plan(gpu="h200", model="llama-3.1-8b", page_size=64, tp=1)


def test_a_tp_whose_weights_do_not_fit_is_skipped_for_the_next_larger_one() -> None:
    with pytest.raises(OutOfRangeError) as e:
        plan(gpu="h200", model="deepseek-v3", tp=4)
    assert e.value.name == "tp"
    assert plan_smallest_tp(gpu="h200", model="deepseek-v3").tp == 8
    assert plan_smallest_tp(gpu="b200", model="deepseek-v3").tp == 4  # more memory, fewer ranks


def test_a_tp_whose_weights_leave_no_page_of_kv_is_skipped_too() -> None:
    with pytest.raises(OutOfRangeError) as e:
        plan(gpu="h200", model="llama-3.1-70b", tp=1)
    assert e.value.name == "budget_bytes"  # the weights fit, the headroom takes the rest
    assert plan_smallest_tp(gpu="h200", model="llama-3.1-70b").tp == 2


def test_the_sizes_are_tried_from_the_smallest_whatever_their_order() -> None:
    assert plan_smallest_tp(gpu="h200", model="gpt-oss-120b", tps=(16, 4, 2)).tp == 2
    assert TP_SIZES == (1, 2, 4, 8, 16)


def test_a_model_that_fits_no_size_names_tp_the_sizes_and_the_last_refusal() -> None:
    with pytest.raises(OutOfRangeError, match=r"a TP in \[1, 2\] at which deepseek-v3 fits h200"
                       ) as e:
        plan_smallest_tp(gpu="h200", model="deepseek-v3", tps=[1, 2])
    assert e.value.name == "tp" and e.value.value == 2
    assert isinstance(e.value.__cause__, OutOfRangeError) and e.value.__cause__.value == 2


def test_an_error_of_the_request_itself_is_raised_at_the_first_size() -> None:
    with pytest.raises(ArgumentError, match="page_size"):
        plan_smallest_tp(gpu="h200", model="llama-3.1-8b", page_size=0)
    with pytest.raises(OutOfRangeError) as e:  # a budget over the device: so at every TP
        plan_smallest_tp(gpu="h200", model="llama-3.1-8b", budget_bytes=1 << 50)
    assert e.value.name == "budget_bytes" and e.value.__cause__ is None


@pytest.mark.parametrize(("kw", "name"), [
    ({"tps": []}, "tps"), ({"tps": [2, 0]}, "tps"), ({"tps": [1.5]}, "tps"),
    ({"tp": 2}, "tp"),
])
def test_bad_sizes_or_a_tp_of_its_own_are_refused_by_name(kw: dict[str, Any], name: str) -> None:
    with pytest.raises(ArgumentError) as e:
        plan_smallest_tp(gpu="h200", model="llama-3.1-8b", **kw)
    assert e.value.name == name

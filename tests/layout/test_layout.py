"""kvvmm.layout: buffer spans, presets, tensor-parallel sharding, model configs, bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvvmm.errors import ArgumentError, KvvmmError, OutOfRangeError, UnknownDtypeError
from kvvmm.layout import (
    DTYPE_ITEMSIZE,
    KvBufferDesc,
    ModelConfig,
    dtype_itemsize,
    dtype_name,
    heads_per_rank,
    hybrid_swa_descs,
    kv_bytes_per_token,
    list_models,
    load_model,
    mha_token_major,
    mla,
    model_descs,
    page_major,
    swa_kv_bytes_per_token,
    swa_reserved_tokens_default,
)

# KV bytes per token per rank in bf16 (2 bytes), computed by hand from each published config:
# full-attention layers x 2 (K and V) x KV heads x head_dim x 2, or for MLA
# layers x (kv_lora_rank + qk_rope_head_dim) x 2. Sliding layers separately.
BF16_FULL_BYTES_PER_TOKEN = {
    "llama-3.1-8b": 32 * 2 * 8 * 128 * 2,  # 131072
    "llama-3.1-70b": 80 * 2 * 8 * 128 * 2,  # 327680
    "qwen2.5-7b": 28 * 2 * 4 * 128 * 2,  # 57344 (head_dim = 3584 / 28)
    "mistral-7b": 32 * 2 * 8 * 128 * 2,  # 131072
    "deepseek-v3": 61 * (512 + 64) * 2,  # 70272, MLA latent
    "gpt-oss-120b": 18 * 2 * 8 * 64 * 2,  # 36864: 18 of 36 layers are full attention
    "gemma-3-27b": 10 * 2 * 16 * 128 * 2,  # 81920: layers 5, 11, ..., 59 are global
}
BF16_SWA_BYTES_PER_TOKEN = {
    "gpt-oss-120b": 18 * 2 * 8 * 64 * 2,  # 36864
    "gemma-3-27b": 52 * 2 * 16 * 128 * 2,  # 425984
}


# -- model figures -----------------------------------------------------------------------------


def test_every_shipped_model_has_a_hand_computed_kv_figure_in_this_file() -> None:
    assert sorted(BF16_FULL_BYTES_PER_TOKEN) == list_models()


@pytest.mark.parametrize("key", sorted(BF16_FULL_BYTES_PER_TOKEN))
def test_kv_bytes_per_token_of_every_shipped_model_matches_its_published_config(key: str) -> None:
    assert kv_bytes_per_token(key, "bfloat16") == BF16_FULL_BYTES_PER_TOKEN[key]
    assert swa_kv_bytes_per_token(key, "bfloat16") == BF16_SWA_BYTES_PER_TOKEN.get(key, 0)


def test_llama_3_1_8b_takes_128_kib_per_token_in_bf16_and_64_kib_in_fp8() -> None:
    assert kv_bytes_per_token("llama-3.1-8b", "bfloat16") == 131072
    assert kv_bytes_per_token("llama-3.1-8b", "float8_e4m3fn") == 65536
    assert kv_bytes_per_token("llama-3.1-8b", "float32") == 262144


@pytest.mark.parametrize("key", sorted(BF16_FULL_BYTES_PER_TOKEN))
def test_the_buffers_of_a_shipped_model_add_up_to_its_bytes_per_token(key: str) -> None:
    m = load_model(key)
    if m.is_hybrid_swa:
        full, swa = hybrid_swa_descs(m, reserved_tokens=4096, page_size=16, dtype="bf16")
        assert sum(d.row_bytes for d in swa) == BF16_SWA_BYTES_PER_TOKEN[key]
    else:
        full = model_descs(m, reserved_tokens=4096, page_size=16, dtype="bf16")
    assert sum(d.row_bytes // d.tokens_per_row for d in full) == BF16_FULL_BYTES_PER_TOKEN[key]


@pytest.mark.parametrize("key", sorted(BF16_FULL_BYTES_PER_TOKEN))
def test_every_shipped_model_file_says_where_its_figures_come_from(key: str) -> None:
    path = Path(__file__).parents[2] / "kvvmm" / "layout" / "models" / f"{key}.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    # The public config it comes from, "repo: file", and nothing else.
    assert data["_source"] == f"{data['_name']}: config.json"
    assert "/" in data["_name"]  # a Hugging Face repo id
    assert data["_name"] in data["hf_id"]
    for repo_id in data["hf_id"]:  # loadable by every repo id it lists, in any case
        assert load_model(repo_id).name == key
        assert load_model(repo_id.upper()).name == key


def test_model_layers_and_heads_match_the_published_configs() -> None:
    figures = {  # layers, attention heads, KV heads, head_dim
        "llama-3.1-8b": (32, 32, 8, 128),
        "llama-3.1-70b": (80, 64, 8, 128),
        "qwen2.5-7b": (28, 28, 4, 128),
        "mistral-7b": (32, 32, 8, 128),
        "gpt-oss-120b": (36, 64, 8, 64),
        "gemma-3-27b": (62, 32, 16, 128),
    }
    for key, want in figures.items():
        m = load_model(key)
        assert (m.num_layers, m.num_attention_heads, m.num_kv_heads, m.head_dim) == want, key
    ds = load_model("deepseek-v3")
    assert (ds.num_layers, ds.num_attention_heads, ds.kv_lora_rank, ds.qk_rope_head_dim) == (
        61,
        128,
        512,
        64,
    )
    assert ds.is_mla and not ds.is_hybrid_swa


def test_gpt_oss_alternates_sliding_and_full_layers_starting_with_sliding() -> None:
    m = load_model("gpt-oss-120b")
    assert m.sliding_window == 128
    assert m.sliding_layers == tuple(range(0, 36, 2))
    assert m.full_layers == tuple(range(1, 36, 2))


def test_gemma_3_slides_five_layers_then_attends_fully_once() -> None:
    m = load_model("gemma-3-27b")
    assert m.sliding_window == 1024
    assert m.full_layers == (5, 11, 17, 23, 29, 35, 41, 47, 53, 59)
    assert len(m.sliding_layers) == 52


def test_mistral_7b_v0_3_and_qwen2_5_have_no_sliding_layers() -> None:
    mistral, qwen = load_model("mistral-7b"), load_model("qwen2.5-7b")
    assert mistral.sliding_window is None and not mistral.is_hybrid_swa
    # Qwen2.5 ships sliding_window=131072 with use_sliding_window=false: the window is off.
    assert qwen.sliding_window is None and not qwen.is_hybrid_swa


# -- spans -------------------------------------------------------------------------------------


def test_17_tokens_in_16_token_pages_back_two_pages_as_prefix_and_three_at_final() -> None:
    (k0, *_) = page_major(
        layers=1, kv_heads=8, head_dim=128, reserved_tokens=64, page_size=16, dtype="bf16"
    )
    page_bytes = 8 * 16 * 128 * 2
    assert k0.tokens_per_row == 16 and k0.row_bytes == page_bytes
    assert k0.rows(17) == 2
    assert k0.prefix_span_bytes(17, 16) == 2 * page_bytes
    assert k0.final_span_bytes(17, 16) == 3 * page_bytes


def test_token_major_final_span_adds_one_page_of_rows_for_the_padded_page() -> None:
    (k0, *_) = mha_token_major(
        layers=1, kv_heads=8, head_dim=128, reserved_tokens=64, page_size=16, dtype="bf16"
    )
    assert k0.shape == (64 + 16, 8, 128)
    assert k0.prefix_span_bytes(17, 16) == 17 * 2048
    assert k0.final_span_bytes(17, 16) == 33 * 2048


def test_negative_token_counts_need_no_rows() -> None:
    d = KvBufferDesc("k0", (10, 4), row_bytes=8, tokens_per_row=1)
    assert d.rows(-5) == 0 and d.prefix_span_bytes(-5, 16) == 0


def test_reserved_span_is_the_whole_upper_bound_tensor() -> None:
    d = KvBufferDesc("k0", (80, 8, 128), row_bytes=2048, tokens_per_row=1)
    assert d.reserved_span_bytes(2) == 80 * 8 * 128 * 2


@given(
    reserved=st.integers(1, 1 << 20),
    page=st.integers(1, 512),
    layout=st.sampled_from(["token_major", "page_major"]),
)
def test_the_final_span_at_the_reserved_tokens_is_exactly_the_reserved_span(
    reserved: int, page: int, layout: str
) -> None:
    preset = mha_token_major if layout == "token_major" else page_major
    for d in preset(
        layers=1, kv_heads=2, head_dim=64, reserved_tokens=reserved, page_size=page, dtype="fp16"
    ):
        assert d.final_span_bytes(reserved, page) == d.reserved_span_bytes(2)
        assert d.prefix_span_bytes(reserved, page) <= d.final_span_bytes(reserved, page)
        # One token more than reserved no longer fits (never clamped).
        if layout == "token_major":
            assert d.final_span_bytes(reserved + 1, page) > d.reserved_span_bytes(2)


def test_k_buffers_come_before_v_buffers() -> None:
    descs = mha_token_major(
        layers=3, kv_heads=8, head_dim=128, reserved_tokens=16, page_size=16, dtype="bf16"
    )
    assert [d.name for d in descs] == ["k0", "k1", "k2", "v0", "v1", "v2"]


def test_mla_has_one_latent_buffer_per_layer_with_the_rope_part_appended() -> None:
    descs = mla(
        layers=2,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        reserved_tokens=100,
        page_size=16,
        dtype="bf16",
    )
    assert [d.name for d in descs] == ["kv0", "kv1"]
    assert descs[0].shape == (116, 1, 576) and descs[0].row_bytes == 576 * 2
    (paged,) = mla(
        layers=1,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        reserved_tokens=100,
        page_size=16,
        dtype="bf16",
        layout="page_major",
    )
    assert paged.shape == (7 + 1, 1, 16, 576) and paged.tokens_per_row == 16


def test_a_list_shape_is_kept_as_a_tuple() -> None:
    d = KvBufferDesc("k0", [4, 2], row_bytes=4, tokens_per_row=1)  # type: ignore[arg-type]
    assert d.shape == (4, 2)


# -- tensor parallelism ------------------------------------------------------------------------


def test_tensor_parallelism_divides_the_kv_heads_among_ranks() -> None:
    assert heads_per_rank(8, 1) == 8 and heads_per_rank(8, 2) == 4 and heads_per_rank(8, 8) == 1
    descs = mha_token_major(
        layers=80, kv_heads=8, head_dim=128, reserved_tokens=16, page_size=16, dtype="bf16", tp=4
    )
    assert descs[0].shape == (32, 2, 128) and descs[0].row_bytes == 2 * 128 * 2
    assert kv_bytes_per_token("llama-3.1-70b", "bf16", tp=8) == 327680 // 8


def test_more_ranks_than_kv_heads_replicate_one_head_per_rank() -> None:
    assert heads_per_rank(8, 16) == 1 and heads_per_rank(4, 8) == 1
    assert kv_bytes_per_token("qwen2.5-7b", "bf16", tp=8) == 28 * 2 * 1 * 128 * 2


def test_mla_is_not_sharded_by_tensor_parallelism() -> None:
    assert kv_bytes_per_token("deepseek-v3", "bf16", tp=8) == 70272
    d1 = model_descs("deepseek-v3", reserved_tokens=64, page_size=16, dtype="bf16", tp=1)
    d8 = model_descs("deepseek-v3", reserved_tokens=64, page_size=16, dtype="bf16", tp=8)
    assert d1 == d8


@pytest.mark.parametrize(("kv_heads", "tp"), [(8, 3), (8, 12), (4, 6), (16, 24)])
def test_tp_that_neither_divides_nor_is_a_multiple_of_the_kv_heads_is_refused(
    kv_heads: int, tp: int
) -> None:
    with pytest.raises(ArgumentError) as e:
        heads_per_rank(kv_heads, tp)
    assert e.value.name == "tp" and e.value.value == tp
    assert f"kv_heads={kv_heads}" in str(e.value) and str(tp) in str(e.value)


# -- dtypes ------------------------------------------------------------------------------------


def test_dtype_names_and_aliases_map_to_their_item_sizes() -> None:
    assert DTYPE_ITEMSIZE["float8_e5m2"] == 1 and DTYPE_ITEMSIZE["float32"] == 4
    assert dtype_name("torch.bfloat16") == "bfloat16" and dtype_name("bf16") == "bfloat16"
    assert dtype_itemsize("half") == 2 and dtype_itemsize("uint8") == 1


def test_torch_dtype_objects_are_read_by_name() -> None:
    torch = pytest.importorskip("torch")
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_itemsize(torch.float8_e4m3fn) == 1
    assert dtype_itemsize(torch.half) == 2
    with pytest.raises(UnknownDtypeError):
        dtype_itemsize(torch.float64)


def test_layout_and_plan_import_without_torch() -> None:
    code = "import sys, kvvmm.layout; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- hybrid sliding-window pools ---------------------------------------------------------------


def test_gpt_oss_gets_a_full_pool_and_a_window_sized_sliding_pool() -> None:
    full, swa = hybrid_swa_descs(
        "gpt-oss-120b", reserved_tokens=100_000, page_size=16, dtype="bf16"
    )
    assert len(full) == len(swa) == 36
    assert full[0].shape == (100_000 + 16, 8, 64)
    # window 128 in whole pages (128) plus the page being written (16) -> 144 slots
    assert swa[0].shape == (144 + 16, 8, 64)
    assert [d.name for d in swa[:2]] == ["k0", "k1"] and swa[18].name == "v0"


def test_the_sliding_pool_rounds_the_window_up_to_whole_pages() -> None:
    m = load_model("gemma-3-27b")
    assert swa_reserved_tokens_default(m, reserved_tokens=10**6, page_size=16) == 1024 + 16
    assert swa_reserved_tokens_default(m, reserved_tokens=10**6, page_size=100) == 1100 + 100
    # never more than the full pool
    assert swa_reserved_tokens_default(m, reserved_tokens=500, page_size=16) == 500


def test_a_given_sliding_pool_capacity_is_used_as_is() -> None:
    _, swa = hybrid_swa_descs(
        "gemma-3-27b", reserved_tokens=10_000, swa_reserved_tokens=8_000, page_size=16, dtype="bf16"
    )
    assert swa[0].shape == (8_016, 16, 128) and len(swa) == 104


def test_hybrid_pools_can_be_page_major_and_tp_sharded() -> None:
    full, swa = hybrid_swa_descs(
        "gemma-3-27b", reserved_tokens=4096, page_size=64, dtype="bf16", tp=4, layout="page_major"
    )
    assert full[0].shape == (64 + 1, 4, 64, 128)
    assert swa[0].shape == (-(-(1024 + 64) // 64) + 1, 4, 64, 128)


# -- loading configs ---------------------------------------------------------------------------


def test_a_config_dict_with_hf_field_names_loads_and_derives_head_dim() -> None:
    m = load_model(
        {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1024},
        name="tiny",
    )
    assert m == ModelConfig("tiny", 2, 8, 8, 128, None, None, None, None, "a config dict")


def test_a_config_json_path_or_its_directory_loads(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "_name_or_path": "me/tiny"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    by_file = load_model(tmp_path / "config.json")
    by_dir = load_model(str(tmp_path))
    assert by_file == by_dir and by_file.name == "me/tiny" and by_file.num_kv_heads == 2


def test_a_nested_text_config_is_read_as_gemma_3_ships_it() -> None:
    m = load_model({"text_config": {"num_hidden_layers": 12, "num_attention_heads": 4,
                                    "head_dim": 16, "sliding_window": 64,
                                    "sliding_window_pattern": 6}})  # fmt: skip
    assert m.full_layers == (5, 11) and m.sliding_window == 64


def test_qwen2_with_the_window_switched_on_slides_the_layers_past_max_window_layers() -> None:
    base: dict[str, Any] = {"num_hidden_layers": 6, "num_attention_heads": 4, "head_dim": 16,
                            "sliding_window": 64, "max_window_layers": 4}  # fmt: skip
    assert not load_model({**base, "use_sliding_window": False}).is_hybrid_swa
    on = load_model({**base, "use_sliding_window": True})
    assert on.full_layers == (0, 1, 2, 3) and on.sliding_layers == (4, 5)


def test_a_uniform_sliding_window_without_layer_types_is_planned_as_full_attention() -> None:
    m = load_model({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "hidden_size": 4096, "sliding_window": 4096})  # fmt: skip
    assert not m.is_hybrid_swa and len(m.full_layers) == 32


def test_model_names_are_matched_case_insensitively() -> None:
    assert load_model("Llama-3.1-8B").name == "llama-3.1-8b"
    assert load_model(load_model("mistral-7b")) == load_model("mistral-7b")


# -- bad input ---------------------------------------------------------------------------------

_MHA: dict[str, Any] = dict(
    layers=2, kv_heads=8, head_dim=128, reserved_tokens=64, page_size=16, dtype="bf16"
)
_TINY: dict[str, Any] = {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16}

BAD_LAYOUT_CALLS: list[tuple[str, Any, type[KvvmmError], str]] = [
    ("empty buffer name", lambda: KvBufferDesc("", (4,), 1, 1), ArgumentError, "name"),
    ("empty shape", lambda: KvBufferDesc("k0", (), 1, 1), ArgumentError, "shape"),
    ("zero dimension", lambda: KvBufferDesc("k0", (4, 0), 1, 1), ArgumentError, "shape"),
    ("bool dimension", lambda: KvBufferDesc("k0", (True,), 1, 1), ArgumentError, "shape"),
    ("zero row bytes", lambda: KvBufferDesc("k0", (4,), 0, 1), ArgumentError, "row_bytes"),
    ("zero tokens per row", lambda: KvBufferDesc("k0", (4,), 1, 0), ArgumentError,
     "tokens_per_row"),
    ("float token count", lambda: KvBufferDesc("k0", (4,), 1, 1).rows(1.5),  # type: ignore[arg-type]
     ArgumentError, "n_tokens"),
    ("zero itemsize", lambda: KvBufferDesc("k0", (4,), 1, 1).reserved_span_bytes(0),
     ArgumentError, "itemsize"),
    ("zero page at final", lambda: KvBufferDesc("k0", (4,), 1, 1).final_span_bytes(1, 0),
     ArgumentError, "page_size"),
    ("zero layers", lambda: mha_token_major(**{**_MHA, "layers": 0}), ArgumentError, "layers"),
    ("negative head_dim", lambda: page_major(**{**_MHA, "head_dim": -1}), ArgumentError,
     "head_dim"),
    ("zero reserved tokens", lambda: mha_token_major(**{**_MHA, "reserved_tokens": 0}),
     ArgumentError, "reserved_tokens"),
    ("zero page size", lambda: page_major(**{**_MHA, "page_size": 0}), ArgumentError,
     "page_size"),
    ("zero tp", lambda: mha_token_major(**_MHA, tp=0), ArgumentError, "tp"),
    ("tp 3 over 8 heads", lambda: mha_token_major(**_MHA, tp=3), ArgumentError, "tp"),
    ("unknown dtype", lambda: mha_token_major(**{**_MHA, "dtype": "float64"}),
     UnknownDtypeError, "dtype"),
    ("dtype of the wrong kind", lambda: dtype_itemsize(2), UnknownDtypeError, "dtype"),
    ("zero latent rank", lambda: mla(layers=1, kv_lora_rank=0, qk_rope_head_dim=64,
                                     reserved_tokens=8, page_size=8, dtype="bf16"),
     ArgumentError, "kv_lora_rank"),
    ("unknown layout", lambda: model_descs("llama-3.1-8b", layout="nhd", reserved_tokens=16,
                                           page_size=16, dtype="bf16"), ArgumentError, "layout"),
    ("hybrid model through model_descs", lambda: model_descs(
        "gpt-oss-120b", reserved_tokens=16, page_size=16, dtype="bf16"), ArgumentError, "model"),
    ("dense model through hybrid_swa_descs", lambda: hybrid_swa_descs(
        "llama-3.1-8b", reserved_tokens=16, page_size=16, dtype="bf16"), ArgumentError, "model"),
    ("sliding pool larger than the full pool", lambda: hybrid_swa_descs(
        "gpt-oss-120b", reserved_tokens=100, swa_reserved_tokens=101, page_size=16,
        dtype="bf16"), OutOfRangeError, "swa_reserved_tokens"),
    ("unknown model key", lambda: load_model("llama-9"), ArgumentError, "model"),
    ("config without layers", lambda: load_model({"num_attention_heads": 4, "head_dim": 8}),
     ArgumentError, "num_hidden_layers"),
    ("config without head_dim or hidden_size", lambda: load_model(
        {"num_hidden_layers": 2, "num_attention_heads": 4}), ArgumentError, "head_dim"),
    ("hidden_size not a multiple of heads", lambda: load_model(
        {**_TINY, "head_dim": None, "hidden_size": 10}), ArgumentError, "hidden_size"),
    ("string layer count", lambda: load_model({**_TINY, "num_hidden_layers": "2"}),
     ArgumentError, "num_hidden_layers"),
    ("kv heads not dividing heads", lambda: load_model({**_TINY, "num_key_value_heads": 3}),
     ArgumentError, "num_kv_heads"),
    ("layer_types of the wrong length", lambda: load_model(
        {**_TINY, "sliding_window": 8, "layer_types": ["full_attention"]}), ArgumentError,
     "layer_types"),
    ("unknown layer type", lambda: load_model(
        {**_TINY, "layer_types": ["full_attention", "linear_attention"]}), ArgumentError,
     "layer_types"),
    ("sliding layers without a window", lambda: load_model(
        {**_TINY, "layer_types": ["sliding_attention", "full_attention"]}), ArgumentError,
     "sliding_window"),
    ("MLA rank without the rope width", lambda: load_model({**_TINY, "kv_lora_rank": 512}),
     ArgumentError, "qk_rope_head_dim"),
    ("zero sliding_window_pattern", lambda: load_model(
        {**_TINY, "sliding_window": 8, "sliding_window_pattern": 0}), ArgumentError,
     "sliding_window_pattern"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "name"),
    [pytest.param(c, e, n, id=i) for i, c, e, n in BAD_LAYOUT_CALLS],
)
def test_bad_layout_input_raises_a_typed_error_naming_the_argument(
    call: Any, error: type[KvvmmError], name: str
) -> None:
    with pytest.raises(error) as e:
        call()
    assert isinstance(e.value, ArgumentError) and e.value.name == name
    assert "must be" in str(e.value)  # the message states the limit


def test_a_malformed_config_file_is_refused_with_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ArgumentError, match=r"config\.json"):
        load_model(bad)
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ArgumentError, match="JSON object"):
        load_model(bad)


def test_an_unknown_dtype_lists_the_known_names() -> None:
    with pytest.raises(UnknownDtypeError) as e:
        dtype_name("float64")
    assert "bfloat16" in str(e.value) and "float64" in str(e.value)
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)


def test_an_unknown_model_lists_the_shipped_ones() -> None:
    with pytest.raises(ArgumentError) as e:
        load_model("no-such-model")
    assert all(k in str(e.value) for k in list_models())


def test_spans_agree_with_sglang_formulas_for_random_descs() -> None:
    for rows, per_row, row_bytes, n, page in [(10, 1, 7, 9, 1), (5, 16, 3, 17, 16),
                                              (9, 64, 1, 0, 64), (3, 2, 5, -1, 2)]:  # fmt: skip
        d = KvBufferDesc("x", (rows, 3), row_bytes, per_row)
        assert d.rows(n) == math.ceil(max(n, 0) / per_row)
        assert d.prefix_span_bytes(n, page) == math.ceil(max(n, 0) / per_row) * row_bytes
        assert d.final_span_bytes(n, page) == math.ceil((n + page) / per_row) * row_bytes

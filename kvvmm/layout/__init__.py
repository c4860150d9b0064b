"""The layout wing: what an owner lays out, for which model, and how much of it fits.

Everything here is arithmetic over ints: no torch, no driver.
"""

from __future__ import annotations

from kvvmm.dtypes import DTYPE_ITEMSIZE, dtype_itemsize, dtype_name
from kvvmm.layout.desc import KvBufferDesc
from kvvmm.layout.geometry import (
    agreed_page_size,
    agreed_reserved_tokens,
    check_itemsize,
    growth_targets,
)
from kvvmm.layout.model_buffers import (
    full_pool_descs,
    hybrid_swa_descs,
    kv_bytes_per_token,
    model_descs,
    swa_kv_bytes_per_token,
    swa_reserved_tokens_default,
)
from kvvmm.layout.models import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    ModelLike,
    list_models,
    load_model,
    weights_bytes_per_rank,
)
from kvvmm.layout.planner import (
    DEFAULT_MEM_FRACTION_STATIC,
    DEFAULT_PAGE_SIZE,
    ENGINES,
    LARGE_TOKENS,
    LARGE_VA_BYTES,
    TP_SIZES,
    HandleCount,
    Plan,
    PlanOptions,
    PlanRequest,
    PoolPlan,
    default_policies,
    plan,
    plan_request,
    plan_smallest_tp,
    vllm_kv_bytes,
    vllm_warmup_bytes,
)
from kvvmm.layout.presets import (
    CROSS_LAYER,
    LAYOUTS,
    block_interleaved,
    heads_per_rank,
    layer_interleaved,
    mha_token_major,
    mla,
    page_major,
)
from kvvmm.layout.ranges import RangesFullError, SlotRanges

__all__ = [
    "CROSS_LAYER",
    "DEFAULT_MEM_FRACTION_STATIC",
    "DEFAULT_PAGE_SIZE",
    "DTYPE_ITEMSIZE",
    "ENGINES",
    "FULL_ATTENTION",
    "LARGE_TOKENS",
    "LARGE_VA_BYTES",
    "LAYOUTS",
    "SLIDING_ATTENTION",
    "TP_SIZES",
    "HandleCount",
    "KvBufferDesc",
    "ModelConfig",
    "ModelLike",
    "Plan",
    "PlanOptions",
    "PlanRequest",
    "PoolPlan",
    "RangesFullError",
    "SlotRanges",
    "agreed_page_size",
    "agreed_reserved_tokens",
    "block_interleaved",
    "check_itemsize",
    "default_policies",
    "dtype_itemsize",
    "dtype_name",
    "full_pool_descs",
    "growth_targets",
    "heads_per_rank",
    "hybrid_swa_descs",
    "kv_bytes_per_token",
    "layer_interleaved",
    "list_models",
    "load_model",
    "mha_token_major",
    "mla",
    "model_descs",
    "page_major",
    "plan",
    "plan_request",
    "plan_smallest_tp",
    "swa_kv_bytes_per_token",
    "swa_reserved_tokens_default",
    "vllm_kv_bytes",
    "vllm_warmup_bytes",
    "weights_bytes_per_rank",
]

"""The KV buffers a model needs: its config turned into :class:`KvBufferDesc` lists.

GQA/MHA models get a K and a V buffer per layer (token- or page-major), MLA models one latent
buffer per layer; hybrid sliding-window models (gpt-oss, Gemma 3) two pools, one per owner
(:func:`hybrid_swa_descs`). Tensor parallelism shards KV heads (MLA is not sharded).
"""

from __future__ import annotations

from kvvmm.checks import int_arg
from kvvmm.dtypes import dtype_itemsize
from kvvmm.errors import ArgumentError, OutOfRangeError
from kvvmm.layout.desc import KvBufferDesc
from kvvmm.layout.models import ModelConfig, ModelLike, load_model
from kvvmm.layout.presets import (
    _check_layout,
    _check_tokens,
    block_interleaved,
    heads_per_rank,
    layer_interleaved,
    mha_token_major,
    mla,
    page_major,
)
from kvvmm.units import align_up

__all__ = [
    "full_pool_descs",
    "hybrid_swa_descs",
    "kv_bytes_per_token",
    "model_descs",
    "swa_kv_bytes_per_token",
    "swa_reserved_tokens_default",
]


def _gqa_descs(
    layers: int,
    model: ModelConfig,
    layout: str,
    reserved_tokens: int,
    page_size: int,
    dtype: object,
    tp: int,
) -> list[KvBufferDesc]:
    preset = {"token_major": mha_token_major, "page_major": page_major,
              "interleaved": layer_interleaved, "block_interleaved": block_interleaved}[layout]
    return preset(
        layers=layers,
        kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        reserved_tokens=reserved_tokens,
        page_size=page_size,
        dtype=dtype,
        tp=tp,
    )


def model_descs(
    model: ModelLike,
    *,
    layout: str = "token_major",
    reserved_tokens: int,
    page_size: int,
    dtype: object,
    tp: int = 1,
) -> list[KvBufferDesc]:
    """The KV buffers of one model's full-attention pool on one tensor-parallel rank.

    The layout picks the preset (MLA's latent is not sharded; in a cross-layer layout it is
    ``kv=1`` with one "head" of the latent width).

    Args:
        model: a :class:`ModelConfig` or anything :func:`load_model` takes.
        layout: ``"token_major"``, ``"page_major"``, ``"interleaved"`` or
            ``"block_interleaved"``.
        reserved_tokens: the pool's upper bound in token slots, > 0.
        page_size: tokens per page, > 0.
        dtype: KV dtype.
        tp: tensor-parallel size (ignored by MLA, whose latent every rank stores whole).
    Returns:
        The descs, K buffers before V buffers (MLA: kv0..).
    Raises:
        ArgumentError: bad sizes or layout, ``tp`` not fitting the KV heads, or a hybrid
            sliding-window model (use :func:`hybrid_swa_descs` for its two pools).
        UnknownDtypeError: unknown dtype.
    """
    m = load_model(model)
    _check_layout(layout)
    int_arg("tp", tp, lo=1, unit="tensor-parallel ranks")
    if m.is_hybrid_swa:
        raise ArgumentError(
            "model",
            m.name,
            "a model without sliding-window layers",
            f"{len(m.sliding_layers)} of its {m.num_layers} layers slide; "
            "use hybrid_swa_descs() for its full and sliding-window pools",
        )
    if m.is_mla:
        return _mla_descs(m, layout, reserved_tokens, page_size, dtype)
    return _gqa_descs(m.num_layers, m, layout, reserved_tokens, page_size, dtype, tp)


def _mla_descs(m: ModelConfig, layout: str, reserved_tokens: int, page_size: int,
               dtype: object) -> list[KvBufferDesc]:
    assert m.kv_lora_rank is not None and m.qk_rope_head_dim is not None
    if layout in ("interleaved", "block_interleaved"):
        cross = layer_interleaved if layout == "interleaved" else block_interleaved
        return cross(layers=m.num_layers, kv_heads=1, head_dim=m.kv_lora_rank + m.qk_rope_head_dim,
                     reserved_tokens=reserved_tokens, page_size=page_size, dtype=dtype, kv=1)
    return mla(layers=m.num_layers, kv_lora_rank=m.kv_lora_rank,
               qk_rope_head_dim=m.qk_rope_head_dim, reserved_tokens=reserved_tokens,
               page_size=page_size, dtype=dtype, layout=layout)


def swa_reserved_tokens_default(model: ModelLike, *, reserved_tokens: int, page_size: int) -> int:
    """Default capacity of a sliding-window pool: one sequence's window, page-rounded.

    ``min(reserved_tokens, align_up(sliding_window, page_size) + page_size)``: the window in
    whole pages plus the page being written, for *one* sequence; pass ``swa_reserved_tokens``
    for a serving plan.

    Args:
        model: a hybrid sliding-window model.
        reserved_tokens: the full pool's capacity in tokens, > 0.
        page_size: tokens per page, > 0.
    Returns:
        Token slots for the sliding-window pool.
    Raises:
        ArgumentError: bad sizes, or the model has no sliding-window layers.
    """
    m = load_model(model)
    _check_tokens(reserved_tokens, page_size)
    if not m.is_hybrid_swa or m.sliding_window is None:
        raise ArgumentError(
            "model", m.name, "a hybrid sliding-window model (some layers sliding_attention)"
        )
    return min(reserved_tokens, align_up(m.sliding_window, page_size) + page_size)


def hybrid_swa_descs(
    model: ModelLike,
    *,
    reserved_tokens: int,
    swa_reserved_tokens: int | None = None,
    page_size: int,
    dtype: object,
    tp: int = 1,
    layout: str = "token_major",
) -> tuple[list[KvBufferDesc], list[KvBufferDesc]]:
    """The two pools of a hybrid sliding-window model: full-attention and sliding layers.

    Each pool is one owner; its layer ``i`` is ``model.full_layers[i]`` or
    ``model.sliding_layers[i]``.

    Args:
        model: a hybrid sliding-window model (gpt-oss, Gemma 3).
        reserved_tokens: the full pool's capacity in tokens, > 0.
        swa_reserved_tokens: the sliding pool's capacity, in ``[1, reserved_tokens]``;
            default :func:`swa_reserved_tokens_default` (one sequence's window).
        page_size, dtype, tp, layout: as :func:`model_descs`.
    Returns:
        ``(full_descs, swa_descs)``; ``full_descs`` is empty if every layer slides.
    Raises:
        ArgumentError: bad sizes or layout, ``tp`` not fitting, not a hybrid model, or
            ``swa_reserved_tokens`` outside ``[1, reserved_tokens]``.
        UnknownDtypeError: unknown dtype.
    """
    m = load_model(model)
    _check_layout(layout)
    swa_default = swa_reserved_tokens_default(
        m, reserved_tokens=reserved_tokens, page_size=page_size
    )
    if swa_reserved_tokens is None:
        swa_tokens = swa_default
    else:
        int_arg("swa_reserved_tokens", swa_reserved_tokens, lo=1, unit="token slots")
        if swa_reserved_tokens > reserved_tokens:
            raise OutOfRangeError(
                "swa_reserved_tokens",
                swa_reserved_tokens,
                f"<= reserved_tokens={reserved_tokens}",
                "a sliding-window pool larger than the full pool can never fill",
            )
        swa_tokens = swa_reserved_tokens
    n_full, n_swa = len(m.full_layers), len(m.sliding_layers)
    full = _gqa_descs(n_full, m, layout, reserved_tokens, page_size, dtype, tp) if n_full else []
    swa = _gqa_descs(n_swa, m, layout, swa_tokens, page_size, dtype, tp)
    return full, swa


def kv_bytes_per_token(model: ModelLike, dtype: object, tp: int = 1) -> int:
    """KV bytes one token takes in the full-capacity layers on one tensor-parallel rank.

    Sliding-window layers are not counted (:func:`swa_kv_bytes_per_token`).

    Args:
        model: a :class:`ModelConfig` or anything :func:`load_model` takes.
        dtype: KV dtype.
        tp: tensor-parallel size.
    Returns:
        Bytes per token per rank.
    Raises:
        ArgumentError: ``tp`` invalid or not fitting the KV heads.
        UnknownDtypeError: unknown dtype.
    """
    m = load_model(model)
    itemsize = dtype_itemsize(dtype)
    int_arg("tp", tp, lo=1, unit="tensor-parallel ranks")
    if m.is_mla:
        assert m.kv_lora_rank is not None and m.qk_rope_head_dim is not None
        return m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * itemsize
    hpr = heads_per_rank(m.num_kv_heads, tp)
    return len(m.full_layers) * 2 * hpr * m.head_dim * itemsize


def swa_kv_bytes_per_token(model: ModelLike, dtype: object, tp: int = 1) -> int:
    """KV bytes one token takes in the sliding-window layers on one rank (0 if none).

    Args, Returns and Raises: as :func:`kv_bytes_per_token`.
    """
    m = load_model(model)
    itemsize = dtype_itemsize(dtype)
    hpr = heads_per_rank(m.num_kv_heads, tp)
    return len(m.sliding_layers) * 2 * hpr * m.head_dim * itemsize


def full_pool_descs(
    model: str, *, layout: str, reserved_tokens: int, page_size: int, dtype: str, tp: int
) -> list[KvBufferDesc]:
    """The full-attention pool's buffers (hybrid sliding-window models: their full pool)."""
    m = load_model(model)
    if m.is_hybrid_swa:
        return hybrid_swa_descs(
            m,
            reserved_tokens=reserved_tokens,
            page_size=page_size,
            dtype=dtype,
            tp=tp,
            layout=layout,
        )[0]
    return model_descs(
        m, layout=layout, reserved_tokens=reserved_tokens, page_size=page_size, dtype=dtype, tp=tp
    )

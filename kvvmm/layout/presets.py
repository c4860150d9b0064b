"""Layout presets: the lists of :class:`KvBufferDesc` that serving engines use.

- :func:`mha_token_major`: one K and one V buffer per layer, a row per token (NHD), as SGLang's
  MHA pool, which allocates ``size + page_size`` rows (the extra page absorbs the dummy writes
  that CUDA-graph capture sends to slot 0).
- :func:`page_major`: the same buffers with a row per page (HND: pages, heads, page, head_dim),
  as paged kernels (FlashInfer's HND layout) read them.
- :func:`mla`: one latent buffer per layer (DeepSeek's multi-head latent attention), not
  sharded by tensor parallelism.
- :func:`layer_interleaved`: one buffer for every layer, a token slot's K and V of every
  layer adjacent; a contiguous range of slots is one VA range whatever the layer count.
- :func:`block_interleaved`: the same, a row per page, so a page's tokens of one layer are
  contiguous as in a token-major page.
"""

from __future__ import annotations

from kvvmm.checks import int_arg, is_int
from kvvmm.dtypes import dtype_itemsize
from kvvmm.errors import ArgumentError
from kvvmm.layout.desc import KvBufferDesc

__all__ = ["CROSS_LAYER", "LAYOUTS", "block_interleaved", "heads_per_rank", "layer_interleaved",
           "mha_token_major", "mla", "page_major"]

#: Layouts :func:`~kvvmm.layout.models.model_descs` builds.
LAYOUTS = ("token_major", "page_major", "interleaved", "block_interleaved")
#: The layouts of ONE buffer holding every layer (a slot range is one VA range).
CROSS_LAYER = ("interleaved", "block_interleaved")


def heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads one tensor-parallel rank stores.

    When ``tp`` divides ``kv_heads`` each rank holds ``kv_heads // tp``. When ``tp`` exceeds
    ``kv_heads`` and is a multiple of it, each rank holds one head, replicated on
    ``tp // kv_heads`` ranks (vLLM and SGLang replicate KV heads this way).

    Args:
        kv_heads: the model's KV heads, > 0.
        tp: tensor-parallel size, > 0.
    Returns:
        Heads per rank.
    Raises:
        ArgumentError: either is not an int > 0, or neither divides the other.
    """
    int_arg("kv_heads", kv_heads, lo=1)
    int_arg("tp", tp, lo=1, unit="tensor-parallel ranks")
    if kv_heads % tp == 0:
        return kv_heads // tp
    if tp > kv_heads and tp % kv_heads == 0:
        return 1
    raise ArgumentError(
        "tp",
        tp,
        f"a divisor of kv_heads={kv_heads} or a multiple of it",
        f"{kv_heads} KV heads cannot be split evenly over {tp} ranks",
    )


def _check_tokens(reserved_tokens: int, page_size: int) -> None:
    int_arg("reserved_tokens", reserved_tokens, lo=1, unit="token slots")
    int_arg("page_size", page_size, lo=1, unit="tokens")


def _kv_pair(
    layers: int, shape: tuple[int, ...], row_bytes: int, tokens_per_row: int
) -> list[KvBufferDesc]:
    # K buffers k0..k(L-1) first, then v0..v(L-1): SGLang's order, which owners keep.
    return [
        KvBufferDesc(f"{kind}{i}", shape, row_bytes, tokens_per_row)
        for kind in ("k", "v")
        for i in range(layers)
    ]


def mha_token_major(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    reserved_tokens: int,
    page_size: int,
    dtype: object,
    tp: int = 1,
) -> list[KvBufferDesc]:
    """K and V buffers per layer, shape ``(reserved_tokens + page_size, heads_per_rank,
    head_dim)``.

    Args:
        layers: attention layers, > 0.
        kv_heads: the model's KV heads (before sharding), > 0.
        head_dim: elements per head, > 0.
        reserved_tokens: token slots the pool can ever hold (its upper bound), > 0.
        page_size: tokens per page, > 0.
        dtype: KV dtype (name or torch dtype).
        tp: tensor-parallel size; see :func:`heads_per_rank`.
    Returns:
        ``2 * layers`` descs: k0..k(L-1), then v0..v(L-1).
    Raises:
        ArgumentError: a size is not an int > 0, or ``tp`` does not fit ``kv_heads``.
        UnknownDtypeError: unknown dtype.
    """
    itemsize, hpr = _mha_checks(layers, kv_heads, head_dim, reserved_tokens, page_size,
                                dtype, tp)
    shape = (reserved_tokens + page_size, hpr, head_dim)
    return _kv_pair(layers, shape, hpr * head_dim * itemsize, 1)


def _check_kv(kv: object) -> None:
    """Tensors per layer and slot of a cross-layer layout: 2 (K and V) or 1 (a latent)."""
    if not is_int(kv) or kv not in (1, 2):
        raise ArgumentError("kv", kv, "2 (K and V per layer) or 1 (one latent per layer)")


def _mha_checks(layers: int, kv_heads: int, head_dim: int, reserved_tokens: int,
                page_size: int, dtype: object, tp: int) -> tuple[int, int]:
    """Check the arguments of an MHA layout; return (itemsize, heads per rank)."""
    int_arg("layers", layers, lo=1)
    int_arg("head_dim", head_dim, lo=1, unit="elements")
    _check_tokens(reserved_tokens, page_size)
    return dtype_itemsize(dtype), heads_per_rank(kv_heads, tp)


def page_major(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    reserved_tokens: int,
    page_size: int,
    dtype: object,
    tp: int = 1,
) -> list[KvBufferDesc]:
    """K and V buffers per layer, shape ``(pages + 1, heads_per_rank, page_size, head_dim)``
    with ``pages = ceil(reserved_tokens / page_size)``; the extra page is the padded page.

    Args:
        layers, kv_heads, head_dim, reserved_tokens, page_size, dtype, tp: as
            :func:`mha_token_major`.
    Returns:
        ``2 * layers`` descs with ``tokens_per_row == page_size``.
    Raises:
        ArgumentError: a size is not an int > 0, or ``tp`` does not fit ``kv_heads``.
        UnknownDtypeError: unknown dtype.
    """
    itemsize, hpr = _mha_checks(layers, kv_heads, head_dim, reserved_tokens, page_size,
                                dtype, tp)
    pages = -(-reserved_tokens // page_size)
    shape = (pages + 1, hpr, page_size, head_dim)
    return _kv_pair(layers, shape, hpr * page_size * head_dim * itemsize, page_size)


def layer_interleaved(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    reserved_tokens: int,
    page_size: int,
    dtype: object,
    tp: int = 1,
    kv: int = 2,
) -> list[KvBufferDesc]:
    """One buffer ``"kv"`` holding every layer's K and V, a row per token slot.

    Shape ``(reserved_tokens + page_size, layers, kv, heads_per_rank, head_dim)``: row ``s``
    is token slot ``s`` of every layer (``kv=2``: K then V; MLA's latent is ``kv=1``,
    ``kv_heads=1``), so a contiguous slot range is one VA range of one buffer. Layer ``l``'s
    K is ``t[:, l, 0]``; :func:`kvvmm.owner.layer_views` returns each layer's views.

    Args:
        layers, kv_heads, head_dim, reserved_tokens, page_size, dtype, tp: as
            :func:`mha_token_major`.
        kv: tensors per layer and slot: 2 (K and V) or 1 (MLA's latent).
    Returns:
        One desc with ``tokens_per_row == 1``.
    Raises:
        ArgumentError: a size is not an int > 0, ``kv`` not 1 or 2, or ``tp`` does not fit
            ``kv_heads``.
        UnknownDtypeError: unknown dtype.
    """
    _check_kv(kv)
    itemsize, hpr = _mha_checks(layers, kv_heads, head_dim, reserved_tokens, page_size,
                                dtype, tp)
    shape = (reserved_tokens + page_size, layers, kv, hpr, head_dim)
    return [KvBufferDesc("kv", shape, layers * kv * hpr * head_dim * itemsize, 1)]


def block_interleaved(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    reserved_tokens: int,
    page_size: int,
    dtype: object,
    tp: int = 1,
    kv: int = 2,
) -> list[KvBufferDesc]:
    """One buffer ``"kv"`` holding every layer's K and V, a row per page.

    Shape ``(pages + 1, layers, kv, page_size, heads_per_rank, head_dim)`` with ``pages =
    ceil(reserved_tokens / page_size)`` (the extra page is the padded page): row ``p`` is page
    ``p`` of every layer, and within it layer ``l``'s K is ``page_size`` contiguous token rows.
    Paged kernels read layer ``l``'s pages as ``t[:, l, 0]``
    (:func:`kvvmm.owner.paged_layer_views`); no flat ``(slots, heads, head_dim)`` view of a
    layer exists, so dense SDPA and ``index_select`` over slots need :func:`layer_interleaved`.

    Args, Returns and Raises: as :func:`layer_interleaved` (one desc, ``tokens_per_row ==
    page_size``).
    """
    _check_kv(kv)
    itemsize, hpr = _mha_checks(layers, kv_heads, head_dim, reserved_tokens, page_size,
                                dtype, tp)
    pages = -(-reserved_tokens // page_size)
    shape = (pages + 1, layers, kv, page_size, hpr, head_dim)
    return [KvBufferDesc("kv", shape, layers * kv * page_size * hpr * head_dim * itemsize,
                         page_size)]


def mla(
    *,
    layers: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    reserved_tokens: int,
    page_size: int,
    dtype: object,
    layout: str = "token_major",
) -> list[KvBufferDesc]:
    """One latent buffer per layer (multi-head latent attention), named kv0..kv(L-1).

    Token-major shape ``(reserved_tokens + page_size, 1, kv_lora_rank + qk_rope_head_dim)``
    (SGLang's MLA pool); page-major ``(pages + 1, 1, page_size, kv_lora_rank + qk_rope_head_dim)``.
    The latent is shared by all heads, so tensor parallelism does not shard it: every rank
    stores the whole buffer.

    Args:
        layers: attention layers, > 0.
        kv_lora_rank: compressed KV width in elements, > 0.
        qk_rope_head_dim: decoupled RoPE key width in elements, > 0.
        reserved_tokens: token slots the pool can ever hold, > 0.
        page_size: tokens per page, > 0.
        dtype: KV dtype.
        layout: ``"token_major"`` or ``"page_major"``.
    Returns:
        ``layers`` descs.
    Raises:
        ArgumentError: a size is not an int > 0 or the layout is unknown.
        UnknownDtypeError: unknown dtype.
    """
    int_arg("layers", layers, lo=1)
    int_arg("kv_lora_rank", kv_lora_rank, lo=1, unit="elements")
    int_arg("qk_rope_head_dim", qk_rope_head_dim, lo=1, unit="elements")
    _check_tokens(reserved_tokens, page_size)
    if _check_layout(layout) in CROSS_LAYER:
        raise ArgumentError("layout", layout, "'token_major' or 'page_major' (for an "
                            "interleaved latent: layer_interleaved or block_interleaved with "
                            "kv=1, kv_heads=1)")
    itemsize = dtype_itemsize(dtype)
    width = kv_lora_rank + qk_rope_head_dim
    if layout == "token_major":
        shape: tuple[int, ...] = (reserved_tokens + page_size, 1, width)
        row_bytes, per_row = width * itemsize, 1
    else:
        pages = -(-reserved_tokens // page_size)
        shape = (pages + 1, 1, page_size, width)
        row_bytes, per_row = page_size * width * itemsize, page_size
    return [KvBufferDesc(f"kv{i}", shape, row_bytes, per_row) for i in range(layers)]


def _check_layout(layout: object) -> str:
    if layout not in LAYOUTS:
        raise ArgumentError("layout", layout, f"one of {list(LAYOUTS)}")
    return str(layout)

"""KV buffer descriptions, layout presets and model configs: what an owner lays out, and why.

Everything here is pure arithmetic over ints: no torch, no driver. A KV cache is a list of
:class:`KvBufferDesc` (SGLang's description of its KV buffers, ``shared/reference/README.md``):
each buffer is a tensor of an upper-bound ``shape`` whose leading dimension counts *rows*; a row
holds ``tokens_per_row`` token slots and takes ``row_bytes`` bytes. The owner backs a buffer's
first rows as tokens arrive, so the spans below are what it commits.

Presets build the lists engines use:

- :func:`mha_token_major`: one K and one V buffer per layer, a row per token (NHD), as SGLang's
  MHA pool, which allocates ``size + page_size`` rows (the extra page absorbs the dummy writes
  that CUDA-graph capture sends to slot 0).
- :func:`page_major`: the same buffers with a row per page (HND: pages, heads, page, head_dim),
  as paged kernels (FlashInfer's HND layout) read them.
- :func:`mla`: one latent buffer per layer (DeepSeek's multi-head latent attention), not
  sharded by tensor parallelism.

Model configs ship as small JSON files of public Hugging Face config fields under
``kvvmm/models/`` (:func:`list_models`, :func:`load_model`). Hybrid sliding-window models
(gpt-oss, Gemma 3) need two pools (:func:`hybrid_swa_descs`), one per owner.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvvmm.errors import ArgumentError, OutOfRangeError, UnknownDtypeError
from kvvmm.units import align_up

__all__ = [
    "DTYPE_ITEMSIZE",
    "FULL_ATTENTION",
    "LAYOUTS",
    "SLIDING_ATTENTION",
    "KvBufferDesc",
    "ModelConfig",
    "dtype_itemsize",
    "dtype_name",
    "heads_per_rank",
    "hybrid_swa_descs",
    "kv_bytes_per_token",
    "list_models",
    "load_model",
    "mha_token_major",
    "mla",
    "model_descs",
    "page_major",
    "swa_kv_bytes_per_token",
    "swa_reserved_tokens_default",
]

#: Bytes per element of every KV dtype kvvmm knows, by torch's name for it.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# Short names people type on a command line; each maps to exactly one torch name.
_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}

#: ``layer_types`` values, as Hugging Face configs spell them.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

#: Layouts :func:`model_descs` builds.
LAYOUTS = ("token_major", "page_major")


# -- argument checks ---------------------------------------------------------------------------


def _positive_int(name: str, value: object, unit: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        what = f"an int > 0{f' ({unit})' if unit else ''}"
        raise ArgumentError(name, value, what)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- dtypes ------------------------------------------------------------------------------------


def dtype_name(dtype: object) -> str:
    """The torch name of a KV dtype, from a name or a torch dtype object (torch not imported).

    Args:
        dtype: ``"bfloat16"``, ``"torch.bfloat16"``, a short alias (``"bf16"``, ``"fp16"``,
            ``"half"``, ``"fp32"``, ``"float"``) or a ``torch.dtype`` (read through ``str()``).
    Returns:
        One of :data:`DTYPE_ITEMSIZE`'s keys (``"bfloat16"``).
    Raises:
        UnknownDtypeError: the dtype is none of those; the message lists the known names.
    """
    if isinstance(dtype, str) or type(dtype).__name__ == "dtype":
        text = str(dtype).strip().lower()
        text = text.removeprefix("torch.")
        text = _DTYPE_ALIASES.get(text, text)
        if text in DTYPE_ITEMSIZE:
            return text
    raise UnknownDtypeError(
        "dtype", dtype, f"one of {sorted(DTYPE_ITEMSIZE)} (a name or a torch dtype)"
    )


def dtype_itemsize(dtype: object) -> int:
    """Bytes per element of a KV dtype.

    Args:
        dtype: a name or torch dtype, as :func:`dtype_name` takes.
    Returns:
        The element size in bytes (``2`` for ``bfloat16``).
    Raises:
        UnknownDtypeError: the dtype is unknown.
    """
    return DTYPE_ITEMSIZE[dtype_name(dtype)]


# -- buffer descriptions -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KvBufferDesc:
    """One KV buffer: an upper-bound tensor whose leading dimension counts rows of tokens.

    Spans are the bytes from the buffer's start that must be backed; they follow SGLang's
    ``KvBufferDesc`` exactly (``shared/reference/README.md``).
    """

    name: str  #: buffer name (``"k0"``, ``"v31"``, ``"kv60"``), unique within a pool
    shape: tuple[int, ...]  #: the tensor's upper-bound shape; ``shape[0]`` counts rows
    row_bytes: int  #: bytes of one row (one leading-dimension index)
    tokens_per_row: int  #: token slots per row: 1 (token-major) or the page size (page-major)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ArgumentError("name", self.name, "a non-empty str")
        shape: object = self.shape  # typed loosely: callers may pass anything
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or not shape:
            raise ArgumentError("shape", shape, "a non-empty tuple of ints > 0")
        for dim in shape:
            if not _is_int(dim) or dim <= 0:
                raise ArgumentError(
                    "shape", shape, "a non-empty tuple of ints > 0", f"buffer {self.name!r}"
                )
        # Frozen: normalise a list to a tuple through object.__setattr__ (dataclass idiom).
        object.__setattr__(self, "shape", tuple(shape))
        _positive_int("row_bytes", self.row_bytes, "bytes")
        _positive_int("tokens_per_row", self.tokens_per_row, "token slots")

    def rows(self, n_tokens: int) -> int:
        """Rows that hold the first ``n_tokens`` token slots: ``ceil(max(n, 0) / tokens_per_row)``.

        Args:
            n_tokens: token slots; negative counts as 0.
        Returns:
            A row count (``17`` tokens in 16-token pages -> ``2`` rows).
        Raises:
            ArgumentError: ``n_tokens`` is not an int.
        """
        if not _is_int(n_tokens):
            raise ArgumentError("n_tokens", n_tokens, "an int (token slots)")
        return -(-max(n_tokens, 0) // self.tokens_per_row)

    def reserved_span_bytes(self, itemsize: int) -> int:
        """Bytes of the whole upper-bound tensor: ``prod(shape) * itemsize``.

        Args:
            itemsize: bytes per element (:func:`dtype_itemsize`).
        Returns:
            The reserved span in bytes.
        Raises:
            ArgumentError: ``itemsize`` is not an int > 0.
        """
        _positive_int("itemsize", itemsize, "bytes")
        return math.prod(self.shape) * itemsize

    def prefix_span_bytes(self, n_tokens: int, page_size: int) -> int:
        """Bytes that make the first ``n_tokens`` token slots usable: ``rows(n) * row_bytes``.

        Args:
            n_tokens: token slots.
            page_size: tokens per page (checked, not used: the row size already holds it).
        Returns:
            The prefix span in bytes.
        Raises:
            ArgumentError: ``n_tokens`` is not an int or ``page_size`` not an int > 0.
        """
        _positive_int("page_size", page_size, "tokens")
        return self.rows(n_tokens) * self.row_bytes

    def final_span_bytes(self, n_tokens: int, page_size: int) -> int:
        """Bytes backed at finalize for ``n_tokens``: ``rows(n + page_size) * row_bytes``.

        The extra page is the padded page that absorbs dummy writes to slot 0 (SGLang sizes
        its pools ``size + page_size``); ``n=17, page_size=16`` in 16-token rows -> 3 rows.

        Args:
            n_tokens: the serving capacity in tokens.
            page_size: tokens per page, > 0.
        Returns:
            The final span in bytes.
        Raises:
            ArgumentError: ``n_tokens`` is not an int or ``page_size`` not an int > 0.
        """
        _positive_int("page_size", page_size, "tokens")
        if not _is_int(n_tokens):
            raise ArgumentError("n_tokens", n_tokens, "an int (token slots)")
        return self.rows(n_tokens + page_size) * self.row_bytes


# -- presets -----------------------------------------------------------------------------------


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
    _positive_int("kv_heads", kv_heads)
    _positive_int("tp", tp, "tensor-parallel ranks")
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
    _positive_int("reserved_tokens", reserved_tokens, "token slots")
    _positive_int("page_size", page_size, "tokens")


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
    """K and V buffers per layer, one row per token (NHD), as SGLang's MHA pool.

    Each buffer has shape ``(reserved_tokens + page_size, heads_per_rank, head_dim)``.

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


def _mha_checks(layers: int, kv_heads: int, head_dim: int, reserved_tokens: int,
                page_size: int, dtype: object, tp: int) -> tuple[int, int]:
    """Check the arguments of an MHA layout; return (itemsize, heads per rank)."""
    _positive_int("layers", layers)
    _positive_int("head_dim", head_dim, "elements")
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
    """K and V buffers per layer, one row per page (HND: pages, heads, page, head_dim).

    Each buffer has shape ``(pages + 1, heads_per_rank, page_size, head_dim)`` with
    ``pages = ceil(reserved_tokens / page_size)``; the extra page is the padded page.

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
    _positive_int("layers", layers)
    _positive_int("kv_lora_rank", kv_lora_rank, "elements")
    _positive_int("qk_rope_head_dim", qk_rope_head_dim, "elements")
    _check_tokens(reserved_tokens, page_size)
    _check_layout(layout)
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


# -- model configs -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The attention geometry of a model: all the KV cache depends on.

    ``layer_types`` is ``None`` when every layer attends to the full context. A config with a
    ``sliding_window`` but no per-layer types (Mistral-7B-v0.1 style, every layer windowed) is
    planned as full attention: a full-size pool is always enough, and engines that do not
    page windows out do exactly that.
    """

    name: str  #: short key (``"llama-3.1-8b"``) or where it came from
    num_layers: int  #: ``num_hidden_layers``
    num_attention_heads: int  #: query heads
    num_kv_heads: int  #: ``num_key_value_heads`` (unused by MLA)
    head_dim: int  #: elements per head (``head_dim``; MLA: nope + rope; else hidden // heads)
    kv_lora_rank: int | None  #: MLA latent width, ``None`` for MHA/GQA
    qk_rope_head_dim: int | None  #: MLA decoupled RoPE width, ``None`` for MHA/GQA
    sliding_window: int | None  #: window in tokens of the sliding layers
    layer_types: tuple[str, ...] | None  #: per layer ``"full_attention"``/``"sliding_attention"``
    source: str  #: where the figures come from

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ArgumentError("name", self.name, "a non-empty str")
        where = f"model {self.name!r}"
        for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not _is_int(value) or value <= 0:
                raise ArgumentError(field, value, "an int > 0", where)
        if self.num_attention_heads % self.num_kv_heads:
            raise ArgumentError(
                "num_kv_heads",
                self.num_kv_heads,
                f"a divisor of num_attention_heads={self.num_attention_heads}",
                where,
            )
        for field in ("kv_lora_rank", "qk_rope_head_dim", "sliding_window"):
            value = getattr(self, field)
            if value is not None and (not _is_int(value) or value <= 0):
                raise ArgumentError(field, value, "an int > 0 or None", where)
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ArgumentError(
                "qk_rope_head_dim",
                self.qk_rope_head_dim,
                "set exactly when kv_lora_rank is set (MLA needs both)",
                f"{where}: kv_lora_rank={self.kv_lora_rank!r}",
            )
        if self.layer_types is not None:
            types: object = self.layer_types
            if isinstance(types, (str, bytes)) or not isinstance(types, Sequence):
                raise ArgumentError("layer_types", types, "a sequence of layer type names", where)
            types = tuple(types)
            if len(types) != self.num_layers:
                raise ArgumentError(
                    "layer_types",
                    f"<{len(types)} entries>",
                    f"one entry per layer ({self.num_layers})",
                    where,
                )
            for t in types:
                if t not in _LAYER_TYPES:
                    raise ArgumentError(
                        "layer_types", t, f"one of {list(_LAYER_TYPES)} per layer", where
                    )
            if SLIDING_ATTENTION in types and self.sliding_window is None:
                raise ArgumentError(
                    "sliding_window", None, "an int > 0 when any layer is sliding_attention", where
                )
            if SLIDING_ATTENTION in types and self.kv_lora_rank is not None:
                raise ArgumentError(
                    "layer_types",
                    "sliding_attention",
                    "full_attention only for an MLA model (kvvmm has no MLA sliding pool)",
                    where,
                )
            object.__setattr__(self, "layer_types", types)
        if not isinstance(self.source, str):
            raise ArgumentError("source", self.source, "a str", where)

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (one latent buffer per layer)."""
        return self.kv_lora_rank is not None

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend to the full context."""
        if self.layer_types is None:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers (empty unless ``layer_types`` says so)."""
        if self.layer_types is None:
            return ()
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION)

    @property
    def is_hybrid_swa(self) -> bool:
        """True when some layers slide and the KV cache needs a second, window-sized pool."""
        return bool(self.sliding_layers)


#: What every function taking a model accepts: a config, or what :func:`load_model` reads.
ModelLike = ModelConfig | str | os.PathLike[str] | Mapping[str, Any]


def _models_dir() -> Any:
    return resources.files("kvvmm").joinpath("models")


def _shipped() -> dict[str, Any]:
    # key -> Traversable of the JSON file; read on demand (a handful of small files).
    out: dict[str, Any] = {}
    for entry in _models_dir().iterdir():
        if entry.name.endswith(".json"):
            out[entry.name.removesuffix(".json")] = entry
    return out


def list_models() -> list[str]:
    """Keys of the model configs shipped in ``kvvmm/models/``, sorted.

    Returns:
        Keys such as ``"llama-3.1-8b"``; each loads with :func:`load_model`.
    """
    return sorted(_shipped())


def _get(cfg: Mapping[str, Any], key: str, where: str, *, required: bool) -> int | None:
    value = cfg.get(key)
    if value is None:
        if required:
            raise ArgumentError(key, None, "present in the config (an int > 0)", where)
        return None
    if not _is_int(value) or value <= 0:
        raise ArgumentError(key, value, "an int > 0", where)
    return int(value)


def _layer_types_from_hf(
    cfg: Mapping[str, Any], layers: int, window: int | None, where: str
) -> tuple[str, ...] | None:
    raw = cfg.get("layer_types")
    if raw is not None:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
            raise ArgumentError("layer_types", raw, "a list of layer type names", where)
        return tuple(raw)
    if window is None:
        return None
    pattern = cfg.get("sliding_window_pattern")
    if pattern is not None:
        # Gemma 3: every pattern-th layer is global, the others slide (transformers'
        # Gemma3TextConfig: sliding unless (i + 1) % pattern == 0).
        if not _is_int(pattern) or pattern <= 0:
            raise ArgumentError("sliding_window_pattern", pattern, "an int > 0", where)
        return tuple(
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)
        )
    if cfg.get("use_sliding_window") is True and cfg.get("max_window_layers") is not None:
        # Qwen2: the first max_window_layers layers attend fully, the rest slide.
        mwl = cfg["max_window_layers"]
        if not _is_int(mwl) or mwl < 0:
            raise ArgumentError("max_window_layers", mwl, "an int >= 0", where)
        return tuple(FULL_ATTENTION if i < mwl else SLIDING_ATTENTION for i in range(layers))
    return None


def _from_hf(cfg: Mapping[str, Any], name: str, source: str) -> ModelConfig:
    where = f"model {name!r}"
    text = cfg.get("text_config")
    if cfg.get("num_hidden_layers") is None and isinstance(text, Mapping):
        # Multimodal wrappers (Gemma 3) nest the decoder's fields under text_config.
        cfg = text
    layers = _get(cfg, "num_hidden_layers", where, required=True)
    heads = _get(cfg, "num_attention_heads", where, required=True)
    assert layers is not None and heads is not None  # required=True never returns None
    kv_heads = _get(cfg, "num_key_value_heads", where, required=False) or heads
    head_dim = _get(cfg, "head_dim", where, required=False)
    nope = _get(cfg, "qk_nope_head_dim", where, required=False)
    rope = _get(cfg, "qk_rope_head_dim", where, required=False)
    if head_dim is None and nope is not None and rope is not None:
        # MLA (DeepSeek): a query/key head is nope + rope wide; the KV cache ignores it.
        head_dim = nope + rope
    if head_dim is None:
        hidden = _get(cfg, "hidden_size", where, required=False)
        if hidden is None:
            raise ArgumentError(
                "head_dim", None, "present, or hidden_size present to derive it", where
            )
        if hidden % heads:
            raise ArgumentError(
                "hidden_size", hidden, f"a multiple of num_attention_heads={heads}", where
            )
        head_dim = hidden // heads
    window = _get(cfg, "sliding_window", where, required=False)
    if cfg.get("use_sliding_window") is False:
        # Qwen2 configs carry sliding_window=131072 with the window switched off.
        window = None
    return ModelConfig(
        name=name,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_lora_rank=_get(cfg, "kv_lora_rank", where, required=False),
        qk_rope_head_dim=rope,
        sliding_window=window,
        layer_types=_layer_types_from_hf(cfg, layers, window, where),
        source=source,
    )


def _read_json(text: str, where: str) -> Mapping[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ArgumentError("model", where, "a JSON object of HF config fields", str(e)) from None
    if not isinstance(data, Mapping):
        raise ArgumentError("model", where, "a JSON object of HF config fields")
    return data


def _normalise_key(text: str) -> str:
    return text.strip().lower().replace("_", "-").replace(" ", "-")


def load_model(model: ModelLike, *, name: str | None = None) -> ModelConfig:
    """Load a model's attention geometry from a shipped key, a JSON file or a config dict.

    Args:
        model: a shipped key (``"llama-3.1-8b"``, see :func:`list_models`) or its Hugging Face
            repo id (``"meta-llama/Llama-3.1-8B"``); a path to a ``config.json`` (or a
            directory holding one); or a mapping of Hugging Face config fields
            (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``head_dim`` or ``hidden_size``, ``kv_lora_rank``, ``qk_rope_head_dim``,
            ``sliding_window``, ``layer_types`` or ``sliding_window_pattern``; a nested
            ``text_config`` is read when the top level has no layers).
        name: the name to give the config; defaults to the key, ``_name_or_path`` or the path.
    Returns:
        The :class:`ModelConfig`.
    Raises:
        ArgumentError: unknown key or missing file, bad JSON, a missing or invalid field.
    """
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, Mapping):
        label = name or str(model.get("_name") or model.get("_name_or_path") or "<dict>")
        return _from_hf(model, label, str(model.get("_source", "a config dict")))
    if not isinstance(model, (str, os.PathLike)):
        raise ArgumentError(
            "model", model, "a shipped model key, a path to a config.json, or a dict"
        )
    shipped = _shipped()
    text = os.fspath(model)
    key = _normalise_key(text)
    entry = shipped.get(key)
    if entry is None:
        for k, e in shipped.items():
            data = _read_json(e.read_text(encoding="utf-8"), k)
            if str(data.get("_name", "")).lower() == text.strip().lower():
                key, entry = k, e
                break
    if entry is not None:
        data = _read_json(entry.read_text(encoding="utf-8"), key)
        return _from_hf(data, name or key, str(data.get("_source", f"kvvmm/models/{key}.json")))
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        data = _read_json(path.read_text(encoding="utf-8"), str(path))
        label = name or str(data.get("_name") or data.get("_name_or_path") or path)
        return _from_hf(data, label, str(data.get("_source", str(path))))
    raise ArgumentError(
        "model", model, f"one of {sorted(shipped)} or a path to an existing config.json"
    )


def _as_model(model: ModelLike) -> ModelConfig:
    return load_model(model)


def _gqa_descs(
    layers: int,
    model: ModelConfig,
    layout: str,
    reserved_tokens: int,
    page_size: int,
    dtype: object,
    tp: int,
) -> list[KvBufferDesc]:
    preset = mha_token_major if layout == "token_major" else page_major
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

    MLA models get :func:`mla` (not sharded); the others :func:`mha_token_major` or
    :func:`page_major`.

    Args:
        model: a :class:`ModelConfig` or anything :func:`load_model` takes.
        layout: ``"token_major"`` or ``"page_major"``.
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
    m = _as_model(model)
    _check_layout(layout)
    _positive_int("tp", tp, "tensor-parallel ranks")
    if m.is_hybrid_swa:
        raise ArgumentError(
            "model",
            m.name,
            "a model without sliding-window layers",
            f"{len(m.sliding_layers)} of its {m.num_layers} layers slide; "
            "use hybrid_swa_descs() for its full and sliding-window pools",
        )
    if m.is_mla:
        assert m.kv_lora_rank is not None and m.qk_rope_head_dim is not None
        return mla(
            layers=m.num_layers,
            kv_lora_rank=m.kv_lora_rank,
            qk_rope_head_dim=m.qk_rope_head_dim,
            reserved_tokens=reserved_tokens,
            page_size=page_size,
            dtype=dtype,
            layout=layout,
        )
    return _gqa_descs(m.num_layers, m, layout, reserved_tokens, page_size, dtype, tp)


def swa_reserved_tokens_default(model: ModelLike, *, reserved_tokens: int, page_size: int) -> int:
    """Default capacity of a sliding-window pool: one sequence's window, page-rounded.

    ``min(reserved_tokens, align_up(sliding_window, page_size) + page_size)``: the window in
    whole pages plus the page being written. This holds the live window of *one* sequence;
    engines serving many sequences size the pool for all of them (SGLang's
    ``swa_full_tokens_ratio``), so pass ``swa_reserved_tokens`` for a serving plan.

    Args:
        model: a hybrid sliding-window model.
        reserved_tokens: the full pool's capacity in tokens, > 0.
        page_size: tokens per page, > 0.
    Returns:
        Token slots for the sliding-window pool.
    Raises:
        ArgumentError: bad sizes, or the model has no sliding-window layers.
    """
    m = _as_model(model)
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

    Each pool is one owner. Buffers are named within their pool (k0.. then v0..): the full
    pool's layer ``i`` is model layer ``model.full_layers[i]``, the sliding pool's layer ``i``
    is ``model.sliding_layers[i]``.

    Args:
        model: a hybrid sliding-window model (gpt-oss, Gemma 3).
        reserved_tokens: the full pool's capacity in tokens, > 0.
        swa_reserved_tokens: the sliding pool's capacity, in ``[1, reserved_tokens]``;
            default :func:`swa_reserved_tokens_default` (one sequence's window).
        page_size: tokens per page, > 0.
        dtype: KV dtype.
        tp: tensor-parallel size.
        layout: ``"token_major"`` or ``"page_major"``.
    Returns:
        ``(full_descs, swa_descs)``; ``full_descs`` is empty if every layer slides.
    Raises:
        ArgumentError: bad sizes or layout, ``tp`` not fitting, not a hybrid model, or
            ``swa_reserved_tokens`` outside ``[1, reserved_tokens]``.
        UnknownDtypeError: unknown dtype.
    """
    m = _as_model(model)
    _check_layout(layout)
    swa_default = swa_reserved_tokens_default(
        m, reserved_tokens=reserved_tokens, page_size=page_size
    )
    if swa_reserved_tokens is None:
        swa_tokens = swa_default
    else:
        _positive_int("swa_reserved_tokens", swa_reserved_tokens, "token slots")
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

    MHA/GQA: ``full_layers * 2 * heads_per_rank * head_dim * itemsize``; MLA:
    ``layers * (kv_lora_rank + qk_rope_head_dim) * itemsize`` on every rank. Sliding-window
    layers are not counted (:func:`swa_kv_bytes_per_token`).

    Args:
        model: a :class:`ModelConfig` or anything :func:`load_model` takes.
        dtype: KV dtype.
        tp: tensor-parallel size.
    Returns:
        Bytes per token per rank (Llama-3.1-8B bf16: 131072).
    Raises:
        ArgumentError: ``tp`` invalid or not fitting the KV heads.
        UnknownDtypeError: unknown dtype.
    """
    m = _as_model(model)
    itemsize = dtype_itemsize(dtype)
    _positive_int("tp", tp, "tensor-parallel ranks")
    if m.is_mla:
        assert m.kv_lora_rank is not None and m.qk_rope_head_dim is not None
        return m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * itemsize
    hpr = heads_per_rank(m.num_kv_heads, tp)
    return len(m.full_layers) * 2 * hpr * m.head_dim * itemsize


def swa_kv_bytes_per_token(model: ModelLike, dtype: object, tp: int = 1) -> int:
    """KV bytes one token takes in the sliding-window layers on one rank (0 if none).

    Args:
        model: a :class:`ModelConfig` or anything :func:`load_model` takes.
        dtype: KV dtype.
        tp: tensor-parallel size.
    Returns:
        ``sliding_layers * 2 * heads_per_rank * head_dim * itemsize``.
    Raises:
        ArgumentError: ``tp`` invalid or not fitting the KV heads.
        UnknownDtypeError: unknown dtype.
    """
    m = _as_model(model)
    itemsize = dtype_itemsize(dtype)
    hpr = heads_per_rank(m.num_kv_heads, tp)
    return len(m.sliding_layers) * 2 * hpr * m.head_dim * itemsize

"""Model configs from public Hugging Face config fields, and the weights they imply.

Configs ship as small JSON files under ``kvvmm/layout/models/``; any HF ``config.json``
loads too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvvmm.checks import int_arg, is_int
from kvvmm.dtypes import dtype_itemsize, dtype_name
from kvvmm.errors import ArgumentError, KvvmmError

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "ModelConfig",
    "ModelLike",
    "list_models",
    "load_model",
    "weights_bytes_per_rank",
]

#: ``layer_types`` values, as Hugging Face configs spell them.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The attention geometry of a model: all the KV cache depends on.

    ``layer_types`` is ``None`` when every layer attends to the full context; a
    ``sliding_window`` without per-layer types is planned as full attention (a full-size
    pool is always enough).
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
    parameter_count: int | None = None  #: weights' parameters (None: the config lacks sizes)
    #: the dtype its weights are stored in, as its config says: fp8 when
    #: ``quantization_config`` says so, else ``torch_dtype`` (None: the config says neither)
    weights_dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ArgumentError("name", self.name, "a non-empty str")
        where = f"model {self.name!r}"
        for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not is_int(value) or value <= 0:
                raise ArgumentError(field, value, "an int > 0", where)
        if self.num_attention_heads % self.num_kv_heads:
            raise ArgumentError(
                "num_kv_heads",
                self.num_kv_heads,
                f"a divisor of num_attention_heads={self.num_attention_heads}",
                where,
            )
        for field in ("kv_lora_rank", "qk_rope_head_dim", "sliding_window", "parameter_count"):
            value = getattr(self, field)
            if value is not None and (not is_int(value) or value <= 0):
                raise ArgumentError(field, value, "an int > 0 or None", where)
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ArgumentError(
                "qk_rope_head_dim",
                self.qk_rope_head_dim,
                "set exactly when kv_lora_rank is set (MLA needs both)",
                f"{where}: kv_lora_rank={self.kv_lora_rank!r}",
            )
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", self._checked_layer_types(where))
        if not isinstance(self.source, str):
            raise ArgumentError("source", self.source, "a str", where)

    def _checked_layer_types(self, where: str) -> tuple[str, ...]:
        """``layer_types`` as a tuple: one known type per layer, a window for the sliding
        ones, none for an MLA model."""
        types: object = self.layer_types
        if isinstance(types, (str, bytes)) or not isinstance(types, Sequence):
            raise ArgumentError("layer_types", types, "a sequence of layer type names", where)
        types = tuple(types)
        if len(types) != self.num_layers:
            raise ArgumentError("layer_types", f"<{len(types)} entries>",
                                f"one entry per layer ({self.num_layers})", where)
        for t in types:
            if t not in _LAYER_TYPES:
                raise ArgumentError("layer_types", t, f"one of {list(_LAYER_TYPES)} per layer",
                                    where)
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
        return types

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
    return resources.files("kvvmm.layout").joinpath("models")


def _shipped() -> dict[str, Any]:
    # key -> Traversable of the JSON file; read on demand (a handful of small files).
    out: dict[str, Any] = {}
    for entry in _models_dir().iterdir():
        if entry.name.endswith(".json"):
            out[entry.name.removesuffix(".json")] = entry
    return out


def list_models() -> list[str]:
    """Keys of the shipped model configs (``"llama-3.1-8b"``, ...), sorted."""
    return sorted(_shipped())


def _get(cfg: Mapping[str, Any], key: str, where: str, *, required: bool) -> int | None:
    value = cfg.get(key)
    if value is None:
        if required:
            raise ArgumentError(key, None, "present in the config (an int > 0)", where)
        return None
    if not is_int(value) or value <= 0:
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
        if not is_int(pattern) or pattern <= 0:
            raise ArgumentError("sliding_window_pattern", pattern, "an int > 0", where)
        return tuple(
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)
        )
    if cfg.get("use_sliding_window") is True and cfg.get("max_window_layers") is not None:
        # Qwen2: the first max_window_layers layers attend fully, the rest slide.
        mwl = cfg["max_window_layers"]
        if not is_int(mwl) or mwl < 0:
            raise ArgumentError("max_window_layers", mwl, "an int >= 0", where)
        return tuple(FULL_ATTENTION if i < mwl else SLIDING_ATTENTION for i in range(layers))
    return None


def _attention_params(cfg: Mapping[str, Any], hidden: int, head_dim: int, where: str) -> int:
    """Parameters of one attention block (projections; norms and biases where they exist)."""
    heads = _get(cfg, "num_attention_heads", where, required=True) or 0
    kv_lora = _get(cfg, "kv_lora_rank", where, required=False)
    if kv_lora is None:
        kv_heads = _get(cfg, "num_key_value_heads", where, required=False) or heads
        qkv = head_dim * (heads + 2 * kv_heads)
        # Qwen2 always has q/k/v biases; others say so with attention_bias (gpt-oss).
        bias = cfg.get("attention_bias") is True or cfg.get("model_type") == "qwen2"
        return hidden * qkv + heads * head_dim * hidden + (qkv if bias else 0)
    # MLA (DeepSeek-V2/V3): low-rank query and a shared KV latent, decompressed per head.
    nope = _get(cfg, "qk_nope_head_dim", where, required=True) or 0
    rope = _get(cfg, "qk_rope_head_dim", where, required=True) or 0
    v_dim = _get(cfg, "v_head_dim", where, required=False) or nope
    q_lora = _get(cfg, "q_lora_rank", where, required=False)
    q_out = heads * (nope + rope)
    q = hidden * q_out if q_lora is None else hidden * q_lora + q_lora + q_lora * q_out
    kv = hidden * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim)
    return q + kv + heads * v_dim * hidden


def _parameter_count(
    cfg: Mapping[str, Any], outer: Mapping[str, Any], head_dim: int, where: str
) -> int | None:
    """Decoder parameters from HF config fields; ``None`` if a size the sum needs is missing.

    Embeddings (twice unless ``tie_word_embeddings``), per layer attention + MLP (or MoE:
    routed and shared experts of ``moe_intermediate_size`` plus the router, dense for the
    first ``first_k_dense_replace`` layers) + two norms, and the final norm. Vision towers
    and multi-token-prediction layers are not counted: published text-model sizes leave them
    out too; an engine that loads them measures ``free_bytes`` after loading.
    """
    hidden = _get(cfg, "hidden_size", where, required=False)
    inter = _get(cfg, "intermediate_size", where, required=False)
    vocab = _get(cfg, "vocab_size", where, required=False)
    layers = _get(cfg, "num_hidden_layers", where, required=True) or 0
    if hidden is None or inter is None or vocab is None:
        return None
    # DeepSeek, Mixtral/gpt-oss and Qwen-MoE spell the routed expert count three ways.
    experts = next(
        (
            _get(cfg, k, where, required=False) or 0
            for k in ("n_routed_experts", "num_local_experts", "num_experts")
            if cfg.get(k)
        ),
        0,
    )
    dense_mlp = 3 * hidden * inter  # gate, up, down
    moe_inter = _get(cfg, "moe_intermediate_size", where, required=False) or inter
    shared = _get(cfg, "n_shared_experts", where, required=False) or 0
    moe_mlp = (experts + shared) * 3 * hidden * moe_inter + hidden * experts
    first_dense = cfg.get("first_k_dense_replace") or 0
    if not is_int(first_dense) or first_dense < 0:
        raise ArgumentError("first_k_dense_replace", first_dense, "an int >= 0", where)
    n_dense = min(layers, first_dense) if experts else layers
    per_layer = _attention_params(cfg, hidden, head_dim, where) + 2 * hidden
    tied = cfg.get("tie_word_embeddings", outer.get("tie_word_embeddings", True))
    embeddings = vocab * hidden * (1 if tied else 2)
    return (
        embeddings
        + layers * per_layer
        + n_dense * dense_mlp
        + (layers - n_dense) * moe_mlp
        + hidden
    )


def _from_hf(cfg: Mapping[str, Any], name: str, source: str) -> ModelConfig:
    where = f"model {name!r}"
    text = cfg.get("text_config")
    outer = cfg
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
        parameter_count=_parameter_count(cfg, outer, head_dim, where),
        weights_dtype=_weights_dtype(outer, cfg),
    )


#: ``quantization_config`` formats whose weights kvvmm counts in one byte each
_FP8_FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def _weights_dtype(outer: Mapping[str, Any], cfg: Mapping[str, Any]) -> str | None:
    """The stored weights' dtype from a HF config: its fp8 quantization, else
    ``torch_dtype``; None when neither is there or kvvmm has no such dtype."""
    q = outer.get("quantization_config", cfg.get("quantization_config"))
    if isinstance(q, Mapping) and q.get("quant_method") == "fp8":
        return _FP8_FORMATS.get(str(q.get("fmt", "e4m3")))
    if isinstance(q, Mapping) and q.get("quant_method"):
        return None  # quantized in a format kvvmm does not count
    t = outer.get("torch_dtype", cfg.get("torch_dtype"))
    try:
        return dtype_name(t) if isinstance(t, str) else None
    except KvvmmError:
        return None


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
        model: a shipped key (:func:`list_models`) or a Hugging Face repo id its file lists
            (any case); a path to a ``config.json`` or a directory holding one; or a mapping
            of Hugging Face config fields (a nested ``text_config`` is read when the top level
            has no layers).
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
        # A Hugging Face repo id: the shipped file's _name or any of its hf_id list (base and
        # instruct checkpoints share one geometry), compared case-insensitively as the Hub does.
        wanted = text.strip().lower()
        for k, e in shipped.items():
            data = _read_json(e.read_text(encoding="utf-8"), k)
            ids = [data.get("_name", ""), *(data.get("hf_id") or [])]
            if wanted in (str(i).lower() for i in ids):
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


def weights_bytes_per_rank(model: ModelLike, dtype: object = "bfloat16", tp: int = 1) -> int | None:
    """Bytes of the model's weights on one tensor-parallel rank, ``None`` if not known.

    ``ceil(parameter_count * itemsize / tp)``: every weight sharded evenly, as an estimate.
    ``None`` when the config lacks the sizes to count parameters.

    Raises:
        ArgumentError: ``tp`` not an int > 0.
        UnknownDtypeError: unknown dtype.
    """
    m = load_model(model)
    itemsize = dtype_itemsize(dtype)
    int_arg("tp", tp, lo=1, unit="tensor-parallel ranks")
    if m.parameter_count is None:
        return None
    return -(-m.parameter_count * itemsize // tp)

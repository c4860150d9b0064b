"""Facts about the dtypes a KV cache is stored in: names and element sizes, without torch."""

from __future__ import annotations

from kvvmm.errors import UnknownDtypeError

__all__ = ["DTYPE_ITEMSIZE", "dtype_itemsize", "dtype_name"]

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
    """Bytes per element of a KV dtype (a name or torch dtype, as :func:`dtype_name` takes).

    Raises:
        UnknownDtypeError: the dtype is unknown.
    """
    return DTYPE_ITEMSIZE[dtype_name(dtype)]

"""KvBufferDesc: one KV buffer as SGLang describes it, and the spans an owner backs.

A buffer is a tensor of an upper-bound ``shape`` whose leading dimension counts rows of
``tokens_per_row`` token slots, ``row_bytes`` each; the owner backs its first rows as tokens
arrive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvvmm.checks import int_arg, is_int
from kvvmm.errors import ArgumentError

__all__ = ["KvBufferDesc"]


@dataclass(frozen=True, slots=True)
class KvBufferDesc:
    """One KV buffer; its spans (bytes from its start that must be backed) follow SGLang's
    ``KvBufferDesc`` exactly."""

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
            if not is_int(dim) or dim <= 0:
                raise ArgumentError(
                    "shape", shape, "a non-empty tuple of ints > 0", f"buffer {self.name!r}"
                )
        object.__setattr__(self, "shape", tuple(shape))
        int_arg("row_bytes", self.row_bytes, lo=1, unit="bytes")
        int_arg("tokens_per_row", self.tokens_per_row, lo=1, unit="token slots")

    def rows(self, n_tokens: int) -> int:
        """Rows that hold the first ``n_tokens`` token slots (negative counts as 0).

        Raises:
            ArgumentError: ``n_tokens`` is not an int.
        """
        if not is_int(n_tokens):
            raise ArgumentError("n_tokens", n_tokens, "an int (token slots)")
        return -(-max(n_tokens, 0) // self.tokens_per_row)

    def reserved_span_bytes(self, itemsize: int) -> int:
        """Bytes of the whole upper-bound tensor: ``prod(shape) * itemsize``.

        Raises:
            ArgumentError: ``itemsize`` is not an int > 0.
        """
        int_arg("itemsize", itemsize, lo=1, unit="bytes")
        return math.prod(self.shape) * itemsize

    def prefix_span_bytes(self, n_tokens: int, page_size: int) -> int:
        """Bytes that make the first ``n_tokens`` token slots usable: ``rows(n) * row_bytes``
        (``page_size`` is checked, not used: the row size already holds it).

        Raises:
            ArgumentError: ``n_tokens`` is not an int or ``page_size`` not an int > 0.
        """
        int_arg("page_size", page_size, lo=1, unit="tokens")
        return self.rows(n_tokens) * self.row_bytes

    def final_span_bytes(self, n_tokens: int, page_size: int) -> int:
        """Bytes backed at finalize for ``n_tokens``: ``rows(n + page_size) * row_bytes``.

        The extra page is the padded page that absorbs dummy writes to slot 0 (SGLang sizes
        its pools ``size + page_size``).

        Raises:
            ArgumentError: ``n_tokens`` is not an int or ``page_size`` not an int > 0.
        """
        int_arg("page_size", page_size, lo=1, unit="tokens")
        if not is_int(n_tokens):
            raise ArgumentError("n_tokens", n_tokens, "an int (token slots)")
        return self.rows(n_tokens + page_size) * self.row_bytes

"""The decode growth every measurement times: 64 KV buffers (Llama-3-8B-like: 32 layers x K/V,
8 KV heads x 128, bf16, page 64, 2M reserved tokens: ~246 GiB of VA), grown in 4096-token
steps to 500k tokens (122 steps), finalized to 1M."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BENCH_WORKLOAD", "Workload"]

_LAYERS, _HEADS, _DIM, _PAGE, _RESERVED = 32, 8, 128, 64, 2_000_000
_STEP, _GROW_TO, _FINAL = 4096, 500_000, 1_000_000


def _descs() -> list[Any]:
    from kvvmm.layout import mha_token_major

    return mha_token_major(layers=_LAYERS, kv_heads=_HEADS, head_dim=_DIM,
                           reserved_tokens=_RESERVED, page_size=_PAGE, dtype="bfloat16")


@dataclass(frozen=True)
class Workload:
    """The decode growth the elastic sections time: buffers, tokens, steps."""

    layers: int = _LAYERS
    kv_heads: int = _HEADS
    head_dim: int = _DIM
    page_size: int = _PAGE
    reserved_tokens: int = _RESERVED
    step_tokens: int = _STEP
    grow_to_tokens: int = _GROW_TO
    #: ``"token_major"`` (K and V per layer: ``2 x layers`` buffers) or ``"interleaved"``
    #: (one buffer of every layer, :func:`kvvmm.layout.layer_interleaved`): the same bytes
    layout: str = "token_major"

    def descs(self) -> Any:
        from kvvmm.layout import layer_interleaved, mha_token_major

        make = layer_interleaved if self.layout == "interleaved" else mha_token_major
        return make(layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                    reserved_tokens=self.reserved_tokens, page_size=self.page_size,
                    dtype="bfloat16")

    @property
    def buffers(self) -> int:
        return 1 if self.layout == "interleaved" else 2 * self.layers

    @property
    def steps(self) -> int:
        return self.grow_to_tokens // self.step_tokens

    def as_dict(self) -> dict[str, int | str]:
        return {"buffers": self.buffers, "layout": self.layout, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "page_size": self.page_size,
                "reserved_tokens": self.reserved_tokens, "step_tokens": self.step_tokens,
                "grow_to_tokens": self.grow_to_tokens, "steps": self.steps}


BENCH_WORKLOAD = Workload()


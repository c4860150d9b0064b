"""The decode growth every measurement times, defined once: :data:`BENCH_WORKLOAD` (a
Llama-3-8B-like KV cache of 64 buffers grown in 4096-token steps to 500k tokens, finalized to
1M). A smaller one is a ``dataclasses.replace`` of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvvmm.layout import KvBufferDesc
    from kvvmm.owner import KvBufferOwner
    from kvvmm.policy import GrowthPolicy

__all__ = ["BENCH_WORKLOAD", "Workload"]


@dataclass(frozen=True)
class Workload:
    """A decode growth: the KV buffers, their tokens, the steps (bf16 throughout)."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 64
    reserved_tokens: int = 2_000_000
    step_tokens: int = 4096
    grow_to_tokens: int = 500_000
    #: ``"token_major"`` (K and V per layer: ``2 x layers`` buffers) or ``"interleaved"``
    #: (one buffer of every layer, :func:`kvvmm.layout.layer_interleaved`): the same bytes
    layout: str = "token_major"
    #: what the growth is finalized to, where a section finalizes
    finalize_tokens: int = 1_000_000

    def descs(self) -> Any:
        from kvvmm.layout import layer_interleaved, mha_token_major

        make = layer_interleaved if self.layout == "interleaved" else mha_token_major
        return make(layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                    reserved_tokens=self.reserved_tokens, page_size=self.page_size,
                    dtype="bfloat16")

    def owner(self, driver: Any, policy: GrowthPolicy | None = None, *,
              descs: Sequence[KvBufferDesc] | None = None, **options: Any) -> KvBufferOwner:
        """A :class:`~kvvmm.owner.KvBufferOwner` of these buffers on ``driver``.

        Args:
            driver: any driver (a :class:`~kvvmm.measure.timer.TimedDriver` to time it).
            policy: the growth policy (None: the owner's default).
            descs: the buffers, when the caller already made them (default: :meth:`descs`).
            options: passed on (``pool``, ``lookahead_bytes``).
        """
        from kvvmm.owner import KvBufferOwner

        return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=self.page_size,
                             reserved_tokens=self.reserved_tokens,
                             descs=self.descs() if descs is None else descs, policy=policy,
                             **options)

    def decode_steps(self) -> range:
        """The token counts ``ensure_prefix`` is called with, one per decode step."""
        return range(self.step_tokens, self.grow_to_tokens + 1, self.step_tokens)

    @property
    def buffers(self) -> int:
        return 1 if self.layout == "interleaved" else 2 * self.layers

    @property
    def token_bytes_all(self) -> int:
        """Bytes one token takes in all the buffers together (K and V of every layer, bf16)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def steps(self) -> int:
        return self.grow_to_tokens // self.step_tokens

    def as_dict(self) -> dict[str, int | str]:
        return {"buffers": self.buffers, "layout": self.layout, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "page_size": self.page_size,
                "reserved_tokens": self.reserved_tokens, "step_tokens": self.step_tokens,
                "grow_to_tokens": self.grow_to_tokens, "steps": self.steps}


#: What ``kvvmm bench`` grows (and ``kvvmm calibrate``'s full plan).
BENCH_WORKLOAD = Workload()

"""Per-layer views of an interleaved KV buffer (:func:`~kvvmm.layout.layer_interleaved`).

The interleaved tensor is ``(slots, layers, kv, heads, head_dim)``: layer ``l``'s K,
``t[:, l, 0]``, reads like a per-layer token-major buffer with a slot stride ``layers * kv``
times larger (docs/ELASTIC.md: which kernels take it). The block-interleaved tensor
(:func:`~kvvmm.layout.block_interleaved`, ``(pages, layers, kv, page_size, heads,
head_dim)``) has paged views only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvvmm.checks import is_int
from kvvmm.errors import ArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["layer_views", "paged_layer_views"]


def _interleaved(owner_or_tensor: Any) -> torch.Tensor:
    t = owner_or_tensor
    tensors = getattr(owner_or_tensor, "tensors", None)
    if tensors is not None:
        if len(tensors) != 1:
            raise ArgumentError("owner", owner_or_tensor, "an owner of one interleaved buffer "
                                                          f"(it has {len(tensors)})")
        t = tensors[0]
    if getattr(t, "dim", None) is None or t.dim() not in (5, 6):
        raise ArgumentError("tensor", getattr(t, "shape", t),
                            "an interleaved KV tensor of shape (slots, layers, kv, heads, "
                            "head_dim), or a block-interleaved one (pages, layers, kv, "
                            "page_size, heads, head_dim)")
    out: torch.Tensor = t
    return out


def layer_views(owner_or_tensor: Any) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, its K and V (or its one latent) as strided ``(slots, heads, head_dim)``
    views of the interleaved buffer: no copy, the owner's memory.

    Args:
        owner_or_tensor: a :class:`~kvvmm.owner.KvBufferOwner` built on an interleaved
            layout, or its tensor.
    Returns:
        ``[(k0, v0), (k1, v1), ...]`` (``kv=1``: ``[(kv0,), ...]``).
    Raises:
        ArgumentError: not an interleaved owner or tensor; a block-interleaved one, which
            has no flat view (:func:`paged_layer_views` reads it).
    """
    t = _interleaved(owner_or_tensor)
    if t.dim() == 6:
        raise ArgumentError("owner_or_tensor", tuple(t.shape),
                            "the token-interleaved layout (layer_interleaved): a "
                            "block-interleaved buffer has no flat (slots, heads, head_dim) "
                            "view of a layer; paged_layer_views(owner, page_size) reads it")
    return [tuple(t[:, layer, j] for j in range(t.shape[2])) for layer in range(t.shape[1])]


def paged_layer_views(owner_or_tensor: Any, page_size: int) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, K and V as ``(pages, page_size, heads, head_dim)`` views (NHD pages, as
    FlashInfer's paged KV cache lays a page out), with a page stride of ``page_size * layers
    * kv * heads * head_dim`` elements. The slot count must be a multiple of ``page_size``.

    On a block-interleaved buffer ``page_size`` must be its page size.

    Raises:
        ArgumentError: not such an owner or tensor, or a ``page_size`` that does not fit it.
    """
    t = _interleaved(owner_or_tensor)
    if t.dim() == 6:
        if not is_int(page_size) or page_size != t.shape[3]:
            raise ArgumentError("page_size", page_size,
                                f"the block-interleaved buffer's page size ({t.shape[3]})")
        return [tuple(t[:, layer, j] for j in range(t.shape[2]))
                for layer in range(t.shape[1])]
    if not is_int(page_size) or page_size < 1 \
            or t.shape[0] % page_size:
        raise ArgumentError("page_size", page_size,
                            f"an int > 0 dividing the slot count ({t.shape[0]})")
    pages = t.view(t.shape[0] // page_size, page_size, *t.shape[1:])
    return [tuple(pages[:, :, layer, j] for j in range(t.shape[2]))
            for layer in range(t.shape[1])]

"""Whether KV buffer descriptors agree with each other and with an owner's arguments.

Pure functions of :class:`~kvvmm.layout.KvBufferDesc` lists, which the owner calls before
it reserves anything, so a layout can be checked without building one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvvmm.dtypes import dtype_name
from kvvmm.errors import ArgumentError, OutOfRangeError
from kvvmm.layout.desc import KvBufferDesc
from kvvmm.policy import GrowthPolicy

__all__ = ["agreed_page_size", "agreed_reserved_tokens", "check_itemsize", "growth_targets"]


def check_itemsize(descs: Sequence[KvBufferDesc], dtype: object, itemsize: int) -> None:
    """Every desc's row must be ``prod(shape[1:])`` elements of ``dtype``'s itemsize (a
    smaller row_bytes would leave slots reported as backed that are not). Blame ``dtype``
    when every desc agrees on another itemsize, else the first desc that disagrees."""
    implied: list[int | None] = []
    for d in descs:
        elements = math.prod(d.shape[1:])
        implied.append(d.row_bytes // elements if d.row_bytes % elements == 0 else None)
    if all(x == itemsize for x in implied):
        return
    first = implied[0]
    if first is not None and all(x == first for x in implied):
        d = descs[0]
        raise ArgumentError(
            "dtype", dtype, f"a dtype of {first} bytes per element, as the descs say",
            f"{dtype_name(dtype)} has {itemsize}; descs[0] {d.name!r}: row_bytes={d.row_bytes} "
            f"over prod(shape[1:])={math.prod(d.shape[1:])} elements",
        )
    i = next(i for i, x in enumerate(implied) if x != itemsize)
    d = descs[i]
    need = math.prod(d.shape[1:]) * itemsize
    raise ArgumentError(
        f"descs[{i}].row_bytes", d.row_bytes,
        f"{need} = prod(shape[1:]) * itemsize for buffer {d.name!r} of shape {d.shape} "
        f"in {dtype_name(dtype)} ({itemsize} bytes per element)",
    )


def agreed_page_size(descs: Sequence[KvBufferDesc], page_size: int | None) -> int:
    """The page size: page-major descs state it (tokens_per_row); a given one must agree."""
    paged = [(i, d) for i, d in enumerate(descs) if d.tokens_per_row > 1]
    for i, d in paged:
        if math.prod(d.shape[1:]) % d.tokens_per_row:
            raise ArgumentError(f"descs[{i}].shape", d.shape,
                                f"a row of {d.tokens_per_row} token slots (tokens_per_row): "
                                f"prod(shape[1:]) a multiple of it", f"buffer {d.name!r}")
    if paged:
        i0, d0 = paged[0]
        for i, d in paged[1:]:
            if d.tokens_per_row != d0.tokens_per_row:
                raise ArgumentError(f"descs[{i}].tokens_per_row", d.tokens_per_row,
                                    f"{d0.tokens_per_row}, as descs[{i0}] {d0.name!r} "
                                    f"(one page size per owner)", f"buffer {d.name!r}")
        if page_size is None:
            return d0.tokens_per_row
        if page_size != d0.tokens_per_row:
            raise ArgumentError("page_size", page_size,
                                f"{d0.tokens_per_row}, the token slots per row of the "
                                f"page-major descs (descs[{i0}] {d0.name!r}); or leave it out")
        return page_size
    if page_size is None:
        raise ArgumentError("page_size", None, "an int > 0 (tokens): every desc is "
                                               "token-major, so none of them states it")
    return page_size


def agreed_reserved_tokens(descs: Sequence[KvBufferDesc], page_size: int,
                            reserved_tokens: int | None, itemsize: int) -> int:
    """Tokens the owner serves at most: what every buffer holds with its padded page.

    A buffer of ``shape[0]`` rows of ``tokens_per_row`` slots holds ``n`` tokens when its
    final span fits: ``ceil((n + page_size) / tokens_per_row) <= shape[0]``, that is
    ``n <= shape[0] * tokens_per_row - page_size``.
    """
    holds = [d.shape[0] * d.tokens_per_row - page_size for d in descs]
    i = min(range(len(descs)), key=holds.__getitem__)
    d, most = descs[i], holds[i]
    if reserved_tokens is None:
        if most < page_size:
            raise ArgumentError(f"descs[{i}].shape", d.shape,
                                f"room for two pages of {page_size} tokens (one to serve, "
                                f"the padded one)", f"buffer {d.name!r}")
        return most
    if reserved_tokens < page_size:
        raise ArgumentError("reserved_tokens", reserved_tokens, f">= page_size ({page_size})")
    if reserved_tokens > most:
        why = (f"buffer {d.name!r} of shape {d.shape} reserves "
               f"{d.reserved_span_bytes(itemsize)} bytes and holds {most} tokens with its "
               f"padded page (shape[0] * tokens_per_row - page_size = {d.shape[0]} * "
               f"{d.tokens_per_row} - {page_size})")
        if d.tokens_per_row == 1:
            why += "; if the descs were built for a smaller page_size, page_size is the wrong one"
        raise OutOfRangeError("reserved_tokens", reserved_tokens,
                              f"at most {most}, what the descs hold", why)
    return reserved_tokens


def growth_targets(policy: GrowthPolicy, names: Sequence[str], spans: Sequence[int],
                   reserved: Sequence[int], limits: Sequence[int], backed: Sequence[int],
                   granularity: int) -> list[tuple[int, int, int]]:
    """``(i, backed, target)`` for each buffer ``i`` whose ``spans[i]`` exceeds what it has
    ``backed``: the bytes the policy grows it to. Every span is checked before any answer.

    Args:
        policy: the growth policy.
        names: the buffers' names (for errors).
        spans: bytes each buffer must have backed from its start.
        reserved: each buffer's reserved tensor bytes (a span past them is a layout bug,
            never clamped).
        limits: each buffer's reserved bytes rounded up to the granularity.
        backed: bytes each buffer has backed contiguously from its start.
        granularity: the driver's.
    Raises:
        OutOfRangeError: a span outside ``[0, reserved]``.
        ArgumentError: the policy answered short of the span (token slots left unbacked:
            illegal addresses on a GPU), past the limit, or off the granularity.
    """
    for name, span, limit in zip(names, spans, reserved, strict=True):
        if not 0 <= span <= limit:
            raise OutOfRangeError(f"span of {name!r}", span,
                                  f"in [0, {limit}] (its reserved tensor bytes)")
    out = []
    for i, (span, limit, have) in enumerate(zip(spans, limits, backed, strict=True)):
        if span <= have:
            continue
        target = policy.target_bytes(have, span, limit, granularity)
        if not (span <= target <= limit and (target % granularity == 0 or target == limit)):
            raise ArgumentError(
                "policy", policy,
                f"a policy whose target_bytes lies in [{span}, {limit}] and is a multiple of "
                f"{granularity} (it answered {target} for buffer {names[i]!r})")
        out.append((i, have, target))
    return out

"""A planned pool's arithmetic: what finalize backs, and the handles each policy would create.

Buffers with the same shape are counted once, times their number, so a plan costs a few
shape groups, not one owner per buffer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvvmm.errors import ArgumentError
from kvvmm.layout.desc import KvBufferDesc
from kvvmm.policy import (
    Chunked,
    Exact,
    Geometric,
    GrowthPolicy,
    default_policy,
    simulate_growth,
)
from kvvmm.units import MiB, align_up

__all__ = [
    "HandleCount",
    "PoolPlan",
    "check_policies",
    "default_policies",
    "final_backed",
    "fit_tokens",
    "pool_plan",
    "shape_groups",
    "sum_handles",
]


def default_policies() -> tuple[GrowthPolicy, ...]:
    """The policies the planner compares by default: ``Exact()``, the owner's default,
    ``Chunked(64 MiB)`` and ``Geometric(2, 256 MiB)``."""
    return (Exact(), default_policy(), Chunked(64 * MiB), Geometric(2.0, 256 * MiB))


@dataclass(frozen=True, slots=True)
class HandleCount:
    """Handles one growth policy creates while a pool grows by decode steps and finalizes."""

    policy: str  #: the policy, as ``str(policy)`` shows it (``"Chunked(64.0 MiB)"``)
    handles: int  #: handles created over all the pool's buffers (slot-0 page included)
    min_handle_bytes: int  #: the smallest handle
    max_handle_bytes: int  #: the largest handle
    backed_bytes: int  #: bytes backed at the end (the handles' sum; may over-commit the spans)


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """One pool (one owner, one arena) of a plan: its capacity, VA and backing."""

    name: str  #: ``"full"`` (full-attention layers) or ``"swa"`` (sliding-window layers)
    num_layers: int  #: model layers in this pool
    num_buffers: int  #: KV buffers (2 per layer for MHA/GQA, 1 for MLA)
    bytes_per_token: int  #: KV bytes per token slot, over all the pool's buffers, per rank
    budget_bytes: int  #: the share of the budget this pool was sized from
    tokens: int  #: serving capacity in token slots (a multiple of the page size)
    reserved_tokens: int  #: the upper bound the buffers' shapes are built for
    logical_bytes: int  #: ``tokens * bytes_per_token``
    final_span_bytes: int  #: sum of the buffers' final spans at ``tokens`` (with the padded page)
    padding_bytes: int  #: ``final_span_bytes - logical_bytes``
    final_backed_bytes: int  #: what finalize(tokens) backs: each final span rounded up to gran
    granularity_waste_bytes: int  #: ``final_backed_bytes - final_span_bytes``
    reserved_span_bytes: int  #: sum of the buffers' reserved spans (tensor bytes)
    va_reserve_bytes: int  #: VA reserved: each reserved span rounded up to the granularity
    va_slack_bytes: int  #: ``va_reserve_bytes - reserved_span_bytes`` (VA only, no memory)
    handles: tuple[HandleCount, ...]  #: per growth policy, in the order asked


def check_policies(policy: object) -> tuple[GrowthPolicy, ...]:
    if policy is None:
        return default_policies()
    items = (
        tuple(policy)
        if isinstance(policy, Sequence) and not isinstance(policy, (str, bytes))
        else (policy,)
    )
    if not items:
        raise ArgumentError(
            "policy", policy, "a growth policy, a non-empty sequence of them, or None"
        )
    for p in items:
        if not isinstance(p, GrowthPolicy):
            raise ArgumentError(
                "policy", p, "a growth policy (Exact(), Chunked(...), Geometric(...))"
            )
    return items


def shape_groups(descs: Sequence[KvBufferDesc]) -> Counter[tuple[int, int]]:
    # Spans depend only on (row_bytes, tokens_per_row): K and V buffers of a layer, and all
    # layers of a pool, share them, so every sum is a handful of multiplications.
    return Counter((d.row_bytes, d.tokens_per_row) for d in descs)


def _rows(n: int, per_row: int) -> int:
    return -(-max(n, 0) // per_row)


def final_backed(groups: Counter[tuple[int, int]], tokens: int, page: int, gran: int) -> int:
    return sum(
        count * align_up(_rows(tokens + page, per_row) * row_bytes, gran)
        for (row_bytes, per_row), count in groups.items()
    )


def fit_tokens(
    budget: int,
    bpt: int,
    groups: Counter[tuple[int, int]],
    page: int,
    gran: int,
    count_overhead: bool,
) -> int:
    """The most tokens (a multiple of ``page``) whose cost fits ``budget``; 0 if none."""
    if budget < 0:
        return 0
    pages = budget // bpt // page  # logical cost only: the SGLang rule
    if not count_overhead:
        return pages * page
    # final_backed(t) >= t * bpt, so the answer lies in [0, pages]; it is monotonic in t.
    lo, hi = 0, pages
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if final_backed(groups, mid * page, page, gran) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * page


def _needs(desc: KvBufferDesc, tokens: int, page: int, step: int) -> Iterator[int]:
    # The owner's life: slot-0 page before capture, decode growth, then finalize.
    yield desc.prefix_span_bytes(page, page)
    n = step
    while n < tokens:
        yield desc.prefix_span_bytes(n, page)
        n += step
    yield desc.prefix_span_bytes(tokens, page)
    yield desc.final_span_bytes(tokens, page)


def _handle_counts(
    descs: Sequence[KvBufferDesc],
    policies: Sequence[GrowthPolicy],
    itemsize: int,
    tokens: int,
    page: int,
    step: int,
    gran: int,
) -> tuple[HandleCount, ...]:
    # Buffers of equal shape and rows grow identically: simulate one of each kind.
    kinds = Counter((d.shape, d.row_bytes, d.tokens_per_row) for d in descs)
    first = {(d.shape, d.row_bytes, d.tokens_per_row): d for d in descs}
    out = []
    for policy in policies:
        count, backed, all_sizes = 0, 0, []
        for kind, n_buffers in kinds.items():
            d = first[kind]
            limit = align_up(d.reserved_span_bytes(itemsize), gran)
            sizes = simulate_growth(policy, _needs(d, tokens, page, step), limit, gran)
            count += n_buffers * len(sizes)
            backed += n_buffers * sum(sizes)
            all_sizes += sizes
        out.append(
            HandleCount(
                str(policy), count, min(all_sizes, default=0), max(all_sizes, default=0), backed
            )
        )
    return tuple(out)


def pool_plan(
    name: str,
    num_layers: int,
    descs: Sequence[KvBufferDesc],
    *,
    bpt: int,
    budget: int,
    tokens: int,
    reserved_tokens: int,
    itemsize: int,
    page: int,
    gran: int,
    step: int,
    policies: Sequence[GrowthPolicy],
) -> PoolPlan:
    final_span = sum(d.final_span_bytes(tokens, page) for d in descs)
    backed = sum(align_up(d.final_span_bytes(tokens, page), gran) for d in descs)
    reserved_span = sum(d.reserved_span_bytes(itemsize) for d in descs)
    va = sum(align_up(d.reserved_span_bytes(itemsize), gran) for d in descs)
    logical = tokens * bpt
    return PoolPlan(
        name=name,
        num_layers=num_layers,
        num_buffers=len(descs),
        bytes_per_token=bpt,
        budget_bytes=budget,
        tokens=tokens,
        reserved_tokens=reserved_tokens,
        logical_bytes=logical,
        final_span_bytes=final_span,
        padding_bytes=final_span - logical,
        final_backed_bytes=backed,
        granularity_waste_bytes=backed - final_span,
        reserved_span_bytes=reserved_span,
        va_reserve_bytes=va,
        va_slack_bytes=va - reserved_span,
        handles=_handle_counts(descs, policies, itemsize, tokens, page, step, gran),
    )


def sum_handles(pools: Sequence[PoolPlan]) -> tuple[HandleCount, ...]:
    out = []
    for i, first in enumerate(pools[0].handles):
        rows = [p.handles[i] for p in pools]
        sizes = [r for r in rows if r.handles]
        out.append(
            HandleCount(
                first.policy,
                sum(r.handles for r in rows),
                min((r.min_handle_bytes for r in sizes), default=0),
                max((r.max_handle_bytes for r in sizes), default=0),
                sum(r.backed_bytes for r in rows),
            )
        )
    return tuple(out)

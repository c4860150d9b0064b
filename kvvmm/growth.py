"""Decode growth as an experiment: a model's KV buffers grown step by step under each policy.

Every policy gets a real :class:`~kvvmm.owner.KvBufferOwner` on a fresh driver, grown by
``ensure_prefix`` once per decode step; the result records handles, driver calls,
over-commit and the bandwidth the handle sizes predict.
"""

from __future__ import annotations

import itertools
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvvmm.checks import int_arg
from kvvmm.driver import Driver, driver_for
from kvvmm.hardware import predicted_bandwidth_tb_s
from kvvmm.hardware.bandwidth import BANDWIDTH_TARGET, RatioBand, predicted_ratio
from kvvmm.layout import KvBufferDesc
from kvvmm.layout.model_buffers import full_pool_descs
from kvvmm.owner import KvBufferOwner
from kvvmm.policy import GrowthPolicy, simulate_growth
from kvvmm.units import align_up

__all__ = ["GrowthCost", "GrowthResult", "decode_growth", "first_layers", "growth_cost",
           "least_over_commit"]

#: ``progress(done, total)``: called after every decode step of every policy.
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class GrowthResult:
    """One growth policy's run of a decode-growth workload on one driver."""

    policy: str  #: ``str(policy)``
    driver: str  #: driver kind the owner ran on
    buffers: int  #: KV buffers that grew together
    handles: int  #: handles backing the buffers at the end (slot-0 pages included)
    driver_calls: int  #: create/map/set_access calls during growth
    min_handle_bytes: int
    max_handle_bytes: int
    handle_bytes: tuple[int, ...]  #: every handle's size at the end, in VA order
    backed_bytes: int  #: backed at the end
    needed_bytes: int  #: what the prefix spans needed at the end
    max_over_commit_bytes: int  #: largest ``backed - needed`` seen after any step
    predicted_tb_s: float  #: copy bandwidth predicted from the handle sizes (H200 table)
    #: the same as a ratio to cudaMalloc's, with the band of the runs it was fitted to
    predicted_ratio: RatioBand
    sim_us: float  #: simulated driver time of the growth (0 on real drivers)
    wall_s: float  #: wall time of the growth steps
    tokens: tuple[int, ...]  #: token count after each step
    backed_by_step: tuple[int, ...]  #: backed bytes after each step
    needed_by_step: tuple[int, ...]  #: needed bytes after each step

    @property
    def over_commit_bytes(self) -> int:
        """Backed beyond what the final prefix needs."""
        return self.backed_bytes - self.needed_bytes


def first_layers(descs: list[KvBufferDesc], layers: int | None) -> list[KvBufferDesc]:
    """The buffers of the first ``layers`` layers (by the number in their names; all of
    them for None): what :func:`decode_growth` grows, and the growth lab with it."""
    if layers is None:
        return descs
    int_arg("layers", layers, lo=1, limit="an int >= 1 or None")
    keep = [d for d in descs if int(re.sub(r"^\D+", "", d.name) or 0) < layers]
    return keep or descs


def _needed_fn(descs: Sequence[KvBufferDesc], page_size: int) -> Callable[[int], int]:
    """``n -> sum of every buffer's prefix span``, computed once per distinct geometry."""
    kinds = Counter(replace(d, name="_") for d in descs)
    return lambda n: sum(c * d.prefix_span_bytes(n, page_size) for d, c in kinds.items())


def decode_growth(
    policies: Sequence[GrowthPolicy],
    *,
    driver: str | Callable[[], Driver] = "sim",
    profile: str = "h200",
    model: str = "llama-3.1-8b",
    layers: int | None = None,
    dtype: str = "bfloat16",
    page_size: int = 16,
    tp: int = 1,
    tokens: int = 32768,
    step_tokens: int = 256,
    reserved_tokens: int | None = None,
    progress: Progress | None = None,
) -> list[GrowthResult]:
    """Grow a model's KV buffers by decode steps under each policy, on a real owner each.

    Args:
        policies: growth policies to compare.
        driver: ``"sim"``, ``"host"``, ``"cuda"``, or a zero-argument driver factory.
        profile: the sim driver's device profile (checked, and unused, on real drivers).
        model: a shipped model key (hybrid models grow their full-attention pool).
        layers: use only the first ``layers`` layers (None: all), to keep runs small.
        dtype, page_size, tp: the layout.
        tokens: tokens to grow to, > 0.
        step_tokens: tokens per decode step, > 0.
        reserved_tokens: tokens each buffer reserves (None: ``tokens``).
        progress: called as ``progress(done, total)`` after each step of every policy.
    Returns:
        One :class:`GrowthResult` per policy, in order.
    Raises:
        ArgumentError and friends: ``step_tokens`` or ``layers`` below 1, bad layout
            arguments; DriverError: a failed driver call.
    """
    int_arg("step_tokens", step_tokens, lo=1, limit="an int >= 1")
    reserved = tokens if reserved_tokens is None else reserved_tokens
    descs = first_layers(full_pool_descs(model, layout="token_major", reserved_tokens=reserved,
                                          page_size=page_size, dtype=dtype, tp=tp), layers)
    steps = [*range(step_tokens, tokens, step_tokens), tokens]
    needed_at = _needed_fn(descs, page_size)
    needed = [needed_at(n) for n in steps]  # the same for every policy
    total, done = len(steps) * len(policies), itertools.count(1)

    def tick() -> None:
        if progress is not None:
            progress(next(done), total)

    return [_grow(policy, driver() if callable(driver) else driver_for(driver, profile=profile),
                  descs, steps, needed, dtype=dtype, page_size=page_size, reserved=reserved,
                  tick=tick)
            for policy in policies]


def _grow(policy: GrowthPolicy, drv: Driver, descs: list[KvBufferDesc], steps: list[int],
          needed: list[int], *, dtype: str, page_size: int, reserved: int,
          tick: Callable[[], None]) -> GrowthResult:
    """One policy's growth on its own owner over ``drv``, closed after; ``tick`` per step.

    Driver calls are counted, not traced: each new handle is one ``create``, one ``map`` and
    one ``set_access``.
    """
    owner = KvBufferOwner(driver=drv, dtype=dtype, page_size=page_size,
                          reserved_tokens=reserved, descs=descs, policy=policy)
    try:
        handles0 = owner.snapshot().handles
        clock0 = drv.clock_us  # the sim's simulated time
        backed = []
        t0 = time.perf_counter()
        for n in steps:
            owner.ensure_prefix(n)
            backed.append(owner.backed_bytes)
            tick()
        wall = time.perf_counter() - t0
        sim_us = drv.clock_us - clock0
        snap = owner.snapshot()
    finally:
        owner.close()
    sizes = [m.size_bytes for m in snap.arena.mappings]
    return GrowthResult(
        policy=str(policy), driver=drv.kind, buffers=len(descs), handles=len(sizes),
        driver_calls=3 * (snap.handles - handles0), min_handle_bytes=min(sizes),
        max_handle_bytes=max(sizes), handle_bytes=tuple(sizes),
        backed_bytes=snap.backed_bytes, needed_bytes=needed[-1],
        max_over_commit_bytes=max(b - n for b, n in zip(backed, needed, strict=True)),
        predicted_tb_s=predicted_bandwidth_tb_s(sizes, interleaved=len(descs) > 1),
        predicted_ratio=predicted_ratio(sizes, interleaved=len(descs) > 1),
        sim_us=sim_us, wall_s=wall, tokens=tuple(steps),
        backed_by_step=tuple(backed), needed_by_step=tuple(needed),
    )


def least_over_commit(results: Sequence[GrowthResult], *,
                      target: float = BANDWIDTH_TARGET) -> GrowthResult | None:
    """The policy that keeps the bandwidth target with the least over-commit.

    Among the results whose predicted bandwidth (the fit's median, ``predicted_ratio.mid``)
    is at least ``target`` times cudaMalloc's, the one whose largest over-commit during the
    growth (``max_over_commit_bytes``) is smallest; the first such on a tie. None if no
    result keeps the target.
    """
    keep = [r for r in results if r.predicted_ratio.mid >= target]
    return min(keep, key=lambda r: r.max_over_commit_bytes) if keep else None


@dataclass(frozen=True, slots=True)
class GrowthCost:
    """What a policy backs beyond need while buffers grow to ``tokens`` (no driver)."""

    policy: str  #: ``str(policy)``
    buffers: int  #: buffers that grow together
    tokens: int  #: tokens grown to
    needed_bytes: int  #: what the prefix spans need at ``tokens``
    backed_bytes: int  #: what the policy has backed then
    max_over_commit_bytes: int  #: largest ``backed - needed`` after any step

    @property
    def over_commit_bytes(self) -> int:
        """Backed beyond need at ``tokens``."""
        return self.backed_bytes - self.needed_bytes


def growth_cost(policy: GrowthPolicy, descs: Sequence[KvBufferDesc], *, page_size: int,
                itemsize: int, tokens: int, granularity_bytes: int,
                step_tokens: int = 256) -> GrowthCost:
    """The over-commit a policy causes when ``descs`` grow to ``tokens``, by arithmetic.

    Each buffer replays :func:`~kvvmm.policy.simulate_growth` from its slot-0 page over
    decode steps of ``step_tokens``: the handles a :class:`~kvvmm.owner.KvBufferOwner` would
    create, without a driver.

    Args:
        policy: the growth policy.
        descs: the buffers.
        page_size: tokens per page.
        itemsize: bytes per element of the dtype (the reserved tensor's size).
        tokens: tokens to grow to, >= 1.
        granularity_bytes: the driver's granularity.
        step_tokens: tokens per decode step, >= 1.
    Returns:
        A :class:`GrowthCost`.
    Raises:
        ArgumentError: ``tokens`` or ``step_tokens`` below 1 (or not an int).
    """
    for name, v in (("tokens", tokens), ("step_tokens", step_tokens)):
        int_arg(name, v, lo=1, limit="an int >= 1")
    g = granularity_bytes
    steps = [*range(step_tokens, tokens, step_tokens), tokens]
    kinds = Counter(replace(d, name="_") for d in descs)
    backed_at = [0] * len(steps)
    needed_at = [0] * len(steps)
    for d, count in kinds.items():
        limit = align_up(d.reserved_span_bytes(itemsize), g)
        # The owner backs slot 0's page exactly at construction, then grows by the policy.
        backed = min(align_up(d.prefix_span_bytes(page_size, page_size), g), limit)
        for i, n in enumerate(steps):
            need = d.prefix_span_bytes(n, page_size)
            backed += sum(simulate_growth(policy, [need], limit, g, backed))
            backed_at[i] += count * backed
            needed_at[i] += count * need
    return GrowthCost(policy=str(policy), buffers=len(descs), tokens=tokens,
                      needed_bytes=needed_at[-1], backed_bytes=backed_at[-1],
                      max_over_commit_bytes=max(b - n for b, n in
                                                zip(backed_at, needed_at, strict=True)))

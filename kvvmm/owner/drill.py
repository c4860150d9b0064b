"""A drill for a tensor-parallel world: one rank fails mid-resize, and every rank rolls back.

The function each rank of notebook 08 runs (under torchrun, or
:func:`kvvmm.owner.distributed.spawn`): each rank opens its own simulated GPU and owner, then

1. runs a collective finalize in which one rank's driver fails a chosen call: every rank
   raises :class:`~kvvmm.errors.CollectiveError` and keeps its snapshot;
2. reads the collective budget and finalizes every rank to the most tokens that fit it;
3. gathers every rank's snapshot on rank 0.

It lives in the package because spawned ranks import their function by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvvmm.driver import Fault, FaultyDriver, driver_for
from kvvmm.errors import ArgumentError, CollectiveError
from kvvmm.owner.buffers import KvBufferOwner
from kvvmm.owner.collective import DistributedOwner
from kvvmm.owner.tp import tp_descs
from kvvmm.snapshot import TpSnapshot
from kvvmm.units import GiB

__all__ = ["DEFAULT_FAULT", "DrillRank", "collective_drill"]

#: What fails on the failing rank by default: its third map of the finalize, after every rank
#: agreed, so every rank has mappings to undo.
DEFAULT_FAULT = Fault(call="map", nth=3)


@dataclass(frozen=True, slots=True)
class DrillRank:
    """What one rank of :func:`collective_drill` saw (sent back to the parent as it is)."""

    rank: int  #: this rank
    world: int  #: ranks in the world
    backend: str  #: the process group's backend (``"gloo"`` on loopback)
    error: str | None  #: the failed finalize's CollectiveError (None: it did not fail)
    cause: str | None  #: ``repr`` of that error's cause here (None: not this rank's fault)
    unchanged: bool  #: the owner's snapshot after the failed finalize is the one before
    own_budget_bytes: int  #: this rank's ``max(0, free - headroom) + backed``
    budget_bytes: int  #: the collective budget: the least ``own_budget_bytes`` over ranks
    tokens: int  #: what ``finalize_to_budget`` finalized every rank to
    fit_bytes: tuple[int, int]  #: what a finalize backs for ``tokens`` and ``tokens + 1``
    backed_bytes: int  #: backed after that finalize
    gathered: TpSnapshot | None  #: every rank's snapshot, on rank 0 (None on the others)


def collective_drill(
    rank: int,
    world: int,
    fail_rank: int | None = 1,
    *,
    model: str = "llama-3.1-8b",
    profile: str = "h200",
    reserved_tokens: int = 262144,
    finalize_tokens: int = 131072,
    headroom_bytes: int = 132 * GiB,
    fault: Fault = DEFAULT_FAULT,
    page_size: int = 16,
    dtype: str = "bfloat16",
    timeout_s: float = 30.0,
) -> DrillRank:
    """Run the drill on this rank of an initialised ``torch.distributed`` group.

    ``spawn(collective_drill, 2, 1)`` runs it on two ranks, rank 1 failing. Every rank must
    pass the same arguments.

    Args:
        rank, world: this rank, and ranks in the group.
        fail_rank: the rank whose driver injects ``fault`` into the first finalize; None:
            no rank fails.
        model, profile: the model whose heads the ranks share, the simulated device.
        reserved_tokens, finalize_tokens, page_size, dtype: each rank's owner, and the first
            finalize's tokens.
        headroom_bytes: the memory every rank keeps back from the budget, >= 0.
        fault: what fails on ``fail_rank`` (default :data:`DEFAULT_FAULT`).
        timeout_s: each collective's limit.
    Returns:
        What this rank saw: a :class:`DrillRank`.
    Raises:
        ArgumentError: ``fail_rank`` outside the world; bad layout arguments (as
            :func:`~kvvmm.owner.tp.tp_descs`).
        CollectiveError: a collective after the first finalize failed (not part of the drill).
    """
    import torch.distributed as dist

    if fail_rank is not None and fail_rank not in range(world):
        raise ArgumentError("fail_rank", fail_rank, f"a rank in [0, {world}) or None")
    drv = FaultyDriver(driver_for("sim", profile=profile, device=rank))
    descs = tp_descs(model, tp=world, reserved_tokens=reserved_tokens, page_size=page_size,
                     dtype=dtype)
    owner = KvBufferOwner(driver=drv, dtype=dtype, page_size=page_size,
                          reserved_tokens=reserved_tokens, descs=descs)
    try:
        kv = DistributedOwner(owner, model=model, timeout_s=timeout_s)
        error, cause, unchanged = _failing_finalize(
            kv, drv, fault if rank == fail_rank else None, finalize_tokens)
        free, _ = drv.mem_info()  # this rank's own figure, for the checks
        own = max(0, free - headroom_bytes) + owner.backed_bytes
        budget = kv.budget_bytes(headroom_bytes=headroom_bytes)
        tokens = kv.finalize_to_budget(headroom_bytes=headroom_bytes)
        # what a finalize backs for those tokens and one more: "the most that fit"
        fit = (kv.finalize_bytes(tokens), kv.finalize_bytes(tokens + 1))
        return DrillRank(rank=kv.rank, world=world, backend=str(dist.get_backend()),
                         error=error, cause=cause, unchanged=unchanged, own_budget_bytes=own,
                         budget_bytes=budget, tokens=tokens, fit_bytes=fit,
                         backed_bytes=owner.backed_bytes, gathered=kv.gather_snapshot(dst=0))
    finally:
        owner.close()


def _failing_finalize(kv: DistributedOwner, drv: FaultyDriver, fault: Fault | None,
                      tokens: int) -> tuple[str | None, str | None, bool]:
    """The drill's first finalize, ``fault`` armed on this rank's driver (None: not this
    rank's): the CollectiveError's text and this rank's cause (None if it did not fail, or
    not here), and whether the owner's snapshot after it is the one before."""
    before = kv.owner.snapshot()
    if fault is not None:
        drv.arm(fault)  # after the other ranks agreed: they have mappings to undo
    error = cause = None
    try:
        kv.finalize(tokens)
    except CollectiveError as e:
        error = str(e)
        cause = None if e.__cause__ is None else repr(e.__cause__)
    return error, cause, kv.owner.snapshot() == before

"""The budget rules, once: what fits, who is asked to shed first and for how much.

Pure functions over frozen records: the cross-process ledger (:mod:`kvvmm.budget.ledger`)
and the workload lab's arbiter (:mod:`kvvmm.workload.tenants`) both call them, so what the
lab predicts is what ships. A change to the rules is made here and nowhere else.

Why the most booked tenant is asked first (ties: the earlier registered): it holds the most
of the GPU, so the fewest tenants are disturbed for a shortfall, and bookings are what the
ledger can check (idleness would be each tenant's own unverifiable report). A tenant gives
back what it is asked in one order (:func:`shed_answer`): what loses nothing first (a range
backing's deferred cache and reserve), then what loses work (shrink, preempt, sleep).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Ask", "ShedAnswer", "TenantState", "kv_claim", "refusal", "shed_answer",
           "shed_plan"]


@dataclass(frozen=True, slots=True)
class TenantState:
    """One tenant as the rules see it."""

    name: str
    index: int  #: registration order (the ledger's slot, the lab's position): breaks ties
    limit_bytes: int  #: the most it may book
    booked_bytes: int  #: what it books now
    asked_bytes: int = 0  #: asked of it by standing shed requests and not yet given back


@dataclass(frozen=True, slots=True)
class Ask:
    """A shed request: ``nbytes`` asked of tenant ``name``."""

    name: str
    index: int
    nbytes: int


def refusal(tenant: TenantState, nbytes: int, *, free_bytes: int) -> str | None:
    """Why a charge of ``nbytes`` to ``tenant`` does not fit, or None when it fits.

    A charge fits when ``booked + nbytes <= limit`` (the tenant's own) and
    ``nbytes <= free_bytes`` (the GPU's budget less every tenant's bookings).

    Args:
        tenant: the tenant charged.
        nbytes: bytes, >= 0 (the caller checked them: this is every charge's path).
        free_bytes: the budget's free bytes (may be negative after a budget was lowered).
    Returns:
        ``"limit"`` (past its limit: refused at once, nobody is asked), ``"budget"`` (past
        the free budget: the shortfall may be asked of the others) or None.
    """
    if tenant.booked_bytes + nbytes > tenant.limit_bytes:
        return "limit"
    if nbytes > free_bytes:
        return "budget"
    return None


def shed_plan(others: Iterable[TenantState], short_bytes: int) -> tuple[Ask, ...]:
    """Whom to ask for ``short_bytes``, in order, and how much of each.

    The most booked first (ties: the lower index), each for at most what it books less what
    it is already asked, until the shortfall is covered; tenants with nothing left to ask
    are skipped.

    Args:
        others: every tenant that may be asked (not the asker).
        short_bytes: the shortfall, bytes (<= 0: nobody is asked).
    Returns:
        The asks, in the order they are made; their sum is below ``short_bytes`` only when
        the others together have no more to ask.
    """
    asks: list[Ask] = []
    short = short_bytes
    for t in sorted(others, key=lambda t: (-t.booked_bytes, t.index)):
        if short <= 0:
            break
        add = min(max(t.booked_bytes - t.asked_bytes, 0), short)
        if add > 0:
            asks.append(Ask(t.name, t.index, add))
            short -= add
    return tuple(asks)


@dataclass(frozen=True, slots=True)
class ShedAnswer:
    """How a tenant answers an ask of ``trim_bytes + rest_bytes``."""

    trim_bytes: int  #: from its cache and reserve first: nothing lost, nothing copied
    rest_bytes: int  #: what is left to ask of what loses work (shrink, preempt, sleep)


def shed_answer(asked_bytes: int, *, givable_bytes: int) -> ShedAnswer:
    """Split an ask: the cache and reserve first (up to ``givable_bytes``), then the rest.

    Args:
        asked_bytes: what the tenant is asked for (<= 0: nothing).
        givable_bytes: what it can give back losing nothing (``RangeBacking.givable_bytes``
            summed; the lab's idle backing).
    """
    asked = max(asked_bytes, 0)
    trim = min(asked, max(givable_bytes, 0))
    return ShedAnswer(trim_bytes=trim, rest_bytes=asked - trim)


def kv_claim(limit_bytes: int, booked_bytes: int, budget_bytes: int) -> int:
    """The device memory a tenant's KV counts on: what torch in its process must leave.

    What it may grow to without anyone's leave (its limit, within the GPU's budget), or
    what it books now when that is more (a limit or budget lowered below its booking,
    not yet shed): ``max(booked, min(limit, budget))``.
    """
    return max(booked_bytes, min(limit_bytes, budget_bytes))

"""Memory pressure as a poll: how close the device is to an out-of-memory create, and what
an engine could give back, before an allocation fails.

:func:`poll` asks the driver how much memory is free (``mem_info``: the device's own answer,
every process counted) and compares it with two watermarks the engine chooses; it adds up what
the engine could give back without losing anything: the deferred cache and reserve of its
:class:`~kvvmm.owner.RangeBacking`\\ s (whole units free and mapped:
``RangeBacking.give_back``, within a deadline, off the decode thread), the idle handles of its
:class:`~kvvmm.arena.pool.HandlePool`\\ s (``HandlePool.trim``), and what a
:meth:`KvBufferOwner.sleep <kvvmm.owner.KvBufferOwner.sleep>` of each owner would give back.
One call, no thread, no callback: the engine polls where it already decides (between decode
steps, at admission) and acts on the level.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvvmm.arena.pool import HandlePool
from kvvmm.checks import int_arg
from kvvmm.driver.base import Driver, check_driver
from kvvmm.errors import ArgumentError
from kvvmm.owner.buffers import KvBufferOwner
from kvvmm.owner.elastic import RangeBacking
from kvvmm.units import fmt_bytes

__all__ = ["LEVELS", "Pressure", "poll"]

#: The levels, calmest first.
LEVELS = ("ok", "low", "critical")


@dataclass(frozen=True, slots=True)
class Pressure:
    """One poll's answer (a record: nothing live)."""

    level: str  #: ``"ok"``, ``"low"`` (free below ``low_bytes``) or ``"critical"``
    free_bytes: int  #: the device's free memory (``mem_info``), every process counted
    total_bytes: int  #: the device's memory
    low_bytes: int  #: the watermark below which the level is ``"low"``
    critical_bytes: int  #: the watermark below which it is ``"critical"``
    pool_bytes: int  #: idle handles of the pools polled: ``HandlePool.trim`` frees them now
    sleep_bytes: int  #: backed bytes of the awake owners polled: what their sleep gives back
    #: the range backings' deferred cache and reserve (whole units free and mapped):
    #: ``RangeBacking.give_back`` frees them, no copy, no contents lost
    cache_bytes: int = 0

    @property
    def short_bytes(self) -> int:
        """Bytes missing to get back above ``low_bytes`` (0 at ``"ok"``)."""
        return max(self.low_bytes - self.free_bytes, 0)

    @property
    def advice(self) -> str:
        """What to do, cheapest first: give back the range backings' cache and reserve (no
        copy, no contents lost, no handle kept), trim the pools, then shrink or sleep owners."""
        if self.level == "ok":
            return "nothing to do"
        short = self.short_bytes
        steps = []
        if self.cache_bytes:
            steps.append(f"give back the range backings' cache and reserve "
                         f"({fmt_bytes(self.cache_bytes)} free and mapped)")
        if self.pool_bytes and self.cache_bytes < short:
            steps.append(f"trim the handle pools ({fmt_bytes(self.pool_bytes)} idle)")
        if self.cache_bytes + self.pool_bytes < short:
            steps.append("shrink owners (release_beyond / decommit_slots)")
            if self.sleep_bytes:
                steps.append(f"or sleep owners ({fmt_bytes(self.sleep_bytes)} backed)")
        return ", then ".join(steps) if steps else "free memory held outside kvvmm"

    def __str__(self) -> str:
        return (f"pressure {self.level}: {fmt_bytes(self.free_bytes)} free of "
                f"{fmt_bytes(self.total_bytes)} (low below {fmt_bytes(self.low_bytes)}, "
                f"critical below {fmt_bytes(self.critical_bytes)}); {self.advice}")


def poll(driver: Driver, *, low_bytes: int, critical_bytes: int = 0,
         owners: Iterable[KvBufferOwner] = (), pools: Iterable[HandlePool] = (),
         backings: Iterable[RangeBacking] = ()) -> Pressure:
    """Ask the driver how much memory is free and say how close that is to running out.

    Args:
        driver: the device's driver (``mem_info`` is called once).
        low_bytes: free memory below this is ``"low"`` (act off the decode path now).
        critical_bytes: free memory below this is ``"critical"`` (the next create may fail);
            ``<= low_bytes``.
        owners: owners whose backed bytes count as what a sleep would give back (asleep and
            closed ones count 0).
        pools: handle pools whose idle handles count as what a trim frees now.
        backings: range backings whose cached units (deferred cache and reserve) count as
            what ``give_back`` frees (closed ones count 0).
    Returns:
        A :class:`Pressure`.
    Raises:
        ArgumentError: a bad watermark or a non-driver, non-owner, non-pool or non-backing
            argument.
        DriverError: ``mem_info`` failed.
    """
    check_driver(driver)
    int_arg("low_bytes", low_bytes, lo=0, limit="an int >= 0 (bytes)")
    int_arg("critical_bytes", critical_bytes, lo=0, hi=low_bytes,
            limit=f"an int in [0, low_bytes={low_bytes}] (bytes)")
    owner_list, pool_list, backing_list = list(owners), list(pools), list(backings)
    for i, o in enumerate(owner_list):
        if not isinstance(o, KvBufferOwner):
            raise ArgumentError(f"owners[{i}]", o, "a KvBufferOwner")
    for i, p in enumerate(pool_list):
        if not isinstance(p, HandlePool):
            raise ArgumentError(f"pools[{i}]", p, "a HandlePool")
    for i, b in enumerate(backing_list):
        if not isinstance(b, RangeBacking):
            raise ArgumentError(f"backings[{i}]", b, "a RangeBacking")
    free, total = driver.mem_info()
    level = "critical" if free < critical_bytes else "low" if free < low_bytes else "ok"
    return Pressure(level=level, free_bytes=free, total_bytes=total, low_bytes=low_bytes,
                    critical_bytes=critical_bytes,
                    pool_bytes=sum(p.held_bytes for p in pool_list),
                    sleep_bytes=sum(o.backed_bytes for o in owner_list if not o.asleep),
                    cache_bytes=sum(b.givable_bytes for b in backing_list if not b.closed))

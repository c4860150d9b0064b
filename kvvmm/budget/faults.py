"""FaultyLedger: a ledger whose writes fail (or whose process dies) at chosen points.

The ledger makes every write that books, asks or registers through one method
(``Ledger._put``) naming the change it belongs to: ``"register"``, ``"charge"``,
``"credit"``, ``"shed"``, ``"limit"``, ``"budget"``, ``"unregister"``. This subclass fails
the nth write of a change with an ``OSError`` (what a failing store or lock raises), or
ends the process right there with ``os._exit`` while it holds the ledger's lock: the two
faults the broker must survive without booking a byte twice or losing one
(tests/budget/test_budget_processes.py).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from typing import Any

from kvvmm.budget.ledger import Ledger
from kvvmm.checks import int_arg
from kvvmm.errors import ArgumentError

__all__ = ["POINTS", "FaultyLedger"]

#: the changes whose writes can be made to fail
POINTS = ("register", "charge", "credit", "shed", "limit", "budget", "unregister")


class FaultyLedger(Ledger):
    """A :class:`~kvvmm.budget.ledger.Ledger` that fails chosen writes.

    Args:
        path, budget_bytes, group, lock_timeout_s: as for :class:`Ledger`.
        fail: ``{point: n}``: the nth write of that change (counted from now, 1-based)
            raises ``OSError(EIO)`` before it is made.
        die: ``{point: n}``: the nth write of that change ends the process
            (``os._exit(3)``) before it is made, the ledger's lock held.
    """

    def __init__(self, path: str | os.PathLike[str], *, budget_bytes: int | None = None,
                 fail: Mapping[str, int] | None = None,
                 die: Mapping[str, int] | None = None, **ledger: Any) -> None:
        self._fail: dict[str, int] = {}
        self._die: dict[str, int] = {}
        self._seen: dict[str, int] = {}
        self.injected: list[str] = []  #: the points that were made to fail
        super().__init__(path, budget_bytes=budget_bytes, **ledger)
        self.arm(fail=fail, die=die)

    def arm(self, *, fail: Mapping[str, int] | None = None,
            die: Mapping[str, int] | None = None) -> None:
        """Replace the faults (counts start again from zero)."""
        for kind, faults in (("fail", fail), ("die", die)):
            for point, n in (faults or {}).items():
                if point not in POINTS:
                    raise ArgumentError(f"{kind}[{point!r}]", point, f"one of {list(POINTS)}")
                int_arg(f"{kind}[{point!r}]", n, lo=1, limit="an int >= 1")
        self._fail = dict(fail or {})
        self._die = dict(die or {})
        self._seen = {}

    def _put(self, q: memoryview, index: int, value: int, point: str) -> None:
        n = self._seen[point] = self._seen.get(point, 0) + 1
        if self._die.get(point) == n:
            os._exit(3)
        if self._fail.get(point) == n:
            self.injected.append(point)
            raise OSError(errno.EIO, f"injected: write {n} of {point!r} to the ledger failed")
        super()._put(q, index, value, point)

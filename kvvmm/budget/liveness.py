"""Is the process that registered a tenant still the one running? (Linux ``/proc``)

A pid alone is not enough: pids are reused, so a tenant that died and a new process that
got its pid would look alike. The ledger keeps each tenant's pid *and* its start time (field
22 of ``/proc/<pid>/stat``: clock ticks after boot, fixed for the life of a process); the
pair names one process for as long as the machine is up. A zombie (killed, not yet reaped
by its parent) holds no memory any more and counts as dead.
"""

from __future__ import annotations

import os

__all__ = ["alive", "start_ticks"]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start ticks) of ``pid``, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after
    # the last ')'.
    rest = text.rpartition(b")")[2].split()
    return rest[0].decode("ascii", "replace"), int(rest[19])


def start_ticks(pid: int | None = None) -> int:
    """The start time of ``pid`` (default: this process) in clock ticks after boot.

    Raises:
        ProcessLookupError: no such process.
    """
    st = _stat(os.getpid() if pid is None else pid)
    if st is None:
        raise ProcessLookupError(pid)
    return st[1]


def alive(pid: int, ticks: int) -> bool:
    """True when process ``pid`` runs and started at ``ticks`` (the one that registered)."""
    if pid <= 0:
        return False
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X") and st[1] == ticks

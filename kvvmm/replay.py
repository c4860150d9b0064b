"""Replays: a recorded trace run again, onto any driver (a SimDriver on a laptop).

Two replays of the two lists a :class:`~kvvmm.record.Trace` holds:

- :func:`replay` runs every recorded driver call again and reports the outcomes that differ
  (the sim must refuse what the recording's driver refused);
- :func:`replay_arenas` runs the recorded arena operations again and returns the arenas'
  snapshots, equal to the recorded ones up to ``base``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvvmm.arena import Arena
from kvvmm.driver.base import Driver
from kvvmm.driver.sim import SimDriver, SimNode
from kvvmm.errors import DriverError
from kvvmm.hardware import DeviceProfile, get_profile
from kvvmm.record.trace import Trace
from kvvmm.snapshot import ArenaSnapshot

__all__ = ["Mismatch", "replay", "replay_arenas"]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A replayed call whose outcome differs from the recording."""

    seq: int
    op: str
    recorded: str  #: "ok" or the recorded CUDA error name
    replayed: str  #: "ok" or the replayed CUDA error name


def replay(trace: Trace, driver: Driver) -> list[Mismatch]:
    """Replay every driver call of ``trace`` on ``driver``; return the outcomes that differ.

    Addresses and handles are translated: a recorded reservation maps to the one the replay
    driver handed out, offsets within it kept; recorded handles map to replayed handles.
    Calls that failed in the recording are replayed too: the driver must refuse them again.
    Wrap a :class:`FaultyDriver` *around* the tracing driver, so injected faults (which no
    replay driver can reproduce) never reach the trace.

    Handle sharing: an export is replayed (its descriptor kept for a later import of the
    recorded one); an import of a descriptor that came from elsewhere (another process) is
    replayed as a create of the same size, which maps the same; descriptors left unimported
    are closed at the end.
    """
    va_map: dict[int, tuple[int, int]] = {}  # recorded reservation start -> (replay, size)
    h_map: dict[int, int] = {}
    fd_map: dict[int, int] = {}  # recorded exported fd -> replayed one
    out: list[Mismatch] = []

    def tva(va: int) -> int:
        for start, (new, size) in va_map.items():
            if start <= va < start + size:
                return new + (va - start)
        return va

    for ev in trace.driver_calls():
        a = ev.args
        try:
            if ev.op == "reserve":
                if ev.error is not None:
                    driver.reserve(a["size"], a["align"])
                else:
                    assert ev.result is not None
                    va_map[ev.result] = (driver.reserve(a["size"], a["align"]), a["size"])
            elif ev.op == "free":
                driver.free(tva(a["va"]), a["size"])
                if ev.error is None:
                    va_map.pop(a["va"], None)  # its VA may be handed out again
            elif ev.op == "create":
                h = driver.create(a["size"])
                if ev.result is not None:
                    h_map[ev.result] = h
            elif ev.op == "release":
                driver.release(h_map.get(a["handle"], -1))
            elif ev.op == "map":
                driver.map(tva(a["va"]), a["size"], h_map.get(a["handle"], -1))
            elif ev.op == "unmap":
                driver.unmap(tva(a["va"]), a["size"])
            elif ev.op == "set_access":
                devices = a.get("devices")
                if devices is None:
                    driver.set_access(tva(a["va"]), a["size"])
                else:
                    driver.set_access(tva(a["va"]), a["size"], tuple(devices))
            elif ev.op == "mem_info":
                driver.mem_info()
            elif ev.op == "export_handle":
                fd = driver.export_handle(h_map.get(a["handle"], -1))
                if ev.result is not None:
                    old = fd_map.pop(ev.result, None)
                    if old is not None:
                        os.close(old)
                    fd_map[ev.result] = fd
                else:
                    os.close(fd)
            elif ev.op == "import_handle":
                if ev.error is not None:
                    h = driver.import_handle(-1, a["size"])  # must be refused again
                elif a["fd"] in fd_map:
                    h = driver.import_handle(fd_map[a["fd"]], a["size"])
                    del fd_map[a["fd"]]  # the driver owns it now
                else:  # exported by another process: same-sized memory of our own
                    h = driver.create(a["size"])
                if ev.result is not None:
                    h_map[ev.result] = h
            got = "ok"
        except DriverError as e:
            got = e.cuda_error
        want = ev.error or "ok"
        if got != want:
            out.append(Mismatch(ev.seq, ev.op, want, got))
    for fd in fd_map.values():
        os.close(fd)
    return out


def replay_arenas(trace: Trace, driver: Driver | None = None) -> list[ArenaSnapshot]:
    """Rebuild the arenas a trace recorded, on a SimDriver, and return their snapshots.

    The arena operations noted in the trace (open, allocate, commit, decommit, grant
    access, close) run again on ``driver`` (default: a SimDriver with the recording's
    granularity and the H200's capacity; on the recorded device of a :class:`SimNode` when
    peers were given access), so the snapshots equal the recorded arenas' up to ``base``.
    An adopted (imported) handle is replayed as a commit of the same size.
    """
    if driver is None:
        gran = int(trace.meta.get("granularity", 2 << 20))
        h200 = get_profile("h200")
        profile = DeviceProfile("replay", "replay of " + str(
            trace.meta.get("device_name", "?")), max(h200.capacity_bytes, 1 << 50), gran,
            "a trace replay")
        # Peers granted access need a node of that many devices, on the recorded device.
        device = int(trace.meta.get("device", 0))
        peers = [int(x) for o in trace.ops if o.op == "grant_access"
                 for x in o.args["devices"]]
        if peers or device:
            driver = SimNode(profile, devices=max([device, *peers]) + 1).driver(device)
        else:
            driver = SimDriver(profile)
    arenas: dict[int, Arena] = {}
    for ev in trace.ops:
        a = ev.args
        i = ev.arena
        if ev.op == "open":
            arenas[i] = Arena(driver, reserve_bytes=int(a["reserve_bytes"]), name=str(a["name"]))
        elif ev.op == "allocate":
            arenas[i].allocate(int(a["nbytes"]), str(a["name"]))
        elif ev.op == "commit":
            arenas[i].commit(int(a["offset"]), int(a["nbytes"]))
        elif ev.op == "decommit":
            arenas[i].decommit(int(a["offset"]), int(a["keep_bytes"]))
        elif ev.op == "grant_access":
            arenas[i].grant_access(int(x) for x in a["devices"])
        elif ev.op == "adopt":  # an imported handle: same-sized memory of our own
            off = int(a["offset"])
            arenas[i].commit(off, arenas[i].backed_of(off) + int(a["nbytes"]))
        elif ev.op == "close":
            arenas[i].close()
    return [arenas[i].snapshot() for i in sorted(arenas)]

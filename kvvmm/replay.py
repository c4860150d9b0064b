"""Replays of a recorded :class:`~kvvmm.record.Trace` onto any driver: its driver calls
(:func:`replay`) or its arena operations (:func:`replay_arenas`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from kvvmm.arena import Arena
from kvvmm.driver.base import Driver
from kvvmm.driver.sim import SimDriver, SimNode
from kvvmm.errors import DriverError, KvvmmError, TraceFormatError
from kvvmm.hardware import DeviceProfile, get_profile
from kvvmm.record.trace import ArenaOp, Trace, TraceEvent
from kvvmm.record.validate import label
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

    Raises:
        TraceFormatError: the trace breaks the format (:meth:`Trace.validate`, for traces
            built in memory too), or the replay ran out of something of the OS's (descriptors)
            at the event named.
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

    trace.validate()  # a trace built in memory gets the checks a loaded one got
    try:
        for i, ev in enumerate(trace.driver_calls()):
            try:
                got = _replay_call(driver, ev, tva, va_map, h_map, fd_map)
            except DriverError as e:
                got = e.cuda_error
            except KvvmmError as e:  # named as TracingDriver names a refusal that is not CUDA's
                got = type(e).__name__
            except OSError as e:  # out of descriptors, say: the replay, not the trace, stops
                raise TraceFormatError(f"{label(f'event {i}', ev.seq, ev.op)}: cannot be "
                                       f"replayed here: {e}") from e
            want = ev.error or "ok"
            if got != want:
                out.append(Mismatch(ev.seq, ev.op, want, got))
    finally:  # descriptors exported and never imported are ours to close, even on the way out
        for fd in fd_map.values():
            os.close(fd)
    return out


def _replay_call(driver: Driver, ev: TraceEvent, tva: Callable[[int], int],
                 va_map: dict[int, tuple[int, int]], h_map: dict[int, int],
                 fd_map: dict[int, int]) -> str:
    a = ev.args
    if ev.op == "reserve":
        va = driver.reserve(a["size"], a["align"])
        if ev.result is not None:  # validate() made every successful reserve carry one
            va_map[ev.result] = (va, a["size"])
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
    return "ok"


def replay_arenas(trace: Trace, driver: Driver | None = None) -> list[ArenaSnapshot]:
    """Rebuild the arenas a trace recorded, on a SimDriver, and return their snapshots.

    The recorded arena operations run again on ``driver`` (default: a SimDriver with the
    recording's granularity, on the recorded device of a :class:`SimNode` when peers were
    given access), so the snapshots equal the recorded arenas' up to ``base``. An adopted
    handle is replayed as a commit of the same size at the prefix.

    Raises:
        TraceFormatError: the trace breaks the format (:meth:`Trace.validate`), or the arena
            refuses a recorded operation (a commit beyond its allocation, say): the message
            names the operation (``arena op 4 (seq 9, commit) on arena 0``) and the refusal.
    """
    trace.validate()  # also checks the meta fields read below
    if driver is None:
        gran = trace.meta.get("granularity", 2 << 20)
        h200 = get_profile("h200")
        profile = DeviceProfile("replay", "replay of " + str(
            trace.meta.get("device_name", "?")), max(h200.capacity_bytes, 1 << 50), gran,
            "a trace replay")
        # Peers granted access need a node of that many devices, on the recorded device.
        device = trace.meta.get("device", 0)
        peers = [x for o in trace.ops if o.op == "grant_access" for x in o.args["devices"]]
        if peers or device:
            driver = SimNode(profile, devices=max([device, *peers]) + 1).driver(device)
        else:
            driver = SimDriver(profile)
    arenas: dict[int, Arena] = {}
    for n, ev in enumerate(trace.ops):
        try:
            _replay_op(driver, arenas, ev)
        except KvvmmError as e:  # what the recorded arena did, this one refuses
            raise TraceFormatError(
                f"{label(f'arena op {n}', ev.seq, ev.op)} on arena {ev.arena} cannot be "
                f"replayed: {e}") from e
    return [arenas[i].snapshot() for i in sorted(arenas)]


def _replay_op(driver: Driver, arenas: dict[int, Arena], ev: ArenaOp) -> None:
    a = ev.args
    i = ev.arena
    if ev.op == "open":
        arenas[i] = Arena(driver, reserve_bytes=a["reserve_bytes"], name=a["name"])
    elif ev.op == "allocate":
        off = arenas[i].allocate(a["nbytes"], a["name"])
        if off != a["offset"]:  # later operations name the allocation by its offset
            raise TraceFormatError(f"the allocation landed at offset {off}, recorded at "
                                   f"{a['offset']}")
    elif ev.op == "commit":
        arenas[i].commit(a["offset"], a["nbytes"])
    elif ev.op == "decommit":
        arenas[i].decommit(a["offset"], a["keep_bytes"])
    elif ev.op == "grant_access":
        arenas[i].grant_access(a["devices"])
    elif ev.op == "commit_range":
        arenas[i].commit_range(a["offset"], a["start"], a["nbytes"])
    elif ev.op == "decommit_range":
        arenas[i].decommit_range(a["offset"], a["start"], a["nbytes"])
    elif ev.op == "adopt":  # an imported handle: same-sized memory of our own, at the prefix
        off = a["offset"]
        arenas[i].commit_range(off, arenas[i].prefix_of(off), a["nbytes"])
    elif ev.op == "sleep":  # the simulator has no bytes: the mappings are what replays
        arenas[i].sleep()
    elif ev.op == "wake":
        arenas[i].wake()
    elif ev.op == "close":
        arenas[i].close()

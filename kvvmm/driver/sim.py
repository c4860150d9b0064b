"""SimDriver: the driver rules with no memory at all, for laptops, notebooks and tests.

It refuses exactly what CUDA refuses (the shared :class:`VmmBook`), hands out deterministic
addresses and handles (so notebook outputs compare exactly), runs out of memory past its
device profile's capacity, and advances a simulated clock by the profile's cost model
(:mod:`kvvmm.hardware.overhead`: the calls ``kvvmm calibrate`` measured on that card, the
library's own work per call, the H200's figures where the profile has none).

Several GPUs of one machine: :class:`SimNode` makes N simulated devices that share one
process-wide VA space (as CUDA's unified addressing does: a reservation is unique across
devices), know each other (peer access, with pairs that cannot reach each other), and pass
exported handles among themselves. ``SimNode("h200", devices=8).driver(3)`` is device 3.

Arguments pass the shared :func:`~kvvmm.driver.base.check_call_ints` (as on the host driver:
the same values are refused with the same errors). A reservation whose end would pass
:data:`VA_LIMIT` (2**57, the widest VA of any CPU or GPU: 5-level page tables) is out of
memory, as ``mmap`` and ``cuMemAddressReserve`` answer for VA they do not have. Calls are
thread safe: one lock per node (the devices of a node share the VA cursor and exports).
"""

from __future__ import annotations

import itertools
import os
import stat
import threading
from collections.abc import Iterable, Sequence

from kvvmm.checks import int_arg, is_int, seconds_arg
from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_OUT_OF_MEMORY,
    U64_LIMIT,
    Driver,
    DriverStats,
    MemoryKind,
    check_call_ints,
    driver_error,
    locked,
)
from kvvmm.driver.book import VmmBook
from kvvmm.errors import ArgumentError
from kvvmm.hardware import COST_TABLE_US, PROFILES, DeviceProfile, get_profile
from kvvmm.hardware.overhead import CallClock, sim_costs

__all__ = [
    "COST_TABLE_US",
    "PROFILES",
    "VA_LIMIT",
    "DeviceProfile",
    "SimDriver",
    "SimNode",
    "get_profile",
]

#: No reservation of the simulator ends past this address (see the module docstring).
VA_LIMIT = 1 << 57


def _plain(va: object, size: object) -> bool:
    """Whether ``va`` and ``size`` are plain ints :func:`check_call_ints` passes unchanged
    (in range, not wrapping past 2**64): the common case, checked without building its
    dict; anything else goes through ``check_call_ints`` for its error."""
    return (type(va) is int and type(size) is int and 0 <= va < U64_LIMIT
            and 0 <= size < U64_LIMIT and va + size <= U64_LIMIT)


def _plain1(x: object) -> bool:
    """Whether ``x`` is a plain int in ``[0, 2**64)`` (see :func:`_plain`)."""
    return type(x) is int and 0 <= x < U64_LIMIT


class _Space:
    """What the drivers of one node share: the VA cursor and the exported handles."""

    __slots__ = ("exports", "lock", "next_va")

    def __init__(self, base_va: int) -> None:
        self.next_va = base_va
        # One lock for every driver of the node: they share this cursor and the exports.
        self.lock = threading.RLock()
        # fd -> (identity of the fd's open file, exporting device, size): see export_handle.
        self.exports: dict[int, tuple[tuple[int, int], int, int]] = {}


def _fd_identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISCHR(st.st_mode) else None


class SimNode:
    """Several simulated GPUs of one machine, seen by one process.

    The devices share one VA space (reservations made through any of them never overlap, and
    addresses stay deterministic: they follow the order of the reserve calls, whichever
    device makes them), may give each other access to their memory (``set_access(...,
    devices=...)``), and import each other's exported handles.

    Args:
        profile: device profile of every device (see :class:`SimDriver`).
        devices: how many devices, >= 1; ordinals ``0 .. devices-1``.
        capacity_bytes, used_bytes: per device, as for :class:`SimDriver`.
        base_va: first address handed out (shared by all devices).
        no_peer: pairs ``(a, b)`` of devices that cannot access each other's memory
            (``cuDeviceCanAccessPeer`` answers 0 both ways), e.g. GPUs on different PCIe
            roots without NVLink. Every other pair can.
    Raises:
        ArgumentError: bad ``devices`` or a ``no_peer`` pair naming a device not in the node.
    """

    def __init__(
        self,
        profile: str | DeviceProfile = "h200",
        *,
        devices: int = 1,
        capacity_bytes: int | None = None,
        used_bytes: int = 0,
        base_va: int = 0x7F00_0000_0000,
        no_peer: Iterable[tuple[int, int]] = (),
    ) -> None:
        int_arg("devices", devices, lo=1, limit="an int >= 1 (devices in the node)")
        self.profile = get_profile(profile)
        self.devices = devices
        self._capacity_bytes = capacity_bytes
        self._used_bytes = used_bytes
        self._space = _Space(base_va)
        blocked: set[tuple[int, int]] = set()
        for pair in no_peer:
            if (not isinstance(pair, tuple) or len(pair) != 2
                    or not all(_is_device(d, devices) for d in pair) or pair[0] == pair[1]):
                raise ArgumentError(
                    "no_peer", pair, f"a pair (a, b) of different devices in [0, {devices})"
                )
            blocked.add((pair[0], pair[1]))
            blocked.add((pair[1], pair[0]))
        self._no_peer = frozenset(blocked)
        self._drivers: dict[int, SimDriver] = {}

    def __repr__(self) -> str:
        return f"SimNode(profile={self.profile.key!r}, devices={self.devices})"

    def driver(self, device: int) -> SimDriver:
        """The driver of ``device`` (made on first use; the same object afterwards)."""
        if not _is_device(device, self.devices):
            raise ArgumentError("device", device, f"in [0, {self.devices}) (the node's devices)")
        d = self._drivers.get(device)
        if d is None:
            d = SimDriver(self.profile, device=device, capacity_bytes=self._capacity_bytes,
                          used_bytes=self._used_bytes, node=self)
        return d

    def drivers(self) -> list[SimDriver]:
        """One driver per device, in ordinal order."""
        return [self.driver(i) for i in range(self.devices)]

    def can_access_peer(self, device: int, peer: int) -> bool:
        """``cuDeviceCanAccessPeer``: can ``device`` access memory that lives on ``peer``?

        False for a device and itself (CUDA answers 0 there too) and for ``no_peer`` pairs.
        """
        return (device != peer and _is_device(device, self.devices)
                and _is_device(peer, self.devices) and (device, peer) not in self._no_peer)

    def _join(self, driver: SimDriver) -> _Space:
        if not _is_device(driver.device, self.devices):
            raise ArgumentError("device", driver.device,
                                f"in [0, {self.devices}) (the node's devices)")
        if driver.device in self._drivers:
            raise ArgumentError("device", driver.device,
                                "a device of the node with no driver yet; use node.driver("
                                f"{driver.device}) for the one it has")
        self._drivers[driver.device] = driver
        return self._space


def _is_device(d: object, count: int) -> bool:
    return is_int(d) and 0 <= d < count


class SimDriver(Driver):
    """A device with no memory: the driver rules, deterministic addresses, a cost clock.

    Args:
        profile: device profile key (``"h100"``, ``"h200"``, ``"b200"``, ``"gb300"``), a
            path to a profile JSON (``kvvmm calibrate --out``), or a :class:`DeviceProfile`.
        device: device ordinal to report.
        capacity_bytes: override the profile's capacity (e.g. a small GPU for a notebook).
        used_bytes: memory held by others (CUDA context, other processes): create fails
            past ``capacity_bytes - used_bytes``.
        base_va: first address handed out; reservations follow it in order. Ignored with
            ``node`` (the node's VA space is shared).
        node: the :class:`SimNode` this device belongs to (``node.driver(i)`` passes it);
            None: a device on its own, which has no peers.
    """

    kind = "sim"
    memory = MemoryKind.NONE
    clock_us: float = 0.0  #: a plain attribute here (the protocol's default is a property)
    #: its exports are file descriptors (``/dev/null``), importable within its node
    handle_type = "posix_fd"

    def __init__(
        self,
        profile: str | DeviceProfile = "h200",
        *,
        device: int = 0,
        capacity_bytes: int | None = None,
        used_bytes: int = 0,
        base_va: int = 0x7F00_0000_0000,
        node: SimNode | None = None,
    ) -> None:
        self.profile = get_profile(profile)
        cap = self.profile.capacity_bytes if capacity_bytes is None else capacity_bytes
        if not is_int(cap) or cap <= 0:
            raise ArgumentError("capacity_bytes", capacity_bytes, "an int > 0 (bytes) or None")
        if not is_int(used_bytes):
            raise ArgumentError("used_bytes", used_bytes, f"an int in [0, {cap}] (bytes)")
        if not 0 <= used_bytes <= cap:
            raise ArgumentError("used_bytes", used_bytes, f"in [0, {cap}] (the capacity)")
        if node is not None and not isinstance(node, SimNode):
            raise ArgumentError("node", node, "a SimNode or None")
        self.device = device
        self.name = self.profile.name
        self.node = node
        self._book = VmmBook(self.profile.granularity_bytes, cap)
        self._used_bytes = used_bytes
        self._space = _Space(base_va) if node is None else node._join(self)
        self._lock = self._space.lock
        self._handle_ids = itertools.count(1)
        # Peer access given so far: mapping start -> other devices that may access it.
        self._peers: dict[int, tuple[int, ...]] = {}
        # Imported handles whose memory lives on another device: handle -> that device.
        self._home: dict[int, int] = {}
        #: Simulated time spent in driver calls, in microseconds (the profile's cost model).
        self.clock_us = 0.0
        # What each call adds to the clock: the profile's measured call costs (the H200's
        # where it has none), plus the library's own work per call and the post-release
        # slowdown where `kvvmm calibrate` measured them (kvvmm/hardware/overhead.py).
        self._cost = CallClock(sim_costs(self.profile))
        # First touch (where the profile models it): regions of VA a mapping has touched
        # since their reservation, and mappings whose set_access still owes the extra.
        self._first = self._cost.costs.first_touch
        self._touched: set[int] = set()
        self._owes_access: dict[int, int] = {}  # mapping start -> extras its access owes

    def __repr__(self) -> str:
        return f"SimDriver(profile={self.profile.key!r}, device={self.device})"

    def granularity(self) -> int:
        return self._book.gran

    @locked
    def reserve(self, size: int, align: int = 0) -> int:
        size, align = check_call_ints("reserve", size=size, align=align).values()
        align = self._book.check_reserve(size, align)
        space = self._space
        va = -(-space.next_va // align) * align
        if va + size > VA_LIMIT:
            raise driver_error("reserve", {"size": size, "align": align},
                               CUDA_ERROR_OUT_OF_MEMORY,
                               f"no free VA range of {size} bytes below {VA_LIMIT:#x}")
        space.next_va = va + size
        self._book.apply_reserve(va, size)
        self.clock_us += self._cost("reserve", size)
        return va

    @locked
    def free(self, va: int, size: int) -> None:
        va, size = check_call_ints("free", va=va, size=size).values()
        self._book.check_free(va, size)
        self._book.apply_free(va)
        self.clock_us += self._cost("free", size)
        if self._touched:
            region = self._first[0]  # type: ignore[index]
            lo, hi = va // region, (va + size - 1) // region
            self._touched = {r for r in self._touched if not lo <= r <= hi}

    @locked
    def create(self, size: int) -> int:
        if not _plain1(size):
            (size,) = check_call_ints("create", size=size).values()
        book = self._book
        book.check_create(size, book.capacity_bytes - self._used_bytes - book.physical_bytes)
        handle = next(self._handle_ids)
        book.apply_create(handle, size)
        self.clock_us += self._cost("create", size)
        return handle

    @locked
    def release(self, handle: int) -> None:
        if not _plain1(handle):
            (handle,) = check_call_ints("release", handle=handle).values()
        h = self._book.check_release(handle)
        self._book.apply_release(handle)
        if self._home and not h.maps:
            self._home.pop(handle, None)
        self.clock_us += self._cost("release", h.size)

    @locked
    def map(self, va: int, size: int, handle: int) -> None:
        if not (_plain(va, size) and _plain1(handle)):
            va, size, handle = check_call_ints("map", va=va, size=size, handle=handle).values()
        res = self._book.check_map(va, size, handle)
        self._book.apply_map(va, size, handle, res)
        self.clock_us += self._cost("map", size)
        if self._first is not None:
            region, map_us, _, once = self._first
            new = [r for r in range(va // region, (va + size - 1) // region + 1)
                   if r not in self._touched]
            if new:
                self._touched.update(new)
                times = 1 if once else len(new)
                self.clock_us += map_us * times
                self._owes_access[va] = times

    @locked
    def unmap(self, va: int, size: int) -> None:
        if not _plain(va, size):
            va, size = check_call_ints("unmap", va=va, size=size).values()
        starts = self._book.covered("unmap", va, size)
        sizes = [self._book.maps[s][0] for s in starts]
        gone = [self._book.maps[s][1] for s in starts] if self._home else ()
        self._book.apply_unmap(starts)
        if self._owes_access:
            for st in starts:
                self._owes_access.pop(st, None)
        if self._peers:  # access goes with the mapping
            for s in starts:
                self._peers.pop(s, None)
        if self._home:
            for h in gone:
                if h not in self._book.handles:
                    self._home.pop(h, None)
        # One unmap over several mappings costs about one per mapping, where calibrate
        # measured it (unmap_per_mapping); else the call's cost by the range's size.
        self.clock_us += self._cost.unmap(sizes)

    @locked
    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        if not _plain(va, size):
            va, size = check_call_ints("set_access", va=va, size=size).values()
        if devices is not None:
            self._set_access_for(va, size, devices)
            return
        starts = self._book.covered("set_access", va, size)
        if self._home:
            self._check_reach(va, size, starts, self.device, None)
        self.clock_us += self._access_cost(starts)
        if self._owes_access:
            owed = sum(self._owes_access.pop(st, 0) for st in starts)
            if owed:
                self.clock_us += self._first[2] * owed  # type: ignore[index]

    def library_work(self, op: str, units: int = 1) -> None:
        """Charge kvvmm's own work for one arena or owner operation to the clock.

        Not a driver call: the arena and the owner say what they did (``op`` such as
        ``"arena.commit"``, ``units`` the handles, mappings or buffers it touched) so the
        simulated clock includes the library's work the profile measured
        (``library_work_us``; nothing where the profile has none). Real drivers keep the
        protocol's no-op, which the arena and owner skip (:func:`~kvvmm.driver.base.work_hook`).
        """
        with self._lock:
            self.clock_us += self._cost.work(op, units)

    def pause(self, seconds: float) -> None:
        """Time passed outside the driver: after a pause of at least the profile's
        cold-premium gap, the next call of every kind is cold again (costs its premium);
        after one of at least ``idle_release.pause_s``, the next create also pays for the GiB
        released since the create before (docs/FIDELITY.md, "Idle creates").

        Not a driver call and not on the protocol: a real driver's calls go cold by
        themselves. The clock does not advance (it counts driver time only). A simulated
        device's first call of each kind is cold without a pause: it follows whatever ran
        before the device was made.

        Raises:
            ArgumentError: ``seconds`` is not a finite number >= 0.
        """
        us = seconds_arg("seconds", seconds) * 1e6
        with self._lock:
            self._cost.pause(us)

    def _access_cost(self, starts: list[int]) -> float:
        """One call over several mappings costs about one call per mapping on an H200
        (0.93-0.95x: docs/MEASUREMENTS.md §9): the cost goes with mappings, not calls."""
        maps = self._book.maps
        return self._cost.access([maps[s][0] for s in starts])

    def _set_access_for(self, va: int, size: int, devices: Sequence[int]) -> None:
        """Set access for listed devices (peers among them): the rules for peers, then record."""
        args = {"va": va, "size": size}
        if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices:
            raise ArgumentError("devices", devices, "a non-empty sequence of device ordinals")
        node = self.node
        count = node.devices if node is not None else 0
        devices = [check_call_ints("set_access", device=d)["device"] for d in devices]
        for d in devices:
            known = _is_device(d, count) if node is not None else d == self.device
            if not known:  # an H200 answers INVALID_VALUE for an ordinal it does not have
                raise driver_error(
                    "set_access", args, CUDA_ERROR_INVALID_VALUE,
                    f"device {d!r} is not a device of this process "
                    + (f"(the node has devices 0..{count - 1})" if node is not None else
                       f"(this sim device stands alone: only {self.device}; a SimNode has "
                       "peers)"),
                )
        starts = self._book.covered("set_access", va, size)
        for d in devices:
            self._check_reach(va, size, starts, d, devices)
        others = tuple(sorted({d for d in devices if d != self.device}))
        if others:
            peers = self._peers
            for s in starts:
                had = peers.get(s, ())
                peers[s] = tuple(sorted(set(had) | set(others)))
        # A guess, not measured (docs/MEASUREMENTS.md §7): one page-table update per device.
        self.clock_us += self._access_cost(starts) * len(set(devices))

    def _check_reach(self, va: int, size: int, starts: list[int], device: int,
                     devices: Sequence[int] | None) -> None:
        """Refuse access by ``device`` to memory on a device it cannot reach."""
        book = self._book
        for s in starts:
            home = self._home.get(book.maps[s][1], self.device)
            if device == home:
                continue
            if self.node is None or not self.node.can_access_peer(device, home):
                raise driver_error(
                    "set_access", {"va": va, "size": size}, CUDA_ERROR_INVALID_DEVICE,
                    f"device {device} cannot access memory on device {home} (no peer access "
                    f"between them: cuDeviceCanAccessPeer({device}, {home}) is 0)"
                    + (f"; devices={list(devices)}" if devices is not None else ""),
                )

    @locked
    def peer_access(self, va: int) -> tuple[int, ...]:
        """Devices other than this one that were given access to the mapping at ``va``."""
        return self._peers.get(va, ())

    @locked
    def mem_info(self) -> tuple[int, int]:
        self.clock_us += self._cost.mem_info_us
        book = self._book
        return book.capacity_bytes - self._used_bytes - book.physical_bytes, book.capacity_bytes

    @locked
    def stats(self) -> DriverStats:
        return self._book.stats()

    # -- handles shared between processes ---------------------------------------------------

    @locked
    def export_handle(self, handle: int) -> int:
        """A file descriptor standing for ``handle``'s memory; the caller owns it.

        The simulator has no memory to share: the descriptor is a real one (``/dev/null``,
        so closing it, sending it, ``os.dup`` all behave), and the node remembers which
        handle it stands for. Only drivers of the same node (or this driver, alone) in this
        process can import it.
        """
        (handle,) = check_call_ints("export_handle", handle=handle).values()
        h = self._book.check_export(handle)
        fd = os.open(os.devnull, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        ident = _fd_identity(fd)
        assert ident is not None  # /dev/null is a character device
        home = self._home.get(handle, self.device)
        self._space.exports[fd] = (ident, home, h.size)
        self.clock_us += self._cost.calls("map", h.size)  # a guess: a cheap driver call
        return fd

    @locked
    def import_handle(self, fd: int, size: int) -> int:
        """A handle for the memory behind ``fd`` (from ``export_handle`` in this node).

        On success this driver owns ``fd`` and closes it (the handle keeps the memory).
        """
        fd, size = check_call_ints("import_handle", fd=fd, size=size).values()
        book = self._book
        book.check_import(fd, size)
        args = {"fd": fd, "size": size}
        rec = self._space.exports.get(fd)
        if rec is None or _fd_identity(fd) != rec[0]:
            raise driver_error(
                "import_handle", args, CUDA_ERROR_INVALID_VALUE,
                f"fd {fd} is not a handle exported by a sim driver of this "
                + ("node" if self.node is not None else "driver")
                + " (simulated handles do not cross processes or nodes)",
            )
        _, home, exported = rec
        if exported != size:
            raise driver_error(
                "import_handle", args, CUDA_ERROR_INVALID_VALUE,
                f"the exported allocation is {exported} bytes, not {size}",
            )
        del self._space.exports[fd]
        os.close(fd)
        handle = next(self._handle_ids)
        book.apply_import(handle, size)
        if home != self.device:
            self._home[handle] = home
        self.clock_us += self._cost.calls("create", size)  # a guess: as costly as a create
        return handle

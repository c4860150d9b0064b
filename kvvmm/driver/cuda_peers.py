"""Peer access for :class:`~kvvmm.driver.cuda.CudaDriver`: ``set_access(..., devices=...)``.

One ``CUmemAccessDesc`` per listed device (read/write) goes to one ``cuMemSetAccess``; the
lists are built once per device tuple and cached (the default call, ``devices=None``, passes
the pre-built own-device list and does not come here). A device the process cannot see, or
one with no peer path to this driver's device, is refused before CUDA is called. The design
is "Peer access" in docs/CUDA_DRIVER.md.

:class:`PeerAccessMixin` is one of ``CudaDriver``'s bases, not a driver of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvvmm.driver.base import (
    CUDA_ERROR_INVALID_DEVICE,
    CUDA_ERROR_INVALID_VALUE,
    check_call_ints,
    driver_error,
)
from kvvmm.driver.cuda_capture import _cuda
from kvvmm.driver.zerocover import ZeroCover
from kvvmm.errors import ArgumentError, DriverError

__all__ = ["PeerAccessMixin"]



class PeerAccessMixin:
    """``CudaDriver``'s access for other devices, and whether a device may have it."""

    # What this uses of CudaDriver (set by its constructor; declared for the type checker).
    device: int
    _dev: Any
    _ok: Any
    _device_count: int
    _access_lists: dict[tuple[int, ...], list[Any]]
    _peer_ok: dict[int, bool]  # device -> cuDeviceCanAccessPeer(device, ours)
    _peer_access: dict[int, list[Any]]
    _maps: dict[int, Any]
    _zero: ZeroCover | None
    _cuMemSetAccess: Any

    if TYPE_CHECKING:  # CudaDriver's own methods, which these call
        def _cuda_error(self, call: str, args: dict[str, int], fn: str,
                        err: Any) -> DriverError: ...
        def _tiling(self, call: str, va: int, size: int) -> list[int]: ...

    def _set_access_for(self, va: int, size: int, devices: Sequence[int]) -> None:
        """Set access for each listed device: the peer rules, then one cuMemSetAccess."""
        try:
            key = tuple(devices)
            # Exact ints only: (False,) and (0.0,) equal (0,) as dict keys.
            access = (self._access_lists.get(key)
                      if all(type(d) is int for d in key) else None)
        except TypeError:  # not iterable, or unhashable items: _access_list says why
            access = None
        if access is None:
            access = self._access_list(va, size, devices)
        m = self._maps.get(va)
        starts = [va] if m is not None and m.size == size else self._tiling("set_access", va,
                                                                             size)
        (err,) = self._cuMemSetAccess(va, size, access, len(access))
        if err:
            raise self._cuda_error("set_access", {"va": va, "size": size}, "cuMemSetAccess", err)
        if self._zero is not None:  # what an undo that maps them back must give them again
            for s in starts:
                self._peer_access[s] = access

    def _access_list(self, va: int, size: int, devices: Sequence[int]) -> list[Any]:
        """Check ``devices`` and build (and cache) their CUmemAccessDesc list."""
        if isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices:
            raise ArgumentError("devices", devices, "a non-empty sequence of device ordinals")
        args = {"va": va, "size": size}
        n = self._device_count
        devices = [check_call_ints("set_access", device=d)["device"] for d in devices]
        for d in devices:
            if not 0 <= d < n:
                # What raw cuMemSetAccess answers on an H200 for an ordinal it does not have
                # (tests/gpu/test_gpu_peer.py, bench/results/h200-export-peer-1gpu.json).
                raise driver_error(
                    "set_access", args, CUDA_ERROR_INVALID_VALUE,
                    f"device {d!r} is not a device this process sees (0..{n - 1})",
                )
            if d != self.device and not self.can_access_peer(d):
                raise driver_error(
                    "set_access", args, CUDA_ERROR_INVALID_DEVICE,
                    f"device {d} cannot access device {self.device}'s memory "
                    f"(cuDeviceCanAccessPeer({d}, {self.device}) is 0: no NVLink or PCIe "
                    "peer path between them)",
                )
        drv = _cuda()._drv
        out = []
        for d in dict.fromkeys(devices):  # each device once, in the order given
            acc = drv.CUmemAccessDesc()
            acc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            acc.location.id = d
            acc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            out.append(acc)
        self._access_lists[tuple(devices)] = out
        return out

    def can_access_peer(self, device: int) -> bool:
        """``cuDeviceCanAccessPeer(device, this device)``: can ``device`` use our memory?

        False for this device itself (CUDA answers 0 there) and for ordinals out of range.
        Asked once per device, then cached.
        """
        ok = self._peer_ok.get(device)
        if ok is None:
            ok = False
            if device != self.device and 0 <= device < self._device_count:
                drv = _cuda()._drv
                err, dev = drv.cuDeviceGet(device)
                if err == self._ok:
                    err, can = drv.cuDeviceCanAccessPeer(dev, self._dev)
                    ok = err == self._ok and bool(can)
            self._peer_ok[device] = ok
        return ok

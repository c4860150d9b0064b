"""Drivers: one protocol (``base.Driver``), three implementations, one wrapper base
(``DriverWrapper``) and the fault-injecting wrapper on it.

``open_driver`` picks one by name, ``driver_for`` one by name for a given GPU profile (the
sim's; see its docstring for why there are two), ``notebook_driver_kind`` the kind a notebook
runs on; nothing here imports torch or cuda.bindings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvvmm.driver.base import DRIVER_KINDS, Driver, DriverStats, MemoryKind
from kvvmm.driver.faults import Fault, FaultyDriver
from kvvmm.driver.sim import SimDriver, SimNode
from kvvmm.driver.wrapper import DriverWrapper
from kvvmm.errors import ArgumentError, DriverUnavailableError
from kvvmm.hardware import PROFILES, DeviceProfile, get_profile

__all__ = [
    "DRIVER_ENV",
    "DRIVER_KINDS",
    "PROFILES",
    "DeviceProfile",
    "Driver",
    "DriverStats",
    "DriverWrapper",
    "Fault",
    "FaultyDriver",
    "MemoryKind",
    "SimDriver",
    "SimNode",
    "driver_for",
    "get_profile",
    "notebook_driver_kind",
    "open_driver",
]

#: What ``open_driver`` takes: a driver's kind, or ``"auto"`` (cuda when a GPU is usable).
_OPEN_KINDS = ("auto", *DRIVER_KINDS)

#: The options ``open_driver("auto")`` passes to the CUDA driver, and to the host driver.
_AUTO_CUDA_OPTIONS = ("device", "granularity", "handle_type", "zero_page")
_AUTO_HOST_OPTIONS = ("granularity", "capacity_bytes")

#: The environment variable the notebooks read to pick their driver (``kvvmm lab`` sets it).
DRIVER_ENV = "KVVMM_DRIVER"


def open_driver(kind: str = "auto", **options: Any) -> Driver:
    """Open a driver by name.

    Args:
        kind: one of :data:`DRIVER_KINDS`: ``"sim"`` (no memory; ``profile=``,
            ``capacity_bytes=``..., or ``node=`` a :class:`SimNode` and ``device=``: that
            device of the node), ``"host"`` (Linux host memory; ``granularity=``,
            ``capacity_bytes=``), ``"cuda"`` (a real GPU;
            ``device=``, ``handle_type=``, ``zero_page=``: unbacked VA reads as zeros, see
            :class:`~kvvmm.driver.cuda.CudaDriver`), or ``"auto"``: cuda when a GPU is
            usable, else host (whose unbacked VA always reads as zeros: ``zero_page`` is
            dropped for it).
        options: passed to the driver's constructor.
    Returns:
        The driver.
    Raises:
        ArgumentError: unknown ``kind``.
        TypeError: an option the driver does not take (for ``"auto"``: neither the CUDA nor
            the host driver), as the driver's constructor says it.
        DriverUnavailableError: the driver cannot run here (one message, no traceback from
            the CUDA library).
    """
    if kind not in _OPEN_KINDS:
        raise ArgumentError("kind", kind, f"one of {list(_OPEN_KINDS)}")
    if kind == "sim":
        node = options.pop("node", None)
        if node is not None:
            if not isinstance(node, SimNode) or set(options) - {"device"}:
                raise ArgumentError("node", node, "a SimNode, with no other option than device=")
            return node.driver(options.get("device", 0))
        return SimDriver(**options)
    if kind == "host":
        from kvvmm.driver.host import HostDriver

        return HostDriver(**options)
    if kind == "cuda":
        return _open_cuda(options)
    # "auto" passes each driver only the options it takes: capacity_bytes caps the host
    # driver, device picks the GPU, handle_type makes GPU handles shareable (host ones always
    # are), zero_page covers unbacked GPU VA (host VA always reads as zeros); granularity
    # means the same to both. One that neither takes is refused, as a constructor would.
    unknown = sorted(set(options) - set(_AUTO_CUDA_OPTIONS) - set(_AUTO_HOST_OPTIONS))
    if unknown:
        takes = sorted({*_AUTO_CUDA_OPTIONS, *_AUTO_HOST_OPTIONS})
        raise TypeError(f"open_driver('auto') got an unexpected keyword argument "
                        f"{unknown[0]!r} (it takes {takes})")
    try:
        return _open_cuda({k: v for k, v in options.items() if k in _AUTO_CUDA_OPTIONS})
    except DriverUnavailableError:
        from kvvmm.driver.host import HostDriver

        host_opts = {k: v for k, v in options.items() if k in _AUTO_HOST_OPTIONS}
        return HostDriver(**host_opts)


def driver_for(kind: str = "auto", *, profile: str | DeviceProfile = "h200", device: int = 0,
               **options: Any) -> Driver:
    """A driver of ``kind`` on ``device``; the simulator simulates ``profile``.

    For code that lets its caller pick the kind (the lab's panels, the notebooks, the growth
    and workload experiments, the TP ranks): one call for every kind. The profile configures
    only the simulator, whose costs and capacity come from it. The real drivers (``"host"``,
    ``"cuda"``, and ``"auto"``, which opens one of them) measure the machine they run on, so
    for them the profile is checked and then not used: it names what the sim would have been
    (a prediction to compare with, as ``decode_growth`` does), not what the device is.

    (``open_driver`` refuses an option its driver does not take, as a caller naming one
    driver wants: ``open_driver("host", profile="h200")`` is a ``TypeError``.)

    Args:
        kind: one of :data:`DRIVER_KINDS`, or ``"auto"`` (see :func:`open_driver`).
        profile: the simulated device: a profile key (``"h200"``, the sim's default), the path
            of a calibrated profile, or a :class:`DeviceProfile`; checked for every kind.
        device: the device ordinal (the sim's and the host driver's only report it).
        options: more constructor options of the chosen driver, as :func:`open_driver`
            passes them (``capacity_bytes=``, ``granularity=``, ``handle_type=``...).
    Returns:
        The driver.
    Raises:
        ArgumentError: unknown ``kind``, or an unknown profile key (whatever the kind).
        ProfileError: a profile file that is not a valid profile (whatever the kind).
        DriverUnavailableError: the driver cannot run here.
    """
    prof = get_profile(profile)
    if kind == "sim":
        return open_driver("sim", profile=prof, device=device, **options)
    return open_driver(kind, device=device, **options)


def notebook_driver_kind(*, real_memory: bool = False,
                         environ: Mapping[str, str] | None = None) -> str:
    """The driver kind a notebook runs on: what ``KVVMM_DRIVER`` says, else the simulator.

    ``kvvmm lab`` sets :data:`DRIVER_ENV` (``--driver auto``: ``cuda`` when a GPU is usable,
    else ``sim``). Without it (an empty value counts as none), as under nbval and
    ``notebooks/build.py``, a notebook runs on the sim, whose addresses and costs are
    deterministic, so its saved outputs compare. A notebook about real memory
    (``real_memory=True``: notebook 05) turns ``"sim"``, set or defaulted, into ``"auto"``:
    the CUDA driver when a GPU is usable, else the host driver. The variable is read when
    this is called, never at import.

    Args:
        real_memory: the notebook needs memory that holds bytes: no simulator.
        environ: the environment to read (default ``os.environ``).
    Returns:
        One of :data:`DRIVER_KINDS`, or ``"auto"``; pass it to :func:`driver_for`.
    Raises:
        ArgumentError: the variable holds something else (named, with what it may hold).
    """
    value = (os.environ if environ is None else environ).get(DRIVER_ENV) or "sim"
    if value not in _OPEN_KINDS:
        raise ArgumentError(DRIVER_ENV, value, f"one of {list(_OPEN_KINDS)}",
                            "the notebooks' driver; kvvmm lab --driver sets it")
    return "auto" if real_memory and value == "sim" else value


def _open_cuda(options: dict[str, Any]) -> Driver:
    try:
        from kvvmm.driver.cuda import CudaDriver
    except ImportError as e:
        raise DriverUnavailableError(f"the CUDA driver is not available: {e}") from None
    return CudaDriver(**options)

"""kvvmm: CUDA virtual memory for LLM KV caches, as a library and a lab.

Reserve a large VA range once, create KV tensors at their upper-bound shape so pointers never
move, and back physical memory only as needed. ``import kvvmm`` needs neither torch nor a
GPU; torch is imported when the first tensor is made.

    >>> import kvvmm
    >>> drv = kvvmm.open_driver("sim", profile="h200")
    >>> descs = kvvmm.mha_token_major(layers=2, kv_heads=8, head_dim=128,
    ...                               reserved_tokens=4096, page_size=16, dtype="bfloat16")
    >>> owner = kvvmm.KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16,
    ...                             reserved_tokens=4096, descs=descs)
"""

from __future__ import annotations

from kvvmm._version import __version__ as __version__
from kvvmm.arena import Arena
from kvvmm.driver import (
    DRIVER_KINDS,
    PROFILES,
    DeviceProfile,
    Driver,
    DriverStats,
    Fault,
    FaultyDriver,
    SimDriver,
    SimNode,
    driver_for,
    notebook_driver_kind,
    open_driver,
)
from kvvmm.errors import (
    AlignmentError,
    ArgumentError,
    AsleepError,
    BackupError,
    BusyError,
    CaptureConflictError,
    ClosedError,
    CollectiveError,
    DriverArgumentError,
    DriverError,
    DriverOutOfMemoryError,
    DriverUnavailableError,
    KvvmmError,
    OutOfRangeError,
    ProfileError,
    ReservationExhaustedError,
    SleepRefusedError,
    StateError,
    TraceFormatError,
    UnknownDtypeError,
    WorkloadFormatError,
    WrongTypeError,
)
from kvvmm.layout import KvBufferDesc, mha_token_major, mla, page_major
from kvvmm.owner import KvBufferOwner
from kvvmm.owner.tp import TpOwners, run_per_device, spawn_tp_snapshots
from kvvmm.policy import Chunked, Exact, Geometric, GrowthPolicy
from kvvmm.record import Trace, TracingDriver
from kvvmm.replay import replay_arenas
from kvvmm.snapshot import (
    AllocationInfo,
    ArenaSnapshot,
    BufferInfo,
    MappingInfo,
    OwnerSnapshot,
    TpSnapshot,
)

__all__ = [
    "DRIVER_KINDS",
    "PROFILES",
    "AlignmentError",
    "AllocationInfo",
    "Arena",
    "ArenaSnapshot",
    "ArgumentError",
    "AsleepError",
    "BackupError",
    "BufferInfo",
    "BusyError",
    "CaptureConflictError",
    "Chunked",
    "ClosedError",
    "CollectiveError",
    "DeviceProfile",
    "Driver",
    "DriverArgumentError",
    "DriverError",
    "DriverOutOfMemoryError",
    "DriverStats",
    "DriverUnavailableError",
    "Exact",
    "Fault",
    "FaultyDriver",
    "Geometric",
    "GrowthPolicy",
    "KvBufferDesc",
    "KvBufferOwner",
    "KvvmmError",
    "MappingInfo",
    "OutOfRangeError",
    "OwnerSnapshot",
    "ProfileError",
    "ReservationExhaustedError",
    "SimDriver",
    "SimNode",
    "SleepRefusedError",
    "StateError",
    "TpOwners",
    "TpSnapshot",
    "Trace",
    "TraceFormatError",
    "TracingDriver",
    "UnknownDtypeError",
    "WorkloadFormatError",
    "WrongTypeError",
    "driver_for",
    "mha_token_major",
    "mla",
    "notebook_driver_kind",
    "open_driver",
    "page_major",
    "replay_arenas",
    "run_per_device",
    "spawn_tp_snapshots",
]

"""Facts about GPUs, as data: profiles (:mod:`~kvvmm.hardware.profiles`), the per-call cost
model the simulator charges (:mod:`~kvvmm.hardware.cost`, :mod:`~kvvmm.hardware.overhead`) and
the copy-bandwidth model (:mod:`~kvvmm.hardware.bandwidth`), read from the JSON files in
``kvvmm/hardware/data/``. Nothing here acts on a device.
"""

from __future__ import annotations

from kvvmm.hardware.bandwidth import (
    BANDWIDTH_TARGET,
    H200_BANDWIDTH,
    BandwidthFit,
    BandwidthPoint,
    BandwidthTable,
    GrowthPoint,
    RatioBand,
    growth_fit,
    predicted_bandwidth_tb_s,
    predicted_ratio,
)
from kvvmm.hardware.cost import COST_TABLE_US, CostModel, default_cost_model
from kvvmm.hardware.interp import Log2Curve
from kvvmm.hardware.overhead import CallClock, PostReleaseSlowdown, SimCosts, sim_costs
from kvvmm.hardware.profiles import (
    GPU_HELP,
    PROFILES,
    DeviceProfile,
    Provenance,
    get_profile,
    load_profile,
    profile_data,
    profile_from_data,
    profile_label,
    profile_summary,
    provenance,
    provenance_label,
)

__all__ = ["BANDWIDTH_TARGET", "COST_TABLE_US", "GPU_HELP", "H200_BANDWIDTH", "PROFILES",
           "BandwidthFit", "BandwidthPoint", "BandwidthTable", "CallClock", "CostModel",
           "DeviceProfile", "GrowthPoint", "Log2Curve", "PostReleaseSlowdown", "Provenance",
           "RatioBand", "SimCosts", "default_cost_model", "get_profile", "growth_fit",
           "load_profile", "predicted_bandwidth_tb_s", "predicted_ratio", "profile_data",
           "profile_from_data", "profile_label", "profile_summary", "provenance",
           "provenance_label", "sim_costs"]

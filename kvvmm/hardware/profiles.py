"""GPU profiles: what the simulator and the planner know of a card, each figure with its source.

A profile is a small JSON data file (``kvvmm/hardware/data/<key>.json``, format
``kvvmm-hardware-profile``): the card's memory capacity and VMM granularity, and where they
were measured, optionally its measured driver-call costs and copy bandwidth. The shipped
files are read once, on first use; :func:`load_profile` reads one from any path (a later
``kvvmm calibrate`` writes the same format).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvvmm.errors import ArgumentError

__all__ = ["FORMAT", "PROFILES", "DeviceProfile", "get_profile", "load_profile"]

FORMAT = "kvvmm-hardware-profile"


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """A GPU as the simulator sees it: memory capacity and VMM granularity, with sources."""

    key: str  #: short name used in APIs (``"h200"``)
    name: str  #: what ``nvidia-smi`` calls it
    capacity_bytes: int  #: total device memory as ``cuMemGetInfo`` reports it
    granularity_bytes: int  #: ``cuMemGetAllocationGranularity`` (minimum)
    source: str  #: where the two figures come from


def _profile_of(data: Mapping[str, Any], where: str) -> DeviceProfile:
    if data.get("format") != FORMAT:
        raise ArgumentError("profile", where, f"a {FORMAT!r} JSON file")
    try:
        return DeviceProfile(str(data["key"]), str(data["name"]), int(data["capacity_bytes"]),
                             int(data["granularity_bytes"]), str(data["source"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ArgumentError("profile", where, f"a profile with key, name, capacity_bytes, "
                                              f"granularity_bytes and source ({e})") from None


@functools.cache
def shipped_data() -> dict[str, dict[str, Any]]:
    """The raw JSON of every shipped profile, by key (read once)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in sorted(resources.files("kvvmm.hardware").joinpath("data").iterdir(),
                        key=lambda p: p.name):
        if entry.name.endswith(".json"):
            data = json.loads(entry.read_text(encoding="utf-8"))
            out[str(data["key"])] = data
    return out


def load_profile(path: str | os.PathLike[str]) -> DeviceProfile:
    """Read a profile from a JSON file of format ``kvvmm-hardware-profile``."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return _profile_of(data, os.fspath(path))


#: The shipped profiles by key: ``h100``, ``h200``, ``b200``, ``gb300``.
PROFILES: dict[str, DeviceProfile] = {
    k: _profile_of(v, k) for k, v in shipped_data().items()
}


def get_profile(profile: str | DeviceProfile) -> DeviceProfile:
    """Look a profile up by key (``"h200"``); pass a :class:`DeviceProfile` through."""
    if isinstance(profile, DeviceProfile):
        return profile
    key = str(profile).lower().replace("-", "").replace(" ", "")
    try:
        return PROFILES[key]
    except KeyError:
        raise ArgumentError("profile", profile, f"one of {sorted(PROFILES)}") from None

"""GPU profiles: what the simulator and the planner know of a card, each figure with its source.

A profile is a JSON file of format ``kvvmm-hardware-profile`` (shipped ones in
``kvvmm/hardware/data/<key>.json``): the card's capacity and VMM granularity, optionally its
measured costs (:mod:`kvvmm.hardware.overhead` says how the simulator charges them), each
section with its ``source``. :func:`get_profile` takes a key or a path; :func:`load_profile`
reads a regular file of at most :data:`MAX_PROFILE_BYTES` as strict JSON. Every profile, read
or built, is checked against :mod:`kvvmm.hardware.schema`: a bad one is one
:class:`~kvvmm.errors.ProfileError` naming the file, the field, its value and its bound.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from kvvmm.checks import number_arg
from kvvmm.errors import ArgumentError, ProfileError
from kvvmm.hardware.schema import FORMAT, MAX_DEPTH, VERSIONS, parse, validate
from kvvmm.hardware.spread import at_quantile
from kvvmm.units import MiB

__all__ = ["FORMAT", "GPU_HELP", "MAX_PROFILE_BYTES", "PROFILES", "VERSIONS", "DeviceProfile",
           "Provenance", "get_profile", "load_profile", "profile_data", "profile_from_data",
           "profile_label", "profile_summary", "provenance", "provenance_label"]

#: Largest profile file read, in bytes (the biggest shipped one is ~40 KiB). A bigger file
#: (or ``/dev/zero``, read until memory ran out) is refused before it is read.
MAX_PROFILE_BYTES = 16 * MiB


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """A GPU as the simulator sees it: memory capacity and VMM granularity, with sources."""

    key: str  #: short name used in APIs (``"h200"``)
    name: str  #: what ``nvidia-smi`` calls it
    capacity_bytes: int  #: total device memory as ``cuMemGetInfo`` reports it
    granularity_bytes: int  #: ``cuMemGetAllocationGranularity`` (minimum)
    source: str  #: where the two figures come from
    date: str = ""  #: when the profile's figures were measured (ISO date), "" if unknown
    path: str = ""  #: the file it was loaded from; "" for a shipped profile
    #: digest of the data a profile was made from ("" for a shipped one): two profiles are
    #: equal only when their data is, so models cached per profile never mix two files
    digest: str = ""

    def __post_init__(self) -> None:
        # A profile made by hand meets the same schema as one read from a file:
        # a 3 MiB granularity or a 0-byte device is refused here, not at the first reserve.
        where = f"DeviceProfile(key={self.key!r})" if isinstance(self.key, str) \
            else "DeviceProfile(...)"
        fields = {"format": FORMAT, "key": self.key, "name": self.name,
                  "capacity_bytes": self.capacity_bytes,
                  "granularity_bytes": self.granularity_bytes, "source": self.source,
                  "date": self.date}
        validate(fields, where)
        for name in ("path", "digest"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ProfileError(where, name, value, "a string",
                                   f"it is a {type(value).__name__}")

    def at(self, q: float) -> DeviceProfile:
        """This profile with every cost figure at its quantile ``q`` of the measured spread.

        ``q`` in [0, 1]: 0.1 is each figure's p10, 0.9 its p90 (linear between, flat beyond).
        Every figure group moves to its own quantile at once
        (:func:`kvvmm.hardware.spread.at_quantile`). A profile without a spread is a point: itself.

        Raises:
            ArgumentError: ``q`` not a finite number in [0, 1].
        """
        number_arg("q", q, lo=0.0, hi=1.0, limit="a quantile in [0, 1] (0.1: each figure's p10)")
        data = profile_data(self)
        spread = data.get("spread")
        if not isinstance(spread, Mapping) or not spread.get("figures"):
            return self
        # The record's own fields stand (a hand-built profile borrows its key's costs only).
        own = {"key": self.key, "name": self.name, "capacity_bytes": self.capacity_bytes,
               "granularity_bytes": self.granularity_bytes, "source": self.source,
               "date": self.date}
        return profile_from_data(at_quantile(data, float(q)) | own,
                                 where=f"{self.key} at q={q:g}", path=self.path)


def _profile_of(data: Mapping[str, Any], path: str = "", digest: str = "") -> DeviceProfile:
    # ``data`` has met the schema (schema.validate): every field here is typed and bounded.
    return DeviceProfile(data["key"], data["name"], data["capacity_bytes"],
                         data["granularity_bytes"], data["source"], data.get("date", ""),
                         path, digest)


@functools.cache
def shipped_data() -> dict[str, dict[str, Any]]:
    """The raw JSON of every shipped profile, by key (read once)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in sorted(resources.files("kvvmm.hardware").joinpath("data").iterdir(),
                        key=lambda p: p.name):
        if entry.name.endswith(".json"):
            data = _parse(entry.read_bytes(), entry.name)
            validate(data, entry.name)  # a broken shipped file fails at import, by name
            out[str(data["key"])] = data
    return out


# The raw data behind every profile made from data (loaded from a path, or built by
# ``kvvmm calibrate`` as it measures), so the cost model can read sections the record does
# not hold. A profile is a frozen value: equal profiles have equal data (``digest``).
_DATA: dict[DeviceProfile, dict[str, Any]] = {}
_DATA_LOCK = threading.Lock()


def profile_from_data(data: Mapping[str, Any], *, where: str = "<data>",
                      path: str = "") -> DeviceProfile:
    """A profile from a ``kvvmm-hardware-profile`` mapping; its sections stay readable.

    Args:
        data: the parsed JSON.
        where: named in errors (a path, or what made the data).
        path: recorded as :attr:`DeviceProfile.path`.
    Raises:
        ProfileError: not a profile of a known format version, or a field missing, of the
            wrong type or out of its bounds (:data:`kvvmm.hardware.schema.SCHEMA`).
    """
    validate(data, where)  # refuse what is not a profile before hashing it
    text = json.dumps(data, sort_keys=True)
    prof = _profile_of(data, path, hashlib.sha256(text.encode()).hexdigest()[:16])
    with _DATA_LOCK:
        _DATA[prof] = json.loads(text)  # a private copy: callers may mutate theirs
    return prof


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))
_FILE_LIMIT = (f"a regular file of at most {MAX_PROFILE_BYTES} bytes "
               f"({MAX_PROFILE_BYTES // MiB} MiB)")


def _what(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _read(where: str) -> bytes:
    """The bytes of a profile file: a regular file, at most :data:`MAX_PROFILE_BYTES`.

    Checked before opening (a FIFO's open blocks until a writer comes; ``/dev/zero`` never
    ends), and again on the descriptor opened without blocking (the path may have been
    swapped in between); at most one byte past the limit is ever read.
    """
    try:
        st = os.stat(where)
    except ValueError as e:  # an embedded NUL: os.stat's ValueError, not an OSError
        raise ProfileError(where, "", where, "a path without NUL bytes", str(e)) from None
    if not stat.S_ISREG(st.st_mode):
        raise ProfileError(where, "", _what(st.st_mode), _FILE_LIMIT,
                           f"it is {_what(st.st_mode)}")
    if st.st_size > MAX_PROFILE_BYTES:
        raise ProfileError(where, "", st.st_size, _FILE_LIMIT,
                           f"it holds {st.st_size} bytes")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(where, flags)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise ProfileError(where, "", _what(mode), _FILE_LIMIT, f"it is {_what(mode)}")
        raw = f.read(MAX_PROFILE_BYTES + 1)
    if len(raw) > MAX_PROFILE_BYTES:
        raise ProfileError(where, "", len(raw), _FILE_LIMIT, "it grew past that as it was read")
    return raw


def _parse(raw: bytes, where: str) -> Any:
    """Strict JSON (no NaN, no Infinity, bounded depth) of a profile's bytes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProfileError(where, "", raw[e.start:e.start + 4], "UTF-8 JSON text",
                           f"byte {e.start} is not UTF-8") from None
    try:
        return parse(text)
    except json.JSONDecodeError as e:
        raise ProfileError(where, "", None, f"a {FORMAT!r} JSON file", str(e)) from None
    except RecursionError:
        raise ProfileError(where, "", None, f"JSON nested at most {MAX_DEPTH} levels deep",
                           "it nests deeper than the JSON parser can go") from None


def load_profile(path: str | os.PathLike[str]) -> DeviceProfile:
    """Read a profile from a JSON file of format ``kvvmm-hardware-profile``: a regular file of at
    most :data:`MAX_PROFILE_BYTES`, strict JSON, meeting :data:`kvvmm.hardware.schema.SCHEMA`.

    Raises:
        OSError: the file does not exist or cannot be opened (permissions).
        ProfileError: not a regular file, too large, not UTF-8 JSON, or not a valid profile;
            the message names the file, the field, its value and what it must be.
    """
    where = os.fspath(path)
    data = _parse(_read(where), where)
    return profile_from_data(data, where=where, path=os.path.abspath(where))


def profile_data(profile: str | os.PathLike[str] | DeviceProfile) -> Mapping[str, Any]:
    """The raw JSON behind a profile (shipped, loaded or built from data).

    A :class:`DeviceProfile` made by hand has no data but its key's shipped file, if any;
    else an empty mapping (every model then falls back to the H200's measurements).
    """
    prof = get_profile(profile)
    with _DATA_LOCK:
        data = _DATA.get(prof)
    if data is not None:
        return data
    shipped = shipped_data()
    if prof.path == "" and prof.key in shipped:
        return shipped[prof.key]
    return {}


#: The shipped profiles by key: ``h100``, ``h200``, ``b200``, ``gb300``.
PROFILES: dict[str, DeviceProfile] = {
    k: _profile_of(v) for k, v in shipped_data().items()
}


def _looks_like_path(text: str) -> bool:
    return text.endswith(".json") or os.sep in text or (os.altsep or os.sep) in text


def get_profile(profile: str | os.PathLike[str] | DeviceProfile) -> DeviceProfile:
    """Look a profile up by key (``"h200"``) or read it from a path; pass a profile through.

    Args:
        profile: a shipped key (``"h200"``, ``"H-200"``), a path to a profile JSON file
            (``"my-card.json"``, ``"/tmp/x/h200.json"``: anything ending in ``.json`` or
            holding a path separator), or a :class:`DeviceProfile`.
    Raises:
        ArgumentError: an unknown key.
        ProfileError: a file that is not a valid profile (:func:`load_profile`).
        OSError: a path that does not exist or cannot be opened.
    """
    if isinstance(profile, DeviceProfile):
        return profile
    if isinstance(profile, os.PathLike) or (isinstance(profile, str)
                                            and _looks_like_path(profile)):
        return load_profile(profile)
    text = str(profile).lower().strip()
    if text in PROFILES:  # a key as shipped ("h200-calibrated")
        return PROFILES[text]
    key = text.replace("-", "").replace(" ", "")  # forgiving: "H-200", "h 200"
    try:
        return PROFILES[key]
    except KeyError:
        raise ArgumentError("profile", profile, f"one of {sorted(PROFILES)}, or a path to a "
                                                f"profile .json file") from None


def profile_label(profile: str | os.PathLike[str] | DeviceProfile) -> str:
    """How figures name the profile they predict from: ``"h200 (NVIDIA H200, 2026-11-29)"``.

    A profile loaded from a file says so: ``"h200 (NVIDIA H200, 2026-12-01, my-h200.json)"``.
    """
    p = get_profile(profile)
    parts = [p.name] + ([p.date[:10]] if p.date else []) + (
        [os.path.basename(p.path)] if p.path else [])
    return f"{p.key} ({', '.join(parts)})"


#: What a ``--gpu`` option takes, for the commands' help.
GPU_HELP = ("device profile: a shipped key (h100, h200, b200, gb300, h200-calibrated) or a "
            "profile .json, such as one `kvvmm calibrate --out FILE` wrote on your card "
            "(default: %(default)s)")


#: The profile whose call costs a profile without its own borrows (what the simulator
#: charges on it: :func:`kvvmm.hardware.overhead.sim_costs`, :mod:`kvvmm.hardware.cost`).
COSTS_FROM = "h200"


@dataclass(frozen=True, slots=True)
class Provenance:
    """Whose figures a profile predicts with: its call costs' and its capacity's.

    A profile without measured call costs (``b200``, ``gb300`` as shipped)
    borrows the H200's: the simulator charges the H200's calls on it, and every output
    that predicts from it says so (:meth:`label`).
    """

    profile: str  #: the profile's key
    costs: str  #: key of the profile whose call costs it uses (``profile`` when its own)
    #: the card its call costs were measured on, as the data names it (``"NVIDIA H200"``);
    #: "" when the data does not say
    measured_on: str
    costs_date: str  #: when the call costs were measured (ISO date), "" when not stated
    capacity: str  #: key of the profile whose capacity and granularity it uses (its own)

    @property
    def borrowed(self) -> bool:
        """True when the call costs are another profile's."""
        return self.costs != self.profile

    def label(self) -> str:
        """``"costs: h200, measured on an H200; capacity: b200"``: the one string every
        prediction, table, chart and JSON names its figures' card with."""
        return f"costs: {self.costs}, {_measured(self.measured_on)}; capacity: {self.capacity}"

    def as_dict(self) -> dict[str, str | bool]:
        """For JSON: the fields, ``borrowed`` and the :meth:`label`."""
        return {"costs": self.costs, "borrowed": self.borrowed,
                "costs_measured_on": self.measured_on or "not stated",
                "costs_date": self.costs_date or "not stated", "capacity": self.capacity,
                "label": self.label()}


# "on NVIDIA H200", "on an H200", "on a B200": where a section's source names its card
_ON_CARD = re.compile(r"\bon (?:an? )?((?:NVIDIA )?[A-Z]{1,3}\d{2,4}\w*)")


def _short_card(card: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"H100"``: the chip, as people name it."""
    words = card.removeprefix("NVIDIA ").split()
    return words[0] if words else card


def _measured(card: str) -> str:
    if not card:
        return "measured on a card not stated"
    short = _short_card(card)
    # "an H200", "an M60", "a B200", "a GB300": the article goes by how the letter sounds
    article = "an" if short[:1].upper() in "AEFHILMNORSX" else "a"
    return f"measured on {article} {short}"


def _own_costs(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A profile's own ``call_costs``, or None when it borrows :data:`COSTS_FROM`'s: the
    same test :func:`kvvmm.hardware.overhead.sim_costs` makes before charging a call."""
    cc = data.get("call_costs")
    if isinstance(cc, Mapping) and isinstance(cc.get("points"), Mapping):
        return cc
    return None


def _costs_card(data: Mapping[str, Any], cc: Mapping[str, Any]) -> str:
    """The card ``cc`` (a profile's call costs) was measured on: the calibration's record
    of the card, else the card the section's source names, else ""."""
    on = data.get("measured_on")
    if isinstance(on, Mapping) and isinstance(on.get("card"), str) and on["card"]:
        return str(on["card"])
    found = _ON_CARD.search(str(cc.get("source", "")))
    return found.group(1) if found else ""


def provenance(profile: str | os.PathLike[str] | DeviceProfile) -> Provenance:
    """Whose call costs and capacity ``profile`` predicts with (:class:`Provenance`).

    Raises:
        ArgumentError, ProfileError, OSError: as :func:`get_profile`.
    """
    p = get_profile(profile)
    data = profile_data(p)
    cc = _own_costs(data)
    costs, lender = p.key, data
    if cc is None:
        costs, lender = COSTS_FROM, shipped_data()[COSTS_FROM]
        cc = _own_costs(lender) or {}
    date = str(lender.get("date", "")) if lender is not data else p.date
    return Provenance(profile=p.key, costs=costs, measured_on=_costs_card(lender, cc),
                      costs_date=date[:10], capacity=p.key)


def provenance_label(profile: str | os.PathLike[str] | DeviceProfile) -> str:
    """:meth:`Provenance.label` of ``profile``: ``"costs: h200, measured on an H200;
    capacity: b200"``."""
    return provenance(profile).label()


def profile_summary(profile: str | os.PathLike[str] | DeviceProfile) -> dict[str, Any]:
    """Which profile a command used, for its output: key, card, date, the file's absolute
    path (``"shipped"`` for one that comes with kvvmm), and whose figures it predicts with
    (:meth:`Provenance.as_dict`: ``costs``, ``borrowed``, ``costs_measured_on``,
    ``costs_date``, ``capacity``, ``label``)."""
    p = get_profile(profile)
    return {"key": p.key, "card": p.name, "date": p.date[:10] if p.date else "not stated",
            "path": p.path or "shipped", **provenance(p).as_dict()}

"""The copy-bandwidth model: how fast a tensor copies, by the sizes of the handles behind it.

Two curves, per handle size, interpolated in log2(size) between measured sizes:

- **one buffer's handles** (``interleaved=False``): the profile's ``bandwidth.runs``, a 1 GiB
  tensor over handles of one size, created in a row;
- **many buffers' handles, created in turn** (``interleaved=True``, as decode growth makes
  them): fitted (:func:`fit_growth_bandwidth`) to the owner's copies measured after growth
  under each policy (``bandwidth.growth``) and to the table's interleaved points.

An estimate from one device's measurements: the lab shows it with its source and its band.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from kvvmm.checks import int_arg
from kvvmm.errors import ArgumentError
from kvvmm.hardware.interp import Log2Curve
from kvvmm.hardware.profiles import shipped_data
from kvvmm.units import GiB, MiB

__all__ = ["BANDWIDTH_TARGET", "H200_BANDWIDTH", "BandwidthFit", "BandwidthPoint",
           "BandwidthTable", "GrowthPoint", "RatioBand", "fit_growth_bandwidth",
           "growth_fit", "predicted_bandwidth_tb_s", "predicted_mix_tb_s", "predicted_ratio"]

#: The copy bandwidth, as a ratio to cudaMalloc's, an owner's tensors must keep: the line
#: the lab draws.
BANDWIDTH_TARGET = 0.99


@dataclass(frozen=True, slots=True)
class BandwidthPoint:
    """Copy bandwidth of one tensor by how its memory was mapped."""

    label: str  #: the measurement's key (``"vmm_64MiB"``)
    handle_bytes: int | None  #: handle size; None for memory not from VMM handles
    interleaved: bool  #: handles created interleaved with other allocations' handles
    runs_tb_s: tuple[float, ...]  #: TB/s of each run

    @property
    def tb_s(self) -> float:
        """Mean of the runs, TB/s."""
        return sum(self.runs_tb_s) / len(self.runs_tb_s)


@dataclass(frozen=True, slots=True)
class GrowthPoint:
    """One measured copy: how its bytes lay over handles, and the ratios its runs gave."""

    label: str  #: the policy (``"Chunked(128.0 MiB)"``) or the table's key
    copied: tuple[tuple[int, int], ...]  #: (handle size, bytes of the copy in such handles)
    ratios: tuple[float, ...]  #: bandwidth / cudaMalloc's, one per run

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)


@dataclass(frozen=True, slots=True)
class RatioBand:
    """A predicted bandwidth as a ratio to cudaMalloc's, with the spread of its runs.

    ``mid`` is fitted to the runs' medians, ``low`` and ``high`` to their lowest and highest:
    what one run may give, not an error of the mean.
    """

    low: float
    mid: float
    high: float


@dataclass(frozen=True, slots=True)
class BandwidthTable:
    """Bandwidth measurements of one device, with where they come from."""

    device: str
    tensor_bytes: int  #: size of the copied tensor
    points: tuple[BandwidthPoint, ...]
    source: str
    #: the owner's copies after decode growth, by policy (``bandwidth.growth``); may be empty
    growth: tuple[GrowthPoint, ...] = field(default=())
    growth_source: str = ""  #: where ``growth`` comes from
    growth_workload: str = ""  #: what grew and what was copied

    @classmethod
    def from_mapping(cls, data: Mapping[str, Sequence[float]], *, device: str, source: str,
                     tensor_bytes: int = GiB) -> BandwidthTable:
        """Read ``{"vmm_64MiB": [4.188, 4.19], "plain": [...], ...}`` (docs/MEASUREMENTS.md §4).

        ``vmm_<N>MiB`` and ``vmm_<N>MiB_interleaved`` are N-MiB handles, ``vmm_1handle`` one
        handle for the whole tensor; other keys (``plain``, ``expandable_segments:True``) are
        kept as reference points without a handle size.
        """
        points = []
        for key, runs in data.items():
            vals = tuple(float(v) for v in runs)
            if not vals:
                raise ArgumentError(f"runs of {key!r}", runs, "a non-empty list of TB/s")
            size: int | None = None
            inter = key.endswith("_interleaved")
            core = key.removesuffix("_interleaved")
            if core == "vmm_1handle":
                size = tensor_bytes
            elif core.startswith("vmm_") and core.endswith("MiB"):
                try:
                    size = int(core[4:-3]) * MiB
                except ValueError:
                    raise ArgumentError("key", key, "vmm_<N>MiB[_interleaved]") from None
            points.append(BandwidthPoint(key, size, inter, vals))
        return cls(device, tensor_bytes, tuple(points), source)

    def reference_tb_s(self, label: str = "plain") -> float | None:
        """Mean TB/s of a non-VMM reference (``"plain"``: cudaMalloc), None if absent."""
        ps = [p.tb_s for p in self.points if p.label.startswith(label)]
        return sum(ps) / len(ps) if ps else None


def growth_points(section: Mapping[str, Any]) -> tuple[GrowthPoint, ...]:
    """Read a profile's ``bandwidth.growth.points`` (sizes in MiB, as the file has them)."""
    return tuple(
        GrowthPoint(label, tuple((round(s * MiB), round(b * MiB)) for s, b in p["copied_mib"]),
                    tuple(float(r) for r in p["ratios"]))
        for label, p in section["points"].items())


def _shipped_table(key: str) -> BandwidthTable:
    data = shipped_data()[key]
    bw = data["bandwidth"]
    table = BandwidthTable.from_mapping(bw["runs"], device=str(data["name"]),
                                        source=str(bw["source"]),
                                        tensor_bytes=int(bw["tensor_bytes"]))
    grown = bw.get("growth")
    if grown is None:
        return table
    return BandwidthTable(table.device, table.tensor_bytes, table.points, table.source,
                          growth_points(grown), str(grown.get("source", "")),
                          str(grown.get("workload", "")))


#: The shipped ``h200.json``'s ``bandwidth``: a 1 GiB bf16 tensor's copies by handle size,
#: and the owner's tensors' after decode growth per policy.
H200_BANDWIDTH = _shipped_table("h200")


def _curve(table: BandwidthTable, interleaved: bool,
           runs: str = "mean") -> Log2Curve:
    """TB/s by handle size from the table; interleaved falls back to plain past its data.

    ``runs``: ``"mean"`` of each point's runs, or its ``"low"`` or ``"high"`` one.
    """
    def tb_s(p: BandwidthPoint) -> float:
        return {"mean": p.tb_s, "low": min(p.runs_tb_s), "high": max(p.runs_tb_s)}[runs]

    plain = {p.handle_bytes: tb_s(p) for p in table.points
             if p.handle_bytes is not None and not p.interleaved}
    pts = dict(plain)
    if interleaved:
        inter = {p.handle_bytes: tb_s(p) for p in table.points
                 if p.handle_bytes is not None and p.interleaved}
        if inter:
            # Interleaving was measured only for small handles; beyond the largest measured
            # one the plain curve holds (the penalty shrinks with size).
            top = max(inter)
            pts = {s: v for s, v in plain.items() if s > top}
            pts.update(inter)
    if not pts:
        raise ArgumentError("table", table.device, "a table with vmm_<N>MiB points")
    return Log2Curve.from_points([(s, v) for s, v in pts.items() if s is not None])


@dataclass(frozen=True, slots=True)
class BandwidthFit:
    """The interleaved curve, fitted: copy time per byte relative to cudaMalloc's, by handle
    size, as three curves (the runs' medians, lowest and highest)."""

    knots_bytes: tuple[int, ...]  #: handle sizes whose slowdown was fitted, ascending
    mid: Log2Curve  #: slowdown (cudaMalloc bandwidth / bandwidth) fitted to the medians
    low: Log2Curve  #: ... to each point's lowest run (the highest slowdown)
    high: Log2Curve  #: ... to each point's highest run
    points: tuple[GrowthPoint, ...]  #: what was fitted

    def band(self, copied: Sequence[tuple[int, int]]) -> RatioBand:
        """The ratio to cudaMalloc of a copy whose bytes lie in handles as ``copied`` says
        (``[(handle size, bytes in such handles), ...]``): each byte takes its handle
        size's time, so the copy's ratio is the byte-weighted harmonic mean."""
        total = sum(b for _, b in copied)
        if total <= 0:
            raise ArgumentError("copied", copied, "at least one byte in a handle")

        def ratio(curve: Log2Curve) -> float:
            return total / sum(b * curve(s) for s, b in copied)

        mid = ratio(self.mid)
        return RatioBand(min(ratio(self.low), mid), mid, max(ratio(self.high), mid))


def _knot_row(xs: Sequence[float], size: int) -> list[float]:
    """Weights of each knot in the log2-linear interpolation at ``size`` (flat past the ends),
    the same interpolation :class:`Log2Curve` does."""
    row = [0.0] * len(xs)
    x = math.log2(size)
    if x <= xs[0] or len(xs) == 1:
        row[0] = 1.0
    elif x >= xs[-1]:
        row[-1] = 1.0
    else:
        i = next(j for j in range(1, len(xs)) if xs[j] >= x)
        t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        row[i - 1], row[i] = 1.0 - t, t
    return row


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Solve ``rows @ u ~= ys`` by the normal equations (a handful of unknowns)."""
    n = len(rows[0])
    m = [[sum(r[i] * r[j] for r in rows) for j in range(n)]
         + [sum(r[i] * y for r, y in zip(rows, ys, strict=True))] for i in range(n)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-12:
            raise ArgumentError("points", len(rows), "points that pin every fitted size")
        m[c], m[piv] = m[piv], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [a - f * b for a, b in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_growth_bandwidth(points: Sequence[GrowthPoint]) -> BandwidthFit:
    """Fit the interleaved curve to measured copies.

    Every byte copies at its handle size's bandwidth; between fitted sizes (knots: the sizes
    that hold most of some point's bytes) the slowdown (time per byte over cudaMalloc's) is linear
    in log2(size), flat beyond. The knots' slowdowns are the least-squares fit to the points'
    slowdowns: once to each point's median run, once to its lowest, once to its highest.

    Raises:
        ArgumentError: no points, or too few to pin every knot.
    """
    if not points:
        raise ArgumentError("points", points, "at least one measured copy")
    knots = sorted({max(p.copied, key=lambda sb: sb[1])[0] for p in points})
    xs = [math.log2(k) for k in knots]
    rows = []
    for p in points:
        total = sum(b for _, b in p.copied)
        row = [0.0] * len(knots)
        for size, nbytes in p.copied:
            for j, w in enumerate(_knot_row(xs, size)):
                row[j] += w * nbytes / total
        rows.append(row)

    def curve(stat: Any) -> Log2Curve:
        u = _least_squares(rows, [1.0 / stat(p) for p in points])
        return Log2Curve(tuple(xs), tuple(u))

    return BandwidthFit(tuple(knots), curve(lambda p: p.median),
                        curve(lambda p: p.low), curve(lambda p: p.high), tuple(points))


@lru_cache(maxsize=8)
def growth_fit(table: BandwidthTable | None = None) -> BandwidthFit | None:
    """The table's interleaved curve fitted to its growth runs and its interleaved points (the
    only figures below the runs' handle sizes); None without growth runs or a ``plain`` reference.
    """
    table = H200_BANDWIDTH if table is None else table
    ref = table.reference_tb_s("plain")
    if not table.growth or not ref:
        return None
    inter = tuple(GrowthPoint(p.label, ((p.handle_bytes, table.tensor_bytes),),
                              tuple(r / ref for r in p.runs_tb_s))
                  for p in table.points if p.interleaved and p.handle_bytes is not None)
    return fit_growth_bandwidth((*table.growth, *inter))


def _sizes(handle_bytes: Sequence[int]) -> list[tuple[int, int]]:
    sizes = list(handle_bytes)
    for s in sizes:
        int_arg("handle size", s, lo=1, limit="an int > 0 (bytes)")
    return [(s, n * s) for s, n in Counter(sizes).items()]


def predicted_ratio(
    handle_bytes: Sequence[int], *, interleaved: bool = False,
    table: BandwidthTable | None = None,
) -> RatioBand:
    """Copy bandwidth predicted for a buffer backed by handles of the given sizes, as a ratio to
    cudaMalloc's, with its band: interleaved, where the table has growth runs, the fitted curve
    (:func:`growth_fit`); otherwise the table's curve, banded by each point's lowest and highest
    run. Arguments as :func:`predicted_bandwidth_tb_s`.

    Raises:
        ArgumentError: a size is not an int > 0, no sizes, or a table without ``plain``.
    """
    table = H200_BANDWIDTH if table is None else table
    copied = _sizes(handle_bytes)
    if not copied:
        raise ArgumentError("handle_bytes", handle_bytes, "at least one handle")
    fit = growth_fit(table) if interleaved else None
    if fit is not None:
        return fit.band(copied)
    ref = table.reference_tb_s("plain")
    if not ref:
        raise ArgumentError("table", table.device, "a table with a plain (cudaMalloc) point")
    total = sum(b for _, b in copied)

    def ratio(runs: str) -> float:
        bw = _curve(table, interleaved, runs)
        return total / sum(b / bw(s) for s, b in copied) / ref

    return RatioBand(ratio("low"), ratio("mean"), ratio("high"))


def predicted_bandwidth_tb_s(
    handle_bytes: Sequence[int], *, interleaved: bool = False,
    table: BandwidthTable | None = None,
) -> float:
    """Copy bandwidth predicted for a buffer backed by handles of the given sizes.

    Each handle's bytes copy at the bandwidth of its size, so the buffer's bandwidth is the
    byte-weighted harmonic mean. Interleaved handles take the curve fitted to the owner's growth
    where the table has it (:func:`predicted_ratio`'s ``mid`` times cudaMalloc's TB/s); otherwise
    the table's curve.

    Args:
        handle_bytes: handle sizes in bytes (all > 0).
        interleaved: handles created in turn with other buffers' handles (decode growth).
        table: the measurements (default :data:`H200_BANDWIDTH`).
    Returns:
        TB/s; 0.0 for no handles.
    Raises:
        ArgumentError: a size is not an int > 0.
    """
    return _copied_tb_s(_sizes(handle_bytes), interleaved,
                        H200_BANDWIDTH if table is None else table)


def predicted_mix_tb_s(
    handles: Sequence[tuple[int, int]], *, interleaved: bool = False,
    table: BandwidthTable | None = None,
) -> float:
    """:func:`predicted_bandwidth_tb_s` of ``count`` handles of each ``size`` (``handles``:
    ``[(size, count), ...]`` in the order the sizes first appear, as ``Counter(sizes).items()``
    gives them): the same result, to the bit, as the list of sizes.

    Raises:
        ArgumentError: a size or a count is not an int > 0.
    """
    for s, n in handles:
        int_arg("handle size", s, lo=1, limit="an int > 0 (bytes)")
        int_arg("handle count", n, lo=1, limit="an int > 0")
    return _copied_tb_s([(s, n * s) for s, n in handles], interleaved,
                        H200_BANDWIDTH if table is None else table)


def _copied_tb_s(copied: list[tuple[int, int]], interleaved: bool,
                 table: BandwidthTable) -> float:
    """TB/s of a copy whose bytes lie in handles as ``copied`` says (``(size, bytes)``)."""
    if not copied:
        return 0.0
    fit = growth_fit(table) if interleaved else None
    ref = table.reference_tb_s("plain")
    if fit is not None and ref:
        return fit.band(copied).mid * ref
    bw = _curve(table, interleaved)
    return sum(b for _, b in copied) / sum(b / bw(s) for s, b in copied)

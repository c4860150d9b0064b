"""The copy-bandwidth model: how fast a tensor copies, by the sizes of the handles behind it.

Measured on a device (a profile's ``bandwidth`` data: the H200's ships), interpolated in
log2(handle size) between measured sizes. An estimate from one device's measurements, not a
measurement: the lab shows it next to the figure's source.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvvmm.checks import int_arg
from kvvmm.errors import ArgumentError
from kvvmm.hardware.interp import Log2Curve
from kvvmm.hardware.profiles import shipped_data
from kvvmm.units import GiB, MiB

__all__ = ["H200_BANDWIDTH", "BandwidthPoint", "BandwidthTable", "predicted_bandwidth_tb_s"]


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
class BandwidthTable:
    """Bandwidth measurements of one device, with where they come from."""

    device: str
    tensor_bytes: int  #: size of the copied tensor
    points: tuple[BandwidthPoint, ...]
    source: str

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


def _shipped_table(key: str) -> BandwidthTable:
    data = shipped_data()[key]
    bw = data["bandwidth"]
    return BandwidthTable.from_mapping(bw["runs"], device=str(data["name"]),
                                       source=str(bw["source"]),
                                       tensor_bytes=int(bw["tensor_bytes"]))


#: Copy bandwidth of a 1 GiB bf16 tensor on an H200, two runs each (the shipped
#: ``h200.json``'s ``bandwidth``; docs/MEASUREMENTS.md §4).
H200_BANDWIDTH = _shipped_table("h200")


def _curve(table: BandwidthTable, interleaved: bool) -> Log2Curve:
    """TB/s by handle size; interleaved falls back to plain past its data."""
    plain = {p.handle_bytes: p.tb_s for p in table.points
             if p.handle_bytes is not None and not p.interleaved}
    pts = dict(plain)
    if interleaved:
        inter = {p.handle_bytes: p.tb_s for p in table.points
                 if p.handle_bytes is not None and p.interleaved}
        if inter:
            # Interleaving was measured only for small handles; beyond the largest measured
            # one the plain curve holds (the penalty shrinks with size: 8 MiB 4.08 vs 4.00).
            top = max(inter)
            pts = {s: v for s, v in plain.items() if s > top}
            pts.update(inter)
    if not pts:
        raise ArgumentError("table", table.device, "a table with vmm_<N>MiB points")
    return Log2Curve.from_points([(s, v) for s, v in pts.items() if s is not None])


def predicted_bandwidth_tb_s(
    handle_bytes: Sequence[int], *, interleaved: bool = False,
    table: BandwidthTable | None = None,
) -> float:
    """Copy bandwidth predicted for a buffer backed by handles of the given sizes.

    Each handle's bytes are copied at the table's bandwidth for its size (piecewise linear
    in log2(size) between measured sizes, flat beyond them), so the buffer's time is the sum
    of ``bytes / bandwidth`` and its bandwidth the byte-weighted harmonic mean. An estimate
    from one device's measurements, not a measurement.

    Args:
        handle_bytes: handle sizes in bytes (all > 0).
        interleaved: use the interleaved curve (handles created in turn with other buffers'
            handles, as decode growth of many buffers does).
        table: the measurements (default :data:`H200_BANDWIDTH`).
    Returns:
        TB/s; 0.0 for no handles.
    Raises:
        ArgumentError: a size is not an int > 0.
    """
    table = H200_BANDWIDTH if table is None else table
    sizes = list(handle_bytes)
    for s in sizes:
        int_arg("handle size", s, lo=1, limit="an int > 0 (bytes)")
    if not sizes:
        return 0.0
    bw = _curve(table, interleaved)
    per_size = Counter(sizes)
    seconds = sum(n * s / bw(s) for s, n in per_size.items())
    return sum(sizes) / seconds

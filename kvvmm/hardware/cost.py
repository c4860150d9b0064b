"""The simulator's cost model: microseconds per driver call, by call and handle size.

The figures are a profile's measured ``call_costs``; a profile without its own borrows the
H200's. Between measured sizes the cost is interpolated in log2(size).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvvmm.hardware.interp import Log2Curve
from kvvmm.hardware.profiles import shipped_data
from kvvmm.units import MiB

__all__ = ["COST_TABLE_US", "CostModel", "default_cost_model"]


def _table() -> dict[str, tuple[tuple[int, float], ...]]:
    raw = shipped_data()["h200"]["call_costs"]["points"]
    return {op: tuple((int(mib), float(us)) for mib, us in pts) for op, pts in raw.items()}


#: Microseconds per call by handle size, measured on an H200 (sizes in MiB); the shipped
#: ``h200.json``'s ``call_costs``.
COST_TABLE_US: dict[str, tuple[tuple[int, float], ...]] = _table()


@dataclass(frozen=True, slots=True)
class CostModel:
    """µs per driver call: ``model("create", size_bytes)``."""

    curves: dict[str, Log2Curve]
    mem_info_us: float  #: a cheap query's cost
    source: str  #: where the figures come from
    #: A set access over several mappings costs this times the sum of one call per mapping.
    multi_access_factor: float = 0.94

    def access_us(self, mapping_sizes: list[int]) -> float:
        """µs of one set access covering mappings of these sizes (one or several)."""
        one = sum(self("set_access", s) for s in mapping_sizes)
        return one if len(mapping_sizes) <= 1 else one * self.multi_access_factor

    @classmethod
    def from_table(cls, table: dict[str, tuple[tuple[int, float], ...]], *,
                   mem_info_us: float, source: str) -> CostModel:
        """Build from ``{call: ((size_MiB, µs), ...)}``."""
        curves = {op: Log2Curve.from_points([(mib * MiB, us) for mib, us in pts])
                  for op, pts in table.items()}
        return cls(curves, mem_info_us, source)

    def __call__(self, op: str, size: int) -> float:
        return self.curves[op](size)


def default_cost_model() -> CostModel:
    """The H200's measured costs (what the sim charges on every profile)."""
    data = shipped_data()["h200"]["call_costs"]
    return CostModel.from_table(COST_TABLE_US, mem_info_us=float(data["mem_info_us"]),
                                source=str(data["source"]))

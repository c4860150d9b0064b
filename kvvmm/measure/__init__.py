"""The calibration workshop: everything that measures the card or fits the simulator.

The library reads what this writes (:mod:`kvvmm.hardware`) and never imports it. The commands:
:mod:`~kvvmm.measure.bench` (``kvvmm bench``), :mod:`~kvvmm.measure.calibrate`
(``kvvmm calibrate``, its sections in :mod:`~kvvmm.measure.calls` and
:mod:`~kvvmm.measure.operations`, its profile made by :mod:`~kvvmm.measure.fit`, its quick
refresh :mod:`~kvvmm.measure.refresh`) and :mod:`~kvvmm.measure.rebuild`
(``kvvmm calibrate rebuild``: the shipped profile's derived figures from the committed results).
What they and the ``bench/`` scripts share: :mod:`~kvvmm.measure.stats` (one measurement
record, one percentile, the spread section), :mod:`~kvvmm.measure.timer` (the call-timing loop,
:class:`TimedDriver`, the copy timer), :mod:`~kvvmm.measure.workload` (the decode growth timed)
and :mod:`~kvvmm.measure.machine` (what a result records of the machine).

torch and cuda-python are imported inside the functions that time them.
"""

from kvvmm.measure.growth import SETTLE_S, grow
from kvvmm.measure.timer import TimedDriver, copy_tb_s, copy_vs_malloc, rotated, wrapper_cost_s
from kvvmm.measure.workload import BENCH_WORKLOAD, Workload

__all__ = ["BENCH_WORKLOAD", "SETTLE_S", "TimedDriver", "Workload", "copy_tb_s", "copy_vs_malloc",
           "grow", "rotated", "wrapper_cost_s"]

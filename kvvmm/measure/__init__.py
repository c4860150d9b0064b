"""The calibration workshop: everything that measures the card or fits the simulator.

The library reads what this writes (:mod:`kvvmm.hardware`: the profiles and the models over
them) and never imports it. The commands:

- :mod:`kvvmm.measure.bench`: kvvmm against the raw driver and the seed, per call, per
  construction, per decode growth, per copy (results under ``bench/results/``); its elastic
  sections are :mod:`kvvmm.measure.elastic`, its growth per policy :mod:`kvvmm.measure.growth`.
- :mod:`kvvmm.measure.calibrate`: what the simulator charges, measured on the card at hand
  (:mod:`~kvvmm.measure.calls`, :mod:`~kvvmm.measure.operations`, planned by
  :mod:`~kvvmm.measure.plan`) and fitted into a hardware profile (:mod:`~kvvmm.measure.fit`);
  ``--quick --profile`` refreshes one (:mod:`~kvvmm.measure.refresh`).
- ``kvvmm calibrate rebuild [--check]`` (:mod:`~kvvmm.measure.rebuild`): the shipped H200
  profile's derived figures remade from the committed results (:mod:`~kvvmm.measure.results`
  finds them): the growth bandwidth (:mod:`~kvvmm.measure.growth_bandwidth`) and the cold
  call's tail (:mod:`~kvvmm.measure.coldtail`); its spread (the bands) is kept as shipped.

What they share, defined once (and what the ``bench/`` scripts import):

- :mod:`kvvmm.measure.stats`: one measurement record, one percentile, and the spread
  section a refresh writes;
- :mod:`kvvmm.measure.timer`: the call-timing loop (:func:`time_handle_calls`), the driver
  wrapper that times every call (:class:`TimedDriver`) and the copy timer;
- :mod:`kvvmm.measure.workload`: the decode growth timed (:class:`Workload`,
  :data:`BENCH_WORKLOAD`).
- :mod:`kvvmm.measure.machine`: what a result records of the machine (CPU model, load,
  commit).

Nothing here is imported by ``import kvvmm``; torch and cuda-python are imported inside the
functions that time them.
"""

from kvvmm.measure.growth import SETTLE_S, grow
from kvvmm.measure.timer import TimedDriver, copy_tb_s, copy_vs_malloc, rotated, wrapper_cost_s
from kvvmm.measure.workload import BENCH_WORKLOAD, Workload

__all__ = ["BENCH_WORKLOAD", "SETTLE_S", "TimedDriver", "Workload", "copy_tb_s", "copy_vs_malloc",
           "grow", "rotated", "wrapper_cost_s"]

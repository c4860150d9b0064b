"""Measuring kvvmm on a GPU: ``kvvmm bench`` and ``kvvmm calibrate``, and what they share.

The commands:

- :mod:`kvvmm.measure.bench`: kvvmm against the raw driver and the seed, per call, per
  construction, per decode growth, per copy (results under ``bench/results/``); its issue-19
  sections are :mod:`kvvmm.measure.elastic`, its growth per policy :mod:`kvvmm.measure.growth`.
- :mod:`kvvmm.measure.calibrate`: what the simulator charges, measured on the card at hand
  (:mod:`~kvvmm.measure.calls`, :mod:`~kvvmm.measure.operations`, planned by
  :mod:`~kvvmm.measure.plan`) and fitted into a hardware profile (:mod:`~kvvmm.measure.fit`).

What both use, defined once (and what the probes and ``bench/`` scripts import):

- :mod:`kvvmm.measure.workload`: the decode growth timed (:class:`Workload`,
  :data:`BENCH_WORKLOAD`);
- :mod:`kvvmm.measure.timer`: the driver wrapper that times every call (:class:`TimedDriver`)
  and the copy timer (:func:`copy_tb_s`, :func:`copy_vs_malloc`).

Nothing here is imported by ``import kvvmm``; torch and cuda-python are imported inside the
functions that time them.
"""

from kvvmm.measure.growth import SETTLE_S, grow
from kvvmm.measure.timer import TimedDriver, copy_tb_s, copy_vs_malloc, rotated, wrapper_cost_s
from kvvmm.measure.workload import BENCH_WORKLOAD, Workload

__all__ = ["BENCH_WORKLOAD", "SETTLE_S", "TimedDriver", "Workload", "copy_tb_s", "copy_vs_malloc",
           "grow", "rotated", "wrapper_cost_s"]

"""Measuring kvvmm on a GPU: ``kvvmm bench`` and ``kvvmm calibrate``.

- :mod:`kvvmm.measure.bench`: kvvmm against the raw driver and the seed, per call, per
  construction, per decode growth, per copy (results under ``bench/results/``).
- :mod:`kvvmm.measure.calibrate`: what the simulator charges, measured on the card at hand and
  written as a hardware profile.

Nothing here is imported by ``import kvvmm``; torch and cuda-python are imported inside the
functions that time them.
"""

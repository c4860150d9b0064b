"""``kvvmm bench``: the GPU benchmarks (:mod:`kvvmm.measure.bench`), or one line saying
why they cannot run here."""

from __future__ import annotations

from collections.abc import Sequence

from kvvmm.cli.common import _err
from kvvmm.cli.lab import GpuProbe
from kvvmm.errors import KvvmmError


def _torch_cuda_usable() -> bool:
    """True when torch is installed with CUDA and sees a GPU (what the benchmarks run on)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _cmd_bench(rest: Sequence[str], gpu_probe: GpuProbe) -> int:
    try:
        from kvvmm.measure import bench
    except ImportError as e:
        _err("bench", f"the benchmarks are not available in this install ({e})")
        return 2
    asks_help = any(a in ("-h", "--help") for a in rest)
    if not asks_help and not gpu_probe():
        # Said here, in one line: deeper down torch raises an AssertionError with a traceback.
        _err("bench", "needs a CUDA GPU and a CUDA build of torch; none is usable here "
                      "(torch.cuda.is_available() is False). Run it on a GPU machine; "
                      "`kvvmm lab` runs the notebooks on the sim driver.")
        return 2
    try:
        return int(bench.main(list(rest)) or 0)
    except KvvmmError as e:
        _err("bench", f"{type(e).__name__}: {e}")
        return 2

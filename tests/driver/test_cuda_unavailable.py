"""Without a usable GPU, asking for the CUDA driver gives one clear error, and "auto" falls back.

These run on machines with no NVIDIA driver (CI, laptops); on a GPU machine they skip.
"""

from __future__ import annotations

import subprocess
import sys
import traceback

import pytest

from kvvmm.driver import open_driver
from kvvmm.errors import DriverUnavailableError


def _cuda_usable() -> bool:
    try:
        from kvvmm.driver.cuda import CudaDriver

        CudaDriver().close()
    except (DriverUnavailableError, ImportError):
        return False
    return True


pytestmark = pytest.mark.skipif(_cuda_usable(), reason="a GPU is usable here")


def test_open_driver_cuda_raises_one_helpful_error():
    with pytest.raises(DriverUnavailableError) as info:
        open_driver("cuda")
    msg = str(info.value)
    assert "CUDA" in msg
    assert 'open_driver("sim")' in msg and 'open_driver("host")' in msg


def test_the_error_chains_no_cuda_library_traceback():
    with pytest.raises(DriverUnavailableError) as info:
        open_driver("cuda")
    err = info.value
    assert err.__cause__ is None
    assert err.__context__ is None or err.__suppress_context__
    shown = "".join(traceback.format_exception(err))
    assert "DynamicLibNotFoundError" not in shown.split("DriverUnavailableError")[0]
    assert shown.count("Traceback") == 1


def test_the_cuda_driver_class_itself_raises_the_same_error():
    try:
        from kvvmm.driver.cuda import CudaDriver
    except ImportError:
        pytest.skip("cuda-python is not installed")
    with pytest.raises(DriverUnavailableError, match="cannot run here"):
        CudaDriver(device=0)


def test_open_driver_auto_falls_back_to_the_host_driver():
    if not sys.platform.startswith("linux"):
        pytest.skip("the host driver needs Linux")
    d = open_driver("auto")
    try:
        assert d.kind == "host"
    finally:
        d.close()  # type: ignore[attr-defined]


def test_importing_the_cuda_driver_module_imports_no_torch():
    code = "import sys, kvvmm.driver.cuda; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

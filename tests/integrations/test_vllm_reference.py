"""The loader of vLLM 0.34's own VMM files (``tests/vllm_files.py``), checked.

vLLM is not installed (and must not be): ``tests/vllm_files.py`` loads its
``vllm/utils/vmm_driver.py`` and ``vllm/utils/extensible_tensor.py`` from
``../shared/reference/vllm-0.34.0/`` beside the repository (``KVVMM_VLLM_DIR`` overrides the
folder) with stand-ins for the rest of vLLM, and stands in for ``torch.accelerator`` on a
torch without a device. :func:`vllm_dir` is the tests' way to reach it: skipped (failed under
``KVVMM_REQUIRE_CONFORMANCE=1``) when the files are not there. The names of the loader are
imported here too, where the other tests have always found them.

The tests here check the loader itself: loaded, and gone again afterwards.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from vllm_files import (  # the other vLLM tests import these names from here
    FILES,
    NAMES,
    VLLM_DIR,
    accelerator_stub,
    missing_files,
    vllm_loaded,
)


def vllm_dir() -> Path:
    """The folder holding vLLM 0.34's files; skip (fail under KVVMM_REQUIRE_CONFORMANCE=1)
    when it is not there."""
    missing = missing_files(VLLM_DIR)
    if missing:
        why = (f"vLLM 0.34's reference files are not at {VLLM_DIR} (missing {missing}): CI "
               "has ../shared/reference/vllm-0.34.0 beside the repository (or set "
               "KVVMM_VLLM_DIR)")
        if os.environ.get("KVVMM_REQUIRE_CONFORMANCE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return VLLM_DIR


def test_vllms_files_load_with_stand_ins_and_leave_no_module_behind() -> None:
    root = vllm_dir()
    before = {n: sys.modules.get(n) for n in NAMES}
    with vllm_loaded(root) as v:
        assert v.vmm_driver.__file__ == str(root / FILES["vllm.utils.vmm_driver"])
        assert v.extensible_tensor.get_vmm_driver is v.vmm_driver.get_vmm_driver
        assert hasattr(v.vmm_driver, "CudaVmmDriver") and hasattr(v.extensible_tensor,
                                                                    "ExtensibleTensor")
    assert {n: sys.modules.get(n) for n in NAMES} == before


def test_the_accelerator_stand_in_is_undone() -> None:
    import torch

    before = torch.accelerator.synchronize
    with accelerator_stub():
        pass
    assert torch.accelerator.synchronize is before

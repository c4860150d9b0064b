"""Check (not a test) that the lab's panels work on the real CUDA driver.

The device machine has no plotly or ipywidgets, so this runs with their wheels carried
along; tests/gpu stays free of them. Drives ArenaLab through its widgets exactly as
tests/lab/test_lab.py does on the sim and host drivers, and GrowthLab on the sim.

    PYTHONPATH=$PWD python3 bench/probes/check_lab_cuda.py

It prints what it saw and exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import torch

from kvvmm.lab import ArenaLab, GrowthLab, LayoutExplorer
from kvvmm.viz import describe


def main() -> int:
    torch.empty(1, device="cuda")
    lab = ArenaLab(driver="cuda", layers=2, reserved_tokens=65_536)
    lab.reserve_mib.value = 512
    lab.reserve_button.click()
    lab.alloc_mib.value = 64
    lab.allocate_button.click()
    lab.commit_mib.value = 32
    lab.commit_button.click()
    snap = lab.snapshot()
    assert snap is not None and not lab.error_text, lab.error_text
    assert snap.driver == "cuda" and snap.backed_bytes == 32 << 20, snap
    print("bare arena on", snap.device_name, ":", snap.backed_bytes >> 20, "MiB backed")
    lab.close_button.click()
    lab.reserve_kv_button.click()
    lab.tokens.value = 32_768
    lab.finalize_button.click()
    owner_snap = lab.snapshot()
    assert not lab.error_text, lab.error_text
    print(describe(owner_snap))
    lab.tokens.value = 8  # below a page: the panel shows the error, nothing changes
    lab.finalize_button.click()
    assert "page_size" in lab.error_text and lab.snapshot() == owner_snap, lab.error_text
    print("bad input:", lab.error_text)
    drv = lab.driver_object
    lab.close_button.click()
    assert drv is not None and drv.stats().clean, drv.stats()
    print("after close:", drv.stats())
    ex = LayoutExplorer(model="llama-3.1-8b", gpu="h200")
    assert not ex.error_text
    g = GrowthLab()
    g.run_button.click()
    assert not g.error_text, g.error_text
    print("LayoutExplorer and GrowthLab: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

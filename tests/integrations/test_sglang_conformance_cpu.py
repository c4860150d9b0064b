"""SGLang 0.5.23's own pool classes on kvvmm, on the host driver (the conformance suite, in CI).

The suite (``tests/conformance/``) runs in a pytest process of its own: it stands in for
SGLang's GPU stack (``tests/conformance/standins.py``), which must not reach the rest of this
run. It needs the sglang wheel unpacked (``make sglang``; ``make test`` does it): without it
the test is skipped, unless ``KVVMM_REQUIRE_CONFORMANCE=1`` (CI sets it), where it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SGLANG_DIR = Path(os.environ.get("KVVMM_SGLANG_DIR", REPO / ".venv" / "sglang-0.5.23"))


def test_sglangs_own_pools_build_and_size_on_kvvmm(tmp_path: Path) -> None:
    if not (SGLANG_DIR / "sglang" / "srt" / "mem_cache" / "memory_pool.py").is_file():
        why = (f"the sglang 0.5.23 wheel is not unpacked at {SGLANG_DIR}: `make sglang` "
               "downloads and unpacks it (or set KVVMM_SGLANG_DIR)")
        if os.environ.get("KVVMM_REQUIRE_CONFORMANCE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    out = tmp_path / "conformance.json"
    env = dict(os.environ, KVVMM_SGLANG_DIR=str(SGLANG_DIR), KVVMM_SGLANG_CONFORMANCE="1",
               KVVMM_CONFORMANCE_OUT=str(out), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         str(REPO / "tests" / "conformance")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and out.is_file()

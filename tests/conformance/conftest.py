"""SGLang's own pools on kvvmm: the conformance suite's process (issue 24).

Run by ``tests/test_sglang_conformance_cpu.py`` (host driver, in CI) and by
``bench/h200_session.sh sglang`` (CUDA, with the seed beside kvvmm) as its own pytest process:
the stand-ins it installs for SGLang's GPU stack (``standins.py``) must not reach the rest of
the suite. ``KVVMM_SGLANG_DIR`` names the unpacked sglang wheel (``make sglang`` makes
``.venv/sglang-0.5.23``); ``KVVMM_CONFORMANCE_OUT``, if set, is a JSON file the observations
are written to.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import standins

ROOT = Path(os.environ["KVVMM_SGLANG_DIR"])
standins.load(ROOT)

import torch  # noqa: E402

from kvvmm.integrations import sglang as adapter  # noqa: E402

CUDA = torch.cuda.is_available()
#: The device SGLang's pools are given: a CPU one runs them on the host driver.
DEVICE = "cuda:0" if CUDA else "cpu:0"

if CUDA:
    adapter.install()
else:
    from kvvmm import open_driver

    _HOST = open_driver("host", granularity=2 << 20, capacity_bytes=8 << 30)
    adapter.install(driver=_HOST)

import sglang.srt.mem_cache.memory_pool as memory_pool  # noqa: E402, F401  # the tests' (from conftest)
import sglang.srt.mem_cache.swa_memory_pool as swa_memory_pool  # noqa: E402, F401  # the tests' (from conftest)
import sglang.srt.mem_cache.unified_memory_pool as unified_memory_pool  # noqa: E402, F401  # the tests' (from conftest)
from sglang.srt.environ import envs  # noqa: E402, F401  # the tests' (from conftest)

_observed: dict[str, Any] = {}


@pytest.fixture(scope="session")
def granularity() -> int:
    if CUDA:
        from kvvmm import open_driver

        d = open_driver("cuda", granularity="recommended")
        try:
            return d.granularity()
        finally:
            d.close()
    return _HOST.granularity()


@pytest.fixture
def observe(request: pytest.FixtureRequest) -> Any:
    """Record a test's observations (spans, backed bytes, owner class) for the JSON."""
    def put(key: str, value: Any) -> None:
        _observed.setdefault(request.node.name, {})[key] = value
    return put


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("KVVMM_CONFORMANCE_OUT")
    if out:
        import datetime
        import platform

        doc = {
            "benchmark": "SGLang 0.5.23's own pools built on kvvmm (tests/conformance)",
            "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "card": torch.cuda.get_device_name(0) if CUDA else f"none ({platform.machine()})",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "sglang": "0.5.23",
            "device": DEVICE,
            "driver": "cuda" if CUDA else "host",
            "standins": sorted({n.split(".")[0] if not n.startswith("sglang") else n
                                for n in standins.served}),
            "exit_status": int(exitstatus),
            "tests": _observed,
        }
        Path(out).write_text(json.dumps(doc, indent=1, default=str) + "\n")

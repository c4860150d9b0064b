"""SGLang's own pools on kvvmm: the conformance suite's process.

Run by ``tests/integrations/test_sglang_conformance_cpu.py`` (host driver, in CI) and by
``bench/device/card_check.sh sglang`` (CUDA, with the seed beside kvvmm) as its own pytest
process:
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
import harness  # loads the stand-ins and installs kvvmm's owner, once
import standins
from harness import CUDA, DEVICE, torch

_status = {"exit": 0}


@pytest.fixture(scope="session")
def granularity() -> int:
    if CUDA:
        from kvvmm import open_driver

        d = open_driver("cuda", granularity="recommended")
        try:
            return d.granularity()
        finally:
            d.close()
    return harness.HOST.granularity()


@pytest.fixture
def observe(request: pytest.FixtureRequest) -> Any:
    """Record a test's observations (spans, backed bytes, owner class) for the JSON."""
    def put(key: str, value: Any) -> None:
        harness.observed.setdefault(request.node.name, {})[key] = value
    return put


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _status["exit"] = int(exitstatus)
    if CUDA:  # no collection from here to the exit below: see pytest_unconfigure
        import gc

        gc.disable()
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
            "tests": harness.observed,
        }
        Path(out).write_text(json.dumps(doc, indent=1, default=str) + "\n")


def pytest_unconfigure(config: pytest.Config) -> None:
    """On CUDA, leave without running the interpreter's teardown: SGLang's own owner (the
    seed) hands torch pointers from a pluggable allocator it has closed by then, and torch's
    caching allocator aborts freeing them at exit ("invalid device pointer"), after every
    test has reported. Known of the seed (bench/seed/seed_side_by_side.py runs it in a child for
    that reason); the exit status stays pytest's."""
    if CUDA:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status["exit"])

"""The conformance suite's process-wide state, imported once (as ``harness``) by the conftest
and the tests: the stand-ins loaded, kvvmm's owner installed, SGLang's pool modules imported,
and the observations every test records for the JSON. (Importing ``conftest`` from a test
would load a second copy of it under importlib mode, with a second install.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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

    HOST = open_driver("host", granularity=2 << 20, capacity_bytes=8 << 30)
    adapter.install(driver=HOST)

import sglang.srt.mem_cache.memory_pool as memory_pool  # noqa: E402, F401
import sglang.srt.mem_cache.swa_memory_pool as swa_memory_pool  # noqa: E402, F401
import sglang.srt.mem_cache.unified_memory_pool as unified_memory_pool  # noqa: E402, F401
from sglang.srt.environ import envs  # noqa: E402, F401

#: test name -> what it observed (owner, spans, backed bytes)
observed: dict[str, dict[str, Any]] = {}

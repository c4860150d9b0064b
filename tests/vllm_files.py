"""vLLM 0.34's own VMM files, loaded with its few imports stood in for (no pytest needed).

vLLM is not installed (and must not be): its ``vllm/utils/vmm_driver.py`` and
``vllm/utils/extensible_tensor.py`` are read from ``../shared/reference/vllm-0.34.0/`` beside
the repository (``KVVMM_VLLM_DIR`` overrides the folder). :func:`vllm_loaded` puts them in
``sys.modules`` under their own names, with stand-ins for what they import from the rest of
vLLM (the packages ``vllm`` and ``vllm.utils``, and ``vllm.logger.init_logger``), and takes
every one of them out again afterwards. :func:`accelerator_stub` stands in for the three
``torch.accelerator`` calls ``ExtensibleTensor`` makes (``current_device_index``,
``synchronize``, ``empty_cache``) on a torch without a device, counting them.

The tests (``tests/integrations/test_vllm_*.py``, ``tests/gpu/test_gpu_vllm.py``) and
``bench/vllm_overhead/`` both load vLLM's files through here; vLLM's files are test and
benchmark inputs only, never part of the package.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VLLM_DIR = Path(os.environ.get("KVVMM_VLLM_DIR",
                               REPO.parent / "shared" / "reference" / "vllm-0.34.0"))
FILES = {"vllm.utils.vmm_driver": "vllm/utils/vmm_driver.py",
         "vllm.utils.extensible_tensor": "vllm/utils/extensible_tensor.py"}
#: What the loader puts in sys.modules (and takes out again).
NAMES = ("vllm", "vllm.utils", "vllm.logger", *FILES)


def missing_files(root: Path = VLLM_DIR) -> list[str]:
    """The vLLM files the loader needs that are not under ``root`` (empty: all there)."""
    return [f for f in FILES.values() if not (root / f).is_file()]


class _Logger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """vLLM's logger: a logging adapter with its ``*_once`` methods."""

    def warning_once(self, msg: str, *args: Any) -> None:
        self.warning(msg, *args)

    def info_once(self, msg: str, *args: Any) -> None:
        self.info(msg, *args)

    def debug_once(self, msg: str, *args: Any) -> None:
        self.debug(msg, *args)


def _package(name: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []  # a package with nothing on disk: its submodules come from sys.modules
    return m


@contextlib.contextmanager
def vllm_loaded(root: Path) -> Iterator[types.SimpleNamespace]:
    """vLLM's vmm_driver and extensible_tensor modules, loaded from ``root`` (as
    ``.vmm_driver`` and ``.extensible_tensor``); sys.modules is as it was afterwards."""
    saved = {n: sys.modules.get(n) for n in NAMES}
    try:
        sys.modules["vllm"] = _package("vllm")
        sys.modules["vllm.utils"] = _package("vllm.utils")
        logger = types.ModuleType("vllm.logger")
        logger.init_logger = lambda name: _Logger(logging.getLogger(name), {})  # type: ignore[attr-defined]
        sys.modules["vllm.logger"] = logger
        loaded = {}
        for name, rel in FILES.items():
            spec = importlib.util.spec_from_file_location(name, root / rel)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            setattr(sys.modules["vllm.utils"], name.rpartition(".")[2], mod)
            loaded[name.rpartition(".")[2]] = mod
        yield types.SimpleNamespace(**loaded)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


@contextlib.contextmanager
def accelerator_stub() -> Iterator[dict[str, int]]:
    """On a torch with no accelerator, ``torch.accelerator``'s ``current_device_index``
    (0), ``synchronize`` and ``empty_cache`` (no-ops), each call counted in the dict
    yielded; on a machine with one, nothing is replaced (the dict stays empty)."""
    import torch

    calls: dict[str, int] = {}
    if torch.accelerator.is_available():
        yield calls
        return
    acc = torch.accelerator
    saved = {n: getattr(acc, n) for n in ("current_device_index", "synchronize",
                                          "empty_cache")}

    def counted(name: str, value: Any = None) -> Any:
        def fn(*args: Any, **kw: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return value
        return fn

    try:
        acc.current_device_index = counted("current_device_index", 0)  # type: ignore[assignment]
        acc.synchronize = counted("synchronize")  # type: ignore[assignment]
        acc.empty_cache = counted("empty_cache")  # type: ignore[assignment]
        yield calls
    finally:
        for n, f in saved.items():
            setattr(acc, n, f)

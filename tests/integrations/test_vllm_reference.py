"""vLLM's own VMM files, loaded for the conformance tests with its few imports stood in for.

vLLM is not installed (and must not be): its ``vllm/utils/vmm_driver.py`` and
``vllm/utils/extensible_tensor.py`` are read from ``../shared/reference/vllm-0.34.0/`` beside
the repository (``KVVMM_VLLM_DIR`` overrides the folder). :func:`vllm_loaded` puts them in
``sys.modules`` under their own names, with stand-ins for what they import from the rest of
vLLM (the packages ``vllm`` and ``vllm.utils``, and ``vllm.logger.init_logger``), and takes
every one of them out again afterwards. :func:`accelerator_stub` stands in for the three
``torch.accelerator`` calls ``ExtensibleTensor`` makes (``current_device_index``,
``synchronize``, ``empty_cache``) on a torch without a device, counting them. Nothing else is
stubbed: vLLM's tensors over the VA are built by its own ``uint8_tensor_from_ptr``, as the
adapter's ``dlpack_device_type`` tells it (CPU tensors over the host driver's real bytes).

The tests here check the loader itself: loaded, and gone again afterwards.
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

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_DIR = Path(os.environ.get("KVVMM_VLLM_DIR",
                               REPO.parent / "shared" / "reference" / "vllm-0.34.0"))
FILES = {"vllm.utils.vmm_driver": "vllm/utils/vmm_driver.py",
         "vllm.utils.extensible_tensor": "vllm/utils/extensible_tensor.py"}
#: What the loader puts in sys.modules (and takes out again).
NAMES = ("vllm", "vllm.utils", "vllm.logger", *FILES)


def vllm_dir() -> Path:
    """The folder holding vLLM 0.34's files; skip (fail under KVVMM_REQUIRE_CONFORMANCE=1)
    when it is not there."""
    missing = [f for f in FILES.values() if not (VLLM_DIR / f).is_file()]
    if missing:
        why = (f"vLLM 0.34's reference files are not at {VLLM_DIR} (missing {missing}): CI "
               "has ../shared/reference/vllm-0.34.0 beside the repository (or set "
               "KVVMM_VLLM_DIR)")
        if os.environ.get("KVVMM_REQUIRE_CONFORMANCE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return VLLM_DIR


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

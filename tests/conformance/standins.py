"""Load SGLang's own pool modules from an unpacked sglang wheel, without its GPU stack.

``import sglang`` runs its whole package ``__init__`` (model patches, FlashInfer, the server),
and ``sglang.srt.mem_cache.memory_pool`` reaches the model layers and the kernel packages. The
pool classes need none of it to be built and sized, so :func:`load` puts the wheel's files on
the import path and serves stand-ins for exactly these:

- ``STANDINS``: the kernel and model code the pool modules import but never run while a pool
  is built and sized (``sglang.kernels``, ``sglang.srt.layers``, ``sglang.srt.configs``,
  ``transformers``), and ``triton`` where it is not installed (the kernels it decorates are
  defined, never launched);
- any other package an sglang module imports that is not installed here (``orjson``,
  ``starlette``, ``pynvml``, ...): the server's and the profiler's, not the pools'.

Everything else is SGLang's own code, unchanged: ``memory_pool.py``, ``swa_memory_pool.py``,
``unified_memory_pool.py``, ``environ.py``, the utils. A stand-in is a module whose every
attribute is a permissive class (it can be subclassed, called, used as a decorator or a type
hint); :data:`served` lists what was stood in, for the report.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

STANDINS = ("sglang.kernels", "sglang.srt.layers", "sglang.srt.configs", "transformers")

#: Names of the modules stood in, in the order they were asked for.
served: list[str] = []


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _standin_class(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, key: object) -> Any:
        return cls

    def __or__(cls, other: object) -> Any:
        return cls

    __ror__ = __or__


def _standin_class(qualname: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator: keep the function
        return self

    def __getattr__(self: Any, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _standin_class(name)

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        pass  # class options a real base takes (msgspec.Struct's frozen=True, ...)

    return _Meta(qualname.rsplit(".", 1)[-1], (),
                 {"__init__": __init__, "__call__": __call__, "__getattr__": __getattr__,
                  "__init_subclass__": classmethod(__init_subclass__), "__qualname__": qualname})


class _StandinModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _standin_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: Path, forced: tuple[str, ...]) -> None:
        self.root = str(root)
        self.forced = forced

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        parts = name.split(".")
        if any(".".join(parts[:i]) in self.forced for i in range(1, len(parts) + 1)):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        top = parts[0]
        if top == "sglang" or name in sys.modules or top in sys.stdlib_module_names:
            return None
        if importlib.machinery.PathFinder.find_spec(top) is not None:
            return None  # installed: the real one
        if not self._from_sglang():
            return None  # someone else's optional import (torch's): let it fail as usual
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def _from_sglang(self) -> bool:
        f = sys._getframe(2)
        while f is not None and (f.f_code.co_filename.startswith("<frozen")
                                 or "importlib" in f.f_code.co_filename):
            f = f.f_back
        return f is not None and f.f_code.co_filename.startswith(self.root)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandinModule(spec.name)
        module.__path__ = []
        served.append(spec.name)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def load(root: Path) -> None:
    """Make ``sglang.*`` importable from the unpacked wheel at ``root`` (its ``sglang/``
    folder inside), with the stand-ins above. Call once per process, before importing
    sglang (and after importing torch, so torch's own optional imports are its own)."""
    import torch  # noqa: F401  # first: its optional imports must not meet the finder

    forced = STANDINS + (() if importlib.util.find_spec("triton") else ("triton",))
    sys.meta_path.insert(0, _Finder(root, forced))
    package = types.ModuleType("sglang")  # sglang/__init__.py (the whole server) is skipped
    package.__path__ = [str(root / "sglang")]
    sys.modules["sglang"] = package

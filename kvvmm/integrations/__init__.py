"""Engine adapters: kvvmm behind the APIs serving engines already call.

:mod:`kvvmm.integrations.sglang` is SGLang's ``kv_vmm_backing.KvVmmBufferOwner``, backed by a
:class:`~kvvmm.owner.KvBufferOwner`; :mod:`kvvmm.integrations.vllm` is vLLM's ``VmmDriver``
(behind ``vllm.utils.vmm_driver.get_vmm_driver``), backed by any kvvmm driver. Adapters sit
above the lab and below the CLI: they use the library's public API only, and ``import kvvmm``
does not import them (nor do they import their engine until asked to install into it).
"""

from __future__ import annotations

import types

__all__: list[str] = []


def twin_class(cls: type[BaseException], base: type[BaseException], namespace: type,
               module: str) -> type[BaseException]:
    """``class <cls's name>(cls, base)``, made once and kept on ``namespace`` (a class of
    ``module`` named ``runtime_errors``) under that name, so that a pickled twin finds its
    class again: the engine's error type and kvvmm's, in one object."""
    sub = namespace.__dict__.get(cls.__name__)
    if not (isinstance(sub, type) and issubclass(sub, cls)):
        sub = types.new_class(cls.__name__, (cls, base))
        sub.__module__, sub.__qualname__ = module, f"runtime_errors.{cls.__name__}"
        sub.__doc__ = cls.__doc__
        setattr(namespace, cls.__name__, sub)
    return sub

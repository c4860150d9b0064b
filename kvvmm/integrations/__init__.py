"""Engine adapters: kvvmm behind the APIs serving engines already call.

:mod:`kvvmm.integrations.sglang` is SGLang's ``kv_vmm_backing.KvVmmBufferOwner``, backed by a
:class:`~kvvmm.owner.KvBufferOwner`; :mod:`kvvmm.integrations.vllm` is vLLM's ``VmmDriver``
(behind ``vllm.utils.vmm_driver.get_vmm_driver``), backed by any kvvmm driver. Adapters sit
above the lab and below the CLI: they use the library's public API only, and ``import kvvmm``
does not import them (nor do they import their engine until asked to install into it).
"""

from __future__ import annotations

__all__: list[str] = []

"""What the vLLM tests share: vLLM's own files loaded, and the bytes of its tensor's segments."""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest
from integrations.test_vllm_reference import accelerator_stub, vllm_dir, vllm_loaded

from kvvmm.integrations import vllm as kv


@pytest.fixture
def vllm() -> Iterator[types.SimpleNamespace]:
    """vLLM's modules loaded, torch.accelerator stood in for (its calls counted in
    ``.accelerator``); the adapter uninstalled after."""
    with vllm_loaded(vllm_dir()) as v, accelerator_stub() as calls:
        v.accelerator = calls
        try:
            yield v
        finally:
            kv.uninstall()


def contents(et: Any) -> list[Any]:
    """A copy of every segment of vLLM's ``ExtensibleTensor`` ``et``."""
    return [et.segment_view(i).clone() for i in range(et.num_segments)]

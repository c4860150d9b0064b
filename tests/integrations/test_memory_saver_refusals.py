"""SGLang's memory saver on kvvmm: a refused pause or resume changes nothing, anywhere.

``KvVmmMemorySaver.pause`` / ``resume`` over the owners of a tag and the inner adapter (host
driver): a second pause, a resume without a pause, a mix of paused and awake owners, a closed
owner, each refuses before any owner or the inner adapter moves; a failing inner adapter
undoes the owners; an owner under two tags moves once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvvmm.errors import ClosedError, SleepRefusedError
from kvvmm.integrations.sglang import KV_CACHE_TAG, KvVmmBufferOwner, KvVmmMemorySaver

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the host driver needs Linux")
PAGE = 16


class _Desc:
    def __init__(self, name: str, shape: tuple[int, ...], row_bytes: int,
                 tokens_per_row: int) -> None:
        self.name, self.shape = name, shape
        self.row_bytes, self.tokens_per_row = row_bytes, tokens_per_row


def _pool(driver: Any, prefix: str) -> KvVmmBufferOwner:
    descs = [_Desc(f"{prefix}{kv}0", (2048 + PAGE, 2, 64), 256, 1) for kv in "kv"]
    own = KvVmmBufferOwner(device="cpu", device_id=0, store_dtype=torch.bfloat16,
                           page_size=PAGE, reserved_num_tokens=2048, buffer_descs=descs,
                           driver=driver, name=f"{prefix}kv")
    own.finalize(1024)
    return own


def _write(own: KvVmmBufferOwner, value: float) -> None:
    for t in own.tensors:
        t[:1024] = value  # type: ignore[misc]


def _holds(own: KvVmmBufferOwner, value: float) -> bool:
    return all(bool((t[:1024] == value).all()) for t in own.tensors)


class Inner:
    """SGLang's TorchMemorySaverAdapter, recording calls; ``fail`` makes one raise."""

    enabled = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self.fail = ""

    def pause(self, tag: str | None = None) -> None:
        if self.fail == "pause":
            raise RuntimeError("torch_memory_saver: pause failed")
        self.calls.append(("pause", tag))

    def resume(self, tag: str | None = None) -> None:
        if self.fail == "resume":
            raise RuntimeError("torch_memory_saver: resume failed")
        self.calls.append(("resume", tag))


Setup = tuple[KvVmmMemorySaver, Inner, list[KvVmmBufferOwner], list[Any]]


@pytest.fixture
def setup(make_driver: Callable[..., Any]) -> Any:
    drvs = [make_driver("host"), make_driver("host")]
    owners = [_pool(drvs[0], ""), _pool(drvs[1], "swa_")]
    inner = Inner()
    saver = KvVmmMemorySaver(inner, cpu_backup=True)
    for i, o in enumerate(owners):
        saver.register(o)
        _write(o, float(i + 3))
    yield saver, inner, owners, drvs
    for o in owners:
        o.close()


def _state(owners: list[KvVmmBufferOwner], drvs: list[Any]) -> list[Any]:
    return [(o.paused, o.snapshot(), d.stats()) for o, d in zip(owners, drvs, strict=True)]


@pytest.mark.parametrize("tag", [KV_CACHE_TAG, None])
def test_a_second_pause_is_refused_and_leaves_every_owner_paused(setup: Setup,
                                                                 tag: str | None) -> None:
    saver, inner, owners, drvs = setup
    saver.pause(tag)
    before, calls = _state(owners, drvs), list(inner.calls)
    with pytest.raises(SleepRefusedError, match="no owner changed") as e:
        saver.pause(tag)
    assert isinstance(e.value, RuntimeError)
    assert _state(owners, drvs) == before and inner.calls == calls
    assert all(d.stats().physical_bytes == 0 for d in drvs)
    saver.resume(tag)
    assert all(_holds(o, float(i + 3)) for i, o in enumerate(owners))


@pytest.mark.parametrize("tag", [KV_CACHE_TAG, None])
@pytest.mark.parametrize("paused_before", ["none", "both-then-resumed"])
def test_a_resume_without_a_pause_is_refused_and_changes_nothing(
        setup: Setup, tag: str | None, paused_before: str) -> None:
    saver, inner, owners, drvs = setup
    if paused_before != "none":
        saver.pause(tag)
        saver.resume(tag)
    before, calls = _state(owners, drvs), list(inner.calls)
    with pytest.raises(SleepRefusedError, match="no owner changed"):
        saver.resume(tag)
    assert _state(owners, drvs) == before and inner.calls == calls


@pytest.mark.parametrize("call", ["pause", "resume"])
@pytest.mark.parametrize("which", [0, 1])
def test_owners_in_mixed_states_refuse_the_whole_call(setup: Setup, call: str,
                                                     which: int) -> None:
    saver, inner, owners, drvs = setup
    if call == "pause":
        owners[which].pause(backup="host")  # paused behind the saver's back
    else:
        saver.pause()
        owners[which].resume()
    before, calls = _state(owners, drvs), list(inner.calls)
    with pytest.raises(SleepRefusedError):
        getattr(saver, call)(None)
    assert _state(owners, drvs) == before and inner.calls == calls


@pytest.mark.parametrize("call", ["pause", "resume"])
def test_a_closed_owner_refuses_the_whole_call(setup: Setup, call: str) -> None:
    saver, inner, owners, _drvs = setup
    if call == "resume":
        saver.pause()
    owners[1].close()
    before, calls = owners[0].paused, list(inner.calls)
    with pytest.raises(ClosedError):
        getattr(saver, call)(None)
    assert owners[0].paused == before and inner.calls == calls


def test_a_failing_inner_pause_resumes_the_owners_it_paused_with_their_bytes(
        setup: Setup) -> None:
    saver, inner, owners, _drvs = setup
    inner.fail = "pause"
    with pytest.raises(RuntimeError, match="pause failed") as e:
        saver.pause()
    assert any("resumed again" in n for n in e.value.__notes__)
    assert not any(o.paused for o in owners)
    assert all(_holds(o, float(i + 3)) for i, o in enumerate(owners))


def test_a_failing_owner_resume_pauses_the_inner_adapter_again(setup: Setup) -> None:
    saver, inner, owners, _drvs = setup
    saver.pause()
    second = owners[1]

    def fail() -> int:
        raise RuntimeError("out of memory")

    second.resume = fail  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="out of memory"):
        saver.resume()
    del second.resume
    assert all(o.paused for o in owners)
    assert inner.calls[-2:] == [("resume", None), ("pause", None)]
    saver.resume()
    assert all(_holds(o, float(i + 3)) for i, o in enumerate(owners))


def test_an_owner_under_two_tags_is_paused_and_resumed_once(setup: Setup) -> None:
    saver, _inner, owners, _drvs = setup
    saver.register(owners[0], "kv_cache_swa")
    saver.pause()
    assert all(o.paused for o in owners)
    saver.resume()
    assert not any(o.paused for o in owners)
    assert all(_holds(o, float(i + 3)) for i, o in enumerate(owners))

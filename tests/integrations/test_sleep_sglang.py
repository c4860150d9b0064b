"""SGLang's release/resume of memory occupation on kvvmm, on the host driver.

SGLang 0.5.23's ``release_memory_occupation`` calls ``memory_saver_adapter.pause("kv_cache")``
and flushes its radix cache; ``resume_memory_occupation`` calls ``resume("kv_cache")``. Here:
``KvVmmBufferOwner.pause/resume`` keep the tensors' pointers and the layout, drop the bytes
by default or keep them with a backup, refuse as kvvmm does but as ``RuntimeError`` (what
SGLang catches); ``KvVmmMemorySaver`` pauses every owner of the tag (a hybrid SWA pool's
two) or none, whichever owner's driver fails, and hands every other tag to the adapter
SGLang made.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from kvvmm.driver import FaultyDriver
from kvvmm.errors import ArgumentError, DriverError
from kvvmm.integrations.sglang import (
    KV_CACHE_TAG,
    KvVmmBufferOwner,
    KvVmmError,
    KvVmmMemorySaver,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the host driver needs Linux")
PAGE = 16


class SglDesc:
    """SGLang's descriptor: four fields, nothing else."""

    def __init__(self, name: str, shape: tuple[int, ...], row_bytes: int,
                 tokens_per_row: int) -> None:
        self.name, self.shape = name, shape
        self.row_bytes, self.tokens_per_row = row_bytes, tokens_per_row


def pool(driver: Any, layers: int = 2, size: int = 8192, prefix: str = "") -> KvVmmBufferOwner:
    """SGLang's MHA pool layout (k0.., v0.., (size + page, 2, 64) bf16), finalized."""
    descs = [SglDesc(f"{prefix}{kv}{i}", (size + PAGE, 2, 64), 2 * 64 * 2, 1)
             for kv in "kv" for i in range(layers)]
    own = KvVmmBufferOwner(device="cpu", device_id=0, store_dtype=torch.bfloat16,
                           page_size=PAGE, reserved_num_tokens=size, buffer_descs=descs,
                           driver=driver, name=f"{prefix}kv")
    own.finalize(size // 2)
    return own


def write(own: KvVmmBufferOwner, value: float) -> None:
    for t in own.tensors:
        t[: own.final_num_tokens or 0] = value  # type: ignore[misc]


def holds(own: KvVmmBufferOwner, value: float) -> bool:
    n = own.final_num_tokens or 0
    return all(bool((t[:n] == value).all()) for t in own.tensors)


class FakeTms:
    """SGLang's TorchMemorySaverAdapter, as far as this adapter calls it."""

    enabled = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def pause(self, tag: str | None = None) -> None:
        self.calls.append(("pause", tag))

    def resume(self, tag: str | None = None) -> None:
        self.calls.append(("resume", tag))

    def cuda_graph(self, **kw: Any) -> str:
        return "inner-graph"

    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False) -> Iterator[None]:
        self.calls.append(("region", tag))
        yield


@pytest.mark.parametrize("backup", [None, "host"])
def test_pause_gives_every_byte_back_and_resume_keeps_the_pointers_and_the_layout(
        make_driver: Callable[..., Any], backup: str | None) -> None:
    drv = make_driver("host")
    own = pool(drv)
    write(own, 3.0)
    ptrs, snap, backed = [t.data_ptr() for t in own.tensors], own.snapshot(), own.backed_bytes
    assert own.pause(backup=backup) == backed and own.paused
    assert drv.stats().physical_bytes == 0 and own.backed_bytes == 0
    assert own.resume() == backed and not own.paused
    assert [t.data_ptr() for t in own.tensors] == ptrs and own.snapshot() == snap
    assert holds(own, 3.0 if backup else 0.0)  # no backup: fresh memory (zeros here)
    own.close()


def test_pause_refusals_reach_sglang_as_runtime_errors(make_driver: Callable[..., Any]) -> None:
    own = pool(make_driver("host"))
    with pytest.raises(KvVmmError) as e:
        own.resume()  # not paused
    assert isinstance(e.value, RuntimeError)
    own.pause()
    with pytest.raises(RuntimeError, match="while asleep"):
        own.pause()
    with pytest.raises(RuntimeError, match="wake"):
        own.ensure_prefix(64)  # SGLang must resume before it allocates again
    own.resume()
    with pytest.raises(ValueError):
        own.pause(backup="tape")
    assert not own.paused
    own.close()


def test_the_memory_saver_pauses_the_kv_tag_on_every_owner_and_forwards_other_tags(
        make_driver: Callable[..., Any]) -> None:
    full, swa = pool(make_driver("host")), pool(make_driver("host"), prefix="swa_")
    tms = FakeTms()
    saver = KvVmmMemorySaver(tms, cpu_backup=True)
    saver.register(full)
    saver.register(swa, KV_CACHE_TAG)
    saver.register(swa)  # idempotent
    assert saver.owners() == (full, swa) and saver.enabled
    write(full, 1.0)
    write(swa, 2.0)
    saver.pause(KV_CACHE_TAG)
    saver.pause("weights")
    assert full.paused and swa.paused and tms.calls == [("pause", "weights")]
    saver.resume("weights")
    saver.resume(KV_CACHE_TAG)
    assert not full.paused and holds(full, 1.0) and holds(swa, 2.0)
    saver.pause()  # every tag: the owners and the inner adapter's
    assert full.paused and tms.calls[-1] == ("pause", None)
    saver.resume()
    assert not swa.paused and tms.calls[-1] == ("resume", None)
    assert saver.cuda_graph() == "inner-graph"  # the rest is the inner adapter's
    with saver.region("weights"):
        pass
    assert tms.calls[-1] == ("region", "weights")
    full.close()
    swa.close()


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("call", ["unmap", "release"])
def test_a_failed_pause_of_any_owner_leaves_every_owner_awake_with_its_bytes(
        make_driver: Callable[..., Any], which: int, call: str) -> None:
    drvs = [FaultyDriver(make_driver("host")) for _ in range(2)]
    owners = [pool(drvs[0]), pool(drvs[1], prefix="swa_")]
    saver = KvVmmMemorySaver(cpu_backup=True)
    for i, o in enumerate(owners):
        saver.register(o)
        write(o, float(i + 5))
    drvs[which].arm({call: 2})
    with pytest.raises(DriverError) as e:
        saver.pause(KV_CACHE_TAG)
    assert isinstance(e.value, RuntimeError)
    assert any("resumed again" in n for n in e.value.__notes__)
    drvs[which].disarm()
    for i, o in enumerate(owners):
        if o.paused:  # a release failing past every unmap: the sleep stood, then was undone
            pytest.fail(f"owner {i} left paused")
        assert holds(o, float(i + 5))
    for o in owners:
        o.close()


@pytest.mark.parametrize("call", ["create", "map", "set_access"])
def test_a_failed_resume_of_the_second_owner_pauses_the_first_again_and_a_retry_works(
        make_driver: Callable[..., Any], call: str) -> None:
    drvs = [FaultyDriver(make_driver("host")) for _ in range(2)]
    owners = [pool(drvs[0]), pool(drvs[1], prefix="swa_")]
    saver = KvVmmMemorySaver(cpu_backup=True)
    for i, o in enumerate(owners):
        saver.register(o)
        write(o, float(i + 5))
    saver.pause()
    drvs[1].arm({call: 1})
    with pytest.raises(RuntimeError):
        saver.resume()
    drvs[1].disarm()
    assert all(o.paused for o in owners)
    assert all(d.stats().physical_bytes == 0 for d in drvs)
    saver.resume()
    assert all(holds(o, float(i + 5)) for i, o in enumerate(owners))
    for o in owners:
        o.close()


def test_bad_memory_saver_arguments_are_refused(make_driver: Callable[..., Any]) -> None:
    with pytest.raises(ArgumentError):
        KvVmmMemorySaver(cpu_backup="yes")  # type: ignore[arg-type]
    saver = KvVmmMemorySaver()
    with pytest.raises(ArgumentError):
        saver.register(object())  # type: ignore[arg-type]
    own = pool(make_driver("host"))
    with pytest.raises(ArgumentError):
        saver.register(own, "")
    with pytest.raises(AttributeError):
        saver.cuda_graph  # noqa: B018  # no inner adapter: nothing to forward to
    own.close()

"""Sleep and wake of the owners above the arena, on a GPU: SGLang's path and the
collective one.

- SGLang's ``release_memory_occupation`` on kvvmm: a ``KvVmmBufferOwner`` on CUDA, a CUDA
  graph captured over its tensors, ``KvVmmMemorySaver.pause("kv_cache")`` gives the device
  the pool's memory back, ``resume`` re-backs it at the same VA, and the graph replays bit for
  bit (with ``cpu_backup=True``; without, it replays over fresh memory without a fault).
- ``DistributedOwner`` in a gloo world of one on CUDA: grown collectively (the collective's
  prepared handles, adopted as the process's own), then a collective sleep and wake with a
  pinned host backup: the device's memory back, every byte back.
"""

from __future__ import annotations

import gc
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvvmm.driver.cuda import CudaDriver

pytestmark = pytest.mark.cuda

HEADS, DIM, PAGE = 8, 128, 16


class SglDesc:
    """SGLang's KvBufferDesc: four fields."""

    def __init__(self, name: str, shape: tuple[int, ...], row_bytes: int,
                 tokens_per_row: int) -> None:
        self.name, self.shape = name, shape
        self.row_bytes, self.tokens_per_row = row_bytes, tokens_per_row


@pytest.fixture
def cd() -> Iterator[CudaDriver]:
    torch.empty(1, device="cuda")
    d = CudaDriver()
    yield d
    gc.collect()
    assert d.stats().clean, d.stats()
    d.close()


def _fill(tensors: list[torch.Tensor], rows: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    want = []
    for t in tensors:
        x = torch.randint(-(1 << 15), 1 << 15, (rows, *t.shape[1:]), dtype=torch.int16,
                          device="cuda", generator=gen)
        t[:rows].view(torch.int16).copy_(x)
        want.append(x)
    torch.cuda.synchronize()
    return want


def _same(tensors: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    n = want[0].shape[0]
    return all(torch.equal(t[:n].view(torch.int16), w) for t, w in zip(tensors, want,
                                                                        strict=True))


@pytest.mark.parametrize("cpu_backup", [True, False])
def test_sglang_s_memory_saver_pause_and_resume_keep_a_captured_graph_valid(
        cd: CudaDriver, cpu_backup: bool) -> None:
    from kvvmm.integrations.sglang import KV_CACHE_TAG, KvVmmBufferOwner, KvVmmMemorySaver

    size = 200_000
    descs = [SglDesc(f"{kv}{i}", (size + PAGE, HEADS, DIM), HEADS * DIM * 2, 1)
             for kv in "kv" for i in range(2)]
    own = KvVmmBufferOwner(device="cuda", device_id=0, store_dtype=torch.bfloat16,
                           page_size=PAGE, reserved_num_tokens=size, buffer_descs=descs,
                           driver=cd)
    own.finalize(size)
    want = _fill(own.tensors, size, seed=3)
    idx = torch.arange(0, size, 101, device="cuda")
    out = torch.empty(idx.numel(), HEADS, DIM, dtype=torch.int16, device="cuda")

    def read() -> torch.Tensor:  # K of layer 0 xor V of layer 0, at every 101st slot
        k, v = own.tensors[0], own.tensors[2]
        return k.index_select(0, idx).view(torch.int16) ^ v.index_select(0, idx).view(
            torch.int16)

    def step() -> None:
        out.copy_(read())

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    before = out.clone()
    saver = KvVmmMemorySaver(cpu_backup=cpu_backup)
    saver.register(own)
    backed = own.backed_bytes
    free0 = cd.mem_info()[0]
    saver.pause(KV_CACHE_TAG)
    assert own.paused and cd.mem_info()[0] - free0 >= 0.99 * backed
    saver.resume(KV_CACHE_TAG)
    graph.replay()
    torch.cuda.synchronize()
    if cpu_backup:
        assert torch.equal(out, before) and _same(own.tensors, want)
    else:  # fresh memory: the graph reads it where the eager code does, without a fault
        assert torch.equal(out, read())
    del graph, want
    own.close(wait=True, timeout=30)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    import torch.distributed as dist

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_a_collectively_grown_owner_sleeps_and_wakes_collectively_on_cuda(
        cd: CudaDriver, world_of_one: None) -> None:
    from kvvmm import KvBufferOwner, mha_token_major
    from kvvmm.owner.distributed import DistributedOwner

    n = 300_000
    descs = mha_token_major(layers=2, kv_heads=HEADS, head_dim=DIM, reserved_tokens=n,
                            page_size=PAGE, dtype="bfloat16")
    owner = KvBufferOwner(driver=cd, dtype="bfloat16", page_size=PAGE, reserved_tokens=n,
                          descs=descs)
    do = DistributedOwner(owner, timeout_s=60)
    do.finalize(n - PAGE)  # the collective's handles: they must sleep like the owner's own
    want = _fill(owner.tensors, n, seed=4)
    snap, backed = owner.snapshot(), owner.backed_bytes
    free0 = cd.mem_info()[0]
    res: Any = do.sleep("host")
    assert res.given_bytes == backed and cd.stats().physical_bytes == 0
    assert cd.mem_info()[0] - free0 >= 0.99 * backed
    assert do.wake() == backed
    assert owner.snapshot() == snap and _same(owner.tensors, want)
    del want
    owner.close()

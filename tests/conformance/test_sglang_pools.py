"""SGLang 0.5.23's own KV pools, built with kvvmm's owner swapped in, sized as SGLang sizes them.

Each scenario builds one of SGLang's pool classes (``MHATokenToKVPool``, ``SWAKVPool``,
``UnifiedKVPool``) with ``post_capture_active`` from SGLang's own gate (its
``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING`` variable, read through its ``envs``), writes slot 0 as
capture's dummy writes do, then calls the pool's own ``finalize_backing(config)`` with the
fields SGLang's post-capture resize fills in. What is checked, against SGLang's own span
arithmetic (its ``KvBufferDesc.final_span_bytes``, its ``_reserved_floor_bytes``) rounded up to
the granularity, and on CUDA against SGLang's own owner (the seed) in the same process:
spans, backed bytes, the tensors' pointers across growth, slot 0's bytes, every final slot
writable, and the pool's own ``size``/``post_capture_backed_bytes``/``get_contiguous_buf_infos``
afterwards.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from harness import (
    CUDA,
    DEVICE,
    ROOT,
    adapter,
    envs,
    memory_pool,
    observed,
    swa_memory_pool,
    unified_memory_pool,
)

GATE = "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"


def _seed_class() -> type:
    path = ROOT / "sglang" / "srt" / "mem_cache" / "kv_vmm_backing.py"
    spec = importlib.util.spec_from_file_location("sglang_0_5_23_kv_vmm_backing", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.KvVmmBufferOwner  # type: ignore[no-any-return]


OWNERS = ["kvvmm", "seed"] if CUDA else ["kvvmm"]


@pytest.fixture(params=OWNERS)
def owner_class(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Which KvVmmBufferOwner SGLang's pool modules build: kvvmm's (through ``install()``,
    the default here) or, on CUDA, SGLang's own, bound where its modules look it up."""
    if request.param == "seed":
        seed = _seed_class()
        monkeypatch.setattr(memory_pool, "KvVmmBufferOwner", seed)
        monkeypatch.setattr(unified_memory_pool, "KvVmmBufferOwner", seed)
    else:
        assert memory_pool.KvVmmBufferOwner is adapter.KvVmmBufferOwner
        assert unified_memory_pool.KvVmmBufferOwner is adapter.KvVmmBufferOwner
    yield request.param


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> bool:
    """SGLang's own switch, read as SGLang reads it."""
    monkeypatch.setenv(GATE, "1")
    on = envs.SGLANG_ENABLE_POST_CAPTURE_KV_SIZING.get()
    assert on is True
    return bool(on)


def test_the_gate_is_sglangs_variable_read_through_its_envs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GATE, raising=False)
    assert envs.SGLANG_ENABLE_POST_CAPTURE_KV_SIZING.get() is False
    monkeypatch.setenv(GATE, "1")
    assert envs.SGLANG_ENABLE_POST_CAPTURE_KV_SIZING.get() is True


def up(n: int, g: int) -> int:
    return -(-n // g) * g


class Config:
    """The fields SGLang's post-capture resize (``PostCaptureKVResize``) hands
    ``finalize_backing``; each pool family reads its own."""

    def __init__(self, **fields: Any) -> None:
        self.max_total_num_tokens = fields.get("max_total_num_tokens")
        self.full_max_total_num_tokens = fields.get("full_max_total_num_tokens")
        self.swa_max_total_num_tokens = fields.get("swa_max_total_num_tokens")
        self.unified_memory_pool_bytes = fields.get("unified_memory_pool_bytes")
        self.capped_max_running_requests = None


def _buffers(pool: Any) -> list[torch.Tensor]:
    return list(pool.k_buffer) + list(pool.v_buffer)


def _fill_slot0(pool: Any) -> None:
    for i, t in enumerate(_buffers(pool)):  # capture routes every dummy write to slot 0
        t[0].view(torch.uint8).fill_(i + 1)


def _check_mha_after_finalize(pool: Any, final: int, ptrs: list[int], g: int) -> dict[str, Any]:
    descs = pool._kv_buffer_descs  # SGLang's own descriptors and span arithmetic
    page = pool.page_size
    want = sum(up(d.final_span_bytes(final, page), g) for d in descs)
    assert pool.post_capture_backed_bytes == want
    assert pool.size == final
    assert [t.data_ptr() for t in _buffers(pool)] == ptrs  # graphs keep their addresses
    for i, t in enumerate(_buffers(pool)):
        assert bool((t[0].view(torch.uint8) == i + 1).all())  # slot 0 survived
    rows = [d._rows(final + page) for d in descs]
    for t, r in zip(_buffers(pool), rows, strict=True):
        t[:r].view(torch.uint8)[-1].fill_(9)  # every final row is there, padded page too
    ptrs_info, lens, item_lens = pool.get_contiguous_buf_infos()
    assert ptrs_info == ptrs
    assert all(n <= up(n, g) for n in lens)
    return {"backed_bytes": want, "final_tokens": final, "lens": lens, "item_lens": item_lens}


LAYOUTS = [  # (page_size, head_num, head_dim, layers, dtype)
    (1, 8, 128, 2, torch.bfloat16),
    (16, 8, 128, 4, torch.bfloat16),
    (64, 4, 64, 3, torch.float16),
    (16, 2, 96, 2, torch.float8_e4m3fn),  # stored as uint8 by SGLang
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"p{x[0]}h{x[1]}d{x[2]}L{x[3]}-{x[4]}")
def test_mha_pool_sized_after_capture(owner_class: str, gate: bool, granularity: int,
                                      layout: tuple[int, int, int, int, torch.dtype],
                                      observe: Callable[[str, Any], None]) -> None:
    page, heads, dim, layers, dtype = layout
    size = 50_000
    pool = memory_pool.MHATokenToKVPool(
        size=size, page_size=page, dtype=dtype, head_num=heads, head_dim=dim,
        layer_num=layers, device=DEVICE, enable_memory_saver=False, post_capture_active=gate)
    owner = pool._post_capture_owner
    assert (type(owner).__module__ == adapter.__name__) == (owner_class == "kvvmm")
    descs = pool._kv_buffer_descs
    rows0 = (pool.size + page) // descs[0].tokens_per_row
    assert [t.shape[0] for t in _buffers(pool)] == [rows0] * (2 * layers)
    slot0 = sum(up(d.prefix_span_bytes(page, page), granularity) for d in descs)
    assert pool.post_capture_backed_bytes == slot0
    ptrs = [t.data_ptr() for t in _buffers(pool)]
    _fill_slot0(pool)
    per_token = sum(d.row_bytes // d.tokens_per_row for d in descs)
    # a budget SGLang would compute: whole pages in 24 granules per buffer set, at most size
    final = min((24 * granularity) // per_token // page * page, pool.size)
    pool.finalize_backing(Config(max_total_num_tokens=final))
    seen = _check_mha_after_finalize(pool, final, ptrs, granularity)
    observe("owner", owner_class)
    observe("slot0_backed_bytes", slot0)
    observe("after_finalize", seen)
    pool._clear_buffers()  # SGLang's teardown closes the owner
    assert pool._post_capture_owner is None


@pytest.mark.parametrize("page", [1, 16])
def test_swa_pool_sizes_its_full_and_window_pools_each_to_its_budget(
        owner_class: str, gate: bool, granularity: int, page: int,
        observe: Callable[[str, Any], None]) -> None:
    full_ids, swa_ids = [0, 3], [1, 2, 4, 5]
    pool = swa_memory_pool.SWAKVPool(
        size=40_000, size_swa=8_000, page_size=page, dtype=torch.bfloat16, head_num=4,
        head_dim=128, swa_attention_layer_ids=swa_ids, full_attention_layer_ids=full_ids,
        device=DEVICE, post_capture_active=gate)
    assert pool.post_capture_active
    subs = (pool.full_kv_pool, pool.swa_kv_pool)
    ptrs = [[t.data_ptr() for t in _buffers(p)] for p in subs]
    for p in subs:
        _fill_slot0(p)
    full_n, swa_n = 20_000 // page * page, 4_096 // page * page
    pool.finalize_backing(Config(full_max_total_num_tokens=full_n, swa_max_total_num_tokens=swa_n,
                                 max_total_num_tokens=full_n))
    seen = [_check_mha_after_finalize(p, n, pt, granularity)
            for p, n, pt in zip(subs, (full_n, swa_n), ptrs, strict=True)]
    assert pool.post_capture_backed_bytes == sum(s["backed_bytes"] for s in seen)
    assert (pool.size, pool.size_swa) == (full_n, swa_n)
    observe("owner", owner_class)
    observe("full", seen[0])
    observe("swa", seen[1])
    for p in subs:
        p._clear_buffers()


@pytest.mark.parametrize("page", [1, 16])
def test_unified_pool_reserves_its_whole_byte_budget_and_backs_the_final_one(
        owner_class: str, gate: bool, granularity: int, page: int,
        observe: Callable[[str, Any], None]) -> None:
    spec = unified_memory_pool.MHASubPoolSpec
    specs = [spec(name="full", layer_num=2, grow_direction="up", head_num=4, head_dim=128,
                  store_dtype=torch.bfloat16),
             spec(name="swa", layer_num=4, grow_direction="down", head_num=4, head_dim=128,
                  store_dtype=torch.bfloat16)]
    total = 40 * granularity + 12_288  # not a whole number of granules
    # The unified pool refuses a non-CUDA device name before it builds the owner; off a GPU
    # the owner runs on the installed host driver whatever the name says.
    pool = unified_memory_pool.UnifiedKVPool(
        total_bytes=total, sub_pool_specs=specs, device="cuda:0", enable_memory_saver=False,
        page_size=page, post_capture_active=gate)
    floor = unified_memory_pool._reserved_floor_bytes(pool.sub_pool_specs, page)
    assert pool.post_capture_backed_bytes == up(floor, granularity)
    raw = pool._raw
    assert raw.numel() == total
    ptr = raw.data_ptr()
    raw[:floor].fill_(3)  # the slot-0 sink capture writes into
    final = 20 * granularity + 4_096
    pool.finalize_backing(Config(unified_memory_pool_bytes=final))
    assert pool.post_capture_backed_bytes == up(final, granularity)
    assert pool._raw.data_ptr() == ptr and pool.active_allocation_bytes == final
    assert bool((pool._raw[floor:final] == 0).all())  # SGLang zeroes what it now serves
    pool._raw[final - 1] = 5
    observe("owner", owner_class)
    observe("floor_bytes", floor)
    observe("backed_after_finalize", pool.post_capture_backed_bytes)


def test_the_lazy_callers_pattern_on_sglangs_own_descriptors(
        gate: bool, granularity: int, observe: Callable[[str, Any], None]) -> None:
    """The later upstream lazy-backing owner's calls (``ensure_prefix(size + page)``,
    ``backed_tokens`` on every allocation, ``release_beyond(floor)``, ``bytes_per_token``),
    made on the owner SGLang's MHA pool built, with SGLang's own descriptors."""
    page = 16
    pool = memory_pool.MHATokenToKVPool(
        size=30_000, page_size=page, dtype=torch.bfloat16, head_num=8, head_dim=128,
        layer_num=2, device=DEVICE, enable_memory_saver=False, post_capture_active=gate)
    owner = pool._post_capture_owner
    descs = pool._kv_buffer_descs
    assert owner.bytes_per_token() == sum(-(-d.row_bytes // d.tokens_per_row) for d in descs)
    top, margin, floor = pool.size + page, 2048, 4096
    for want in [*range(margin, top, margin), top]:  # it commits in margin-sized bursts
        if want > owner.backed_tokens:
            owner.ensure_prefix(want)
        assert owner.backed_tokens >= want
    assert owner.backed_tokens == top  # the pool's top page is usable
    assert pool.post_capture_backed_bytes == sum(
        up(d.prefix_span_bytes(top, page), granularity) for d in descs)
    before = pool.post_capture_backed_bytes
    given = owner.release_beyond(floor)  # the pool went idle: back to the floor
    keep = sum(up(d.prefix_span_bytes(floor, page), granularity) for d in descs)
    assert given == before - pool.post_capture_backed_bytes > 0
    # every burst's mapping past the floor's span went; the one straddling it stays
    assert keep <= pool.post_capture_backed_bytes < keep + sum(
        up(d.prefix_span_bytes(margin, page), granularity) for d in descs)
    assert owner.backed_tokens >= floor
    observe("released_bytes", given)
    pool._clear_buffers()


@pytest.mark.skipif(not CUDA, reason="the seed needs CUDA")
def test_kvvmm_and_the_seed_observed_the_same(request: pytest.FixtureRequest) -> None:
    """Run last in the file: every scenario's observations, kvvmm's against the seed's."""
    pairs: dict[str, dict[str, Any]] = {}
    for name, seen in observed.items():
        owner = seen.get("owner")
        if owner is None:
            continue
        key = name.replace("[seed-", "[").replace("[kvvmm-", "[")
        pairs.setdefault(key, {})[owner] = {k: v for k, v in seen.items() if k != "owner"}
    assert pairs
    for key, both in pairs.items():
        assert set(both) == {"kvvmm", "seed"}, key
        assert both["kvvmm"] == both["seed"], key


if os.environ.get("KVVMM_CONFORMANCE_LIST"):  # for the docs: the owner calls SGLang makes
    print(sorted(n for n in dir(adapter.KvVmmBufferOwner) if not n.startswith("_")))

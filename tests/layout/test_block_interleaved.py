"""The block-interleaved layout (``[page][layer][k|v][page_size][heads][head_dim]``): the
same bytes per page as the token-interleaved one, so the same slot-range backing, and paged
views whose pages hold a layer's tokens contiguously (what a paged kernel reads at the
token-major layout's rate, docs/ELASTIC.md)."""

from __future__ import annotations

import pytest

from kvvmm import KvBufferOwner, open_driver
from kvvmm.errors import ArgumentError
from kvvmm.layout import (
    CROSS_LAYER,
    LAYOUTS,
    block_interleaved,
    layer_interleaved,
    model_descs,
)
from kvvmm.owner import layer_views, paged_layer_views

MODELS = ["llama-3.1-8b", "qwen2.5-7b", "llama-3.1-70b", "deepseek-v3"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp", [1, 8])
def test_a_page_holds_the_same_bytes_as_the_token_interleaved_layouts_page(
        model: str, tp: int) -> None:
    kw = {"reserved_tokens": 4000, "page_size": 16, "dtype": "bfloat16", "tp": tp}
    (tok,) = model_descs(model, layout="interleaved", **kw)
    (blk,) = model_descs(model, layout="block_interleaved", **kw)
    assert blk.tokens_per_row == 16 and tok.tokens_per_row == 1
    assert blk.row_bytes == 16 * tok.row_bytes
    pages = -(-4000 // 16)
    assert blk.shape[0] == pages + 1 and blk.shape[3] == 16
    assert blk.shape[1:3] + blk.shape[4:] == tok.shape[1:]
    assert "block_interleaved" in LAYOUTS and set(CROSS_LAYER) <= set(LAYOUTS)


def test_bad_arguments_are_refused_by_name() -> None:
    for bad in (3, True, 2.0):  # 1 or 2, an int: a bool or a float is refused by its name
        with pytest.raises(ArgumentError, match=r"^kv="):
            block_interleaved(layers=2, kv_heads=1, head_dim=8, reserved_tokens=64,
                              page_size=16, dtype="bfloat16", kv=bad)
    with pytest.raises(ArgumentError, match="page_size"):
        block_interleaved(layers=2, kv_heads=1, head_dim=8, reserved_tokens=64, page_size=0,
                          dtype="bfloat16")
    with pytest.raises(ArgumentError, match="layout"):
        model_descs("llama-3.1-8b", layout="blocky", reserved_tokens=64, page_size=16,
                    dtype="bfloat16")


def _owner(layout: str, driver: object) -> KvBufferOwner:
    descs = model_descs("llama-3.1-8b", layout=layout, reserved_tokens=16 * 1024,
                        page_size=16, dtype="bfloat16")
    return KvBufferOwner(driver=driver, dtype="bfloat16", page_size=16,  # type: ignore[arg-type]
                         descs=descs)


@pytest.mark.parametrize("ranges", [[(16, 160)], [(16, 32), (64, 4096)], [(1024, 16 * 1024)]])
def test_slot_ranges_back_the_same_bytes_with_the_same_calls_as_token_interleaved(
        ranges: list[tuple[int, int]]) -> None:
    got = {}
    for layout in CROSS_LAYER:
        d = open_driver("sim", profile="h200")
        with _owner(layout, d) as owner:
            assert owner.slot_block_tokens() == 16
            n = owner.commit_slots(ranges)
            maps = [(m.offset, m.size_bytes) for m in owner.arena.snapshot().mappings]
            owner.decommit_slots(ranges)
            got[layout] = (n, maps, owner.backed_bytes)
    assert got["interleaved"] == got["block_interleaved"]


def test_paged_views_hold_each_pages_tokens_of_a_layer_contiguously() -> None:
    torch = pytest.importorskip("torch")
    descs = block_interleaved(layers=3, kv_heads=2, head_dim=8, reserved_tokens=16 * 64,
                              page_size=16, dtype="float32")
    ref = layer_interleaved(layers=3, kv_heads=2, head_dim=8, reserved_tokens=16 * 64,
                            page_size=16, dtype="float32")
    with KvBufferOwner(driver=open_driver("host"), dtype="float32", page_size=16,
                       descs=descs) as blk, \
            KvBufferOwner(driver=open_driver("host"), dtype="float32", page_size=16,
                          descs=ref) as tok:
        blk.finalize(16 * 64)
        tok.finalize(16 * 64)
        bv, tv = paged_layer_views(blk, 16), paged_layer_views(tok, 16)
        assert len(bv) == 3
        for (bk, bvv), (tk, tvv) in zip(bv, tv, strict=True):
            assert bk.shape == tk.shape == (65, 16, 2, 8)
            tk.copy_(torch.randn(tk.shape))
            tvv.copy_(torch.randn(tvv.shape))
            bk.copy_(tk)
            bvv.copy_(tvv)
        for (bk, bvv), (tk, tvv) in zip(bv, tv, strict=True):
            assert torch.equal(bk, tk) and torch.equal(bvv, tvv)
            # a page's tokens of a layer are one contiguous run: token stride heads * dim
            assert bk.stride()[1:] == (16, 8, 1) and bk[5].is_contiguous()
            assert bk.stride(0) == 3 * 2 * 16 * 2 * 8
            assert tk.stride(1) == 3 * 2 * 2 * 8  # the token-interleaved row stride
        # layer 1's V of page 7 sits right after its K in the same page row
        t = blk.tensors[0]
        assert t[7, 1, 1].data_ptr() - t[7, 1, 0].data_ptr() == 16 * 2 * 8 * 4
        with pytest.raises(ArgumentError, match="paged_layer_views"):
            layer_views(blk)
        for bad in (8, True, 16.0):  # the page size, an int (as on a token-major buffer)
            with pytest.raises(ArgumentError, match="page size"):
                paged_layer_views(blk, bad)  # type: ignore[arg-type]
        del bv, tv, bk, bvv, tk, tvv, t

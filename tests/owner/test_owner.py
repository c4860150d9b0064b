"""KvBufferOwner on sim and host: spans, backed bytes and handle counts computed by hand; the
bytes written after a finalize read back on the host driver and, where a GPU is usable, on the
CUDA driver (both paths)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from drivers import driver_params, open_driver_kind

from kvvmm import (
    Chunked,
    Exact,
    Geometric,
    KvBufferOwner,
    SimDriver,
    mha_token_major,
    mla,
    page_major,
)
from kvvmm.driver.base import Driver
from kvvmm.driver.host import HostDriver
from kvvmm.errors import OutOfRangeError
from kvvmm.units import GiB, MiB

G = 2 * MiB


def gran_up(n: int) -> int:
    return -(-n // G) * G


@pytest.fixture(params=["sim", "host"])
def drv(request: pytest.FixtureRequest) -> Driver:
    if request.param == "sim":
        return SimDriver("h200")
    d = HostDriver(capacity_bytes=4 * GiB)
    request.addfinalizer(d.close)
    return d


def test_token_major_owner_backs_what_was_computed_by_hand(drv: Driver) -> None:
    # 2 layers x (K, V), 8 KV heads x 128 dims in bf16: 8*128*2 = 2048 bytes per token.
    descs = mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=100_000,
                            page_size=16, dtype="bfloat16")
    assert [d.name for d in descs] == ["k0", "k1", "v0", "v1"]
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=100_000,
                          descs=descs, policy=Exact())
    # Each tensor is (100_000 + 16) x 8 x 128 bf16 = 204_832_768 bytes -> 98 granules.
    assert [tuple(t.shape) for t in owner.tensors] == [(100_016, 8, 128)] * 4
    snap = owner.snapshot()
    assert [b.reserved_span_bytes for b in snap.buffers] == [204_832_768] * 4
    assert [b.aligned_bytes for b in snap.buffers] == [98 * G] * 4
    assert snap.arena.reserved_bytes == 4 * 98 * G
    assert [b.offset for b in snap.buffers] == [0, 98 * G, 196 * G, 294 * G]
    # Slot 0: one page of 16 tokens = 32 KiB -> one granule, one handle per buffer.
    assert owner.backed_bytes == 4 * G and snap.handles == 4
    # 5000 tokens = 10_240_000 bytes -> 5 granules: one more handle of 4 granules each.
    owner.ensure_prefix(5000)
    assert owner.backed_bytes == 4 * 5 * G and owner.snapshot().handles == 8
    # finalize(20_000): final span = (20_000 + 16) * 2048 = 40_992_768 -> 20 granules.
    owner.finalize(20_000)
    snap = owner.snapshot()
    assert [b.final_bytes for b in snap.buffers] == [40_992_768] * 4
    assert owner.backed_bytes == 4 * 20 * G and snap.handles == 12
    assert [m.size_bytes for m in snap.arena.mappings[:3]] == [G, 4 * G, 15 * G]
    # shrink(1000): keep (1000 + 16) * 2048 = 2_080_768 -> inside the first granule.
    assert owner.shrink(1000) == 4 * 19 * G
    assert owner.backed_bytes == 4 * G and owner.snapshot().handles == 4
    assert owner.final_tokens == 1000
    snap.arena.check()
    owner.close()
    assert drv.stats().clean


def test_page_major_owner_counts_whole_pages_including_the_padded_one(drv: Driver) -> None:
    # page 64, 8 heads x 128 dims bf16: a row is one page = 8*64*128*2 = 131_072 bytes.
    descs = page_major(layers=1, kv_heads=8, head_dim=128, reserved_tokens=100_000,
                       page_size=64, dtype="bfloat16")
    # ceil(100_000 / 64) = 1563 pages, plus one: (1564, 8, 64, 128).
    assert [d.shape for d in descs] == [(1564, 8, 64, 128)] * 2
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=64, reserved_tokens=100_000,
                          descs=descs, policy=Exact())
    snap = owner.snapshot()
    assert [b.reserved_span_bytes for b in snap.buffers] == [1564 * 131_072] * 2
    assert [b.page0_bytes for b in snap.buffers] == [131_072] * 2
    # n=17, page=64: rows(17 + 64) = 2 pages.
    owner.finalize(64)
    assert owner.snapshot().buffers[0].final_bytes == 2 * 131_072
    # n=50_000: rows(50_064 / 64) = 783 pages = 102_629_376 bytes -> 49 granules.
    owner.finalize(50_000)
    assert owner.snapshot().buffers[0].final_bytes == 102_629_376
    assert owner.backed_bytes == 2 * 49 * G
    owner.close()
    assert drv.stats().clean


def test_mla_owner_has_one_latent_buffer_per_layer(drv: Driver) -> None:
    # DeepSeek-style latent: 512 + 64 = 576 values per token, bf16: 1152 bytes per token.
    descs = mla(layers=3, kv_lora_rank=512, qk_rope_head_dim=64, reserved_tokens=200_000,
                page_size=1, dtype="bfloat16")
    assert [d.name for d in descs] == ["kv0", "kv1", "kv2"]
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=1, reserved_tokens=200_000,
                          descs=descs, policy=Chunked(16 * MiB))
    assert [tuple(t.shape) for t in owner.tensors] == [(200_001, 1, 576)] * 3
    # 10_000 tokens = 11_520_000 bytes; Chunked(16 MiB) from one granule -> 9 granules.
    owner.ensure_prefix(10_000)
    assert owner.backed_bytes == 3 * 9 * G
    assert owner.snapshot().handles == 6
    owner.close()
    assert drv.stats().clean


def test_geometric_growth_doubles_until_its_cap(drv: Driver) -> None:
    descs = mha_token_major(layers=1, kv_heads=8, head_dim=128, reserved_tokens=400_000,
                            page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=400_000,
                          descs=descs, policy=Geometric(2.0, 16 * MiB))
    for n in range(1024, 100_000, 1024):  # 2 MiB per 1024 tokens
        owner.ensure_prefix(n)
    sizes = [m.size_bytes for m in owner.snapshot().arena.mappings if m.allocation == "k0"]
    assert sizes[:5] == [G, G, 2 * G, 4 * G, 8 * G]
    assert max(sizes) == 16 * MiB
    assert sum(sizes) - 100_000 * 2048 < 16 * MiB  # over-commit under one cap
    owner.close()


@pytest.mark.parametrize("kind", driver_params(("host", "cuda-c", "cuda-python")))
def test_bytes_written_after_finalize_read_back_intact(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Real bytes: host memory, and device memory where a GPU is usable (both CUDA paths).
    import torch

    drv: Driver = (HostDriver(capacity_bytes=4 * GiB) if kind == "host"
                   else open_driver_kind(kind, monkeypatch))
    if kind != "host" and not torch.cuda.is_available():
        drv.close()
        pytest.skip("torch has no CUDA here: the bytes are written through torch")
    descs = mha_token_major(layers=2, kv_heads=4, head_dim=64, reserved_tokens=50_000,
                            page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=50_000,
                          descs=descs)
    owner.finalize(30_000)
    device = owner.tensors[0].device
    gen = torch.Generator(device=device).manual_seed(0)
    data = [torch.randn(30_016, 4, 64, generator=gen, device=device).bfloat16()
            for _ in owner.tensors]
    for t, x in zip(owner.tensors, data, strict=True):
        t[:30_016].copy_(x)
    for t, x in zip(owner.tensors, data, strict=True):
        assert torch.equal(t[:30_016], x)
    # Memory beyond the backed spans exists nowhere: the driver holds exactly what is backed.
    assert drv.stats().physical_bytes == owner.backed_bytes
    del t, data  # the loop's last tensor: a live view pins the VA, and close() would wait
    owner.close()
    assert drv.stats().clean
    drv.close()


def test_writing_beyond_the_backed_span_faults_instead_of_touching_memory() -> None:
    code = textwrap.dedent("""
        import kvvmm
        from kvvmm.driver.host import HostDriver
        drv = HostDriver(capacity_bytes=1 << 30)
        descs = kvvmm.mha_token_major(layers=1, kv_heads=4, head_dim=64,
                                      reserved_tokens=50_000, page_size=16, dtype="bfloat16")
        owner = kvvmm.KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16,
                                    reserved_tokens=50_000, descs=descs)
        owner.finalize(1000)
        k0 = owner.tensors[0]
        k0[:1016].fill_(1.0)
        print("inside ok", flush=True)
        backed_tokens = owner.snapshot().buffers[0].backed_bytes // 512
        k0[backed_tokens].fill_(1.0)
        print("beyond ok", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "inside ok" in proc.stdout
    assert "beyond ok" not in proc.stdout
    assert proc.returncode == -11, proc.stderr[-2000:]


def test_two_owners_live_side_by_side_in_one_process(drv: Driver) -> None:
    full = mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=20_000,
                           page_size=16, dtype="bfloat16")
    swa = mha_token_major(layers=2, kv_heads=8, head_dim=128, reserved_tokens=4_096,
                          page_size=16, dtype="bfloat16")
    a = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=20_000,
                      descs=full, name="full")
    b = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=4_096,
                      descs=swa, name="swa")
    a.finalize(20_000)
    b.finalize(4_096)
    assert drv.stats().physical_bytes == a.backed_bytes + b.backed_bytes
    assert b.backed_bytes == 4 * gran_up((4_096 + 16) * 2048)
    a.close()
    b.close()
    assert drv.stats().clean


def test_close_is_idempotent_and_waits_for_tensors_the_caller_still_holds() -> None:
    drv = HostDriver(capacity_bytes=1 * GiB)
    descs = mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=10_000,
                            page_size=16, dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=10_000,
                          descs=descs)
    k0 = owner.tensors[0][:16]
    owner.close()
    owner.close()
    assert owner.closed and not owner.arena.released
    k0.fill_(2.0)  # still backed: close() did not unmap memory a live tensor reaches
    assert drv.stats().physical_bytes > 0
    del k0
    import gc

    gc.collect()
    assert owner.arena.released and drv.stats().clean


def test_hybrid_swa_owners_commit_no_more_than_their_window_needs(drv: Driver) -> None:
    from kvvmm.layout import hybrid_swa_descs, load_model

    # gpt-oss-120b: 36 layers alternating sliding (window 128) and full, 8 KV heads x 64.
    model = load_model("gpt-oss-120b")
    full, swa = hybrid_swa_descs(model, reserved_tokens=100_000, page_size=16,
                                 dtype="bfloat16")
    assert len(full) == len(swa) == 36  # 18 layers each, K and V
    # The sliding pool holds one window plus paging: align_up(128, 16) + 16 = 144 tokens.
    assert [d.shape for d in swa] == [(144 + 16, 8, 64)] * 36
    a = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=100_000,
                      descs=full, name="full")
    b = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, reserved_tokens=144,
                      descs=swa, name="swa")
    a.finalize(50_000)
    b.finalize(144)
    # Each sliding buffer: (144 + 16) tokens x 8 x 64 x 2 bytes = 163,840 bytes -> 1 granule;
    # the window never needs more, however long the full pool grows.
    assert b.backed_bytes == 36 * G
    assert all(x.final_bytes == 163_840 for x in b.snapshot().buffers)
    assert a.backed_bytes == 36 * gran_up((50_000 + 16) * 8 * 64 * 2)
    a.close()
    b.close()
    assert drv.stats().clean


@pytest.mark.parametrize("layout", ["token", "page"])
@pytest.mark.parametrize("given", [None, 3000])
def test_ensure_prefix_reaches_the_top_page_and_backed_tokens_is_what_it_would_spare(
        drv: Driver, layout: str, given: int | None) -> None:
    """ensure_prefix backs up to reserved_tokens + page_size (the final span of
    reserved_tokens: SGLang hands out its pool's top page), no further; backed_tokens is the
    most n it would back nothing for, after each call and on either layout."""
    import random
    page, reserved = 16, 4096
    make = mha_token_major if layout == "token" else page_major
    descs = make(layers=2, kv_heads=4, head_dim=128, reserved_tokens=reserved, page_size=page,
                 dtype="bfloat16")
    owner = KvBufferOwner(driver=drv, dtype="bfloat16", page_size=page, reserved_tokens=given,
                          descs=descs, policy=Exact())
    r = owner.reserved_tokens
    assert owner.max_prefix_tokens == r + page
    rng = random.Random(7)
    for n in [rng.randrange(0, r + page + 1) for _ in range(12)] + [r + page]:
        before = owner.backed_bytes
        spare = owner.backed_tokens
        added = owner.ensure_prefix(n)
        assert (added == 0) == (n <= spare)  # backed_tokens is exactly what it spares
        assert owner.backed_bytes == before + added
        spans = [gran_up(d.prefix_span_bytes(n, page)) for d in descs]
        assert all(b.backed_bytes >= s for b, s in zip(owner.snapshot().buffers, spans,
                                                       strict=True))
        covered = min(r + page, *(b.backed_bytes // d.row_bytes * d.tokens_per_row
                                  for b, d in zip(owner.snapshot().buffers, descs,
                                                  strict=True)))
        assert owner.backed_tokens == covered
    top = [d.final_span_bytes(r, page) for d in descs]  # the top page: finalize(r)'s span
    assert all(b.backed_bytes >= t for b, t in zip(owner.snapshot().buffers, top, strict=True))
    backed = owner.backed_bytes
    with pytest.raises(OutOfRangeError, match=rf"max_prefix_tokens.*\({r + page}\)"):
        owner.ensure_prefix(r + page + 1)
    assert owner.backed_bytes == backed
    owner.close()
    assert owner.backed_tokens == 0

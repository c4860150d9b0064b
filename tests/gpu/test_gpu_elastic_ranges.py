"""Request-granular elastic backing (0.3) on the CUDA driver (both fast paths, via the ``cuda``
fixture): the interleaved layout's slot ranges, one handle per range, RangeBacking's backing
thread against a writer on the calling thread, attention read through the strided views, and a
failed commit that leaves every byte and handle as it was. Bytes are checked through torch."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvvmm.driver.faults import Fault, FaultyDriver
from kvvmm.errors import DriverError
from kvvmm.layout import RangesFullError, model_descs
from kvvmm.owner import KvBufferOwner, RangeBacking, layer_views, paged_layer_views

pytestmark = pytest.mark.cuda

G = 2 << 20
PS = 16


def _owner(drv: Any, tokens: int = 32 * 1024, model: str = "llama-3.1-8b",
           **kw: Any) -> KvBufferOwner:
    descs = model_descs(model, layout="interleaved", reserved_tokens=tokens, page_size=PS,
                        dtype="bfloat16", **kw)
    return KvBufferOwner(driver=drv, dtype="bfloat16", page_size=PS, reserved_tokens=tokens,
                         descs=descs)


def _stamp(owner: KvBufferOwner, start: int, stop: int, value: float) -> None:
    owner.tensors[0][start:stop].fill_(value)


def _holds(owner: KvBufferOwner, start: int, stop: int, value: float) -> bool:
    import torch

    t = owner.tensors[0][start:stop]
    return bool(torch.all(t == value).item())


def test_commit_slots_maps_one_handle_per_range_and_each_range_keeps_its_bytes(
    cuda: Any, needs_torch_cuda: None
) -> None:
    import torch

    owner = _owner(cuda)
    assert owner.slot_block_tokens() == PS  # llama-3.1-8b interleaved: a page is a granule
    handles = cuda.stats().handles
    ranges = [(PS, PS * 40), (PS * 100, PS * 130), (PS * 500, PS * 501)]
    assert owner.commit_slots(ranges) == (39 + 30 + 1) * G
    assert cuda.stats().handles == handles + 3  # one handle per range, every layer in it
    for i, (a, b) in enumerate(ranges):
        _stamp(owner, a, b, float(i + 1))
    torch.cuda.synchronize()
    assert owner.decommit_slots([ranges[1]]) == 30 * G
    assert cuda.stats().handles == handles + 2
    assert _holds(owner, *ranges[0], 1.0) and _holds(owner, *ranges[2], 3.0)
    owner.commit_slots([ranges[1]])  # backed again: fresh memory, written and read back
    _stamp(owner, *ranges[1], 7.0)
    assert _holds(owner, *ranges[1], 7.0) and _holds(owner, *ranges[0], 1.0)
    owner.snapshot().arena.check()
    owner.decommit_slots(ranges)
    assert owner.backed_bytes == G and cuda.stats().handles == handles
    owner.close()


def test_slot_ranges_whose_granules_are_shared_keep_a_committed_neighbours_bytes(
    cuda: Any, needs_torch_cuda: None
) -> None:
    # llama-3.1-70b at TP8: 640 KiB pages, 3.2 to a granule; neighbours share end granules.
    owner = _owner(cuda, tokens=16 * 1024, model="llama-3.1-70b", tp=8)
    assert owner.slot_block_tokens() > PS
    owner.commit_slots([(PS * 10, PS * 20)])
    owner.commit_slots([(PS * 20, PS * 30)])
    _stamp(owner, PS * 10, PS * 30, 5.0)
    owner.decommit_slots([(PS * 10, PS * 20)])
    assert _holds(owner, PS * 20, PS * 30, 5.0)
    owner.snapshot().arena.check()
    owner.close()


@pytest.mark.parametrize("reserve", [0, 64 * G])
def test_range_backing_on_its_thread_gives_each_lease_its_own_bytes(
    cuda: Any, needs_torch_cuda: None, reserve: int
) -> None:
    import torch

    owner = _owner(cuda, tokens=64 * 1024)
    rng = random.Random(reserve)
    with RangeBacking(owner, reserve_bytes=reserve) as backing:
        live: dict[int, tuple[Any, float]] = {}
        for step in range(300):
            if live and (rng.random() < 0.4 or len(live) > 40):
                key = rng.choice(sorted(live))
                lease, value = live.pop(key)
                for a, b in lease.slots:
                    assert _holds(owner, a, b, value), (step, lease)
                backing.release(lease)  # given back on the backing thread, later
                continue
            want = rng.randint(1, 3000)
            try:
                lease = backing.wait(backing.admit(want))
            except RangesFullError:  # the pool is full: a release comes next
                continue
            assert sum(b - a for a, b in lease.slots) >= want
            value = float(step % 120 + 1)
            for a, b in lease.slots:
                _stamp(owner, a, b, value)  # the calling thread writes while mapping goes on
            live[step] = (lease, value)
            if rng.random() < 0.2:
                try:
                    grown = backing.grow(lease, want + rng.randint(1, 2000))
                except RangesFullError:
                    assert lease.tokens == want  # refused: the lease is as it was
                    grown = False
                if grown:
                    backing.wait(lease)
                    for a, b in lease.slots:
                        _stamp(owner, a, b, value)
        torch.cuda.synchronize()
        for lease, value in live.values():
            for a, b in lease.slots:
                assert _holds(owner, a, b, value)
            backing.release(lease)
        backing.drain()
        s = backing.stats()
        assert s.leased_bytes == 0 and s.pending_bytes == 0
        owner.snapshot().arena.check()
    mapped = owner.backed_bytes
    assert backing.reclaim(0) == mapped - G  # every cached block: whole units, all free
    assert owner.backed_bytes == G and backing.stats().units == 0
    owner.close()


def test_attention_through_the_interleaved_views_equals_attention_on_copies(
    cuda: Any, needs_torch_cuda: None
) -> None:
    import torch
    import torch.nn.functional as F

    owner = _owner(cuda, tokens=8 * 1024)
    n = 2048
    owner.commit_slots([(PS, PS + n)])
    t = owner.tensors[0]
    torch.manual_seed(0)
    t[PS:PS + n].copy_(torch.randn(t[PS:PS + n].shape, device=t.device, dtype=t.dtype))
    views = layer_views(owner)
    heads = views[0][0].shape[1]
    q = torch.randn(1, heads * 4, 1, views[0][0].shape[2], device=t.device, dtype=t.dtype)
    for k, v in views[:4]:
        kk = k[PS:PS + n].transpose(0, 1).unsqueeze(0)  # (1, heads, n, dim), strided
        vv = v[PS:PS + n].transpose(0, 1).unsqueeze(0)
        got = F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)
        want = F.scaled_dot_product_attention(q, kk.contiguous(), vv.contiguous(),
                                              enable_gqa=True)
        torch.testing.assert_close(got, want)
    pages = paged_layer_views(owner, PS)
    kp = pages[3][0]
    assert kp.shape[1:] == (PS, heads, views[0][0].shape[2])
    assert torch.equal(kp[1:1 + n // PS].reshape(n, heads, -1), views[3][0][PS:PS + n])
    del views, pages, kp, kk, vv, t
    owner.close()


@pytest.mark.parametrize("nth", [1, 2])
def test_a_failed_commit_on_cuda_leaves_every_byte_and_handle_as_it_was(
    cuda: Any, needs_torch_cuda: None, nth: int
) -> None:
    drv = FaultyDriver(cuda)
    owner = _owner(drv)
    owner.commit_slots([(PS, PS * 10)])
    _stamp(owner, PS, PS * 10, 9.0)
    before, handles = owner.snapshot(), cuda.stats().handles
    drv.arm([Fault("map", nth=nth)])
    with pytest.raises(DriverError):
        owner.commit_slots([(PS * 50, PS * 60), (PS * 80, PS * 90)])
    assert owner.snapshot() == before and cuda.stats().handles == handles
    assert _holds(owner, PS, PS * 10, 9.0)
    owner.decommit_slots([(PS, PS * 10)])  # a RangeBacking owns every slot it may lease
    handles = cuda.stats().handles
    backing = RangeBacking(owner, executor="inline")
    drv.arm([Fault("map", nth=1)])
    lease = backing.admit(PS * 20)
    with pytest.raises(DriverError):
        backing.wait(lease)
    backing.release(lease)
    assert cuda.stats().handles == handles and owner.backed_bytes == G
    ok = backing.wait(backing.admit(PS * 20))
    for a, b in ok.slots:
        _stamp(owner, a, b, 4.0)
        assert _holds(owner, a, b, 4.0)
    backing.close()
    owner.close()


def test_block_interleaved_pages_hold_what_token_interleaved_pages_hold_on_the_card(
        cuda: Any) -> None:
    """The same KV in both cross-layer layouts, backed by slot ranges on the card: every
    layer's paged view agrees, a page's tokens of a layer are one contiguous run, and an
    attention over gathered pages gives the same answer from either layout."""
    import torch

    F = torch.nn.functional
    tokens = 8 * 1024
    owners = {}
    for layout in ("interleaved", "block_interleaved"):
        descs = model_descs("llama-3.1-8b", layout=layout, reserved_tokens=tokens,
                            page_size=PS, dtype="bfloat16")
        owners[layout] = KvBufferOwner(driver=cuda, dtype="bfloat16", page_size=PS,
                                       reserved_tokens=tokens, descs=descs)
    try:
        ranges = [(PS, 64 * PS), (200 * PS, 300 * PS)]
        for o in owners.values():
            assert o.commit_slots(ranges) == (63 + 100) * G  # one granule a page
        tok = paged_layer_views(owners["interleaved"], PS)
        blk = paged_layer_views(owners["block_interleaved"], PS)
        pages = torch.tensor([*range(1, 64), *range(200, 300)], device="cuda")
        torch.manual_seed(0)
        for (tk, tv), (bk, bv) in zip(tok, blk, strict=True):
            tk[pages] = torch.randn(len(pages), *tk.shape[1:], device="cuda").bfloat16()
            tv[pages] = torch.randn(len(pages), *tv.shape[1:], device="cuda").bfloat16()
            bk[pages] = tk[pages]
            bv[pages] = tv[pages]
        torch.cuda.synchronize()
        q = torch.randn(1, 32, 1, 128, device="cuda").bfloat16()
        for layer in (0, 31):
            (tk, tv), (bk, bv) = tok[layer], blk[layer]
            assert torch.equal(tk[pages], bk[pages]) and torch.equal(tv[pages], bv[pages])
            assert bk[7].is_contiguous() and not tk[7].is_contiguous()
            outs = []
            for k, v in ((tk, tv), (bk, bv)):
                kk = k[pages].flatten(0, 1).permute(1, 0, 2)[None]
                vv = v[pages].flatten(0, 1).permute(1, 0, 2)[None]
                outs.append(F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True))
            assert torch.equal(outs[0], outs[1])
        del tok, blk, tk, tv, bk, bv, kk, vv
    finally:
        for o in owners.values():
            o.close()

"""kvvmm.integrations.sglang runs SGLang's own call sequence on the host driver.

SGLang's descriptors are stood in for by a small duck-typed class (``SglDesc``: the four fields
SGLang's ``KvBufferDesc`` has, nothing else), built the way SGLang's pools build them: MHA one
token-major K and V buffer per layer of ``(size + page_size, heads, head_dim)``; hybrid SWA two
such pools (full layers, sliding-window layers), each with its own owner in one process.

The spans are re-derived here from ``reference/README.md``'s formulas, written independently of
``kvvmm.layout``: rows(n) = ceil(max(n, 0) / tokens_per_row); prefix = rows(n) * row_bytes;
final = rows(n + page_size) * row_bytes; each backed rounded up to the granularity (the seed's
``commit_range`` aligns every want up).
"""

from __future__ import annotations

import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvvmm.driver import FaultyDriver  # noqa: E402
from kvvmm.errors import (  # noqa: E402
    ArgumentError,
    BusyError,
    ClosedError,
    DriverError,
    DriverOutOfMemoryError,
    KvvmmError,
    OutOfRangeError,
)
from kvvmm.integrations import sglang  # noqa: E402
from kvvmm.integrations.sglang import KvBufferDesc, KvVmmBufferOwner, KvVmmError  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the host driver needs Linux")

GRAN = 2 << 20  # the test host driver's granularity (conftest: 2 MiB, as on an H200)
PAGE = 16
ITEMSIZE = 2  # bfloat16


class SglDesc:
    """What SGLang hands the owner: an object with four fields (no kvvmm type, no methods)."""

    def __init__(self, name: str, shape: tuple[int, ...], row_bytes: int,
                 tokens_per_row: int) -> None:
        self.name, self.shape = name, shape
        self.row_bytes, self.tokens_per_row = row_bytes, tokens_per_row


def mha_descs(layers: int, size: int, heads: int = 2, head_dim: int = 64,
              prefix: str = "") -> list[SglDesc]:
    """SGLang's MHATokenToKVPool layout: k0..k(L-1) then v0..v(L-1), (size + page, H, D)."""
    row = heads * head_dim * ITEMSIZE
    return [SglDesc(f"{prefix}{kv}{i}", (size + PAGE, heads, head_dim), row, 1)
            for kv in "kv" for i in range(layers)]


def rows(n: int, tokens_per_row: int) -> int:
    return -(-max(n, 0) // tokens_per_row)


def up(n: int) -> int:
    return -(-n // GRAN) * GRAN


def seed_prefix_backed(descs: list[SglDesc], n: int) -> int:
    return sum(up(rows(n, d.tokens_per_row) * d.row_bytes) for d in descs)


def seed_final_backed(descs: list[SglDesc], n: int) -> int:
    return sum(up(rows(n + PAGE, d.tokens_per_row) * d.row_bytes) for d in descs)


def build(make_driver: Callable[..., Any], descs: list[SglDesc], size: int,
          **kw: Any) -> KvVmmBufferOwner:
    return KvVmmBufferOwner(device="cpu", device_id=0, store_dtype=torch.bfloat16,
                            page_size=PAGE, reserved_num_tokens=size, buffer_descs=descs,
                            driver=kw.pop("driver", None) or make_driver("host"), **kw)


def covered_tokens(descs: list[SglDesc], n: int, top: int | None = None) -> int:
    """Tokens usable once each buffer's prefix for ``n`` is backed in whole granules, up to
    ``top`` (the pool's ``size + page_size``)."""
    top = descs[0].shape[0] * descs[0].tokens_per_row if top is None else top
    return min(top, *(up(rows(n, d.tokens_per_row) * d.row_bytes) // d.row_bytes
                      * d.tokens_per_row for d in descs))


def budget_tokens(budget_bytes: int, per_token_bytes: int) -> int:
    """How SGLang turns a memory budget into a pool size: whole pages that fit."""
    return budget_bytes // per_token_bytes // PAGE * PAGE


def test_sglangs_mha_sequence_backs_the_seeds_spans_with_stable_pointers_and_contents(
        make_driver: Callable[..., Any]) -> None:
    size = 20_000
    descs = mha_descs(layers=3, size=size)
    own = build(make_driver, descs, size)
    # Tensors: descs order, upper-bound shapes, the store dtype.
    assert [tuple(t.shape) for t in own.tensors] == [d.shape for d in descs]
    assert all(t.dtype == torch.bfloat16 for t in own.tensors)
    # Slot 0 (one page) backed by construction, as the seed's ensure_prefix(page_size).
    assert own.backed_bytes == seed_prefix_backed(descs, PAGE)
    ptrs = [t.data_ptr() for t in own.tensors]
    for i, t in enumerate(own.tensors):  # capture's dummy writes land in slot 0
        t[0].fill_(i + 1)

    per_token = own.bytes_per_token()
    assert per_token == sum(d.row_bytes for d in descs)
    final = budget_tokens(8 * GRAN, per_token)
    own.finalize(final)
    assert own.final_num_tokens == final
    assert own.backed_bytes == seed_final_backed(descs, final)
    assert [t.data_ptr() for t in own.tensors] == ptrs  # graphs keep their addresses
    for i, t in enumerate(own.tensors):
        assert bool((t[0] == i + 1).all())  # slot 0 survived finalize
        t[: final + PAGE] = float(i + 10)  # every final slot is writable (padded page too)
    assert all(bool((t[final + PAGE - 1] == i + 10).all()) for i, t in enumerate(own.tensors))

    own.ensure_prefix(final)  # already backed: nothing to do
    assert own.backed_bytes == seed_final_backed(descs, final)
    own.ensure_prefix(size)
    assert own.backed_bytes == seed_prefix_backed(descs, size)
    assert own.backed_tokens == covered_tokens(descs, size)
    del t  # the loop's last tensor: kvvmm's close waits for every live tensor
    own.close()
    assert own.tensors == [] and own.backed_bytes == 0 and own.released


def test_hybrid_swa_pools_are_two_owners_in_one_process_each_finalized_to_its_budget(
        make_driver: Callable[..., Any]) -> None:
    drv = make_driver("host")
    full_size, swa_size = 12_000, 3_000
    full, swa = mha_descs(2, full_size, prefix="full_"), mha_descs(4, swa_size, prefix="swa_")
    owners = [build(make_driver, full, full_size, driver=drv, name="full"),
              build(make_driver, swa, swa_size, driver=drv, name="swa")]
    ptrs = [[t.data_ptr() for t in o.tensors] for o in owners]
    for o, descs, size in zip(owners, (full, swa), (full_size, swa_size), strict=True):
        n = min(budget_tokens(4 * GRAN, o.bytes_per_token()), size)
        o.finalize(n)
        assert o.backed_bytes == seed_final_backed(descs, n)
        for t in o.tensors:
            t[: n + PAGE] = 3.0
    assert [[t.data_ptr() for t in o.tensors] for o in owners] == ptrs
    # The two arenas do not overlap: one process, two reservations.
    a, b = (o.snapshot().arena for o in owners)
    assert a.base + a.reserved_bytes <= b.base or b.base + b.reserved_bytes <= a.base
    del t  # the loop's last tensor: kvvmm's close waits for every live tensor
    for o in owners:
        o.close()
    assert all(o.released for o in owners)


def test_ensure_prefix_reaches_the_top_page_and_refuses_more_as_a_value_error(
        make_driver: Callable[..., Any]) -> None:
    size = 4_000
    descs = mha_descs(1, size)
    own = build(make_driver, descs, size)
    own.ensure_prefix(0)
    own.ensure_prefix(size + PAGE)  # the lazy caller hands out the pool's top page
    assert own.backed_bytes == seed_prefix_backed(descs, size + PAGE)
    assert own.backed_tokens == size + PAGE
    for t in own.tensors:
        t[size: size + PAGE] = 5.0  # the top page is writable
    del t
    backed = own.backed_bytes
    with pytest.raises(OutOfRangeError) as e:
        own.ensure_prefix(size + PAGE + 1)  # past every slot the tensors hold
    assert isinstance(e.value, ValueError) and str(size + PAGE) in str(e.value)
    with pytest.raises(ValueError):
        own.finalize(PAGE - 1)  # the seed's bound: page_size <= n <= reserved
    with pytest.raises(ValueError):
        own.finalize(size + 1)
    assert own.backed_bytes == backed  # nothing committed by a refused call
    own.close()


def test_seed_runtime_errors_reach_sglang_as_runtime_error_and_keep_their_kvvmm_type(
        make_driver: Callable[..., Any]) -> None:
    size = 20_000
    faulty = FaultyDriver(make_driver("host"))
    own = build(make_driver, mha_descs(1, size), size, driver=faulty)
    backed = own.backed_bytes
    faulty.arm({"create": 1})
    with pytest.raises(RuntimeError) as e:
        own.finalize(size)
    err = e.value
    assert isinstance(err, DriverOutOfMemoryError) and isinstance(err, DriverError)
    assert isinstance(err, KvvmmError) and isinstance(err, KvVmmError)
    assert err.cuda_error == "CUDA_ERROR_OUT_OF_MEMORY" and err.call == "create"
    assert isinstance(err.__cause__, DriverOutOfMemoryError)
    assert not isinstance(err.__cause__, RuntimeError)  # the original, kept as the cause
    assert own.backed_bytes == backed  # the failed finalize undid itself
    # The twin crosses processes like the original (tp spawns workers).
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is type(err) and again.call_args == err.call_args
    own.close()
    with pytest.raises(RuntimeError) as e2:
        own.ensure_prefix(PAGE)
    assert isinstance(e2.value, ClosedError)


def test_close_with_a_live_tensor_waits_for_it_and_close_wait_times_out_with_busy_error(
        make_driver: Callable[..., Any]) -> None:
    size = 4_000
    own = build(make_driver, mha_descs(1, size), size)
    held = own.tensors[0][:8]  # SGLang's pool keeps its k_buffer views
    held.fill_(1.0)
    assert own.close() is False  # the seed would unmap under `held` here
    assert own.tensors == [] and not own.released and own.live_tensors >= 1
    assert float(held.sum()) == 8 * 2 * 64  # still backed: no fault
    with pytest.raises(RuntimeError) as e:
        own.close(wait=True, timeout=0.02)
    assert isinstance(e.value, BusyError) and "0.02" in str(e.value)
    for bad in (float("nan"), float("inf"), -1, True):  # a wait on NaN never ended
        with pytest.raises(ValueError, match="timeout"):
            own.close(wait=True, timeout=bad)
    assert not own.released and own.live_tensors >= 1  # nothing changed
    del held
    assert own.close(wait=True, timeout=5.0) is True
    assert own.released and own.close() is True  # idempotent


def test_sglang_descriptors_are_read_duck_typed_and_a_missing_field_is_named(
        make_driver: Callable[..., Any]) -> None:
    class NoRows:
        name, shape, row_bytes = "k0", (32, 2, 64), 256

    with pytest.raises(ArgumentError, match="tokens_per_row"):
        build(make_driver, [NoRows()], 16)  # type: ignore[list-item]
    # Descriptors disagreeing with the dtype: the seed would back fewer bytes than the rows.
    with pytest.raises(ValueError, match=r"row_bytes|dtype"):
        build(make_driver, [SglDesc("k0", (32, 2, 64), 128, 1)], 16)
    # A CUDA device string is required without driver=: no silent fallback to the host.
    with pytest.raises(ArgumentError, match="device"):
        KvVmmBufferOwner(device="cpu", device_id=0, store_dtype=torch.bfloat16,
                         page_size=PAGE, reserved_num_tokens=16,
                         buffer_descs=mha_descs(1, 16))


def test_page_major_descs_back_whole_pages_and_item_len_is_one_page_of_a_buffer(
        make_driver: Callable[..., Any]) -> None:
    pages, heads, dim = 600, 2, 64
    row = PAGE * heads * dim * ITEMSIZE
    descs = [SglDesc(f"kv{i}", (pages, PAGE, heads, dim), row, PAGE) for i in range(2)]
    size = (pages - 1) * PAGE  # one page is the padded one
    own = build(make_driver, descs, size)
    own.finalize(1000)
    assert own.backed_bytes == seed_final_backed(descs, 1000)
    assert own.bytes_per_token() == 2 * heads * dim * ITEMSIZE
    own.close()
    # item_len_bytes(page) = row_bytes * page_size / tokens_per_row (one page of the buffer).
    assert KvBufferDesc("kv0", (pages, PAGE, heads, dim), row, PAGE).item_len_bytes(PAGE) == row
    tok = KvBufferDesc("k0", (size + PAGE, heads, dim), heads * dim * ITEMSIZE, 1)
    assert tok.item_len_bytes(PAGE) == PAGE * heads * dim * ITEMSIZE
    assert tok.prefix_span_bytes(17, PAGE) == 17 * heads * dim * ITEMSIZE
    with pytest.raises(ArgumentError):
        KvBufferDesc("kv0", (pages, PAGE, heads, dim), row, PAGE).item_len_bytes(8)


def test_install_makes_sglangs_import_resolve_to_kvvmm_and_uninstall_puts_back_what_was_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    name = sglang.SGLANG_MODULE
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        res = sglang.install()
        assert res.status == "installed" and name in str(res)
        assert sglang.install().status == "already"
        # What SGLang's memory_pool.py does; works whether or not sglang is installed.
        from sglang.srt.mem_cache.kv_vmm_backing import (  # type: ignore[import-not-found]
            KvVmmBufferOwner as Imported,
        )
        assert Imported is KvVmmBufferOwner
    finally:
        assert sglang.uninstall()
    assert name not in sys.modules
    assert not sglang.uninstall()


def test_install_after_the_seed_was_imported_replaces_it_and_warns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    name = sglang.SGLANG_MODULE
    seed = types.ModuleType(name)  # stands for the seed module SGLang imported first
    parent = types.ModuleType(name.rpartition(".")[0])
    parent.kv_vmm_backing = seed  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, seed)
    monkeypatch.setitem(sys.modules, parent.__name__, parent)
    with pytest.warns(RuntimeWarning, match="imported before"):
        res = sglang.install()
    assert res.status == "replaced"
    assert sys.modules[name] is sglang and parent.kv_vmm_backing is sglang  # type: ignore[attr-defined]
    assert sglang.uninstall()
    assert sys.modules[name] is seed and parent.kv_vmm_backing is seed  # type: ignore[attr-defined]


# -- the adapter's four defects, each as a class of inputs ---------------------------------


class UpstreamModel:
    """Upstream's lazy-backing owner, modelled independently: Exact growth maps one handle
    per extension, ``[backed, up(prefix(n)))``; ``release_beyond(n)`` keeps
    ``up(prefix(n))`` and drops every mapping that starts at or past it."""

    def __init__(self, descs: list[SglDesc]) -> None:
        self.descs = descs
        self.maps: list[list[tuple[int, int]]] = [[] for _ in descs]

    def ensure_prefix(self, n: int) -> None:
        for d, maps in zip(self.descs, self.maps, strict=True):
            end = maps[-1][1] if maps else 0
            want = up(rows(n, d.tokens_per_row) * d.row_bytes)
            if want > end:
                maps.append((end, want))

    def release_beyond(self, n: int) -> int:
        given = 0
        for i, d in enumerate(self.descs):
            keep = up(rows(n, d.tokens_per_row) * d.row_bytes)
            given += sum(e - s for s, e in self.maps[i] if s >= keep)
            self.maps[i] = [(s, e) for s, e in self.maps[i] if s < keep]
        return given

    @property
    def backed(self) -> int:
        return sum(e - s for maps in self.maps for s, e in maps)

    def backed_tokens(self, top: int) -> int:
        """Tokens whose prefix is backed in every buffer (mappings are contiguous from 0)."""
        return min(top, *(sum(e - s for s, e in maps) // d.row_bytes * d.tokens_per_row
                          for d, maps in zip(self.descs, self.maps, strict=True)))


LAYOUTS = [  # (heads, head_dim, tokens_per_row): token-major rows of several sizes, paged rows
    (2, 64, 1), (8, 128, 1), (1, 96, 1), (2, 64, PAGE), (4, 128, PAGE)]


def layout_descs(layers: int, size: int, heads: int, head_dim: int, tpr: int) -> list[SglDesc]:
    if tpr == 1:
        return mha_descs(layers, size, heads, head_dim)
    row = PAGE * heads * head_dim * ITEMSIZE  # one page per row (SGLang's HND layout)
    return [SglDesc(f"{kv}{i}", ((size + PAGE) // PAGE, PAGE, heads, head_dim), row, PAGE)
            for kv in "kv" for i in range(layers)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"h{x[0]}d{x[1]}r{x[2]}")
def test_release_beyond_gives_back_what_upstreams_lazy_owner_does_at_every_boundary(
        make_driver: Callable[..., Any], layout: tuple[int, int, int]) -> None:
    import random
    heads, head_dim, tpr = layout
    size = 40_000 // PAGE * PAGE
    descs = layout_descs(2, size, heads, head_dim, tpr)
    own = build(make_driver, descs, size)
    model = UpstreamModel(descs)
    model.ensure_prefix(PAGE)  # slot 0 at construction
    per_granule = max(1, GRAN // descs[0].row_bytes * tpr)  # tokens one granule holds
    rng = random.Random(24)
    # n at and around mapping boundaries (k granules, +-1 token), and anywhere
    picks = [k * per_granule + dk for k in range(1, 6) for dk in (-1, 0, 1)]
    picks += [rng.randrange(PAGE, size) for _ in range(10)]
    for n in picks:
        n = min(max(n, PAGE), size)
        for step in sorted(rng.sample(range(PAGE, size + PAGE), 3)):
            own.ensure_prefix(step)
            model.ensure_prefix(step)
        assert own.backed_bytes == model.backed
        assert own.release_beyond(n) == model.release_beyond(n), n
        assert own.backed_bytes == model.backed, n
        assert own.backed_tokens == model.backed_tokens(size + PAGE), n
    own.close()


@pytest.mark.parametrize("page", [1, 16])
def test_reserved_num_tokens_may_be_every_slot_the_tensors_hold_as_sglangs_unified_pool_passes(
        make_driver: Callable[..., Any], page: int) -> None:
    total = 48 * GRAN + 12_345  # SGLang's unified pool: one raw uint8 buffer of total bytes
    desc = SglDesc("unified_raw", (total,), 1, 1)
    floor = 3 * page + 100  # its slot-0 sink, backed before capture
    for reserved in (total - page, total - 1, total):
        own = KvVmmBufferOwner(device="cpu", device_id=0, store_dtype=torch.uint8,
                               page_size=page, reserved_num_tokens=reserved,
                               buffer_descs=[desc], driver=make_driver("host"))
        assert own.reserved_num_tokens == reserved
        own.ensure_prefix(floor)
        assert own.backed_bytes == up(floor)
        own.ensure_prefix(total)  # finalize_backing: ensure_prefix(final_total_bytes)
        assert own.backed_bytes == up(total) and own.backed_tokens == total
        own.tensors[0][total - 1] = 7  # the last byte is there
        with pytest.raises(ValueError):  # the final span of reserved would pass the tensor
            own.finalize(total - page + 1)
        if reserved == total - page:
            with pytest.raises(ValueError):
                own.finalize(reserved + 1)
        own.finalize(total - page)
        own.close()
    with pytest.raises(OutOfRangeError, match=str(total)):  # past the tensor: the bound
        KvVmmBufferOwner(device="cpu", device_id=0, store_dtype=torch.uint8, page_size=page,
                         reserved_num_tokens=total + 1, buffer_descs=[desc],
                         driver=make_driver("host"))


def test_backed_tokens_reads_no_buffer_and_no_driver_and_stays_true_after_every_change(
        make_driver: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import random
    size = 30_000 // PAGE * PAGE
    descs = mha_descs(32, size)  # 64 buffers: the case upstream reads on every allocation
    own = build(make_driver, descs, size)
    model = UpstreamModel(descs)
    model.ensure_prefix(PAGE)
    rng = random.Random(4)

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("backed_tokens walked the buffers")

    for _ in range(25):
        n = rng.randrange(PAGE, size + PAGE + 1)
        if rng.random() < 0.3 and n <= size:
            own.release_beyond(n)
            model.release_beyond(n)
        else:
            own.ensure_prefix(n)
            model.ensure_prefix(n)
        with monkeypatch.context() as m:  # a read costs no snapshot, no arena walk
            m.setattr(type(own.owner), "snapshot", refuse)
            m.setattr(type(own.owner.arena), "prefix_of", refuse)
            m.setattr(type(own.owner.arena), "snapshot", refuse)
            got = own.backed_tokens
        assert got == model.backed_tokens(size + PAGE)
        own.ensure_prefix(got)  # nothing to back up to it
        assert own.backed_bytes == model.backed
    own.close()
    assert own.backed_tokens == 0




def test_install_with_a_driver_runs_sglangs_own_construction_on_it_and_uninstall_forgets_it(
        make_driver: Callable[..., Any]) -> None:
    drv = make_driver("host")
    name = sglang.SGLANG_MODULE
    saved = sys.modules.get(name)
    try:
        sglang.install(driver=drv)
        own = KvVmmBufferOwner(device="cpu:0", device_id=0, store_dtype=torch.bfloat16,
                               page_size=PAGE, reserved_num_tokens=1000,
                               buffer_descs=mha_descs(1, 1000))  # no driver=: as SGLang calls
        assert own.driver is drv
        own.close()
        assert own.released
        sglang.uninstall()
        with pytest.raises(ArgumentError, match="cuda"):  # CUDA's again: "cpu:0" is refused
            KvVmmBufferOwner(device="cpu:0", device_id=0, store_dtype=torch.bfloat16,
                             page_size=PAGE, reserved_num_tokens=1000,
                             buffer_descs=mha_descs(1, 1000))
        with pytest.raises(ArgumentError, match="driver"):
            sglang.install(driver="host")  # type: ignore[arg-type]  # a kind's name, not a driver
    finally:
        sglang.uninstall()
        if saved is not None:
            sys.modules[name] = saved


@pytest.mark.parametrize("granularity", ["recommended", "minimum", 4 << 20])
def test_the_cuda_driver_is_opened_with_the_granularity_asked_recommended_by_default(
        monkeypatch: pytest.MonkeyPatch, make_driver: Callable[..., Any],
        granularity: Any) -> None:
    asked: list[dict[str, Any]] = []

    def fake_open(kind: str, **options: Any) -> Any:
        asked.append({"kind": kind, **options})
        return make_driver("host")

    monkeypatch.setattr(sglang, "open_driver", fake_open)
    kw = {} if granularity == "recommended" else {"granularity": granularity}
    own = KvVmmBufferOwner(device="cuda:0", device_id=0, store_dtype=torch.bfloat16,
                           page_size=PAGE, reserved_num_tokens=1000,
                           buffer_descs=mha_descs(1, 1000), **kw)
    assert asked == [{"kind": "cuda", "device": 0, "granularity": granularity,
                      "handle_type": "auto"}]
    own.close()


@pytest.mark.parametrize("handle_type", ["auto", "posix_fd", "fabric", "none"])
def test_the_cuda_driver_is_opened_with_the_handle_type_asked_auto_by_default_as_sglang(
        monkeypatch: pytest.MonkeyPatch, make_driver: Callable[..., Any],
        handle_type: str) -> None:
    # SGLang 0.5.23's own owner probes FABRIC, then POSIX fd, then none
    # (make_device_allocation_prop's "auto"); the seed asked for no shareable handle.
    asked: list[dict[str, Any]] = []

    def fake_open(kind: str, **options: Any) -> Any:
        asked.append({"kind": kind, **options})
        return make_driver("host")

    monkeypatch.setattr(sglang, "open_driver", fake_open)
    kw = {} if handle_type == "auto" else {"handle_type": handle_type}
    own = KvVmmBufferOwner(device="cuda", device_id=0, store_dtype=torch.bfloat16,
                           page_size=PAGE, reserved_num_tokens=1000,
                           buffer_descs=mha_descs(1, 1000), **kw)
    assert asked == [{"kind": "cuda", "device": 0, "granularity": "recommended",
                      "handle_type": handle_type}]
    assert own.driver.handle_type == "posix_fd"  # the host driver's, which it was given
    own.close()


@pytest.mark.parametrize("bad", ["FABRIC", "posix", None, 1])
def test_an_unknown_handle_type_is_refused_naming_it_before_any_driver_opens(
        monkeypatch: pytest.MonkeyPatch, bad: object) -> None:
    def fake_open(kind: str, **options: Any) -> Any:
        raise AssertionError("no driver may open for a bad handle_type")

    monkeypatch.setattr(sglang, "open_driver", fake_open)
    with pytest.raises(ArgumentError) as info:
        KvVmmBufferOwner(device="cuda", device_id=0, store_dtype=torch.bfloat16,
                         page_size=PAGE, reserved_num_tokens=1000,
                         buffer_descs=mha_descs(1, 1000), handle_type=bad)  # type: ignore[arg-type]
    assert info.value.name == "handle_type" and info.value.value == bad
    assert "'auto'" in info.value.limit and "'fabric'" in info.value.limit

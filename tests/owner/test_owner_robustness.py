"""Arena, owner and policy robustness: bad construction refused early and typed, descs that
disagree with the owner refused naming the wrong argument, decommits that say what they kept,
and a decommit whose release fails after its unmaps.
"""

from __future__ import annotations

import pytest

from kvvmm import (
    Arena,
    ArgumentError,
    Chunked,
    DriverError,
    Exact,
    Fault,
    FaultyDriver,
    Geometric,
    KvBufferOwner,
    OutOfRangeError,
    SimDriver,
    mha_token_major,
    page_major,
)
from kvvmm.arena import DecommitResult
from kvvmm.arena.arena import MAX_RESERVE_BYTES
from kvvmm.driver.host import HostDriver
from kvvmm.layout import KvBufferDesc
from kvvmm.policy import default_policy
from kvvmm.units import GiB, MiB

G = 2 << 20
R = 4096


def token_descs(page: int = 16, dtype: str = "bfloat16") -> list[KvBufferDesc]:
    return mha_token_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=R,
                           page_size=page, dtype=dtype)


def paged_descs(page: int = 16) -> list[KvBufferDesc]:
    return page_major(layers=1, kv_heads=4, head_dim=64, reserved_tokens=R, page_size=page,
                      dtype="bfloat16")


def owner(**kw: object) -> KvBufferOwner:
    args: dict[str, object] = dict(driver=SimDriver("h200"), dtype="bfloat16", page_size=16,
                                   reserved_tokens=R, descs=token_descs())
    args.update(kw)
    return KvBufferOwner(**args)  # type: ignore[arg-type]


def refused(error: type[Exception], name: str, **kw: object) -> ArgumentError:
    with pytest.raises(error) as info:
        owner(**kw)
    err = info.value
    assert isinstance(err, ArgumentError)
    assert err.name == name, f"blamed {err.name!r}, not {name!r}: {err}"
    return err


# -- construction: typed, early, naming the argument ---------------------------------------


@pytest.mark.parametrize("bad", [None, "sim", 3], ids=["none", "a-kind-name", "an-int"])
def test_an_owner_or_arena_given_something_that_is_not_a_driver_refuses_it_by_name(
    bad: object,
) -> None:
    refused(ArgumentError, "driver", driver=bad)
    with pytest.raises(ArgumentError) as info:
        Arena(bad, reserve_bytes=G)  # type: ignore[arg-type]
    assert info.value.name == "driver"
    if bad == "sim":
        assert "open_driver('sim')" in str(info.value)


@pytest.mark.parametrize("cls", [Exact, Chunked, Geometric])
def test_a_policy_class_instead_of_an_instance_is_refused_at_construction(cls: type) -> None:
    err = refused(ArgumentError, "policy", policy=cls)
    assert f"{cls.__name__}()" in str(err)


def test_an_object_that_is_no_policy_is_refused_at_construction() -> None:
    refused(ArgumentError, "policy", policy="chunked")


@pytest.mark.parametrize("nbytes", [2**64 + 5, MAX_RESERVE_BYTES + G])
def test_an_arena_larger_than_any_device_addresses_is_refused_before_reserving(
    nbytes: int,
) -> None:
    drv = SimDriver("h200")
    with pytest.raises(OutOfRangeError) as info:
        Arena(drv, reserve_bytes=nbytes)
    assert info.value.name == "reserve_bytes" and str(MAX_RESERVE_BYTES) in str(info.value)
    assert drv.stats().clean


def test_reserved_tokens_far_beyond_the_descs_is_an_out_of_range_error_naming_it() -> None:
    drv = SimDriver("h200")
    refused(OutOfRangeError, "reserved_tokens", driver=drv, reserved_tokens=2**60)
    assert drv.stats().clean


def test_descs_that_need_more_va_than_an_arena_may_reserve_are_refused_before_reserving() -> None:
    drv = SimDriver("h200")
    huge = mha_token_major(layers=1, kv_heads=8, head_dim=128, reserved_tokens=2**40,
                           page_size=16, dtype="bfloat16")
    refused(OutOfRangeError, "reserved_tokens", driver=drv, descs=huge, reserved_tokens=2**40)
    refused(OutOfRangeError, "descs", driver=drv, descs=huge, reserved_tokens=None)
    assert drv.stats().clean


# -- descs that disagree: refused, the wrong argument named ---------------------------------


def test_a_dtype_of_another_size_than_the_descs_say_is_blamed_on_dtype() -> None:
    err = refused(ArgumentError, "dtype", dtype="float32")
    assert "2 bytes per element" in str(err)


def test_a_desc_whose_row_bytes_disagree_with_its_shape_is_blamed_on_that_desc() -> None:
    good = token_descs()
    bad = KvBufferDesc("v0", good[1].shape, good[1].row_bytes // 2, 1)
    err = refused(ArgumentError, "descs[1].row_bytes", descs=[good[0], bad])
    assert str(good[1].row_bytes) in str(err)


def test_row_bytes_that_are_no_whole_number_of_elements_are_blamed_on_the_desc() -> None:
    d = token_descs()[0]
    refused(ArgumentError, "descs[0].row_bytes",
            descs=[KvBufferDesc("k0", d.shape, d.row_bytes + 1, 1)])


def test_a_page_size_other_than_the_page_major_descs_hold_is_blamed_on_page_size() -> None:
    # Regression: this used to be blamed on reserved_tokens.
    err = refused(ArgumentError, "page_size", descs=paged_descs(16), page_size=32)
    assert "16" in str(err)


def test_page_major_descs_with_different_pages_are_blamed_on_the_one_that_differs() -> None:
    a, b = paged_descs(16)[0], paged_descs(32)[1]
    refused(ArgumentError, "descs[1].tokens_per_row", descs=[a, b], page_size=None)


def test_a_page_major_row_that_cannot_hold_its_token_slots_is_blamed_on_its_shape() -> None:
    d = paged_descs(16)[0]
    odd = KvBufferDesc("k0", (d.shape[0], 3), 3 * 2, 16)
    refused(ArgumentError, "descs[0].shape", descs=[odd], page_size=None, reserved_tokens=None)


def test_token_major_descs_do_not_state_the_page_size_so_it_is_required() -> None:
    refused(ArgumentError, "page_size", page_size=None)


def test_a_token_major_page_size_mismatch_names_page_size_as_the_likely_cause() -> None:
    err = refused(OutOfRangeError, "reserved_tokens", page_size=32)
    assert "page_size is the wrong one" in str(err)


# -- derived from the descs: stated once ---------------------------------------------------


def test_page_size_and_reserved_tokens_default_to_what_page_major_descs_say() -> None:
    o = owner(descs=paged_descs(16), page_size=None, reserved_tokens=None)
    assert (o.page_size, o.reserved_tokens) == (16, R)
    o.close()


def test_reserved_tokens_defaults_to_what_token_major_descs_hold() -> None:
    o = owner(reserved_tokens=None)
    assert o.reserved_tokens == R
    o.ensure_prefix(R + o.page_size)  # the top page: every slot the descs hold
    with pytest.raises(OutOfRangeError):
        o.ensure_prefix(R + o.page_size + 1)
    o.close()


def test_a_reserved_tokens_below_what_the_descs_hold_is_still_accepted() -> None:
    o = owner(reserved_tokens=R // 2)
    assert o.reserved_tokens == R // 2
    o.close()


def test_an_owner_on_the_host_driver_can_write_every_slot_it_reports_backed() -> None:
    # The defect the checks guard: descs that under-state their rows made slots the owner
    # called backed unbacked (a segfault). With consistent descs every reported slot writes.
    drv = HostDriver(capacity_bytes=GiB)
    o = owner(driver=drv, reserved_tokens=None)
    o.ensure_prefix(1000)
    for t in o.tensors:
        t[:o.prefix_tokens].fill_(1.0)
    del t  # a live view pins the VA: drv.close() refuses while it lives
    o.close()
    drv.close()


# -- decommits that say what they did --------------------------------------------------------


def three_handles(drv: object) -> tuple[Arena, int]:
    arena = Arena(drv, reserve_bytes=16 * G)  # type: ignore[arg-type]
    a = arena.allocate(8 * G, "x")
    for n in (2 * G, 4 * G, 8 * G):  # mappings [0, 2G) [2G, 4G) [4G, 8G)
        arena.commit(a, n)
    return arena, a


def test_a_decommit_stopped_by_a_straddling_mapping_reports_that_mapping() -> None:
    arena, a = three_handles(SimDriver("h200"))
    r = arena.decommit_many_report([(a, 5 * G)])[0]
    assert isinstance(r, DecommitResult)
    assert (r.given_bytes, r.backed_bytes, r.kept_mapping) == (0, 8 * G, (4 * G, 8 * G))
    assert r.held_bytes == 3 * G
    assert "straddles" in str(r) and "gave back 0" in str(r)
    assert arena.decommit(a, 5 * G) == 0  # the int return is unchanged
    arena.close()


def test_a_decommit_ending_on_a_mapping_boundary_reports_no_kept_mapping() -> None:
    arena, a = three_handles(SimDriver("h200"))
    r = arena.decommit_many_report([(a, 4 * G)])[0]
    assert (r.given_bytes, r.backed_bytes, r.kept_mapping, r.held_bytes) == (4 * G, 4 * G,
                                                                            None, 0)
    arena.close()


def test_a_shrink_that_gives_back_nothing_says_which_buffers_a_mapping_held() -> None:
    o = owner(policy=Chunked(64 * MiB))  # one handle covers every buffer's whole span
    o.ensure_prefix(1000)
    rep = o.shrink_report(16)
    assert rep.given_bytes == 0 and o.shrink(16) == 0
    assert len(rep.held) == len(o.descs) and rep.held_bytes > 0
    assert "straddle" in str(rep)
    o.close()


def test_a_release_failing_after_the_unmaps_keeps_the_decommit_and_a_close_releases_it() -> None:
    inner = SimDriver("h200")
    drv = FaultyDriver(inner)
    arena, a = three_handles(drv)
    drv.arm(Fault("release", nth=1))
    with pytest.raises(DriverError) as info:
        arena.decommit(a, 2 * G)
    assert any("decommit or close again" in n for n in info.value.__notes__)
    assert arena.backed_of(a) == 2 * G, "past the point of no return: the decommit stands"
    assert arena.unreleased_bytes == 6 * G
    assert inner.stats().mappings == 1 and inner.stats().handles == 3
    drv.disarm()
    arena.close()
    assert inner.stats().clean


def test_a_shrink_whose_release_fails_caps_the_token_counts_it_did_shrink() -> None:
    drv = FaultyDriver(SimDriver("h200"))
    descs = mha_token_major(layers=1, kv_heads=8, head_dim=128, reserved_tokens=40_000,
                            page_size=16, dtype="bfloat16")  # 2 KiB a token: 1024 a granule
    o = owner(driver=drv, policy=Exact(), descs=descs, reserved_tokens=None)
    for n in (2000, 4000, 8000):
        o.ensure_prefix(n)
    o.finalize(8000)
    drv.arm(Fault("release", nth=1))
    with pytest.raises(DriverError):
        o.shrink(100)
    assert o.prefix_tokens == 100 and o.final_tokens == 100
    drv.disarm()
    o.close()
    assert drv.stats().clean


def test_a_failed_map_back_after_a_failed_unmap_is_attached_as_a_note() -> None:
    inner = SimDriver("h200")
    drv = FaultyDriver(inner)
    arena = Arena(drv, reserve_bytes=16 * G)
    x, y = arena.allocate(4 * G, "x"), arena.allocate(4 * G, "y")
    arena.commit_many([(x, 4 * G), (y, 4 * G)])
    drv.arm([Fault("unmap", nth=2), Fault("map", nth=1)])
    with pytest.raises(DriverError) as info:
        arena.decommit_many([(x, 0), (y, 0)])
    assert info.value.call == "unmap"
    assert any(n.startswith("undo map back handle") for n in info.value.__notes__)


# -- the default policy ----------------------------------------------------------------------


def test_the_default_policy_over_commits_relative_to_what_is_backed() -> None:
    # Chunked(128 MiB) backed 128 MiB per buffer for a 19 MiB prefix.
    p = default_policy()
    need = 19 * MiB + 300 * 1024
    backed = 0
    while backed < need:
        backed = p.target_bytes(backed, min(backed + 2 * MiB, need), 256 * MiB, G)
    assert backed - need <= max(need, 8 * MiB)
    big = p.target_bytes(1024 * MiB, 1024 * MiB + G, 4096 * MiB, G)
    assert big - 1024 * MiB >= 64 * MiB, "large buffers grow in large handles (bandwidth)"


def test_geometric_refuses_a_min_bytes_beyond_max_bytes() -> None:
    with pytest.raises(ArgumentError, match="min_bytes"):
        Geometric(2.0, 8 * MiB, 16 * MiB)


def test_an_options_record_backs_like_the_keywords_and_is_refused_beside_them() -> None:
    """OwnerOptions (one frozen record) and the constructor's keywords are one thing: the
    same fields, the same checks, the same owner; both at once, or a keyword that is no
    field, is refused before anything is reserved."""
    import dataclasses

    from kvvmm.owner import OwnerOptions

    drv = SimDriver(profile="h200")
    opts = OwnerOptions(policy=Chunked(4 * G), name="kv-opts")
    with KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, descs=token_descs(),
                       options=opts) as a, \
            KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, descs=token_descs(),
                          policy=Chunked(4 * G), name="kv-opts") as b:
        assert a.options == b.options == opts and a.policy == b.policy
        assert a.ensure_prefix(1000) == b.ensure_prefix(1000)
        assert a.snapshot().arena.name == "kv-opts"
    with KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16,
                       descs=token_descs()) as plain:
        assert plain.options.policy == default_policy()
    with pytest.raises(ArgumentError, match="options or the keywords"):
        KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, descs=token_descs(),
                      options=opts, name="other")
    with pytest.raises(TypeError, match="unexpected keyword"):
        KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, descs=token_descs(),
                      polcy=Exact())
    with pytest.raises(ArgumentError, match="lookahead_bytes"):
        dataclasses.replace(opts, lookahead_bytes=G)  # no pool: checked in the record
    with pytest.raises(ArgumentError, match="policy"):
        OwnerOptions(policy=Exact)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="options"):
        KvBufferOwner(driver=drv, dtype="bfloat16", page_size=16, descs=token_descs(),
                      options={"name": "x"})  # type: ignore[arg-type]
    assert drv.stats().clean

"""Several devices: a simulated node of N GPUs, peer access rules, per-device owners.

A :class:`SimNode` is N simulated GPUs sharing one VA space; set access for peers follows
CUDA's rules (a device the process sees, with a peer path to the memory's device, on whole
mappings only) on the simulator, and the host driver (one device) refuses peers. Tensor
parallelism builds one owner per device, in process on the simulator and one spawned process
per device on the host driver.
"""

from __future__ import annotations

import itertools
import pickle
import sys
from collections.abc import Callable

import pytest

from kvvmm.arena import Arena
from kvvmm.driver import Driver, FaultyDriver, SimDriver, SimNode, open_driver
from kvvmm.driver.base import CUDA_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_VALUE
from kvvmm.errors import ArgumentError, DriverError
from kvvmm.layout import model_descs
from kvvmm.owner import KvBufferOwner
from kvvmm.owner.tp import TpOwners, TpWorkerError, run_per_device, spawn_tp_snapshots
from kvvmm.record import TracingDriver
from kvvmm.replay import replay, replay_arenas
from kvvmm.snapshot import OwnerSnapshot, TpSnapshot
from kvvmm.units import GiB, MiB

MakeDriver = Callable[..., Driver]
G = 2 * MiB
host_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                               reason="the host driver needs Linux")


def mapped(driver: Driver, va: int, size: int) -> int:
    h = driver.create(size)
    driver.map(va, size, h)
    driver.set_access(va, size)
    return h


# -- the node -----------------------------------------------------------------------------


def test_a_node_of_eight_h200s_gives_each_device_its_own_driver_once() -> None:
    node = SimNode("h200", devices=8)
    drivers = node.drivers()
    assert [d.device for d in drivers] == list(range(8))
    assert all(d.name == "NVIDIA H200" and d.node is node for d in drivers)
    assert node.driver(3) is drivers[3]
    with pytest.raises(ArgumentError, match="device"):
        node.driver(8)
    with pytest.raises(ArgumentError, match=r"node\.driver"):
        SimDriver("h200", device=3, node=node)


def test_reservations_of_all_devices_share_one_va_space_and_never_overlap() -> None:
    node = SimNode("h200", devices=4)
    got = [(d.reserve(64 * G), 64 * G) for d in reversed(node.drivers())]
    starts = sorted(got)
    for (a, size), (b, _) in itertools.pairwise(starts):
        assert a + size <= b
    assert got[0][0] == 0x7F00_0000_0000  # the first reserve, whichever device makes it


def test_node_addresses_are_deterministic() -> None:
    def layout() -> list[int]:
        node = SimNode("h100", devices=2)
        return [node.driver(i % 2).reserve((i + 1) * G) for i in range(6)]

    assert layout() == layout()


def test_device_zero_of_a_node_hands_out_the_addresses_a_lone_driver_does() -> None:
    lone, in_node = SimDriver("h200"), SimNode("h200", devices=2).driver(0)
    assert [lone.reserve(8 * G) for _ in range(3)] == [in_node.reserve(8 * G) for _ in range(3)]


def test_each_device_has_its_own_capacity() -> None:
    node = SimNode("h200", devices=2, capacity_bytes=4 * G)
    d0, d1 = node.drivers()
    d0.create(4 * G)
    assert d0.mem_info()[0] == 0 and d1.mem_info() == (4 * G, 4 * G)


def test_open_driver_sim_still_works_and_takes_a_node() -> None:
    assert open_driver("sim", device=2).device == 2
    node = SimNode(devices=2)
    assert open_driver("sim", node=node, device=1) is node.driver(1)
    with pytest.raises(ArgumentError, match="node"):
        open_driver("sim", node=node, device=1, profile="h100")


@pytest.mark.parametrize("bad", [0, -1, True, "8"])
def test_a_node_needs_at_least_one_device(bad: object) -> None:
    with pytest.raises(ArgumentError, match="devices"):
        SimNode(devices=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("pair", [(0, 0), (0, 4), (1,), [0, 1]])
def test_no_peer_pairs_must_name_two_devices_of_the_node(pair: object) -> None:
    with pytest.raises(ArgumentError, match="no_peer"):
        SimNode(devices=4, no_peer=[pair])  # type: ignore[list-item]


def test_can_access_peer_is_false_for_itself_unknown_devices_and_blocked_pairs() -> None:
    node = SimNode(devices=4, no_peer=[(0, 3)])
    assert node.can_access_peer(0, 1) and node.can_access_peer(1, 0)
    assert not node.can_access_peer(0, 0)
    assert not node.can_access_peer(0, 3) and not node.can_access_peer(3, 0)
    assert not node.can_access_peer(0, 4)


# -- peer access rules --------------------------------------------------------------------


def test_a_peer_of_the_node_may_be_given_access_to_mapped_va() -> None:
    node = SimNode(devices=4)
    d0 = node.driver(0)
    va = d0.reserve(8 * G)
    mapped(d0, va, 2 * G)
    d0.set_access(va, 2 * G, devices=(0, 1))
    d0.set_access(va, 2 * G, devices=[3])
    assert d0.peer_access(va) == (1, 3)
    assert d0.peer_access(va + 2 * G) == ()


def test_set_access_for_a_device_outside_the_node_is_invalid_value_as_on_an_h200() -> None:
    # Raw cuMemSetAccess on a one-GPU H200 answers INVALID_VALUE for device 1.
    d0 = SimNode(devices=2).driver(0)
    va = d0.reserve(8 * G)
    mapped(d0, va, 2 * G)
    before = d0.stats()
    with pytest.raises(DriverError) as info:
        d0.set_access(va, 2 * G, devices=(0, 2))
    assert info.value.cuda_error == CUDA_ERROR_INVALID_VALUE
    assert "device 2" in str(info.value) and d0.stats() == before
    assert d0.peer_access(va) == ()


def test_set_access_for_a_pair_without_peer_capability_is_invalid_device() -> None:
    d0 = SimNode(devices=2, no_peer=[(0, 1)]).driver(0)
    va = d0.reserve(8 * G)
    mapped(d0, va, 2 * G)
    with pytest.raises(DriverError) as info:
        d0.set_access(va, 2 * G, devices=(1,))
    assert info.value.cuda_error == CUDA_ERROR_INVALID_DEVICE
    assert "cuDeviceCanAccessPeer(1, 0)" in str(info.value)
    assert d0.peer_access(va) == ()


def test_a_lone_sim_driver_has_no_peers() -> None:
    d = SimDriver(device=1)
    va = d.reserve(8 * G)
    mapped(d, va, 2 * G)
    d.set_access(va, 2 * G, devices=(1,))  # its own device, named: fine
    with pytest.raises(DriverError) as info:
        d.set_access(va, 2 * G, devices=(0,))
    assert info.value.cuda_error == CUDA_ERROR_INVALID_VALUE
    assert "SimNode" in str(info.value)


@pytest.mark.parametrize(("what", "offset", "size"), [
    ("unmapped VA", 4 * G, 2 * G),
    ("part of a mapping", 0, G),
    ("a mapping and a hole", 0, 4 * G),
])
def test_peer_access_takes_whole_mappings_only(what: str, offset: int, size: int) -> None:
    d0 = SimNode(devices=2).driver(0)
    va = d0.reserve(8 * G)
    mapped(d0, va, 2 * G)
    with pytest.raises(DriverError) as info:
        d0.set_access(va + offset, size, devices=(0, 1))
    assert info.value.cuda_error == CUDA_ERROR_INVALID_VALUE, what
    assert d0.peer_access(va) == ()


@pytest.mark.parametrize("bad", [(), "01", None, 1])
def test_a_device_list_must_be_a_non_empty_sequence(bad: object) -> None:
    d0 = SimNode(devices=2).driver(0)
    va = d0.reserve(8 * G)
    mapped(d0, va, 2 * G)
    if bad is None:  # None is the default: the driver's own device
        d0.set_access(va, 2 * G, devices=None)
        return
    with pytest.raises(ArgumentError, match="devices"):
        d0.set_access(va, 2 * G, devices=bad)  # type: ignore[arg-type]


def test_peer_access_goes_with_the_mapping() -> None:
    d0 = SimNode(devices=2).driver(0)
    va = d0.reserve(8 * G)
    h = mapped(d0, va, 2 * G)
    d0.set_access(va, 2 * G, devices=(0, 1))
    d0.unmap(va, 2 * G)
    d0.map(va, 2 * G, h)
    assert d0.peer_access(va) == ()


def test_set_access_for_several_devices_costs_more_simulated_time() -> None:
    d0 = SimNode(devices=4).driver(0)
    va = d0.reserve(8 * G)
    mapped(d0, va, 2 * G)
    d0.set_access(va, 2 * G)  # the call after a cold one still pays part of it: warm now
    t0 = d0.clock_us
    d0.set_access(va, 2 * G)
    one = d0.clock_us - t0
    t1 = d0.clock_us
    d0.set_access(va, 2 * G, devices=(0, 1, 2, 3))
    assert d0.clock_us - t1 == pytest.approx(4 * one)


@host_only
def test_the_host_driver_refuses_every_device_but_its_own(make_driver: MakeDriver) -> None:
    d = make_driver("host")
    va = d.reserve(8 * G)
    mapped(d, va, 2 * G)
    d.set_access(va, 2 * G, devices=(0,))
    with pytest.raises(DriverError) as info:
        d.set_access(va, 2 * G, devices=(0, 1))
    assert info.value.cuda_error == CUDA_ERROR_INVALID_VALUE
    assert "one device" in str(info.value)


def test_wrappers_pass_the_device_list_on_and_traces_replay_it() -> None:
    node = SimNode(devices=2)
    t = TracingDriver(node.driver(0))
    f = FaultyDriver(t)
    va = f.reserve(8 * G)
    mapped(f, va, 2 * G)
    f.set_access(va, 2 * G, devices=(0, 1))
    with pytest.raises(DriverError):
        f.set_access(va, 2 * G, devices=(0, 5))
    ev = [e for e in t.trace.driver_calls() if e.op == "set_access"]
    assert [e.args.get("devices") for e in ev] == [None, [0, 1], [0, 5]]
    assert ev[-1].error == CUDA_ERROR_INVALID_VALUE
    assert replay(t.trace, SimNode(devices=2).driver(0)) == []
    mismatches = replay(t.trace, SimDriver())  # a lone driver: the peer grant is refused
    assert [(m.op, m.recorded, m.replayed) for m in mismatches] == [
        ("set_access", "ok", CUDA_ERROR_INVALID_VALUE)]


# -- arenas on several devices ------------------------------------------------------------


def test_an_arena_grants_peers_access_to_what_it_backs_now_and_later() -> None:
    node = SimNode(devices=4)
    d1 = node.driver(1)
    arena = Arena(d1, reserve_bytes=1 * GiB)
    a = arena.allocate(64 * MiB, "a")
    b = arena.allocate(64 * MiB, "b")
    arena.commit(a, 8 * MiB)
    arena.grant_access([0, 3])
    arena.commit(a, 16 * MiB)  # a second mapping, after the grant
    arena.commit(b, 4 * MiB)
    for m in arena.snapshot().mappings:
        assert d1.peer_access(arena.base + m.offset) == (0, 3), m
    snap = arena.snapshot()
    assert snap.peer_devices == arena.peer_devices == (0, 3)
    snap.check()
    arena.close()
    assert d1.stats().clean


def test_a_refused_grant_leaves_the_arena_as_it_was() -> None:
    node = SimNode(devices=2, no_peer=[(0, 1)])
    arena = Arena(node.driver(0), reserve_bytes=256 * MiB)
    a = arena.allocate(64 * MiB, "a")
    arena.commit(a, 8 * MiB)
    before = arena.snapshot()
    with pytest.raises(DriverError) as info:
        arena.grant_access([1])
    assert info.value.cuda_error == CUDA_ERROR_INVALID_DEVICE
    assert arena.snapshot() == before and arena.peer_devices == ()
    arena.commit(a, 16 * MiB)  # later commits still work, with the default access
    arena.close()


def test_a_peer_view_of_an_arena_needs_a_grant() -> None:
    pytest.importorskip("torch")
    node = SimNode(devices=2)
    arena = Arena(node.driver(0), reserve_bytes=64 * MiB)
    off = arena.allocate(2 * MiB, "x")
    with pytest.raises(ArgumentError, match="grant_access"):
        arena.tensor(off, (16,), "bfloat16", device=1)
    arena.grant_access([1])
    assert arena.tensor(off, (16,), "bfloat16", device=1).shape == (16,)
    arena.close()


def test_a_traced_arena_with_peers_replays_to_the_same_snapshot() -> None:
    node = SimNode(devices=3)
    t = TracingDriver(node.driver(2))
    arena = Arena(t, reserve_bytes=512 * MiB, name="peers", trace=t.trace)
    a = arena.allocate(100 * MiB, "a")
    arena.commit(a, 10 * MiB)
    arena.grant_access([0])
    arena.commit(a, 40 * MiB)
    want = arena.snapshot()
    (got,) = replay_arenas(t.trace)
    assert got.peer_devices == (0,)
    assert got.mappings == want.mappings and got.allocations == want.allocations
    arena.close()


# -- tensor-parallel owners ---------------------------------------------------------------


def test_tp8_on_a_simulated_node_builds_eight_owners_with_one_eighth_of_the_heads() -> None:
    with TpOwners.on_sim("llama-3.1-70b", tp=8, reserved_tokens=200_000) as group:
        assert group.devices == tuple(range(8))
        group.finalize(100_000)
        snap = group.snapshot()
    assert isinstance(snap, TpSnapshot) and snap.tp == 8 and len(snap.owners) == 8
    one = model_descs("llama-3.1-70b", reserved_tokens=200_000, page_size=16,
                      dtype="bfloat16", tp=8)
    assert [b.shape for b in snap.owners[0].buffers] == [d.shape for d in one]
    assert len({o.backed_bytes for o in snap.owners}) == 1  # same layout on every rank
    bases = sorted(o.arena.base for o in snap.owners)
    assert len(set(bases)) == 8  # one VA space: no two ranks share an address
    assert snap.backed_bytes == 8 * snap.owners[0].backed_bytes
    assert snap.reserved_bytes == sum(o.arena.reserved_bytes for o in snap.owners)


def test_tp_must_fit_the_kv_heads() -> None:
    with pytest.raises(ArgumentError, match="tp"):
        TpOwners.on_sim("llama-3.1-8b", tp=3, reserved_tokens=4096)  # 8 KV heads


def test_two_ranks_on_one_device_are_refused() -> None:
    d = SimDriver()
    with pytest.raises(ArgumentError, match="distinct devices"):
        TpOwners([d, d], model="llama-3.1-8b", dtype="bfloat16", page_size=16,
                 reserved_tokens=4096)


def test_a_rank_that_fails_closes_the_ranks_built_before_it() -> None:
    node = SimNode(devices=2)
    bad = FaultyDriver(node.driver(1), fail={"create": 1})
    with pytest.raises(DriverError) as info:
        TpOwners([node.driver(0), bad], model="llama-3.1-8b", dtype="bfloat16",
                 page_size=16, reserved_tokens=4096)
    assert any("rank 1 of 2" in n for n in info.value.__notes__)
    assert node.driver(0).stats().clean and node.driver(1).stats().clean


def test_a_growth_failure_on_one_rank_names_the_ranks_that_grew() -> None:
    node = SimNode(devices=2, capacity_bytes=8 * GiB)
    group = TpOwners(node.drivers(), model="llama-3.1-8b", dtype="bfloat16", page_size=16,
                     reserved_tokens=200_000)
    node.driver(1).create(node.driver(1).mem_info()[0])  # rank 1's device is full
    with pytest.raises(DriverError) as info:
        group.finalize(50_000)
    assert any("ranks 0..0 already did it" in n for n in info.value.__notes__)
    group.close()


def test_an_owner_snapshot_survives_pickling() -> None:
    owner = KvBufferOwner(driver=SimDriver(), dtype="bfloat16", page_size=16,
                          reserved_tokens=4096,
                          descs=model_descs("llama-3.1-8b", reserved_tokens=4096, page_size=16,
                                            dtype="bfloat16"))
    snap = owner.snapshot()
    assert pickle.loads(pickle.dumps(snap)) == snap
    owner.close()


def _rank_and_device(rank: int, device: int, tag: str) -> tuple[int, int, str]:
    return rank, device, tag


def _fails_on_rank_one(rank: int, device: int) -> int:
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def test_run_per_device_runs_one_spawned_process_per_device() -> None:
    assert run_per_device(_rank_and_device, [3, 5], "x") == [(0, 3, "x"), (1, 5, "x")]


def test_a_failing_worker_is_reported_with_its_traceback() -> None:
    with pytest.raises(TpWorkerError) as info:
        run_per_device(_fails_on_rank_one, [0, 1])
    text = str(info.value)
    assert "1 of 2 workers failed" in text and "rank 1 (device 1" in text
    assert "ValueError: rank one is broken" in text and "Traceback" in text


@host_only
def test_tp2_on_the_host_driver_builds_one_owner_per_spawned_process() -> None:
    snap = spawn_tp_snapshots("host", model="llama-3.1-8b", tp=2, reserved_tokens=4096,
                              finalize_tokens=1024,
                              driver_options={"capacity_bytes": 1 * GiB})
    assert snap.devices == (0, 1) and snap.tp == 2
    assert all(isinstance(o, OwnerSnapshot) for o in snap.owners)
    assert [o.arena.name for o in snap.owners] == ["kv.tp0", "kv.tp1"]
    assert [o.arena.driver for o in snap.owners] == ["host", "host"]
    assert [o.final_tokens for o in snap.owners] == [1024, 1024]
    assert snap.owners[0].backed_bytes == snap.owners[1].backed_bytes > 0
    assert not any(o.arena.closed for o in snap.owners)  # snapshot taken before close


def test_spawned_ranks_check_their_arguments_before_starting_any_process() -> None:
    with pytest.raises(ArgumentError, match="tp"):
        spawn_tp_snapshots("sim", model="llama-3.1-8b", tp=3, reserved_tokens=4096)
    with pytest.raises(ArgumentError, match="devices"):
        spawn_tp_snapshots("sim", model="llama-3.1-8b", tp=2, reserved_tokens=4096,
                           devices=[0, 0])
